"""Muon's update-rule variants against the float64 formula (tests/muon_reference.py): momentum
forms (ema, sum), NorMuon / AdaMuon second moments, sign momentum, the weight decay methods
(cautious, independent, palm, l2); their properties, state and argument errors."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from muon_reference import ADJUST, muon64, newton_schulz64, random_tensors, run_steps
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon, route_parameters
from lightning_muon.layout import MatrixLayout

pytestmark = pytest.mark.numerics

VARIANTS = {
    "sum": dict(momentum_form="sum"),
    "sum-plain": dict(momentum_form="sum", nesterov=False),
    "ema-plain": dict(nesterov=False),
    "normuon": dict(second_moment="normuon_rms"),
    "adamuon": dict(second_moment="adamuon_rms"),
    "adamuon-sign": dict(second_moment="adamuon_rms", sign_momentum=True),
    "cautious": dict(weight_decay_method="cautious"),
    "sum-normuon-cautious": dict(momentum_form="sum", second_moment="normuon_rms", weight_decay_method="cautious"),
    # The family's other decay methods, which Muon takes as every matrix algorithm does.
    "independent": dict(weight_decay_method="independent"),
    "palm": dict(weight_decay_method="palm"),
    "l2": dict(weight_decay_method="l2"),
    "l2-normuon-sum": dict(weight_decay_method="l2", second_moment="normuon_rms", momentum_form="sum"),
    "normuon-adamw-scale": dict(second_moment="normuon_rms", adjust="match_rms_adamw"),
    "adamuon-plain-spectral": dict(second_moment="adamuon_rms", nesterov=False, adjust="spectral_norm"),
    # Emerging-Optimizers' (Megatron-Core's adaptive_muon) forms
    "eo-normuon": dict(second_moment="normuon", nesterov=False, adjust="spectral"),
    "eo-adamuon": dict(second_moment="adamuon", nesterov=False, adjust="spectral"),
    "eo-namo": dict(second_moment="namo", nesterov=False, adjust="spectral"),
    "eo-namo-nesterov-sum": dict(second_moment="namo", momentum_form="sum"),
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
    (W0,) = random_tensors([shape], seed=2, dtype=torch.float64)
    grads = [random_tensors([shape], seed=10 + t, dtype=torch.float64)[0] for t in range(8)]
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.05, momentum=0.9, weight_decay=0.1, **muon_kwargs(spec))
    run_steps(opt, [p], [[g] for g in grads])
    W_ref, B_ref, V_ref = muon64(W0, grads, **spec)
    # Same float64 math in another association (baddbmm, foreach): rounding only.
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"], B_ref, atol=1e-12, rtol=0)
    if V_ref is not None:
        v = opt.state[p]["second_moment"]
        assert v.numel() == V_ref.numel()
        assert_close(v.reshape(V_ref.shape), V_ref, atol=1e-12, rtol=0)
    assert (W_ref - W0).abs().max() > 0.05  # the parameters moved


@pytest.mark.parametrize("variant", ["normuon", "adamuon-sign", "sum-normuon-cautious"])
def test_variant_in_float32_matches_float64_formula(variant):
    """float32 parameters and Newton-Schulz against the float64 formula."""
    spec = dict(VARIANTS[variant])
    (W0,) = random_tensors([(24, 12)], seed=3, dtype=torch.float64)
    grads = [random_tensors([(24, 12)], seed=20 + t, dtype=torch.float64)[0] for t in range(6)]
    p = nn.Parameter(W0.float())
    opt = Muon([p], lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype="float32", **muon_kwargs(spec))
    run_steps(opt, [p], [[g.float()] for g in grads])
    W_ref, _, _ = muon64(W0, grads, **spec)
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
    spec = dict(second_moment=second_moment, weight_decay_method="cautious", split_sizes=split_sizes)
    (W0,) = random_tensors([shape], seed=4, dtype=torch.float64)
    grads = [random_tensors([shape], seed=30 + t, dtype=torch.float64)[0] for t in range(6)]
    p = nn.Parameter(W0.clone())
    kwargs = muon_kwargs({k: v for k, v in spec.items() if k != "split_sizes"})
    opt = Muon([{"params": [p], "split_sizes": list(split_sizes)}], lr=0.05, momentum=0.9, weight_decay=0.1, **kwargs)
    run_steps(opt, [p], [[g] for g in grads])
    W_ref, _, V_ref = muon64(W0, grads, **spec)
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["second_moment"].reshape(V_ref.shape), V_ref, atol=1e-12, rtol=0)


def test_grouped_split_views_follow_megatron_layout():
    """matrix_views gathers each block's rows from every query group; matrix_slots write them back."""
    t = torch.arange(8 * 3, dtype=torch.float64).reshape(8, 3)  # 2 groups of (2 q + 1 k + 1 v) rows
    q, k, v = MatrixLayout((2, 1, 1)).views(t)
    # Megatron: t.view(groups, 4, -1).split([2, 1, 1], dim=1), each reshaped to (-1, cols).
    expected = [x.reshape(-1, 3) for x in t.view(2, 4, 3).split([2, 1, 1], dim=1)]
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got, want)
    assert q.shape == (4, 3) and k.shape == (2, 3)
    target = torch.zeros_like(t)
    for slot, piece in zip(MatrixLayout((2, 1, 1)).slots(target), (q, k, v)):
        slot.copy_(piece.view(slot.shape))
    assert torch.equal(target, t)


