"""Muon variants (issue 7): momentum forms, NorMuon / AdaMuon, cautious weight decay, Gram
Newton-Schulz, Megatron names; each against a direct float64 implementation of its formula."""

from __future__ import annotations

import io
import math

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon, MuonConfig, route_parameters
from lightning_muon.config import MEGATRON_COEFFICIENTS
from lightning_muon.distributed.sharded import MuonSharding
from lightning_muon.functional import matrix_slots, matrix_views
from lightning_muon.newton_schulz import (
    COEFFICIENTS,
    GRAM_MIN_ASPECT,
    GRAM_MIN_SHORT_SIDE,
    NORMALIZATION,
    gram_restarts,
    ns_flops,
    orthogonalize,
    orthogonalize_many,
    resolve_ns_method,
)

pytestmark = [pytest.mark.numerics, pytest.mark.distributed]

# ------------------------------------------------------------------ float64 reference

ADJUST = {
    "original": lambda r, c: math.sqrt(max(1.0, r / c)),
    "match_rms_adamw": lambda r, c: 0.2 * math.sqrt(max(r, c)),
    "spectral_norm": lambda r, c: math.sqrt(r / c),
}


def ns64(M: torch.Tensor, name: str = "polar_express", steps: int = 5) -> torch.Tensor:
    """Quintic Newton-Schulz in float64 on the short side, straight from its definition."""
    schedule = (list(COEFFICIENTS[name]) + [COEFFICIENTS[name][-1]] * steps)[:steps]
    safety, eps = NORMALIZATION[name]
    tall = M.shape[0] > M.shape[1]
    X = M.T if tall else M
    X = X / (torch.linalg.matrix_norm(X) * safety + eps)
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def piece_rows(rows: int, split_sizes) -> list[list[int]]:
    """Row indices of each matrix Muon orthogonalizes: Megatron's per-group [q | k | v] layout."""
    if not split_sizes:
        return [list(range(rows))]
    total, out, offset = sum(split_sizes), [], 0
    for size in split_sizes:
        out.append([g * total + offset + j for g in range(rows // total) for j in range(size)])
        offset += size
    return out


def reference(W0, grads, *, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, momentum_form="ema",
              second_moment=None, beta2=0.9, eps=1e-8, sign_momentum=False, weight_decay_form="decoupled",
              adjust="original", split_sizes=None):  # fmt: skip
    """The variant Muon loop in float64; returns weights, momentum, second moment (rows as the matrix)."""
    W = W0.to(torch.float64, copy=True)
    B = torch.zeros_like(W)
    rows = W.shape[0]
    V = None
    if second_moment == "normuon":
        V = torch.zeros(rows, 1, dtype=torch.float64)
    elif second_moment == "adamuon":
        V = torch.zeros(rows, W[0].numel(), dtype=torch.float64)
    for G in grads:
        G = G.to(torch.float64)
        if momentum_form == "ema":
            B = momentum * B + (1 - momentum) * G
            U = (1 - momentum) * G + momentum * B if nesterov else B
        else:
            B = momentum * B + G
            U = G + momentum * B if nesterov else B
        if sign_momentum:
            U = torch.sign(U)
        M = U.reshape(rows, -1)
        step = torch.zeros_like(M)  # the update direction, lr aside
        for idx in piece_rows(rows, split_sizes):
            Q = ns64(M[idx])  # the orthogonalized piece, O in the docs
            if second_moment is not None:
                stat = (Q**2).mean(dim=1, keepdim=True) if second_moment == "normuon" else Q**2
                V[idx] = beta2 * V[idx] + (1 - beta2) * stat
                Q_hat = Q / (V[idx].sqrt() + eps)
                Q = Q_hat * torch.linalg.matrix_norm(Q) / torch.linalg.matrix_norm(Q_hat)
            step[idx] = ADJUST[adjust](len(idx), M.shape[1]) * Q
        Wm = W.reshape(rows, -1)
        if weight_decay_form == "decoupled":
            Wm = Wm * (1 - lr * weight_decay)
        else:  # cautious: decay where the update (subtracted) and W agree in sign
            Wm = Wm - lr * weight_decay * (step * Wm >= 0).double() * Wm  # a bool mask times a float is float32
        W = (Wm - lr * step).reshape(W.shape)
    return W, B, V


def random_tensors(shapes, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def run(opt, params, grad_steps):
    for grads in grad_steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


VARIANTS = {
    "sum": dict(momentum_form="sum"),
    "sum-plain": dict(momentum_form="sum", nesterov=False),
    "ema-plain": dict(nesterov=False),
    "normuon": dict(second_moment="normuon"),
    "adamuon": dict(second_moment="adamuon"),
    "adamuon-sign": dict(second_moment="adamuon", sign_momentum=True),
    "cautious": dict(weight_decay_form="cautious"),
    "sum-normuon-cautious": dict(momentum_form="sum", second_moment="normuon", weight_decay_form="cautious"),
    "normuon-adamw-scale": dict(second_moment="normuon", adjust="match_rms_adamw"),
    "adamuon-plain-spectral": dict(second_moment="adamuon", nesterov=False, adjust="spectral_norm"),
}


def muon_kwargs(variant: dict) -> dict:
    """The variant as Muon keywords (the reference's names differ for beta2 and adjust)."""
    kw = {k: v for k, v in variant.items() if k not in ("adjust", "beta2", "eps")}
    return dict(kw, second_moment_beta2=0.9, second_moment_eps=1e-8, adjust_lr=variant.get("adjust", "original"))


# ------------------------------------------------------------- variants vs the formula


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("shape", [(16, 16), (24, 12), (12, 24), (8, 3, 3, 3)])
def test_variant_matches_float64_formula(variant, shape):
    """8 steps of each variant in float64 equal the formula; momentum and second moment too."""
    spec = dict(VARIANTS[variant])
    (W0,) = random_tensors([shape], seed=2)
    grads = [random_tensors([shape], seed=10 + t)[0] for t in range(8)]
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.05, momentum=0.9, weight_decay=0.1, **muon_kwargs(spec))
    run(opt, [p], [[g] for g in grads])
    W_ref, B_ref, V_ref = reference(W0, grads, **spec)
    # Same float64 math in another association (baddbmm, foreach): rounding only.
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"], B_ref, atol=1e-12, rtol=0)
    if V_ref is not None:
        v = opt.state[p]["second_moment"]
        expected_shape = p.shape if spec["second_moment"] == "adamuon" else (shape[0], 1)
        assert v.shape == expected_shape
        assert_close(v.reshape(V_ref.shape), V_ref, atol=1e-12, rtol=0)
    assert (W_ref - W0).abs().max() > 0.05  # the parameters moved


@pytest.mark.parametrize("variant", ["normuon", "adamuon-sign", "sum-normuon-cautious"])
def test_variant_in_float32_matches_float64_formula(variant):
    """float32 parameters and Newton-Schulz against the float64 formula."""
    spec = dict(VARIANTS[variant])
    (W0,) = random_tensors([(24, 12)], seed=3)
    grads = [random_tensors([(24, 12)], seed=20 + t)[0] for t in range(6)]
    p = nn.Parameter(W0.float())
    opt = Muon([p], lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype="float32", **muon_kwargs(spec))
    run(opt, [p], [[g.float()] for g in grads])
    W_ref, _, _ = reference(W0, grads, **spec)
    # float32 Newton-Schulz is off by ~1e-6 per entry (Polar Express amplifies rounding); the
    # second moment divides by sqrt(v) and rescales, which keeps that level: lr * adjust * 1e-5
    # per step over 6 steps stays below 1e-5 (measured 1e-6).
    assert_close(p.detach().double(), W_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("second_moment", ["normuon", "adamuon"])
@pytest.mark.parametrize(
    ("shape", "split_sizes"),
    [((48, 8), (24, 8, 16)), ((32, 8), (4, 2, 2)), ((24, 6), (6,))],
    ids=["contiguous", "grouped-gqa", "grouped-one-block"],
)
def test_split_sizes_with_second_moment_match_formula(second_moment, shape, split_sizes):
    """Fused QKV, contiguous (sizes sum to dim 0) and Megatron's grouped layout (sum divides it)."""
    spec = dict(second_moment=second_moment, weight_decay_form="cautious", split_sizes=split_sizes)
    (W0,) = random_tensors([shape], seed=4)
    grads = [random_tensors([shape], seed=30 + t)[0] for t in range(6)]
    p = nn.Parameter(W0.clone())
    kwargs = muon_kwargs({k: v for k, v in spec.items() if k != "split_sizes"})
    opt = Muon([{"params": [p], "split_sizes": list(split_sizes)}], lr=0.05, momentum=0.9, weight_decay=0.1, **kwargs)
    run(opt, [p], [[g] for g in grads])
    W_ref, _, V_ref = reference(W0, grads, **spec)
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["second_moment"].reshape(V_ref.shape), V_ref, atol=1e-12, rtol=0)


def test_grouped_split_views_follow_megatron_layout():
    """matrix_views gathers each block's rows from every query group; matrix_slots write them back."""
    t = torch.arange(8 * 3, dtype=torch.float64).reshape(8, 3)  # 2 groups of (2 q + 1 k + 1 v) rows
    q, k, v = matrix_views(t, (2, 1, 1))
    # Megatron: t.view(groups, 4, -1).split([2, 1, 1], dim=1), each reshaped to (-1, cols).
    expected = [x.reshape(-1, 3) for x in t.view(2, 4, 3).split([2, 1, 1], dim=1)]
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got, want)
    assert q.shape == (4, 3) and k.shape == (2, 3)
    target = torch.zeros_like(t)
    for slot, piece in zip(matrix_slots(target, (2, 1, 1)), (q, k, v)):
        slot.copy_(piece.view(slot.shape))
    assert torch.equal(target, t)


@pytest.mark.parametrize("second_moment", ["normuon", "adamuon"])
def test_batched_tensor_with_second_moment_equals_separate_matrices(second_moment):
    """A (3, 6, 10) expert tensor with batched=True steps like three separate (6, 10) matrices."""
    (W0,) = random_tensors([(3, 6, 10)], seed=5)
    grads = [random_tensors([(3, 6, 10)], seed=40 + t)[0] for t in range(5)]
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.1, second_moment=second_moment, weight_decay_form="cautious")
    fused = nn.Parameter(W0.clone())
    fused_opt = Muon([{"params": [fused], "batched": True}], **hp)
    run(fused_opt, [fused], [[g] for g in grads])
    separate = [nn.Parameter(W0[i].clone()) for i in range(3)]
    separate_opt = Muon(separate, **hp)
    run(separate_opt, separate, [list(g.unbind(0)) for g in grads])
    assert_close(fused.detach(), torch.stack([p.detach() for p in separate]), atol=1e-12, rtol=0)
    v = fused_opt.state[fused]["second_moment"]
    assert v.shape == ((3, 6, 10) if second_moment == "adamuon" else (3, 6, 1))
    expected = torch.stack([separate_opt.state[p]["second_moment"] for p in separate])
    assert_close(v, expected, atol=1e-12, rtol=0)


def test_non_contiguous_parameter_with_cautious_decay_equals_contiguous():
    (W0,) = random_tensors([(12, 20)], seed=6)
    grads = [random_tensors([(12, 20)], seed=50 + t)[0] for t in range(4)]
    hp = dict(lr=0.05, weight_decay=0.2, weight_decay_form="cautious", second_moment="normuon")
    base = nn.Parameter(W0.T.clone().contiguous())  # (20, 12)
    strided = nn.Parameter(torch.empty(12, 20, dtype=torch.float64).T)  # (20, 12), not contiguous
    with torch.no_grad():
        strided.copy_(base)
    assert not strided.is_contiguous()
    for p in (base, strided):
        run(Muon([p], **hp), [p], [[g.T] for g in grads])
    assert_close(strided.detach(), base.detach(), atol=1e-13, rtol=0)


# -------------------------------------------------------------------- properties


@pytest.mark.parametrize("second_moment", ["normuon", "adamuon"])
def test_second_moment_keeps_plain_muon_update_norm(second_moment):
    """At every step the update's Frobenius norm is exactly plain Muon's: the lr carries over."""
    shape = (20, 36)
    (W0,) = random_tensors([shape], seed=7)
    grads = [random_tensors([shape], seed=60 + t)[0] for t in range(4)]
    plain, adaptive = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    opt_plain = Muon([plain], lr=0.1)
    opt_adaptive = Muon([adaptive], lr=0.1, second_moment=second_moment)
    for g in grads:
        before = plain.detach().clone(), adaptive.detach().clone()
        run(opt_plain, [plain], [[g]])
        run(opt_adaptive, [adaptive], [[g]])
        norm_plain = torch.linalg.matrix_norm(plain.detach() - before[0])
        norm_adaptive = torch.linalg.matrix_norm(adaptive.detach() - before[1])
        assert_close(norm_adaptive, norm_plain, atol=0, rtol=1e-12)
        # ... while the direction differs: rows (NorMuon) or entries (AdaMuon) were reweighted.
        assert not torch.allclose(adaptive.detach() - before[1], plain.detach() - before[0], atol=1e-6)


def test_normuon_equalizes_row_norms_on_its_first_step():
    """With v = (1 - b2) mean(O^2) per row, O / sqrt(v) has equal row norms (eps aside)."""
    (W0,) = random_tensors([(16, 40)], seed=8)
    # A gradient whose rows differ in scale by 100x: O keeps unequal row norms.
    (G,) = random_tensors([(16, 40)], seed=9)
    G = G * torch.logspace(0, 2, 16, dtype=torch.float64)[:, None]
    p = nn.Parameter(W0.clone())
    run(Muon([p], lr=0.1, second_moment="normuon"), [p], [[G]])
    rows = torch.linalg.vector_norm(p.detach() - W0, dim=1)
    assert_close(rows, rows.mean().expand_as(rows), atol=0, rtol=1e-6)


def test_cautious_decay_only_where_update_and_weight_agree():
    """No update (lr scale 0 is impossible, so a zero gradient): decay acts only where O * W >= 0."""
    W0 = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 2.0, -3.0]], dtype=torch.float64)
    G = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.1, weight_decay=0.5, momentum=0.0, nesterov=False, weight_decay_form="cautious")
    run(opt, [p], [[G]])
    update = ns64(G)  # every entry > 0, as G's: it agrees with the positive weights only
    agree = (update * W0 >= 0).double()
    expected = W0 - 0.1 * 0.5 * agree * W0 - 0.1 * math.sqrt(max(1, 2 / 3)) * update
    assert_close(p.detach(), expected, atol=1e-12, rtol=0)
    assert torch.equal(agree, (W0 > 0).double())


