"""Newton-Schulz on tensor-parallel shards and the tp_mode cost formulas, on one process.

The ``distributed`` mode's math is checked with a simulated split: every shard on one
process and no reduction (each sum over the shards is then already complete), against
``orthogonalize`` of the whole matrix.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lightning_muon.distributed.tp_math import (
    long_side_split,
    newton_schulz_on_shards,
    tp_bytes,
    tp_ns_flops,
)
from lightning_muon.newton_schulz import ns_flops, orthogonalize, resolve_coefficients

pytestmark = pytest.mark.numerics

# float32: another order of the Gram sum moves the result by ulps, which the schedule's gains
# (up to ~8 per step at small singular values) grow to ~3e-6; a wrong block or a missing sum
# moves it by 1e-2 or more (test_partial_shards_need_the_reduction).
FP32 = dict(rtol=0, atol=1e-5)


def _wide_blocks(G: torch.Tensor, tp: int, split_dim: int) -> tuple[list[torch.Tensor], bool]:
    """The shards a TP group holds, laid out as ``MuonTPSharding`` hands them to the iteration.

    A split along the short side is re-split along the long side first (the all-to-all of
    the real run): the simulation chunks the wide form's columns.
    """
    rows, cols = G.shape
    tall = rows > cols
    X = G.mT if tall else G  # the wide form
    return list(X.chunk(tp, dim=1)), tall


@pytest.mark.parametrize(
    ("rows", "cols", "tp", "split_dim"),
    [
        (16, 48, 2, 1),  # wide, split along the long side (RowwiseParallel of a wide weight)
        (48, 16, 4, 0),  # tall, split along the long side (ColwiseParallel of fc1)
        (16, 48, 2, 0),  # wide, split along the short side: re-split first
        (24, 24, 3, 0),  # square
        (10, 23, 4, 1),  # uneven torch.chunk blocks (6, 6, 6, 5)
    ],
)
def test_shards_equal_whole_matrix(rows, cols, tp, split_dim, coefficients="polar_express"):
    G = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols + tp), dtype=torch.float64)
    schedule, norm = resolve_coefficients(coefficients, 5)
    blocks, tall = _wide_blocks(G, tp, split_dim)
    out = newton_schulz_on_shards([b.unsqueeze(0) for b in blocks], schedule, norm, all_reduce=lambda t: t)
    X = torch.cat([o[0] for o in out], dim=1)
    result = X.mT if tall else X
    # float64: the order of the Gram sum is the only difference from one matrix.
    assert_close(result, orthogonalize(G, 5, coefficients, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # And in float32, what the parity tests run: a few ulps, grown by the schedule's gains.
    out32 = newton_schulz_on_shards([b.float().unsqueeze(0) for b in blocks], schedule, norm, lambda t: t)
    X32 = torch.cat([o[0] for o in out32], dim=1)
    assert_close(X32.mT if tall else X32, orthogonalize(G.float(), 5, coefficients, dtype="float32"), **FP32)


def test_cubic_schedule():
    """c = 0: B = b A without the A A product."""
    test_shards_equal_whole_matrix(12, 30, 3, 1, coefficients="cubic")


def test_batched_shards_and_reduce_calls():
    """K matrices at once; one reduction of the squared norms and one Gram matrix per step."""
    G = torch.randn(3, 8, 20, generator=torch.Generator().manual_seed(1))
    schedule, norm = resolve_coefficients("polar_express", 5)
    shapes = []

    def reduce(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    out = newton_schulz_on_shards(list(G.chunk(2, dim=-1)), schedule, norm, reduce)
    assert_close(torch.cat(out, dim=-1), orthogonalize(G, 5, dtype="float32"), **FP32)
    assert shapes == [(3,)] + [(3, 8, 8)] * 5


def test_partial_shards_need_the_reduction():
    """Half the shards with no reduction is not the answer: the sums really span the shards."""
    G = torch.randn(1, 8, 20, generator=torch.Generator().manual_seed(2))
    schedule, norm = resolve_coefficients("polar_express", 5)
    alone = newton_schulz_on_shards([G[..., :10]], schedule, norm, lambda t: t)[0]
    assert (alone - orthogonalize(G, 5, dtype="float32")[..., :10]).abs().max() > 1e-2


def test_long_side():
    assert long_side_split(16, 48, 1) and not long_side_split(16, 48, 0)
    assert long_side_split(48, 16, 0) and not long_side_split(48, 16, 1)
    assert long_side_split(16, 16, 1) and not long_side_split(16, 16, 0)  # square: laid as it is
    with pytest.raises(ValueError, match="split_dim must be 0 or 1"):
        long_side_split(4, 4, 2)


def test_cost_formulas():
    # 1024 x 4096 on 4 ranks, 5 steps, bf16 (2 bytes): m = 1024, n = 4096, P = 4M.
    P, m, n = 1024 * 4096, 1024, 4096
    assert tp_bytes(1024, 4096, 5, 4, "duplicated", 1, 2) == 0.75 * P * 2
    gram = 5 * 2 * 0.75 * m * m * 2 + 2 * 0.75 * 4
    assert tp_bytes(1024, 4096, 5, 4, "distributed", 1, 2) == gram  # long side split
    assert tp_bytes(1024, 4096, 5, 4, "distributed", 0, 2) == gram + 2 * 0.75 * P / 4 * 2  # short side: re-split
    assert tp_bytes(1024, 4096, 5, 4, "blockwise", 1, 2) == 0
    assert tp_bytes(1024, 4096, 5, 1, "duplicated", 1, 2) == 0  # no tensor parallelism
    assert tp_ns_flops(1024, 4096, 5, 4, "duplicated") == ns_flops(1024, 4096, 5)
    assert tp_ns_flops(1024, 4096, 5, 4, "distributed") == 5 * (4 * (n // 4) * m * m + 2 * m**3)
    assert tp_ns_flops(1024, 4096, 5, 4, "blockwise", split_dim=0) == ns_flops(256, 4096, 5)
    assert tp_ns_flops(1024, 4096, 5, 4, "blockwise", split_dim=1) == ns_flops(1024, 1024, 5)
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        tp_bytes(4, 4, 5, 2, "exact", 0, 4)
