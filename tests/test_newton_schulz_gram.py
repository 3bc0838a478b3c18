"""Gram Newton-Schulz: the same polynomial reassociated on the Gram matrix, against the standard
iteration and the exact polar factor; restarts, FLOPs, when "auto" picks it, and Muon with it."""

from __future__ import annotations

import pytest
import torch
from muon_reference import polar_factor, random_tensors, run_steps
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon
from lightning_muon.newton_schulz import (
    GRAM_MIN_ASPECT,
    GRAM_MIN_SHORT_SIDE,
    gram_restarts,
    ns_flops,
    orthogonalize,
    orthogonalize_many,
    resolve_ns_method,
)

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (2, 3, 12, 40), (20, 20)])
@pytest.mark.parametrize("name", ["polar_express", "keller", "you", "polar_express_paper"])
def test_gram_equals_standard_in_float64(shape, name):
    """The same polynomial, reassociated: equal to rounding in float64, batched and tall too."""
    (G,) = random_tensors([shape], seed=15, dtype=torch.float64)
    steps = 8 if name == "polar_express_paper" else 5
    standard = orthogonalize(G, steps, name, method="standard")
    gram = orthogonalize(G, steps, name, method="gram")
    assert_close(gram, standard, atol=1e-11, rtol=0)


@pytest.mark.parametrize(("steps", "name"), [(5, "polar_express"), (8, "polar_express_paper"), (12, "polar_express")])
def test_gram_is_as_accurate_as_standard_in_float32(steps, name):
    """Error against the exact polar factor (float64 SVD) on 64 x 256 with singular values 1 .. 1e-3.

    Restarts (gram_restarts) keep the float32 Gram iteration within 1e-4 relative of the standard
    iteration's error; measured 1e-7 at 5 steps, ~1e-5 at 8-12 (2e-3 with one restart at 12).
    """
    gen = torch.Generator().manual_seed(16)
    U, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(256, 64, dtype=torch.float64, generator=gen))
    G = (U * torch.logspace(0, -3, 64, dtype=torch.float64)) @ V.T
    polar = polar_factor(G)
    err = {m: torch.linalg.matrix_norm(orthogonalize(G.float(), steps, name, "float32", m).double() - polar).item()
           for m in ("standard", "gram")}  # fmt: skip
    assert abs(err["gram"] - err["standard"]) <= 1e-4 * polar.norm().item() + 1e-3 * err["standard"]


def test_gram_runs_half_precision_requests_in_float32():
    (G,) = random_tensors([(8, 40)], seed=17, dtype=torch.bfloat16)
    out = orthogonalize(G, dtype="bfloat16", method="gram")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, orthogonalize(G, dtype="float32", method="gram"))


def test_gram_zero_matrix_and_batched_many():
    assert torch.equal(orthogonalize(torch.zeros(4, 16), method="gram"), torch.zeros(4, 16))
    mats = random_tensors([(8, 32), (32, 8), (8, 32), (200, 700)], seed=18, dtype=torch.float64)
    for got, M in zip(orthogonalize_many(mats, method="gram"), mats):
        assert_close(got, orthogonalize(M, method="standard"), atol=1e-11, rtol=0)


def test_auto_picks_gram_only_for_wide_float32_matrices():
    m = GRAM_MIN_SHORT_SIDE
    n = int(GRAM_MIN_ASPECT * m)
    assert resolve_ns_method("auto", m, n, torch.float32) == "gram"
    assert resolve_ns_method("auto", n, m, torch.float64) == "gram"  # tall: its transpose
    assert resolve_ns_method("auto", m, n - 1, torch.float32) == "standard"
    assert resolve_ns_method("auto", m - 1, 4 * m, torch.float32) == "standard"
    assert resolve_ns_method("auto", m, n, torch.bfloat16) == "standard"
    assert resolve_ns_method("standard", m, n, torch.float32) == "standard"
    assert resolve_ns_method("gram", 8, 8, torch.float32) == "gram"
    with pytest.raises(ValueError, match=r"ns_method must be one of .*got 'fast'"):
        resolve_ns_method("fast", 8, 8, torch.float32)


def test_gram_restarts_and_flops():
    assert gram_restarts(5) == {2} and gram_restarts(2) == set()
    assert gram_restarts(8) == {2, 4, 6}
    m, n = 64, 256
    # R0 and the final Q X (2 n m^2 each), one restart (Q X and R: 4 n m^2); m x m products:
    # step 0: Z, R update; 1: Z, Q; 2 (after the restart): Z, R update; 3: Z, Q, R update; 4: Z, Q.
    expected = 8 * n * m * m + (6 + 4 + 6 + 8 + 4) * m**3
    assert ns_flops(m, n, 5, method="gram") == expected
    assert ns_flops(m, n, 5, method="gram") < ns_flops(m, n, 5) / 1.45  # 60 m^3 vs 90 m^3 at 1:4
    assert ns_flops(m, m, 5, method="gram") > ns_flops(m, m, 5)  # square: Gram does more work


def test_muon_with_gram_equals_standard():
    (W0,) = random_tensors([(12, 48)], seed=19, dtype=torch.float64)
    grads = [[g] for g in random_tensors([(12, 48)] * 4, seed=20, dtype=torch.float64)]
    results = []
    for method in ("standard", "gram"):
        p = nn.Parameter(W0.clone())
        run_steps(Muon([p], lr=0.05, ns_method=method, second_moment="normuon"), [p], grads)
        results.append(p.detach())
    assert_close(results[1], results[0], atol=1e-12, rtol=0)