@pytest.mark.parametrize("second_moment", ["normuon_rms", "adamuon_rms", "normuon", "adamuon", "namo"])
def test_batched_tensor_with_second_moment_equals_separate_matrices(second_moment):
    """A (3, 6, 10) expert tensor with batched=True steps like three separate (6, 10) matrices."""
    (W0,) = random_tensors([(3, 6, 10)], seed=5, dtype=torch.float64)
    grads = [random_tensors([(3, 6, 10)], seed=40 + t, dtype=torch.float64)[0] for t in range(5)]
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.1, second_moment=second_moment, weight_decay_method="cautious")
    fused = nn.Parameter(W0.clone())
    fused_opt = Muon([{"params": [fused], "batched": True}], **hp)
    run_steps(fused_opt, [fused], [[g] for g in grads])
    separate = [nn.Parameter(W0[i].clone()) for i in range(3)]
    separate_opt = Muon(separate, **hp)
    run_steps(separate_opt, separate, [list(g.unbind(0)) for g in grads])
    assert_close(fused.detach(), torch.stack([p.detach() for p in separate]), atol=1e-12, rtol=0)
    v = fused_opt.state[fused]["second_moment"]
    # (3, 6, 10): three wide 6 x 10 matrices; Emerging-Optimizers' NorMuon averages their rows
    shapes = {"adamuon_rms": (3, 6, 10), "adamuon": (3, 6, 10), "namo": (3,), "normuon": (3, 1, 10)}
    expected_shape = shapes.get(second_moment, (3, 6, 1))
    assert v.shape == expected_shape
    expected = torch.stack([separate_opt.state[p]["second_moment"] for p in separate])
    assert_close(v, expected, atol=1e-12, rtol=0)


def test_non_contiguous_parameter_with_cautious_decay_equals_contiguous():
    (W0,) = random_tensors([(12, 20)], seed=6, dtype=torch.float64)
    grads = [random_tensors([(12, 20)], seed=50 + t, dtype=torch.float64)[0] for t in range(4)]
    hp = dict(lr=0.05, weight_decay=0.2, weight_decay_method="cautious", second_moment="normuon_rms")
    base = nn.Parameter(W0.T.clone().contiguous())  # (20, 12)
    strided = nn.Parameter(torch.empty(12, 20, dtype=torch.float64).T)  # (20, 12), not contiguous
    with torch.no_grad():
        strided.copy_(base)
    assert not strided.is_contiguous()
    for p in (base, strided):
        run_steps(Muon([p], **hp), [p], [[g.T] for g in grads])
    assert_close(strided.detach(), base.detach(), atol=1e-13, rtol=0)


# -------------------------------------------------------------------- properties


@pytest.mark.parametrize("second_moment", ["normuon_rms", "adamuon_rms", "normuon"])
def test_second_moment_keeps_plain_muon_update_norm(second_moment):
    """At every step the update's Frobenius norm is exactly plain Muon's: the lr carries over."""
    shape = (20, 36)
    (W0,) = random_tensors([shape], seed=7, dtype=torch.float64)
    grads = [random_tensors([shape], seed=60 + t, dtype=torch.float64)[0] for t in range(4)]
    plain, adaptive = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    opt_plain = Muon([plain], lr=0.1)
    opt_adaptive = Muon([adaptive], lr=0.1, second_moment=second_moment)
    for g in grads:
        before = plain.detach().clone(), adaptive.detach().clone()
        run_steps(opt_plain, [plain], [[g]])
        run_steps(opt_adaptive, [adaptive], [[g]])
        norm_plain = torch.linalg.matrix_norm(plain.detach() - before[0])
        norm_adaptive = torch.linalg.matrix_norm(adaptive.detach() - before[1])
        assert_close(norm_adaptive, norm_plain, atol=0, rtol=1e-12)
        # ... while the direction differs: rows (NorMuon) or entries (AdaMuon) were reweighted.
        assert not torch.allclose(adaptive.detach() - before[1], plain.detach() - before[0], atol=1e-6)


def test_normuon_equalizes_row_norms_on_its_first_step():
    """With v = (1 - b2) mean(O^2) per row, O / sqrt(v) has equal row norms (eps aside)."""
    (W0,) = random_tensors([(16, 40)], seed=8, dtype=torch.float64)
    # A gradient whose rows differ in scale by 100x: O keeps unequal row norms.
    (G,) = random_tensors([(16, 40)], seed=9, dtype=torch.float64)
    G = G * torch.logspace(0, 2, 16, dtype=torch.float64)[:, None]
    p = nn.Parameter(W0.clone())
    run_steps(Muon([p], lr=0.1, second_moment="normuon_rms"), [p], [[G]])
    rows = torch.linalg.vector_norm(p.detach() - W0, dim=1)
    assert_close(rows, rows.mean().expand_as(rows), atol=0, rtol=1e-6)


