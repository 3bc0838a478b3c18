"""Scion, PolarGrad and MOP (``"scion"``, ``"polargrad"``, ``"mop"`` groups) against float64 references of their papers.

``_emerging64`` writes the three rules from their formulas, one matrix at a time, with
Emerging-Optimizers 0.3.0's momentum and weight decay methods (``mixin.WeightDecayMixin``)::

    decay W (decoupled, independent, palm), or G <- G + wd W (l2)
    B <- mu B + (1 - mu) G;  U <- (1 - mu) G + mu B if nesterov else B
    Scion:      W <- (1 - lr) W - lr rho sqrt(rows / cols) NS(B)        (Pethick et al., arXiv 2502.07529)
    PolarGrad:  W <- W - lr extra <NS(U), U> NS(U)                      (Lau, Long, Su, arXiv 2505.21799)
    MOP:        W <- W - lr extra s P Q^T,  U = P S Q^T,  s = sum(S) or a shape scale

``NS`` is the quintic Newton-Schulz iteration in float64 (``muon_reference.newton_schulz64``)
with Emerging-Optimizers' coefficient tables, spelled out here and cycled as it cycles them.
The reference takes Emerging-Optimizers' keywords (``coefficient_type``, ``num_ns_steps``,
``scale_mode``); a group given ours (``ns_coefficients``, ``ns_steps``, ``adjust_lr``) is
compared with it through ``_eo_names``, a group given Emerging-Optimizers' as it is (the
aliases of ``lightning_muon.aliases``). The parity with Emerging-Optimizers itself (float32,
same gradients) is checked by hand, outside this suite.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from muon_reference import newton_schulz64, piece_rows, random_tensors, run_steps
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon
from lightning_muon.algorithms import (
    HparamError,
    MOPSettings,
    PolarGradSettings,
    ScionSettings,
    algorithm_names,
    get_algorithm,
    orthogonalizes,
)
from lightning_muon.algorithms.mop import PolarFactorSVD

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

SHAPES = [(16, 16), (24, 12), (12, 24)]
METHODS = ("decoupled", "independent", "l2", "palm")
STEPS = 10
# Emerging-Optimizers 0.3.0 ``muon_utils._COEFFICIENT_SETS``; "quintic" and "simple" cycle.
EO_COEFFICIENTS = {
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "simple": [(3.4445, -4.7750, 2.0315)],
}
# Emerging-Optimizers' Muon scale modes (``get_muon_scale_factor``) for a stored (rows, cols) matrix.
SHAPE_SCALES = {
    "shape_scaling": lambda r, c: max(1.0, r / c) ** 0.5,
    "spectral": lambda r, c: max(r, c) ** 0.5,
    "unit_rms_norm": lambda r, c: (r / c) ** 0.5,
}
# Emerging-Optimizers' keywords for ours, and its values for ours, spelled out (the library's table is
# lightning_muon.aliases): "quintic" is our "you" up to 5 steps (it cycles past them, ours repeats the last
# tuple), "simple" our "keller"; scale_mode "shape_scaling" is our adjust_lr "original", "unit_rms_norm" our
# "spectral_norm".
EO_NAMES = {"ns_steps": "num_ns_steps", "ns_coefficients": "coefficient_type", "adjust_lr": "scale_mode"}
EO_VALUES = {
    "ns_coefficients": {"you": "quintic", "keller": "simple"},
    "adjust_lr": {
        "original": "shape_scaling",
        "spectral": "spectral",
        "spectral_norm": "unit_rms_norm",
        "nuclear_norm": "nuclear_norm",
    },
}
# Off the defaults, so that a swapped momentum or a misplaced decay shows.
HP = {"lr": 0.02, "momentum": 0.9}
# PolarGrad's default fp32_matmul_prec "highest" runs Newton-Schulz in float32 (families.ns_dtype_for), float64
# parameters too; the reference is float64.
FLOAT64_NS = {"polargrad": {"ns_dtype": "float64"}}
# The nuclear norm of these updates is ~10-50: an extra scale that moves the weights by ~0.05 a step.
NUCLEAR_EXTRA = 0.25


def _ns(M: torch.Tensor, coefficient_type: str, steps: int) -> torch.Tensor:
    table = EO_COEFFICIENTS[coefficient_type]
    return newton_schulz64(M, [table[i % len(table)] for i in range(steps)], steps)


def _emerging64(
    rule: str,
    W0: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    weight_decay: float = 0.0,
    weight_decay_method: str = "decoupled",
    nesterov: bool = False,
    coefficient_type: str = "quintic",
    num_ns_steps: int = 5,
    spectral_radius: float = 1.0,
    extra_scale_factor: float = 1.0,
    scale_mode: str = "nuclear_norm",
    split_sizes: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's loop over ``grads`` in float64 (module docstring): final weights and momentum."""
    if rule == "scion":  # its constructor fixes these
        weight_decay, weight_decay_method, nesterov = 1.0, "decoupled", False
    shrink = {"decoupled": lr * weight_decay, "independent": weight_decay, "palm": lr * lr * weight_decay, "l2": 0.0}
    W = W0.to(torch.float64, copy=True)
    B = torch.zeros_like(W)
    for G in grads:
        G = G.to(torch.float64)
        if weight_decay_method == "l2":
            G = G + weight_decay * W
        W = W - shrink[weight_decay_method] * W
        B = momentum * B + (1 - momentum) * G
        U = (1 - momentum) * G + momentum * B if nesterov else B
        step = torch.zeros_like(W)
        for idx in piece_rows(W.shape[0], split_sizes):
            M = U[idx]  # (rows, cols): the matrix, or a piece of a split one
            rows, cols = M.shape
            if rule == "scion":
                step[idx] = spectral_radius * math.sqrt(rows / cols) * _ns(M, coefficient_type, num_ns_steps)
            elif rule == "polargrad":
                ortho = _ns(M, coefficient_type, num_ns_steps)
                step[idx] = extra_scale_factor * (ortho * M).sum() * ortho
            else:
                P, S, Qh = torch.linalg.svd(M, full_matrices=False)
                s = S.sum() if scale_mode == "nuclear_norm" else SHAPE_SCALES[scale_mode](rows, cols)
                step[idx] = extra_scale_factor * s * (P @ Qh)
        W = W - lr * step
    return W, B