@pytest.mark.parametrize("variant", ["sum-normuon-cautious", "adamuon-sign"])
def test_zero_lr_step_changes_no_parameter(variant):
    """DCP resumes with an lr = 0 step: every variant's update and decay scale with lr."""
    (W0,) = random_tensors([(10, 14)], seed=10)
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.0, weight_decay=0.3, **muon_kwargs(VARIANTS[variant]))
    run(opt, [p], [[g] for g in random_tensors([(10, 14)] * 2, seed=11)])
    assert torch.equal(p.detach(), W0)


def test_zero_gradient_gives_a_zero_update_with_second_moments():
    for method in ("normuon", "adamuon"):
        p = nn.Parameter(torch.ones(4, 6, dtype=torch.float64))
        run(Muon([p], lr=0.1, second_moment=method), [p], [[torch.zeros(4, 6, dtype=torch.float64)]])
        assert torch.equal(p.detach(), torch.ones(4, 6, dtype=torch.float64))


def test_update_observer_sees_the_pieces_as_applied():
    """``ortho`` handed to the observer is after the second moment: lr * adjust * ortho is the step."""
    (W0,) = random_tensors([(12, 30)], seed=12)
    p = nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "split_sizes": [4, 8]}], lr=0.1, second_moment="adamuon")
    seen = []
    opt._update_observer = lambda group, params, updates, ortho: seen.append([o.clone() for o in ortho[0]])
    run(opt, [p], [random_tensors([(12, 30)], seed=13)])
    delta = torch.cat([-0.1 * ADJUST["original"](*o.shape) * o for o in seen[0]])
    assert_close(p.detach() - W0, delta, atol=1e-14, rtol=0)


