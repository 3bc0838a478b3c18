"""Newton-Schulz orthogonalization: schedules against a float64 SVD, batching, dtype policy."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import lightning_muon.newton_schulz as ns
from lightning_muon.newton_schulz import (
    COEFFICIENTS,
    FAST_BF16_ENV,
    NORMALIZATION,
    bf16_matmul_is_fast,
    ns_flops,
    orthogonalize,
    orthogonalize_many,
    resolve_coefficients,
    resolve_ns_dtype,
)

pytestmark = pytest.mark.numerics


def with_spectrum(s: torch.Tensor, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(U, V, G)`` in float64 with ``G = U diag(s) V^T`` and orthonormal columns in U, V."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=gen))
    return U, V, U @ torch.diag(s.to(torch.float64)) @ V.T


def scalar_map(name: str, steps: int, x: torch.Tensor) -> torch.Tensor:
    """The composite polynomial a schedule applies to each normalized singular value."""
    schedule, _ = resolve_coefficients(name, steps)
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------- tables


def test_coefficient_tables_are_complete_and_match_their_sources():
    """Every schedule has a normalization, finite (a, b, c) tuples, and the published numbers."""
    assert set(NORMALIZATION) == set(COEFFICIENTS)
    for name, schedule in COEFFICIENTS.items():
        assert schedule, name
        assert all(len(abc) == 3 and all(math.isfinite(v) for v in abc) for abc in schedule), name
    # torch.optim.Muon's constants (torch/optim/_muon.py: DEFAULT_A/B/C, 5 steps, EPS = 1e-7).
    assert COEFFICIENTS["keller"] == [(3.4445, -4.7750, 2.0315)] * 5
    assert NORMALIZATION["keller"] == (1.0, 1e-7)
    assert COEFFICIENTS["polar_express"][0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    assert NORMALIZATION["polar_express"] == (1.02, 1e-6)
    # Amsel et al.'s list: all but the last tuple divided by (1.01, 1.01^3, 1.01^5).
    paper = COEFFICIENTS["polar_express_paper"]
    assert len(paper) == 8
    assert_close(
        torch.tensor(paper[0], dtype=torch.float64),
        torch.tensor(
            [8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3, 17.300387312530933 / 1.01**5],
            dtype=torch.float64,
        ),
        atol=0,
        rtol=1e-15,
    )
    assert paper[-1] == (1.875, -1.25, 0.375)
    assert COEFFICIENTS["cubic"] == [(1.5, -0.5, 0.0)]
    # NVIDIA Emerging-Optimizers 0.3.0 (muon_utils): "cans" (arXiv 2506.10935) and "deepseekv4",
    # both pre-scaled by ||X||_F alone.
    assert COEFFICIENTS["cans"] == [
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ]
    assert COEFFICIENTS["deepseekv4"] == [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2
    assert NORMALIZATION["cans"] == NORMALIZATION["deepseekv4"] == (1.0, 1e-7)


def test_ns_flops_counts_three_matmuls_on_the_short_side():
    """X X^T, A A and B X on an m x n matrix (m short): 2nm^2 + 2m^3 + 2nm^2 FLOPs per step."""
    assert ns_flops(64, 256, 5) == 5 * (4 * 256 * 64**2 + 2 * 64**3)
    assert ns_flops(256, 64, 5) == ns_flops(64, 256, 5)
    assert ns_flops(64, 256, 3, cubic=True) == 3 * 4 * 256 * 64**2  # no A A term
    assert ns_flops(64, 256, 1) <= 6 * 256 * 64**2  # one step is 2 (2 n m^2 + m^3) <= 6 n m^2


# ----------------------------------------------------------------- accuracy vs SVD

# schedule -> (steps, floor, lo, hi). "Relative singular value" is s_i / ||G||_F, what the
# iteration starts from. The composite polynomial of each schedule, evaluated in float64 on
# a grid of 200,001 points over [1e-5, 1] (and confirmed on 64x64, 48x96, 96x48 matrices),
# maps inputs above `floor` into:
#   keller  5 steps, floor 2e-3: [0.6818, 1.2024]   (Keller's "roughly [0.7, 1.2]")
#   you     5 steps, floor 5e-3: [0.9778, 1.1115]
#   polar_express        5 steps, floor 1e-3: [0.8466, 1.1411]
#   polar_express_paper  8 steps, floor 1e-3: [1 - 3e-15, 1 + 3e-15]
#   polar_express_megatron  8 steps, floor 1e-3: [1 - 1e-15, 1 + 4e-16] (4-digit tuples, no 1.01 pre-scale)
#   cans     5 steps, floor 1e-3: [0.8844, 1.1198]
#   deepseekv4  10 steps, floor 1e-3: [1.0000, 1.0005] (approached from above: the last
#               tuple's p(x) = 2x - 1.5x^3 + 0.5x^5 has p(1) = 1, p'(1) = 0, p''(1) = 1);
#               inputs down to 1e-5 land below 1.0021
# The bands below add a margin of ~0.03 (1e-3 for the converged schedules, above 1.0021 for
# deepseekv4, whose band also caps the inputs below the floor), which covers float32 rounding
# (~1e-5 here) but would catch a wrong coefficient or normalization.
BANDS = {
    "keller": (5, 2e-3, 0.65, 1.25),
    "you": (5, 5e-3, 0.95, 1.15),
    "polar_express": (5, 1e-3, 0.82, 1.17),
    "polar_express_paper": (8, 1e-3, 0.999, 1.001),
    "polar_express_megatron": (8, 1e-3, 0.999, 1.001),
    "cans": (5, 1e-3, 0.85, 1.15),
    "deepseekv4": (10, 1e-3, 0.999, 1.003),
}


def test_every_named_schedule_has_a_band_test():
    """Adding a schedule to COEFFICIENTS without an accuracy test fails here."""
    assert set(BANDS) | {"cubic"} == set(COEFFICIENTS)


@pytest.mark.parametrize("name", sorted(BANDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("rows", "cols", "scale"), [(64, 64, 1.0), (96, 48, 1e-3), (48, 96, 1e3)])
def test_output_singular_values_lie_in_the_schedule_band(name, dtype, rows, cols, scale):
    """For inputs above the floor, Q = U f(S) V^T with f(S) inside the schedule's band."""
    steps, floor, lo, hi = BANDS[name]
    k = min(rows, cols)
    s = torch.logspace(-4, 0, k, dtype=torch.float64) * scale
    U, V, G = with_spectrum(s, rows, cols, seed=rows + cols)
    Q = orthogonalize(G.to(dtype), steps=steps, coefficients=name, dtype=dtype).to(torch.float64)
    out = torch.diagonal(U.T @ Q @ V)  # the output singular value paired with each input one
    rel = s / torch.linalg.vector_norm(s)
    above = rel >= floor
    assert 0 < int(above.sum()) < k  # the spectrum straddles the floor
    assert lo <= out[above].min().item() and out[above].max().item() <= hi
    # Below the floor the map is still positive and never overshoots the band.
    assert out.min().item() > 0 and out.max().item() <= hi