def _eo_names(group: dict) -> dict:
    """``group`` in the reference's names: ours renamed and their values mapped, Emerging-Optimizers' as given."""
    if group.get("ns_coefficients") == "you":
        assert group.get("ns_steps", 5) <= 5, "past 5 steps Emerging-Optimizers' quintic cycles and our 'you' does not"
    return {EO_NAMES.get(k, k): EO_VALUES[k][v] if k in EO_VALUES else v for k, v in group.items()}


def _run(rule: str, shape, steps: int = STEPS, dtype=torch.float64, seed: int = 0, **group):
    """Our optimizer over ``steps`` random gradients: (W0, grads, parameter, optimizer)."""
    (W0,) = random_tensors([shape], seed=seed, dtype=torch.float64)
    grads = [random_tensors([shape], seed=seed + 100 + t, dtype=torch.float64)[0] for t in range(steps)]
    p = nn.Parameter(W0.to(dtype, copy=True))
    pinned = FLOAT64_NS.get(rule, {}) if dtype == torch.float64 else {}
    opt = Muon([{"params": [p], "algorithm": rule, **HP, **pinned, **group}])
    run_steps(opt, [p], [[g.to(dtype)] for g in grads])
    return W0, grads, p, opt


def _check(rule: str, shape, **group) -> None:
    W0, grads, p, opt = _run(rule, shape, **group)
    W_ref, B_ref = _emerging64(rule, W0, grads, **HP, **_eo_names(group))
    # Same float64 math in another order (our short-side iteration, foreach updates): rounding only.
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"], B_ref, atol=1e-11, rtol=0)
    assert (W_ref - W0).abs().max() > 0.05  # the weights did move