# ------------------------------------------------------------------------ state


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 12), nn.Tanh(), nn.Linear(12, 3))


def _train(net, opt, steps):
    for t in steps:
        gen = torch.Generator().manual_seed(t)
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


ALL_ON = dict(momentum_form="sum", second_moment="normuon", weight_decay_form="cautious", ns_method="gram")


@pytest.mark.parametrize("variant", [ALL_ON, dict(second_moment="adamuon", sign_momentum=True)], ids=["normuon", "ada"])
def test_state_dict_round_trip_resumes_exactly(variant):
    torch.manual_seed(0)
    net = _net()
    opt = Muon(route_parameters(net), lr=0.02, weight_decay=0.1, ns_dtype="float32", **variant)
    _train(net, opt, range(4))
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, buf)
    _train(net, opt, range(4, 8))

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _net()
    resumed.load_state_dict(saved["model"])
    resumed_opt = Muon(route_parameters(resumed), lr=0.02, weight_decay=0.1, ns_dtype="float32", **variant)
    resumed_opt.load_state_dict(saved["optim"])
    _train(resumed, resumed_opt, range(4, 8))
    for (name, p), q in zip(net.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
        for key, value in opt.state[p].items():
            assert torch.equal(value, resumed_opt.state[q][key]), (name, key)
    muon = next(g for g in opt.param_groups if g["algorithm"] == "muon")
    for p in muon["params"]:
        assert "second_moment" in opt.state[p]
    strip = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]
    assert strip(resumed_opt.param_groups) == strip(opt.param_groups)