# bf16 keeps 8 significant bits: one ulp at 1 is u = 2^-8.
BF16_UNIT_ROUNDOFF = 2.0**-8
# Rounding G to bf16 perturbs it by u / 2 per entry, a spectral perturbation of about
# (u / 2) (sqrt(m) + sqrt(n)) / sqrt(m n) of ||G||_F: 5e-4 at 48 x 96. Singular values that
# small relative to ||G||_F are set by the rounding, not by G, so the bf16 floor sits 3x above
# the float32 one (3e-3), where that perturbation is at most 1/6 of the value.
BF16_FLOOR = 3e-3


@pytest.mark.parametrize("name", sorted(BANDS))
@pytest.mark.parametrize(("rows", "cols", "scale"), [(64, 64, 1.0), (96, 48, 1e-3), (48, 96, 1e3)])
def test_bfloat16_output_singular_values_lie_in_the_schedule_band(name, rows, cols, scale):
    """The bf16 iteration maps singular values above the bf16 floor into the exact band +- 4 u.

    The band is the schedule's composite polynomial over [BF16_FLOOR, 1], evaluated in float64
    here. The bf16 result is stored with u / 2 relative rounding per entry, and each of the
    last steps' products adds u / 2 that the next step passes on with a slope below 1 near
    the band: 4 u bounds their sum (measured at most 1.7 u, polar_express_paper's lower edge).
    """
    steps = BANDS[name][0]
    safety, _ = NORMALIZATION[name]
    grid = torch.logspace(math.log10(BF16_FLOOR), 0, 100_001, dtype=torch.float64)
    exact = scalar_map(name, steps, grid / safety)
    margin = 4 * BF16_UNIT_ROUNDOFF
    k = min(rows, cols)
    s = torch.logspace(-4, 0, k, dtype=torch.float64) * scale
    U, V, G = with_spectrum(s, rows, cols, seed=rows + cols)
    Q = orthogonalize(G.to(torch.bfloat16), steps=steps, coefficients=name, dtype="bfloat16")
    assert Q.dtype == torch.bfloat16
    out = torch.diagonal(U.T @ Q.to(torch.float64) @ V)
    above = s / torch.linalg.vector_norm(s) >= BF16_FLOOR
    assert 0 < int(above.sum()) < k
    assert exact.min().item() - margin <= out[above].min().item()
    assert out[above].max().item() <= exact.max().item() + margin


