"""Newton-Schulz's symmetric products by 2 x 2 blocks: the same values as the dense products.

Every dtype is pinned: nothing here reads the host's bf16 policy.
"""

from __future__ import annotations

import pytest
import torch

import lightning_muon.newton_schulz as sym
from lightning_muon.newton_schulz import gram_, orthogonalize, orthogonalize_many, square_, symmetric_blocks

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n", "tall"), [(16, 48, False), (17, 40, False), (9, 9, False), (15, 44, True)])
def test_gram_by_blocks_equals_the_dense_product(k, n, tall, dtype):
    gen = torch.Generator().manual_seed(k * n)
    X = torch.randn(n, k, generator=gen).to(dtype) if tall else torch.randn(k, n, generator=gen).to(dtype)
    S = X.mT if tall else X  # (k, n): a tall matrix's short side, as the iteration sees it (a view)
    dense = gram_(S, torch.empty(k, k, dtype=dtype), blocks=False)
    blocks = gram_(S, torch.full((k, k), float("nan"), dtype=dtype), blocks=True)  # every entry written
    # Each entry is the same dot product over n either way; kernels may sum it in another order
    # at another block size (at Muon's sizes measured bitwise equal): the classic bound for a
    # dot product, n eps |s_i| |s_j|, plus one rounding of the output.
    norms = S.double().norm(dim=1).max().item() ** 2
    eps = torch.finfo(torch.float32 if dtype == torch.bfloat16 else dtype).eps
    out_ulp = 2**-8 if dtype == torch.bfloat16 else eps
    torch.testing.assert_close(blocks, dense, rtol=0, atol=n * eps * norms + out_ulp * dense.abs().max().item())
    h = k // 2
    assert torch.equal(blocks[h:, :h], blocks[:h, h:].mT)  # the lower block is the upper one mirrored


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [8, 13])
def test_square_by_blocks_equals_the_dense_product(k, dtype):
    gen = torch.Generator().manual_seed(k)
    S = torch.randn(k, 3 * k, generator=gen, dtype=torch.float64) / k
    A = (S @ S.mT).to(dtype)  # (k, k) symmetric
    b, c = -4.775, 2.0315
    dense = square_(A, torch.empty_like(A), b, c, blocks=False)
    blocks = square_(A, torch.full_like(A, float("nan")), b, c, blocks=True)
    # A A = A A^T: each entry is one dot product over k either way, plus b A, rounded once.
    eps = torch.finfo(torch.float32 if dtype == torch.bfloat16 else dtype).eps
    out_ulp = 2**-8 if dtype == torch.bfloat16 else eps
    scale = abs(b) * A.abs().max().item() + abs(c) * A.double().norm(dim=1).max().item() ** 2
    torch.testing.assert_close(blocks, dense, rtol=0, atol=(k * eps + 2 * out_ulp) * scale)
    exact = b * A.double() + c * A.double() @ A.double()
    torch.testing.assert_close(blocks.double(), exact, rtol=0, atol=(k * eps + 2 * out_ulp) * scale)
    h = k // 2
    assert torch.equal(blocks[h:, :h], blocks[:h, h:].mT)


def test_the_rule_picks_blocks_only_where_measured_faster():
    cpu = torch.device("cpu")
    short, long = sym.SYMMETRIC_MIN_SHORT_SIDE, sym.SYMMETRIC_MIN_LONG_SIDE
    bf16, fp32 = torch.bfloat16, torch.float32
    assert symmetric_blocks(short, long, bf16, cpu) == (True, False)  # the square is short x short
    assert symmetric_blocks(long, long, bf16, cpu) == (True, True)
    assert symmetric_blocks(short, long - 1, bf16, cpu) == (False, False)
    assert symmetric_blocks(short, short, fp32, cpu) == (True, True)  # float32 gains from 384 x 384
    assert symmetric_blocks(short - 1, 4 * long, fp32, cpu) == (False, False)
    assert symmetric_blocks(4 * long, 4 * long, fp32, torch.device("meta")) == (False, False)
    assert symmetric_blocks(4 * long, 4 * long, bf16, torch.device("cuda")) == (False, False)


@pytest.fixture
def small_blocks(monkeypatch):
    """The block products from tiny sizes on, so that a test's small matrices take them."""
    monkeypatch.setattr(sym, "SYMMETRIC_MIN_SHORT_SIDE", 4)
    monkeypatch.setattr(sym, "SYMMETRIC_MIN_LONG_SIDE", 8)


def _dense(monkeypatch):
    monkeypatch.setattr(sym, "SYMMETRIC_MIN_SHORT_SIDE", 1 << 30)


@pytest.mark.parametrize("shape", [(24, 72), (72, 24), (33, 33)])
def test_orthogonalize_with_blocks_equals_the_dense_iteration(shape, small_blocks, monkeypatch):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    blocked = {d: orthogonalize(G, dtype=d) for d in (torch.bfloat16, torch.float32)}
    _dense(monkeypatch)
    dense = {d: orthogonalize(G, dtype=d) for d in (torch.bfloat16, torch.float32, torch.float64)}
    # The blocks compute the dense products' entries (bitwise equal on the CPUs measured).
    # Where a kernel sums them in another order, the difference is of the iteration's own
    # rounding, which five steps amplify: bounded by the dense iteration's distance from the
    # same iteration in float64.
    for dtype, result in blocked.items():
        noise = (dense[dtype].double() - dense[torch.float64]).norm()
        assert (result - dense[dtype]).double().norm() <= noise, dtype


def test_every_matrix_iterated_alone_asks_the_rule(small_blocks, monkeypatch):
    monkeypatch.setattr("lightning_muon.newton_schulz.BATCH_MAX_ELEMENTS", 16)  # 12 x 36 runs alone
    made = []

    class Spy(sym.SymmetricProduct):
        def __init__(self, L, R, out, blocks, C=None):
            made.append((tuple(L.shape), blocks, C is not None))
            super().__init__(L, R, out, blocks, C)

    monkeypatch.setattr("lightning_muon.newton_schulz.SymmetricProduct", Spy)
    orthogonalize_many([torch.randn(12, 36), torch.randn(36, 12), torch.randn(3, 5)], dtype=torch.float32)
    # Tall or wide, the Gram products (one per buffer) are of the short side laid wide (12 x 36),
    # the square of the 12 x 12 Gram matrix; 3 x 5 (a stack of one) is under the thresholds.
    alone = [((12, 36), True, False)] * 2 + [((12, 12), True, True)]
    assert made == alone * 2 + [((3, 5), False, False)] * 2 + [((3, 3), False, True)]