def test_groups_from_an_older_checkpoint_get_the_new_knobs():
    """A saved param group without the variant keys (an older release) still steps, as plain Muon."""
    p = nn.Parameter(torch.randn(6, 8, dtype=torch.float64))
    opt = Muon([p], lr=0.02)
    state = opt.state_dict()
    for key in ("momentum_form", "second_moment", "weight_decay_form", "ns_method", "sign_momentum"):
        del state["param_groups"][0][key]
    fresh = Muon([p], lr=0.02)
    fresh.load_state_dict(state)
    run(fresh, [p], [random_tensors([(6, 8)], seed=14)])
    assert fresh.param_groups[0]["momentum_form"] == "ema"


# --------------------------------------------------------------------- Gram Newton-Schulz


def _polar(G: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (2, 3, 12, 40), (20, 20)])
@pytest.mark.parametrize("name", ["polar_express", "keller", "you", "polar_express_paper"])
def test_gram_equals_standard_in_float64(shape, name):
    """The same polynomial, reassociated: equal to rounding in float64, batched and tall too."""
    (G,) = random_tensors([shape], seed=15)
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
    polar = _polar(G)
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
    mats = random_tensors([(8, 32), (32, 8), (8, 32), (200, 700)], seed=18)
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
    (W0,) = random_tensors([(12, 48)], seed=19)
    grads = [[g] for g in random_tensors([(12, 48)] * 4, seed=20)]
    results = []
    for method in ("standard", "gram"):
        p = nn.Parameter(W0.clone())
        run(Muon([p], lr=0.05, ns_method=method, second_moment="normuon"), [p], grads)
        results.append(p.detach())
    assert_close(results[1], results[0], atol=1e-12, rtol=0)


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"momentum_form": "nesterov"}, r"momentum_form must be one of \('ema', 'sum'\), got 'nesterov'"),
        ({"second_moment": "adam"}, r"second_moment must be one of \(None, 'normuon', 'adamuon'\), got 'adam'"),
        ({"second_moment_beta2": 1.0}, r"second_moment_beta2 must be a finite number in \[0.0, 1.0\)"),
        ({"second_moment_eps": 0.0}, r"second_moment_eps must be a finite number in \(0.0"),
        ({"weight_decay_form": "l2"}, r"weight_decay_form must be one of \('decoupled', 'cautious'\)"),
        ({"ns_method": "fast"}, r"ns_method must be one of \('standard', 'gram', 'auto'\)"),
        ({"sign_momentum": 1}, r"sign_momentum must be a bool"),
    ],
)
def test_bad_variant_arguments_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=r"Muon\(\): " + match):
        Muon([torch.zeros(3, 3, requires_grad=True)], **kwargs)
    with pytest.raises(ValueError, match=r"param group 0: " + match):
        Muon([{"params": [torch.zeros(3, 3, requires_grad=True)], **kwargs}])