def test_cubic_converges_to_the_exact_polar_factor():
    """Classic Newton-Schulz reaches U V^T on a well-conditioned input given enough steps."""
    s = torch.logspace(-1, 0, 32, dtype=torch.float64)  # relative singular values >= 0.03
    U, V, G = with_spectrum(s, 32, 80, seed=3)
    # 1.5x per step lifts 0.03 to ~1 in 9 steps; quadratic convergence then takes it to
    # the float64 floor well before 30 steps (measured error 2e-15).
    Q = orthogonalize(G, steps=30, coefficients="cubic")
    assert_close(Q, U @ V.T, atol=1e-12, rtol=0)
    # ... and 5 steps are visibly not enough: cubic is the slow schedule.
    assert (orthogonalize(G, steps=5, coefficients="cubic") - U @ V.T).abs().max() > 0.1


def test_polar_express_is_more_accurate_than_you_and_keller_at_five_steps():
    """Frobenius error against U V^T: Polar Express < you < keller, and PE <= 0.8 x keller."""
    s = torch.logspace(-3, 0, 128, dtype=torch.float64)
    U, V, G = with_spectrum(s, 128, 512, seed=4)
    polar = U @ V.T
    err = {
        name: (torch.linalg.matrix_norm(orthogonalize(G, coefficients=name) - polar) / polar.norm()).item()
        for name in ("polar_express", "you", "keller")
    }
    # Measured here 0.218 / 0.319 / 0.356 (0.32 / 0.42 / 0.45 reported for 512x2048 with singular
    # values down to 1e-3, the matrix of benchmarks/bench_optimizer.py's accuracy table, whose
    # relative singular values are smaller): the ratio PE/keller is ~0.61 at both sizes.
    assert err["polar_express"] < err["you"] < err["keller"]
    assert err["polar_express"] <= 0.8 * err["keller"]


@pytest.mark.parametrize("name", sorted(COEFFICIENTS))
@pytest.mark.parametrize(("rows", "cols"), [(40, 40), (24, 56), (56, 24)])
def test_singular_vectors_are_preserved(name, rows, cols):
    """U^T Q V is diagonal: the iteration changes singular values, never singular vectors."""
    s = torch.logspace(-3, 0, min(rows, cols), dtype=torch.float64)
    U, V, G = with_spectrum(s, rows, cols, seed=5)
    Q = orthogonalize(G, coefficients=name)
    core = U.T @ Q @ V
    diag = torch.diagonal(core)
    # Every step is a polynomial in X X^T times X, so in exact arithmetic U^T Q V is
    # diagonal; in float64 the off-diagonal is rounding (measured <= 5e-15).
    assert_close(core, torch.diag(diag), atol=1e-12, rtol=0)
    assert_close(Q, U @ torch.diag(diag) @ V.T, atol=1e-12, rtol=0)
    # The diagonal holds the singular values of Q (positive, in some order).
    assert_close(torch.linalg.svdvals(Q), diag.sort(descending=True).values, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------- edge cases


def test_orthogonalize_does_not_touch_its_input():
    """The iteration works on a copy, for tall and wide inputs and when no cast is needed."""
    for G in (randn(6, 10, dtype=torch.float32), randn(10, 6, dtype=torch.float64), randn(2, 5, 5)):
        before = G.clone()
        orthogonalize(G, dtype=G.dtype)
        assert torch.equal(G, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(6, 14), (3, 9, 4), (2, 3, 5, 8)])
def test_wide_input_equals_tall_transposed(dtype, shape):
    """orthogonalize(G^T) = orthogonalize(G)^T exactly: a tall matrix is iterated as its transpose."""
    G = randn(*shape, seed=6, dtype=dtype)
    assert torch.equal(orthogonalize(G.mT), orthogonalize(G).mT)


def test_square_input_commutes_with_transpose_to_rounding():
    """A square G is iterated on G G^T, its transpose on G^T G: equal up to rounding."""
    G = randn(24, 24, seed=7)
    # float64 Gram matrices in a different order; NS amplifies by at most its slope ~1e3.
    assert_close(orthogonalize(G.mT), orthogonalize(G).mT, atol=1e-11, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 4), (6, 3), (2, 3, 5)])