def test_cautious_decay_only_where_update_and_weight_agree():
    """No update (lr scale 0 is impossible, so a zero gradient): decay acts only where O * W >= 0."""
    W0 = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 2.0, -3.0]], dtype=torch.float64)
    G = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.1, weight_decay=0.5, momentum=0.0, nesterov=False, weight_decay_method="cautious")
    run_steps(opt, [p], [[G]])
    update = newton_schulz64(G)  # every entry > 0, as G's: it agrees with the positive weights only
    agree = (update * W0 >= 0).double()
    expected = W0 - 0.1 * 0.5 * agree * W0 - 0.1 * math.sqrt(max(1, 2 / 3)) * update
    assert_close(p.detach(), expected, atol=1e-12, rtol=0)
    assert torch.equal(agree, (W0 > 0).double())


@pytest.mark.parametrize("variant", ["sum-normuon-cautious", "adamuon-sign"])
def test_zero_lr_step_changes_no_parameter(variant):
    """DCP resumes with an lr = 0 step: every variant's update and decay scale with lr."""
    (W0,) = random_tensors([(10, 14)], seed=10, dtype=torch.float64)
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=0.0, weight_decay=0.3, **muon_kwargs(VARIANTS[variant]))
    run_steps(opt, [p], [[g] for g in random_tensors([(10, 14)] * 2, seed=11, dtype=torch.float64)])
    assert torch.equal(p.detach(), W0)


def test_zero_gradient_gives_a_zero_update_with_second_moments():
    for method in ("normuon_rms", "adamuon_rms", "normuon", "adamuon", "namo"):
        p = nn.Parameter(torch.ones(4, 6, dtype=torch.float64))
        run_steps(Muon([p], lr=0.1, second_moment=method), [p], [[torch.zeros(4, 6, dtype=torch.float64)]])
        assert torch.equal(p.detach(), torch.ones(4, 6, dtype=torch.float64))


def test_update_observer_sees_the_pieces_as_applied():
    """``ortho`` handed to the observer is after the second moment: lr * adjust * ortho is the step."""
    (W0,) = random_tensors([(12, 30)], seed=12, dtype=torch.float64)
    p = nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "split_sizes": [4, 8]}], lr=0.1, second_moment="adamuon_rms")
    seen = []
    opt.register_update_hook(lambda group, params, updates, ortho: seen.append([o.clone() for o in ortho[0]]))
    run_steps(opt, [p], [random_tensors([(12, 30)], seed=13, dtype=torch.float64)])
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


ALL_ON = dict(momentum_form="sum", second_moment="normuon_rms", weight_decay_method="cautious", ns_method="gram")


@pytest.mark.parametrize(
    "variant", [ALL_ON, dict(second_moment="adamuon_rms", sign_momentum=True)], ids=["normuon", "ada"]
)
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
    knobs = ("momentum_form", "second_moment", "weight_decay_method", "ns_method", "sign_momentum", "fp32_matmul_prec")
    for key in knobs:
        del state["param_groups"][0][key]
    fresh = Muon([p], lr=0.02)
    fresh.load_state_dict(state)
    run_steps(fresh, [p], [random_tensors([(6, 8)], seed=14, dtype=torch.float64)])
    assert fresh.param_groups[0]["momentum_form"] == "ema"
    assert {k: fresh.param_groups[0][k] for k in knobs} == {k: opt.param_groups[0][k] for k in knobs}  # defaults


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"momentum_form": "nesterov"}, r"momentum_form must be one of \('ema', 'sum'\), got 'nesterov'"),
        (
            {"second_moment": "adam"},
            r"second_moment must be one of "
            r"\('normuon', 'adamuon', 'namo', 'normuon_rms', 'adamuon_rms', None\), got 'adam'",
        ),
        ({"second_moment_beta2": 1.0}, r"second_moment_beta2 must be a finite number in \[0.0, 1.0\)"),
        ({"second_moment_eps": 0.0}, r"second_moment_eps must be a finite number in \(0.0"),
        (
            {"weight_decay_method": "l1"},
            r"weight_decay_method must be one of \('decoupled', 'independent', 'l2', 'palm', 'cautious'\), got 'l1'",
        ),
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


def test_a_second_moment_buffer_of_another_form_is_refused():
    """A saved buffer that does not fit the form its group names is refused, naming the fix."""
    p = nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
    opt = Muon([p], lr=0.1, second_moment="normuon_rms")
    run_steps(opt, [p], [[torch.randn(4, 8, dtype=torch.float64)]])
    saved = opt.state_dict()
    assert saved["state"][0]["second_moment"].shape == (4, 1)  # per output
    # The buffer under a group that names Emerging-Optimizers' form (per column of a wide matrix).
    mislabelled = copy.deepcopy(saved)
    mislabelled["param_groups"][0]["second_moment"] = "normuon"
    other = Muon([p], lr=0.1, second_moment="normuon")
    other.load_state_dict(mislabelled)
    p.grad = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"second-moment buffer of shape \(4, 1\).*keeps \(1, 8\).*'normuon_rms'"):
        other.step()