def test_split_sizes_must_divide_dim_zero():
    W = torch.zeros(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"sum to 4, but dim 0 has size 10, not a multiple of it"):
        Muon([{"params": [W], "split_sizes": [2, 1, 1]}])
    Muon([{"params": [torch.zeros(12, 4, requires_grad=True)], "split_sizes": [2, 1, 1]}])  # 3 groups


# ---------------------------------------------------------------- Megatron names


def test_megatron_names_map_onto_ours():
    config = MuonConfig(
        coefficient_type="simple", num_ns_steps=6, scale_mode="unit_rms_norm", moment2_method="adamuon",
        extra_scale_factor=0.5,
    )  # fmt: skip
    kw = config.optimizer_kwargs()
    assert (kw["ns_coefficients"], kw["ns_steps"], kw["adjust_lr"]) == ("keller", 6, "unit_rms_norm")
    assert (kw["second_moment"], kw["extra_scale_factor"]) == ("adamuon", 0.5)
    assert MuonConfig(coefficient_type="polar_express", num_ns_steps=8).ns_coefficients == "polar_express_paper"
    assert MuonConfig(coefficient_type="quintic").ns_coefficients == "you"
    assert MuonConfig(scale_mode="spectral").adjust_lr == "spectral"
    assert MuonConfig(scale_mode="shape_scaling").adjust_lr == "shape_scaling"  # our "original"
    custom = [(3.0, -3.2, 1.2)]
    assert MuonConfig(coefficient_type="custom", ns_coefficients=custom).ns_coefficients == custom
    # Megatron cycles a list over num_ns_steps (a multiple of its length).
    quintic10 = MuonConfig(coefficient_type="quintic", num_ns_steps=10).ns_coefficients
    assert quintic10 == list(COEFFICIENTS["you"]) * 2
    aol8 = MuonConfig(coefficient_type="aol", num_ns_steps=8).ns_coefficients
    assert aol8 == MEGATRON_COEFFICIENTS["aol"] * 2
    # Megatron's polar_express numbers are the paper's divided by the 1.01 safety, to 4 digits.
    megatron_first = (8.2051, -22.9019, 16.4607)
    assert_close(torch.tensor(COEFFICIENTS["polar_express_paper"][0]), torch.tensor(megatron_first), atol=1e-4, rtol=0)