def test_zero_matrix_gives_zeros(dtype, shape):
    """The eps in the normalization keeps 0 / 0 out: zeros in, zeros out, no NaN."""
    Q = orthogonalize(torch.zeros(shape, dtype=dtype))
    assert Q.dtype == dtype and Q.shape == shape
    assert torch.equal(Q, torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("name", ["polar_express", "keller"])
@pytest.mark.parametrize("shape", [(1, 17), (17, 1), (1, 1), (3, 1, 9)])
def test_vectors_are_normalized(name, shape):
    """A 1 x n (or n x 1) matrix has one singular value ||G||: Q = f(1 / safety) G / ||G||."""
    G = randn(*shape, seed=8)
    Q = orthogonalize(G, coefficients=name)
    norms = torch.linalg.matrix_norm(G, keepdim=True)
    safety, eps = NORMALIZATION[name]
    expected = scalar_map(name, 5, norms / (norms * safety + eps)) * G / norms
    assert_close(Q, expected, atol=1e-12, rtol=0)
    if name == "polar_express":  # unit norm up to the schedule's band
        assert_close(torch.linalg.matrix_norm(Q), torch.ones(shape[:-2], dtype=torch.float64), atol=0.15, rtol=0)


def test_empty_matrix_gives_empty_result():
    """A matrix with a zero-size dim passes through with its shape."""
    for shape in [(0, 5), (5, 0), (0, 3, 4)]:
        Q = orthogonalize(torch.empty(shape))
        assert Q.shape == shape


def test_leading_batch_dims_equal_a_loop():
    """A (2, 3, m, n) input is 6 independent matrices."""
    G = randn(2, 3, 7, 11, seed=9)
    looped = torch.stack([torch.stack([orthogonalize(G[i, j]) for j in range(3)]) for i in range(2)])
    # bmm vs mm in float64: different blocking, NS slope ~1e3 on ~1e-16 rounding.
    assert_close(orthogonalize(G), looped, atol=1e-12, rtol=0)


@pytest.mark.parametrize(("max_elements", "stack_matrices"), [(ns.BATCH_MAX_ELEMENTS, None), (100, 16), (100, 1)])
def test_orthogonalize_many_equals_one_by_one_bit_for_bit(monkeypatch, max_elements, stack_matrices):
    """Bucketed, stacked and chunked batches give what one call per matrix gives, the same bits however cut."""
    # The other cases lower the threshold so that the 12x12 matrices run one by one, and cut
    # the 6x10 bucket into stacks of 16 matrices, or of one (a stack of one runs the batched
    # iteration beside a zero matrix: the same bits as in any stack).
    monkeypatch.setattr(ns, "BATCH_MAX_ELEMENTS", max_elements)
    cap = None if stack_matrices is None else stack_matrices * ns.stack_bytes(6, 10, torch.float64)
    mats = [randn(6, 10, seed=i) for i in range(20)]
    mats += [randn(10, 6, seed=100 + i) for i in range(5)]  # joins the 6x10 bucket transposed
    mats += [randn(12, 12, seed=200), randn(12, 12, seed=201), randn(3, 4, 5, seed=300), torch.empty(0, 4)]
    mats += [randn(6, 10, seed=400, dtype=torch.float32)]  # same shape, other dtype: its own bucket
    out = orthogonalize_many(mats, max_stack_bytes=cap)
    assert len(out) == len(mats)
    for M, Q, R in zip(mats, out, orthogonalize_many(mats)):
        assert Q.shape == M.shape and Q.dtype == M.dtype
        assert torch.equal(Q, R)  # however the stacks are cut: the same bits
        # float64 bmm vs mm differ at ~1e-16; float32 only stands alone, so exact is kept there.
        assert_close(Q, orthogonalize(M), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matrix_gets_the_same_bits_in_any_stack(dtype):
    """Stacks of 1, 2, 5 and 12 of one kind, wide and tall, donated or not: each matrix gets the same bits."""
    mats = [randn(48, 96, seed=i, dtype=dtype) for i in range(6)] + [
        randn(96, 48, seed=50 + i, dtype=dtype) for i in range(6)
    ]
    reference = orthogonalize_many([m.clone() for m in mats], dtype=dtype)
    per_matrix = ns.stack_bytes(48, 96, dtype)
    for k in (1, 2, 5):
        for donate in (False, True):
            got = orthogonalize_many(
                [m.clone() for m in mats], dtype=dtype, donate=donate, max_stack_bytes=k * per_matrix
            )
            assert all(torch.equal(a, b) for a, b in zip(got, reference)), (k, donate)


def test_stacks_reach_further_on_a_gpu_and_in_half_precision_on_a_cpu():
    """Up to ``BATCH_MAX_ELEMENTS`` every dtype and device stacks; past it a GPU up to 2^24, bf16/fp16 on a CPU less."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ns.BATCH_MAX_ELEMENTS == 1 << 17 and ns.HALF_BATCH_MAX_ELEMENTS == 384 * 1536
    assert ns.CUDA_BATCH_MAX_ELEMENTS == 1 << 24
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for device in (cpu, cuda):
            assert ns.stacks(256, 512, dtype, device) and ns.stacks(512, 256, dtype, device)  # 2^17 elements
        assert not ns.stacks(384, 3072, dtype, cpu)
        # A GPU stacks GPT-2 small's and a 1.3B model's matrices, up to 2^24 elements.
        for rows, cols in ((768, 768), (3072, 768), (768, 3072), (2048, 8192), (4096, 4096)):
            assert ns.stacks(rows, cols, dtype, cuda), (rows, cols, dtype)
        assert not ns.stacks(4096, 4097, dtype, cuda) and not ns.stacks(8192, 8192, dtype, cuda)
    for dtype in (torch.bfloat16, torch.float16):
        # A d=384 GPT's matrices (qkv, projection, fc1 and fc2), and up to a short side of 512.
        for rows, cols in ((1152, 384), (384, 384), (1536, 384), (384, 1536), (512, 1024), (257, 512)):
            assert ns.stacks(rows, cols, dtype, cpu), (rows, cols, dtype)
            assert not ns.stacks(rows, cols, torch.float32, cpu)
        assert not ns.stacks(768, 768, dtype, cpu)  # short side past 512 (590K elements, as 384 x 1536)
        assert not ns.stacks(513, 1024, dtype, cpu)
        assert not ns.stacks(384, 1537, dtype, cpu)  # elements past 384 x 1536


def test_half_precision_stacks_past_the_common_bound_and_equal_one_by_one(monkeypatch):
    """In bf16 same-shape matrices past ``BATCH_MAX_ELEMENTS`` run as one stack; a lone one runs alone.

    The bounds are lowered so that small matrices play the parts: 12 x 20 (240 elements) is
    past ``BATCH_MAX_ELEMENTS`` = 100 and within ``HALF_BATCH_MAX_ELEMENTS`` = 400.
    """
    monkeypatch.setattr(ns, "BATCH_MAX_ELEMENTS", 100)
    monkeypatch.setattr(ns, "HALF_BATCH_MAX_ELEMENTS", 400)
    monkeypatch.setattr(ns, "HALF_BATCH_MAX_SHORT_SIDE", 16)
    mats = [randn(12, 20, seed=i, dtype=torch.float32) for i in range(3)] + [randn(20, 12, seed=3, dtype=torch.float32)]
    mats += [randn(16, 24, seed=4, dtype=torch.float32)]  # 384 elements, but the only one of its shape
    mats += [randn(18, 20, seed=5, dtype=torch.float32), randn(18, 20, seed=6, dtype=torch.float32)]  # short side 18
    batches = []
    iterate = ns._newton_schulz_
    monkeypatch.setattr(ns, "_newton_schulz_", lambda X, *a, **k: batches.append(tuple(X.shape)) or iterate(X, *a, **k))
    out = orthogonalize_many(mats, dtype=torch.bfloat16)
    # 12 x 20 and its transpose share one stack; the rest run one by one.
    assert sorted(batches) == sorted([(4, 12, 20), (1, 16, 24), (1, 18, 20), (1, 18, 20)])
    assert ns.runs_alone(mats, dtype=torch.bfloat16) == [False] * 4 + [True] * 3
    # Where the step holds more 16 x 24 matrices elsewhere, this one stays a stack (of one, beside a zero matrix).
    assert ns.runs_alone(mats, dtype=torch.bfloat16, multi_shapes={(16, 24)}) == [False] * 5 + [True] * 2
    assert ns.runs_alone(mats, dtype=torch.float32) == [True] * 7  # float32 keeps the common bound
    # A donated temporary is made in the work dtype where it runs alone (in place), in its own
    # where a stack's copy casts it, and in its own for Gram Newton-Schulz (float32 work).
    assert ns.plan_matrices(mats, dtype=torch.bfloat16).donated == [torch.float32] * 4 + [torch.bfloat16] * 3
    assert ns.plan_matrices(mats, dtype=torch.bfloat16, method="gram").donated == [torch.float32] * 7
    for M, Q in zip(mats, out):
        assert Q.shape == M.shape and Q.dtype == M.dtype
        # A stack's products are its matrices' own (bmm against mm): equal here, and at most
        # one bf16 rounding step apart (u = 2^-8 of a unit-size entry) on other kernels.
        assert_close(Q, orthogonalize(M, dtype=torch.bfloat16), atol=2**-8, rtol=0)


@pytest.mark.parametrize("shape", [(40, 12), (12, 40), (2, 30, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_donated_temporary_is_iterated_in_place_and_matches_the_copy(monkeypatch, shape, dtype):
    """``donate=True`` runs in the caller's temporary, tall ones on their short side, to rounding.

    A tall matrix iterated as it lies (``A = X^T X``, ``X <- a X + X B``) is the same map as
    the wide iteration on its transpose; only the summation order inside the products differs.
    """
    monkeypatch.setattr(ns, "BATCH_MAX_ELEMENTS", 16)  # every matrix here runs alone
    G = randn(*shape, seed=8, dtype=torch.float32).to(dtype)
    kept = G.clone()
    (Q,) = orthogonalize_many([kept], dtype=dtype, donate=True, keep_work_dtype=True)
    # No staging copy: the donated buffer is the iterate (the result ends in it or in its
    # ping-pong partner, by the parity of the step count).
    assert not torch.equal(kept, G)
    # Rounding of the Gram products (fp32: 2^-24, bf16: 2^-8 per product) amplified by the
    # polynomial's slope (at most ~10 per step for well-conditioned inputs like these):
    # fp32 lands near 1e-6; bf16 differs in the last bits of a few entries (measured <= 3u).
    tol = 2e-5 if dtype == torch.float32 else 4 * 2**-8
    assert_close(Q.float(), orthogonalize(G, dtype=dtype).float(), atol=tol, rtol=0)
    # Without donation the input is left alone, as before.
    before = G.clone()
    orthogonalize_many([G], dtype=dtype)
    assert torch.equal(G, before)


def test_donated_temporaries_are_released_as_they_are_consumed(monkeypatch):
    """Each donated matrix is dropped once its result exists, so its memory serves the next one.

    ``muon_orthogonalize(donate=True)`` empties the caller's list of updates and
    ``orthogonalize_many`` sets each consumed entry of its list to None: the last reference
    to every temporary goes with it (a weak reference shows the storage is freed).
    """
    import weakref

    from lightning_muon.functional import muon_orthogonalize
    from lightning_muon.layout import MatrixLayout

    monkeypatch.setattr(ns, "BATCH_MAX_ELEMENTS", 16)  # these run alone
    updates = [randn(12, 20, seed=s, dtype=torch.float32) for s in (1, 2)]
    storages = [weakref.ref(u.untyped_storage()) for u in updates]
    expected = [orthogonalize(u.clone(), dtype=torch.float32) for u in updates]
    ortho = muon_orthogonalize(
        updates, ns_steps=5, ns_coefficients="polar_express", ns_dtype="float32",
        layout=MatrixLayout(), keep_work_dtype=True, donate=True,
    )  # fmt: skip
    assert updates == []
    # 5 steps: the results sit in the ping-pong partners, and the donated buffers are gone.
    assert all(ref() is None for ref in storages)
    for (Q,), E in zip(ortho, expected):
        assert_close(Q, E, atol=2e-5, rtol=0)
    # A stacked matrix is released once it is copied into its stack (2 x 3 and its transpose
    # share one), a matrix alone once it is iterated; without donation the list is kept.
    mats = [randn(12, 20, seed=3, dtype=torch.float32), randn(2, 3, seed=4, dtype=torch.float32)]
    mats.append(mats[1].mT.clone())
    expected = [orthogonalize(M, dtype=torch.float32) for M in mats]
    storages = [weakref.ref(M.untyped_storage()) for M in mats]
    kept = list(mats)
    for Q, E in zip(orthogonalize_many(kept, dtype=torch.float32), expected):
        assert_close(Q, E, atol=2e-5, rtol=0)
    assert all(M is not None for M in kept)
    out = orthogonalize_many(mats, dtype=torch.float32, donate=True)
    del kept
    assert mats == [None] * 3
    assert all(ref() is None for ref in storages)
    for Q, E in zip(out, expected):
        assert_close(Q, E, atol=2e-5, rtol=0)


# ---------------------------------------------------------------------- schedules


def test_explicit_coefficient_list_equals_named_schedule():
    """keller as a name or as its (a, b, c) list: same numbers, same default normalization."""
    G = randn(12, 20, seed=10)
    assert torch.equal(orthogonalize(G, coefficients=COEFFICIENTS["keller"]), orthogonalize(G, coefficients="keller"))
    assert torch.equal(
        orthogonalize(G, coefficients=[list(abc) for abc in COEFFICIENTS["you"]]), orthogonalize(G, coefficients="you")
    )


def test_short_coefficient_list_repeats_its_last_tuple():
    """[t1, t2] over 6 steps is t1, t2, t2, t2, t2, t2; a longer list is cut at ``steps``."""
    t1, t2 = (3.0, -3.2, 1.2), (1.875, -1.25, 0.375)
    G = randn(9, 15, seed=11)
    short = orthogonalize(G, steps=6, coefficients=[t1, t2])
    assert torch.equal(short, orthogonalize(G, steps=6, coefficients=[t1] + [t2] * 5))
    assert not torch.equal(short, orthogonalize(G, steps=6, coefficients=[t1] * 6))
    assert resolve_coefficients([t1, t2], 4)[0] == [t1, t2, t2, t2]
    assert resolve_coefficients([t1, t2, t1], 2)[0] == [t1, t2]
    # Named schedules extend the same way.
    pe = COEFFICIENTS["polar_express"]
    assert resolve_coefficients("polar_express", 8)[0] == pe + [pe[-1]] * 2
    # polar_express's tail tuple converges to 1, so extra steps approach the exact polar factor.
    assert pe[-1] == (1.875, -1.25, 0.375)
    assert resolve_coefficients("polar_express", 3)[0] == pe[:3]


# ----------------------------------------------------------------------- dtype policy


@pytest.fixture
def detect(monkeypatch):
    """Let the hardware decide: unset LIGHTNING_MUON_FAST_BF16 (CI forces it both ways)."""
    monkeypatch.delenv(FAST_BF16_ENV, raising=False)


@pytest.fixture
def bf16_speed(monkeypatch, detect):
    """Set what the CPU capability check answers; the real cached answer is left alone."""

    def set_fast(fast: bool) -> None:
        monkeypatch.setattr(ns, "_cpu_has_fast_bf16", lambda: fast)

    return set_fast


@pytest.mark.parametrize("fast", [True, False])
def test_auto_dtype_is_bf16_only_where_bf16_matmul_is_fast(bf16_speed, fast):
    """None picks bf16 on a CPU with AVX512-BF16/AMX, float32 elsewhere; float64 stays float64."""
    bf16_speed(fast)
    expected = torch.bfloat16 if fast else torch.float32
    assert bf16_matmul_is_fast("cpu") is fast
    for input_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert resolve_ns_dtype(None, "cpu", input_dtype) == expected
    assert resolve_ns_dtype(None, "cpu", torch.float64) == torch.float64
    # The choice reaches the iteration: the auto result is bitwise the explicit one.
    G = randn(4, 6, seed=12, dtype=torch.float32)
    auto = orthogonalize(G)
    assert auto.dtype == torch.float32
    assert torch.equal(auto, orthogonalize(G, dtype=expected))
    assert not torch.equal(auto, orthogonalize(G, dtype=torch.float32 if fast else torch.bfloat16))


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        (torch.float32, torch.float32),
        ("float64", torch.float64),
        (torch.float16, torch.float16),
    ],
)
def test_explicit_ns_dtype_is_honored(bf16_speed, fast, requested, expected):
    """A named or torch dtype overrides the policy, whatever the hardware and input dtype."""
    bf16_speed(fast)
    for input_dtype in (torch.float32, torch.float64):
        assert resolve_ns_dtype(requested, "cpu", input_dtype) == expected


def test_float64_input_iterated_in_float32_on_request():
    """dtype="float32" on a float64 input: float32 numbers, float64 output."""
    G = randn(8, 12, seed=13)
    Q = orthogonalize(G, dtype="float32")
    assert Q.dtype == torch.float64
    assert torch.equal(Q, orthogonalize(G.float(), dtype="float32").double())
    assert not torch.equal(Q, orthogonalize(G))


@pytest.mark.parametrize("input_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("ns_dtype", [None, "float32", "bfloat16"])
def test_output_dtype_is_input_dtype(input_dtype, ns_dtype):
    """Whatever the iteration dtype, the result comes back in the input's dtype and shape."""
    G = randn(2, 3, 5, seed=14, dtype=input_dtype)
    Q = orthogonalize(G, dtype=ns_dtype)
    assert Q.dtype == input_dtype and Q.shape == G.shape
    assert bool(Q.isfinite().all())


@pytest.fixture
def fresh_cpu_check(detect):
    """Clear the cached CPU capability answer before and after, so no fake answer leaks."""
    ns._HOST.clear()
    yield
    ns._HOST.clear()


@pytest.mark.parametrize(
    ("caps", "fast"),
    [
        ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, False),
        ({"avx2": True, "avx512_bf16": True, "amx_bf16": False}, True),
        ({"avx2": True, "avx512_bf16": False, "amx_bf16": True}, True),
        ({}, False),
    ],
)
def test_cpu_bf16_check_reads_cpu_capabilities(monkeypatch, fresh_cpu_check, caps, fast):
    """AVX512-BF16 or AMX-BF16 means fast bf16 matmul; AVX2 alone does not."""
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: caps)
    assert bf16_matmul_is_fast("cpu") is fast
    assert resolve_ns_dtype(None, torch.device("cpu"), torch.float32) == (torch.bfloat16 if fast else torch.float32)