# ---------------------------------------------------------------------------------------- formulas


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "schedule",
    [
        {"spectral_radius": 2.5},
        # Emerging-Optimizers' names (aliases), as the reference takes them.
        {"spectral_radius": 0.5, "coefficient_type": "quintic", "num_ns_steps": 7},  # cycles the 5 tuples
        {"coefficient_type": "simple", "num_ns_steps": 6},
        # Ours.
        {"spectral_radius": 0.5, "ns_coefficients": "you", "ns_steps": 4},
        {"ns_coefficients": "keller", "ns_steps": 6},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_scion_matches_float64_reference(shape, schedule):
    """``(1 - lr) W - lr rho sqrt(rows / cols) NS(B)``, with its fixed decay 1 and no Nesterov."""
    _check("scion", shape, **schedule)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("nesterov", [False, True])
def test_polargrad_matches_float64_reference(shape, method, nesterov):
    """``decay(W) - lr extra <O, U> O`` under every weight decay method, Nesterov or not."""
    _check(
        "polargrad",
        shape,
        weight_decay=0.1,
        weight_decay_method=method,
        nesterov=nesterov,
        extra_scale_factor=NUCLEAR_EXTRA,
    )


@pytest.mark.parametrize(
    "schedule",
    [
        {"coefficient_type": "simple", "num_ns_steps": 6},  # Emerging-Optimizers' names (aliases)
        {"coefficient_type": "quintic", "num_ns_steps": 7},  # cycles the 5 tuples
        {"ns_coefficients": "keller", "ns_steps": 6},  # ours
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_polargrad_schedules_match_float64_reference(schedule):
    """Emerging-Optimizers' ``coefficient_type`` over ``num_ns_steps`` steps, and our schedule of the same tuples."""
    _check("polargrad", (24, 12), weight_decay=0.1, extra_scale_factor=NUCLEAR_EXTRA, **schedule)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "scale",
    [
        # Emerging-Optimizers' scale_mode (an alias), as the reference takes it.
        {"scale_mode": "nuclear_norm"},
        {"scale_mode": "shape_scaling"},
        {"scale_mode": "spectral"},
        {"scale_mode": "unit_rms_norm"},
        # Ours, adjust_lr.
        {"adjust_lr": "nuclear_norm"},
        {"adjust_lr": "original"},
        {"adjust_lr": "spectral"},
        {"adjust_lr": "spectral_norm"},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_mop_matches_float64_reference(shape, scale):
    """The SVD's polar factor times the nuclear norm, or a Muon scale by shape."""
    extra = NUCLEAR_EXTRA if "nuclear_norm" in scale.values() else 1.0
    _check("mop", shape, weight_decay=0.1, extra_scale_factor=extra, **scale)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("nesterov", [False, True])
def test_mop_weight_decay_methods_and_nesterov(method, nesterov):
    _check(
        "mop",
        (24, 12),
        weight_decay=0.1,
        weight_decay_method=method,
        nesterov=nesterov,
        extra_scale_factor=NUCLEAR_EXTRA,
    )


@pytest.mark.parametrize("rule", ["scion", "polargrad", "mop"])
def test_split_pieces_take_their_own_scale(rule):
    """A fused QKV (split_sizes): every piece is its own matrix, with its own shape and nuclear norm."""
    own = {"spectral_radius": 1.5} if rule == "scion" else {"weight_decay": 0.1, "extra_scale_factor": NUCLEAR_EXTRA}
    group = {"split_sizes": [2, 1, 1], **own}
    W0, grads, p, _ = _run(rule, (24, 8), **group)
    W_ref, _ = _emerging64(rule, W0, grads, **HP, **group)
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)


@pytest.mark.parametrize("rule", ["polargrad", "mop"])
def test_expert_stack_matrices_take_their_own_nuclear_norm(rule):
    """``batched``: every expert of an ``(E, out, in)`` stack steps as a matrix of its own."""
    group = {"weight_decay": 0.1, "extra_scale_factor": NUCLEAR_EXTRA}
    W0, grads, p, _ = _run(rule, (3, 10, 6), batched=True, **group)
    for e in range(3):
        W_ref, _ = _emerging64(rule, W0[e], [g[e] for g in grads], **HP, **group)
        assert_close(p.detach()[e], W_ref, atol=1e-11, rtol=0)


# ---------------------------------------------------------------------------------------- properties


def test_mop_step_is_the_nuclear_norm_times_the_polar_factor():
    """One MOP step from rest: ``-dW / lr = ||B||_* P Q^T``, every singular value the nuclear norm.

    A rank-2 gradient keeps rank 2: the SVD's directions of zero singular values are dropped.
    """
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    low = torch.randn(12, 2, generator=gen, dtype=torch.float64) @ torch.randn(2, 8, generator=gen, dtype=torch.float64)
    for G, rank in ((full, 8), (low, 2)):
        p = nn.Parameter(torch.zeros(12, 8, dtype=torch.float64))
        opt = Muon([{"params": [p], "algorithm": "mop", "lr": 0.1, "momentum": 0.5, "weight_decay": 0.0}])
        p.grad = G.clone()
        opt.step()
        B = 0.5 * G
        S_B = torch.linalg.svdvals(B)
        S_step = torch.linalg.svdvals(-p.detach() / 0.1)
        expected = torch.zeros(8, dtype=torch.float64)
        expected[:rank] = S_B.sum()  # the nuclear norm, on B's rank directions only
        assert_close(S_step, expected, atol=1e-10, rtol=0)
        # The direction is B's polar factor: <step, B> = ||step||_2 ||B||_*.
        assert (-p.detach() / 0.1 * B).sum() == pytest.approx(S_B.sum().item() ** 2, rel=1e-12)


def test_polar_factor_svd_is_orthogonal_and_maps_zero_to_zero():
    gen = torch.Generator().manual_seed(4)
    X = torch.randn(9, 5, generator=gen)
    polar = PolarFactorSVD()(X)
    assert_close(polar.mT @ polar, torch.eye(5), atol=1e-5, rtol=0)
    assert torch.equal(PolarFactorSVD()(torch.zeros(4, 6)), torch.zeros(4, 6))


# ---------------------------------------------------------------------------------------- keys and checks


# Emerging-Optimizers 0.3.0's constructors: their keywords and defaults, in its names.
EO_CONSTRUCTORS = {
    "scion": dict(lr=3e-4, momentum=0.95, fp32_matmul_prec="medium", coefficient_type="quintic", num_ns_steps=5,
                  spectral_radius=1.0),
    "polargrad": dict(lr=3e-4, momentum=0.95, weight_decay=0.01, nesterov=False, weight_decay_method="decoupled",
                      fp32_matmul_prec="highest", coefficient_type="quintic", num_ns_steps=5, extra_scale_factor=1.0),
    "mop": dict(lr=3e-4, momentum=0.95, weight_decay=0.01, nesterov=False, weight_decay_method="decoupled",
                fp32_matmul_prec="highest", scale_mode="nuclear_norm", extra_scale_factor=1.0),
}  # fmt: skip
# The same defaults in our names; what a constructor fixes (Scion: decay 1, decoupled, no Nesterov, its
# unit_rms_norm scale; PolarGrad: no scale by shape) and our own settings (ns_dtype, ns_method, tp_mode, ns_eps).
OUR_DEFAULTS = {
    "scion": (
        ScionSettings,
        dict(lr=3e-4, momentum=0.95, fp32_matmul_prec="medium", ns_coefficients="you", ns_steps=5,
             spectral_radius=1.0, weight_decay=1.0, weight_decay_method="decoupled", nesterov=False,
             adjust_lr="spectral_norm", extra_scale_factor=1.0, ns_dtype=None, ns_method="standard",
             tp_mode="duplicated", ns_eps=None),
    ),
    "polargrad": (
        PolarGradSettings,
        dict(lr=3e-4, momentum=0.95, weight_decay=0.01, nesterov=False, weight_decay_method="decoupled",
             fp32_matmul_prec="highest", ns_coefficients="you", ns_steps=5, extra_scale_factor=1.0,
             adjust_lr="none", ns_dtype=None, ns_method="standard", tp_mode="duplicated", ns_eps=None),
    ),
    "mop": (
        MOPSettings,
        dict(lr=3e-4, momentum=0.95, weight_decay=0.01, nesterov=False, weight_decay_method="decoupled",
             fp32_matmul_prec="highest", adjust_lr="nuclear_norm", extra_scale_factor=1.0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("rule", ["scion", "polargrad", "mop"])
def test_defaults_are_emerging_optimizers_in_our_names(rule):
    """The settings' defaults are the constructors' (Emerging-Optimizers 0.3.0), which load by its names too."""
    settings, ours = OUR_DEFAULTS[rule]
    algorithm = get_algorithm(rule)
    assert algorithm.settings is settings
    assert settings().asdict() == ours
    assert algorithm.make_settings(EO_CONSTRUCTORS[rule]) == settings()
    # A group given the constructor's keywords holds ours, at the same values, and none of its names.
    p = nn.Parameter(torch.zeros(4, 4))
    group = Muon([{"params": [p], "algorithm": rule, **EO_CONSTRUCTORS[rule]}]).param_groups[0]
    assert {k: group[k] for k in ours} == ours
    assert not set(EO_NAMES.values()) & set(group)


@pytest.mark.parametrize("rule", ["scion", "polargrad", "mop"])
def test_registered_as_orthogonalizing(rule):
    assert rule in algorithm_names(orthogonal=True)
    assert orthogonalizes({"algorithm": rule})


@pytest.mark.parametrize(
    ("rule", "key", "value"),
    [
        ("scion", "spectral_radius", 0.0),
        ("scion", "spectral_radius", float("nan")),
        ("scion", "num_ns_steps", 0),
        ("scion", "coefficient_type", "keller"),  # ours, not one of Emerging-Optimizers' names
        ("scion", "ns_steps", 0),
        ("scion", "ns_coefficients", "quintic"),  # Emerging-Optimizers', not one of ours
        ("scion", "adjust_lr", "unit_rms_norm"),  # Emerging-Optimizers', not one of ours
        ("scion", "momentum", 1.0),
        ("scion", "fp32_matmul_prec", "low"),
        ("scion", "ns_dtype", "int8"),
        ("scion", "weight_decay", 0.1),  # fixed by Scion: refused, not silently replaced
        ("scion", "nesterov", True),
        ("scion", "weight_decay_method", "l2"),
        ("polargrad", "weight_decay_method", "adamw"),
        ("polargrad", "weight_decay", -0.1),
        ("polargrad", "extra_scale_factor", 0.0),
        ("polargrad", "nesterov", 1),
        ("polargrad", "lr", -1.0),
        ("polargrad", "num_ns_steps", 2.5),
        ("polargrad", "ns_steps", 2.5),
        ("polargrad", "coefficient_type", "you"),
        ("mop", "scale_mode", "spectral_norm"),  # ours, not one of Emerging-Optimizers' scale modes
        ("mop", "adjust_lr", "unit_rms_norm"),  # Emerging-Optimizers', not one of ours
        ("mop", "extra_scale_factor", -1.0),
        ("mop", "weight_decay_method", "adamw"),
        ("mop", "momentum", -0.1),
    ],
)
def test_bad_values_raise_naming_the_key(rule, key, value):
    """In a group, in a settings dict (Emerging-Optimizers' names among them) and in the settings themselves."""
    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(HparamError, match=rf"^param group 0: {key}\b") as err:
        Muon([{"params": [p], "algorithm": rule, key: value}])
    assert err.value.field == key
    algorithm = get_algorithm(rule)
    with pytest.raises(HparamError, match=rf"^Muon\(\): {key}\b") as err:
        algorithm.make_settings({key: value})
    assert err.value.field == key
    if key in algorithm.settings.field_names():  # the settings' own check (Muon(settings=[...]), MuonConfig)
        with pytest.raises(HparamError, match=rf"^{algorithm.settings.__name__}\.{key}\b") as err:
            algorithm.settings(**{key: value})
        assert err.value.field == key


@pytest.mark.parametrize("rule", ["scion", "polargrad", "mop"])
def test_a_vector_is_refused_naming_it(rule):
    bias = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"'encoder\.bias'.*1-D"):
        Muon([{"params": [("encoder.bias", bias)], "algorithm": rule}])


# ---------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    ("rule", "group"),
    [
        ("scion", {"spectral_radius": 2.0}),
        ("polargrad", {"nesterov": True, "weight_decay": 0.1, "extra_scale_factor": NUCLEAR_EXTRA}),
        ("mop", {"weight_decay_method": "l2", "weight_decay": 0.1, "extra_scale_factor": NUCLEAR_EXTRA}),
        ("mop", {"adjust_lr": "spectral"}),
    ],
)
def test_checkpoint_round_trip_equals_an_uninterrupted_run(rule, group):
    """4 steps, state_dict through torch.save, a new optimizer, 4 more: the same bits as 8 in a row."""
    (W0,) = random_tensors([(12, 8)], seed=5, dtype=torch.float32)
    grads = [random_tensors([(12, 8)], seed=50 + t, dtype=torch.float32)[0] for t in range(8)]

    pinned = {} if rule == "mop" else {"ns_dtype": "float32"}  # MOP has no Newton-Schulz to pin

    def make(w):
        p = nn.Parameter(w.clone())
        return p, Muon([{"params": [p], "algorithm": rule, **HP, **group, **pinned}])

    p_a, opt_a = make(W0)
    run_steps(opt_a, [p_a], [[g] for g in grads])
    p_b, opt_b = make(W0)
    run_steps(opt_b, [p_b], [[g] for g in grads[:4]])
    buffer = io.BytesIO()
    torch.save(opt_b.state_dict(), buffer)
    buffer.seek(0)
    p_c, opt_c = make(p_b.detach())
    opt_c.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt_c.param_groups[0]["algorithm"] == rule
    run_steps(opt_c, [p_c], [[g] for g in grads[4:]])
    assert torch.equal(p_c.detach(), p_a.detach())
    assert torch.equal(opt_c.state[p_c]["momentum_buffer"], opt_a.state[p_a]["momentum_buffer"])