def test_megatron_settings_build_the_same_optimizer_as_ours():
    megatron = MuonConfig(coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral", moment2_method="normuon")
    ours = MuonConfig(ns_coefficients="you", ns_steps=5, adjust_lr="spectral", second_moment="normuon")
    assert megatron.optimizer_kwargs() == ours.optimizer_kwargs()
    assert MuonConfig.from_any(megatron.to_dict()) == megatron  # the round trip does not clash with itself


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(ns_steps=6, num_ns_steps=8), r"num_ns_steps=8 and ns_steps=6 disagree"),
        (dict(ns_coefficients="keller", coefficient_type="quintic"), r"coefficient_type='quintic' and ns_coeff"),
        (dict(adjust_lr="match_rms_adamw", scale_mode="spectral"), r"scale_mode='spectral' and adjust_lr="),
        (dict(second_moment="adamuon", moment2_method="normuon"), r"moment2_method='normuon' and second_moment="),
        (dict(coefficient_type="cubic"), r"MuonConfig\.coefficient_type must be one of"),
        (dict(coefficient_type="custom"), r"coefficient_type='custom' needs ns_coefficients as a list"),
        (dict(num_ns_steps=0), r"MuonConfig\.num_ns_steps must be a positive int"),
        (dict(scale_mode="rms"), r"MuonConfig\.scale_mode must be one of"),
        (dict(moment2_method="namo"), r"MuonConfig\.moment2_method must be one of"),
        (dict(split_qkv=True), r"MuonConfig\.split_qkv needs qkv_split_shapes"),
        (dict(split_qkv=True, qkv_split_shapes=[4, 0]), r"MuonConfig\.qkv_split_shapes must be"),
        (dict(second_moment="rms"), r"MuonConfig\.second_moment: .*second_moment must be one of"),
        (dict(ns_method="fast"), r"MuonConfig\.ns_method: .*ns_method must be one of"),
        (dict(weight_decay_form="l2"), r"MuonConfig\.weight_decay_form: "),
        (dict(momentum_form="x"), r"MuonConfig\.momentum_form: "),
    ],
)
def test_megatron_and_variant_config_errors_name_the_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MuonConfig(**kwargs)


def test_megatron_names_read_from_yaml():
    """A Megatron user's YAML (its names, plus ours) parses through jsonargparse as LightningCLI does."""
    import jsonargparse

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    yaml = (
        "muon:\n  coefficient_type: polar_express\n  num_ns_steps: 8\n  scale_mode: spectral\n"
        "  extra_scale_factor: 0.2\n  split_qkv: true\n  qkv_split_shapes: [64, 16, 16]\n"
        "  moment2_method: normuon\n  weight_decay_form: cautious\n"
    )
    config = parser.instantiate(parser.parse_string(yaml)).muon
    kw = config.optimizer_kwargs()
    assert (kw["ns_coefficients"], kw["ns_steps"], kw["adjust_lr"]) == ("polar_express_paper", 8, "spectral")
    assert (kw["extra_scale_factor"], kw["second_moment"], kw["weight_decay_form"]) == (0.2, "normuon", "cautious")
    assert config.qkv_split_shapes == (64, 16, 16) and len(config.qkv_rules()) == 2