@pytest.mark.parametrize("supported", [True, False])
def test_cuda_bf16_follows_torch_cuda(monkeypatch, detect, supported):
    """On CUDA the answer is torch.cuda.is_bf16_supported(); other devices say no."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: supported)
    assert bf16_matmul_is_fast("cuda") is supported
    assert bf16_matmul_is_fast("meta") is False


@pytest.mark.parametrize(("value", "fast"), [("1", True), ("0", False), (" 1 ", True)])
@pytest.mark.parametrize("hardware", [True, False])
@pytest.mark.parametrize("device", ["cpu", "cuda", "meta"])
def test_environment_variable_overrides_the_hardware_answer(bf16_speed, monkeypatch, value, fast, hardware, device):
    """LIGHTNING_MUON_FAST_BF16=1/0 decides on every device, whatever the CPU or GPU says."""
    bf16_speed(hardware)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: hardware)
    monkeypatch.setenv(FAST_BF16_ENV, value)
    assert bf16_matmul_is_fast(device) is fast
    assert resolve_ns_dtype(None, device, torch.float32) == (torch.bfloat16 if fast else torch.float32)
    assert resolve_ns_dtype(None, device, torch.float64) == torch.float64  # float64 is still kept
    assert resolve_ns_dtype("float32", device, torch.float32) == torch.float32  # an explicit dtype still wins


@pytest.mark.parametrize("hardware", [True, False])
def test_empty_environment_variable_means_detect(bf16_speed, monkeypatch, hardware):
    bf16_speed(hardware)
    monkeypatch.setenv(FAST_BF16_ENV, "")
    assert bf16_matmul_is_fast("cpu") is hardware


@pytest.mark.parametrize("value", ["yes", "true", "2", "fast"])
def test_bad_environment_variable_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(FAST_BF16_ENV, value)
    with pytest.raises(ValueError, match=rf"LIGHTNING_MUON_FAST_BF16 must be '1' .* got '{value}'"):
        bf16_matmul_is_fast("cpu")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, r"ns_steps must be a positive int, got 0"),
        ({"steps": 1.5}, r"ns_steps must be a positive int, got 1\.5"),
        ({"steps": True}, r"ns_steps must be a positive int, got True"),
        ({"coefficients": "quintic"}, r"ns_coefficients: unknown schedule 'quintic'"),
        ({"coefficients": []}, r"ns_coefficients must be a non-empty list of \(a, b, c\) tuples, got \[\]"),
        ({"coefficients": [(1.5, -0.5)]}, r"ns_coefficients must be a non-empty list of \(a, b, c\) tuples"),
        ({"coefficients": [(1.5, float("nan"), 0.0)]}, r"ns_coefficients must be finite numbers, got .*nan"),
        ({"coefficients": [(1.5, "x", 0.0)]}, r"ns_coefficients must be a name in .* got .*'x'"),
        ({"coefficients": (3.4445, -4.775)}, r"ns_coefficients must be a name in .* or one \(a, b, c\), got \(3"),
        ({"eps": 0.0}, r"ns_eps must be None or a finite number > 0, got 0\.0"),
        ({"dtype": "int8"}, r"ns_dtype must be None, a torch dtype or one of .* got 'int8'"),
        ({"dtype": torch.int32}, r"ns_dtype must be a floating torch dtype, got torch\.int32"),
    ],
)
def test_orthogonalize_rejects_bad_arguments(kwargs, match):
    """Bad steps, schedules and dtypes raise ValueError naming the argument and value."""
    with pytest.raises(ValueError, match=match):
        orthogonalize(randn(4, 6), **kwargs)


@pytest.mark.parametrize(
    ("G", "match"),
    [
        (torch.ones(5), r"G must be a tensor with at least 2 dims, got shape torch\.Size\(\[5\]\)"),
        (torch.ones(3, 3, dtype=torch.int64), r"G must be a real floating tensor, got dtype torch\.int64"),
        (torch.ones(3, 3, dtype=torch.complex64), r"G must be a real floating tensor, got dtype torch\.complex64"),
    ],
)
def test_orthogonalize_rejects_bad_inputs(G, match):
    """Vectors, integer and complex tensors are refused with their shape or dtype."""
    with pytest.raises(ValueError, match=match):
        orthogonalize(G)


def test_ns_flops_as_run_counts_each_matrix_of_a_batch_with_the_iteration_it_runs():
    from lightning_muon.newton_schulz import ns_flops, ns_flops_as_run

    wide = torch.zeros(3, 128, 512)  # aspect 4, short side 128: "auto" runs Gram in fp32
    assert ns_flops_as_run(wide, 5, "auto", dtype="float32") == 3 * ns_flops(128, 512, 5, method="gram")
    assert ns_flops_as_run(wide, 5, "standard", dtype="float32") == 3 * ns_flops(128, 512, 5)
    # In bf16 "auto" keeps the standard iteration (Gram is unstable in half precision).
    assert ns_flops_as_run(wide, 5, "auto", dtype="bfloat16") == 3 * ns_flops(128, 512, 5)
    square = torch.zeros(256, 256)
    assert ns_flops_as_run(square, 5, "auto") == ns_flops(256, 256, 5)