def test_megatron_agreeing_values_are_accepted():
    config = MuonConfig(ns_steps=8, num_ns_steps=8, adjust_lr="original", scale_mode="shape_scaling")
    assert config.ns_steps == 8


class _GQAttention(nn.Module):
    def __init__(self, d: int = 8, groups: int = 2, heads_per_group: int = 2, head_dim: int = 2) -> None:
        super().__init__()
        self.linear_qkv = nn.Linear(d, groups * (heads_per_group + 2) * head_dim)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)


def test_split_qkv_routes_fused_qkv_weights_with_megatron_split():
    """split_qkv + qkv_split_shapes: the fused weight (by name or is_qkv) is split as Megatron does."""
    model = _GQAttention()
    config = MuonConfig(split_qkv=True, qkv_split_shapes=[4, 2, 2])
    groups = route_parameters(model, **config.routing_kwargs())
    qkv = next(g for g in groups if g["name"] == "muon_qkv")
    assert qkv["param_names"] == ["linear_qkv.weight"] and qkv["split_sizes"] == [4, 2, 2]
    assert groups.assignments["proj.weight"] == "hidden_matrices"
    # Megatron's attribute works whatever the name.
    other = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    other[0].weight.is_qkv = True
    groups = route_parameters(other, **config.routing_kwargs())
    assert groups.assignments["0.weight"] == "split_qkv"
    # Stepping the routed model: the QKV weight moves as the formula with Megatron's row layout says.
    W0 = model.linear_qkv.weight.detach().double().clone()
    model = model.double()
    opt = Muon(route_parameters(model, **config.routing_kwargs()), **config.optimizer_kwargs())
    grads = random_tensors([W0.shape] * 3, seed=21)
    for g in grads:
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        model.linear_qkv.weight.grad = g.clone()
        opt.step()
    W_ref, _, _ = reference(W0, grads, lr=0.02, momentum=0.95, weight_decay=0.0, split_sizes=(4, 2, 2))
    assert_close(model.linear_qkv.weight.detach(), W_ref, atol=1e-12, rtol=0)


def test_config_variant_fields_reach_the_optimizer():
    config = MuonConfig(**{k: v for k, v in ALL_ON.items()}, sign_momentum=True, second_moment_beta2=0.8)
    opt = Muon([torch.zeros(4, 4, requires_grad=True)], **config.optimizer_kwargs())
    group = opt.param_groups[0]
    assert {k: group[k] for k in ALL_ON} == ALL_ON
    assert group["sign_momentum"] is True and group["second_moment_beta2"] == 0.8


# ------------------------------------------------------- distributed: equal to one process

DIST_VARIANTS = [
    dict(momentum_form="sum"),
    dict(second_moment="normuon", weight_decay_form="cautious"),
    dict(second_moment="adamuon", sign_momentum=True, nesterov=False),
    dict(ns_method="gram", momentum_form="sum", second_moment="normuon"),
]
DIST_STEPS, DIST_BATCH = 5, 12


def _dist_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)
    )


def _dist_train(rank: int, world: int) -> list[dict]:
    """Every variant in turn, MuonSharding (reduce_scatter) when world > 1; params and full states."""
    out = []
    for variant in DIST_VARIANTS:
        model = _dist_model()
        opt = Muon(route_parameters(model), lr=0.02, weight_decay=0.1, ns_dtype="float32", adamw_lr=1e-2, **variant)
        sharding = MuonSharding(opt) if world > 1 else None
        muon_ids = {id(p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
        for step in range(DIST_STEPS):
            gen = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(DIST_BATCH, 8, generator=gen), torch.randn(DIST_BATCH, 4, generator=gen)
            lo, hi = rank * DIST_BATCH // world, (rank + 1) * DIST_BATCH // world
            opt.zero_grad()
            nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
            if sharding is not None:
                for p in model.parameters():  # plain DDP's share: everything but the Muon matrices
                    if id(p) not in muon_ids:
                        torch.distributed.all_reduce(p.grad)
                        p.grad /= world
                sharding.reduce_gradients()
            opt.step()
        muon_params = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        states = sharding.gather_states() if sharding is not None else [dict(opt.state[p]) for p in muon_params]
        out.append({"params": [p.detach().clone() for p in model.parameters()], "states": states})
    return out


# FSDP2: Shard(0) DTensors, whole matrices orthogonalized by owners (MuonFSDPSharding).
FSDP_SHAPES = {"a": (5, 4), "b": (6, 7), "conv": (4, 2, 3, 3), "experts": (3, 4, 5)}


def _fsdp_run(rank: int, world: int) -> list[dict]:
    """Every variant in turn on Shard(0) DTensors (world > 1) or plain tensors; full params and states."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    place = (lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])) if mesh else (lambda t: t.clone())
    full = lambda t: t.full_tensor() if mesh else t
    out = []
    for variant in DIST_VARIANTS:
        gen = torch.Generator().manual_seed(0)
        params = {n: nn.Parameter(place(torch.randn(s, generator=gen))) for n, s in FSDP_SHAPES.items()}
        grads = [{n: torch.randn(s, generator=gen) for n, s in FSDP_SHAPES.items()} for _ in range(4)]
        groups = [
            {"params": [params[n] for n in ("a", "b", "conv")], "algorithm": "muon"},
            {"params": [params["experts"]], "algorithm": "muon", "batched": True},
        ]
        opt = Muon(groups, lr=0.05, weight_decay=0.1, ns_dtype="float32", **variant)
        if mesh:
            MuonFSDPSharding(opt)
        for step in range(4):
            for n, p in params.items():
                p.grad = place(grads[step][n])
            opt.step()
        states = {n: {k: full(v) for k, v in opt.state[p].items()} for n, p in params.items()}
        types = {type(v).__name__ for p in params.values() for v in opt.state[p].values()}
        out.append({"params": {n: full(p.detach()) for n, p in params.items()}, "states": states, "types": types})
    return out


def _both(rank: int, world: int) -> dict:
    return {"sharded": _dist_train(rank, world), "fsdp": _fsdp_run(rank, world)}


@pytest.fixture(scope="module")
def distributed_runs() -> dict:
    """One spawn of 2 gloo ranks runs every variant under MuonSharding and under FSDP2; one process too."""
    return {"single": _both(0, 1), "ranks": run_distributed(_both, 2)}


def _tolerance(variant: dict) -> float:
    # fp32; the gradient average's summation order differs (~1e-7 relative), which
    # Newton-Schulz keeps near 1e-6 over 5 steps. Gram Newton-Schulz carries R = X X^T
    # between restarts, whose rounding (eps ||X||^2) swamps the near-zero singular values
    # of rank-deficient gradients (batch 12 < 16 rows) that the polynomial then amplifies:
    # perturbing every gradient by 1e-7 relative moved the weights by 0.9-1.4e-6 with the
    # standard iteration and by 2.2-4.2e-6 with Gram (5 seeds, measured).
    return 5e-6 if variant.get("ns_method") == "gram" else 1e-6


def test_sharded_variants_equal_single_process(distributed_runs):
    """Two gloo ranks with owner-based Newton-Schulz equal one process for every variant; the
    gathered checkpoint state (momentum and second moments, whichever rank owns them) too."""
    single = distributed_runs["single"]["sharded"]
    for v, variant in enumerate(DIST_VARIANTS):
        atol = _tolerance(variant)
        for res in (r["sharded"] for r in distributed_runs["ranks"]):
            for a, b in zip(res[v]["params"], single[v]["params"]):
                assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m, variant=variant: f"{variant}: {m}")
            for got, want in zip(res[v]["states"], single[v]["states"]):
                assert set(got) == set(want), variant
                for key in want:
                    assert_close(got[key], want[key], rtol=1e-5, atol=atol)
        if "second_moment" in variant:
            assert all("second_moment" in s for s in single[v]["states"])


def test_fsdp_variants_equal_single_process(distributed_runs):
    """Under FSDP2 every variant's state is a Shard(0) DTensor made from its param (NorMuon's per-row
    buffer, AdaMuon's per-element one) and the steps equal one process."""
    single = distributed_runs["single"]["fsdp"]
    for v, variant in enumerate(DIST_VARIANTS):
        atol = _tolerance(variant)
        for res in (r["fsdp"] for r in distributed_runs["ranks"]):
            assert res[v]["types"] == {"DTensor"}, variant
            for n, want in single[v]["params"].items():
                label = f"{variant} {n}"
                assert_close(
                    res[v]["params"][n], want, rtol=1e-5, atol=atol, msg=lambda m, label=label: f"{label}: {m}"
                )
            for n, state in single[v]["states"].items():
                assert set(res[v]["states"][n]) == set(state)
                for key, want in state.items():
                    assert_close(res[v]["states"][n][key], want, rtol=1e-5, atol=atol)
