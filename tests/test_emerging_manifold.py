"""Spel and Sinkhorn-Muon (``"spel"``, ``"sinkhorn_muon"`` groups): each against a float64 reference, its checks.

Under FSDP2 (``MuonFSDPSharding``, Shard(0) row blocks: the owner gathers a weight whole to
project or map it) and DDP (``MuonDDPSharding``: owners hold whole weights) on 2 gloo ranks, both
equal one process. The references are written here from the formulas (Emerging-Optimizers 0.3.0's ``Spel`` and
``SinkhornMuon``), with its quintic coefficients spelled out, so that the mapping of
``coefficient_type="quintic"`` onto our schedules (our default "you"; the alias, cycled past 5
steps) is under test too, and its ``scale_mode`` names beside our ``adjust_lr``.
"""

from __future__ import annotations

import functools
import io
import math

import pytest
import torch
from dist_utils import run_distributed
from muon_reference import newton_schulz64, random_tensors, run_steps
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon, MuonConfig
from lightning_muon.algorithms import HparamError, SinkhornMuonSettings, SpelSettings, get_algorithm
from lightning_muon.algorithms.sinkhorn_muon import sinkhorn_knopp

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

# Emerging-Optimizers 0.3.0's "quintic" (muon_utils._COEFFICIENT_SETS), cycled past 5 steps.
QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
SIMPLE = [(3.4445, -4.7750, 2.0315)]  # its "simple"
# Emerging-Optimizers' get_muon_scale_factor(out, in, mode).
SCALE = {
    "shape_scaling": lambda o, i: math.sqrt(max(1.0, o / i)),
    "spectral": lambda o, i: math.sqrt(max(o, i)),
    "unit_rms_norm": lambda o, i: math.sqrt(o / i),
}
# Our adjust_lr for each of its scale modes, spelled out (the library's table is lightning_muon.aliases).
ADJUST_LR = {"shape_scaling": "original", "spectral": "spectral", "unit_rms_norm": "spectral_norm"}
METHODS = ("decoupled", "independent", "l2", "palm")
SHAPES = [(16, 16), (24, 12), (12, 24)]
STEPS = 8


# ------------------------------------------------------------------ float64 references


def msign64(M: torch.Tensor, steps: int = 5, table: list = QUINTIC) -> torch.Tensor:
    """Emerging-Optimizers' Newton-Schulz over ``steps`` steps, its tuples cycled as it cycles them."""
    return newton_schulz64(M, [table[i % len(table)] for i in range(steps)], steps=steps)


def emerging_loop64(W0, grads, *, lr, momentum, weight_decay, nesterov, method, scale, post, msign=msign64):
    """Emerging-Optimizers' orthogonalized step in float64: decay, EMA momentum, ``W - lr scale msign(U)``, post."""
    W = W0.to(torch.float64, copy=True)
    B = torch.zeros_like(W)
    for G in grads:
        G = G.to(torch.float64)
        if method == "l2":
            G = G + weight_decay * W
        else:
            factor = {"decoupled": lr * weight_decay, "independent": weight_decay, "palm": lr * lr * weight_decay}
            W = W - factor[method] * W
        B = momentum * B + (1 - momentum) * G
        U = (1 - momentum) * G + momentum * B if nesterov else B
        W = post(W - lr * scale * msign(U))
    return W, B


def sinkhorn64(W: torch.Tensor, num_iters: int = 20, eps: float = 1e-8) -> torch.Tensor:
    """``exp(W - max W)``, then ``num_iters`` times: columns to sum c, rows to sum r (each sum floored at eps)."""
    rows, cols = W.shape
    r, c = (cols / rows, 1.0) if cols > rows else (1.0, rows / cols)
    P = torch.exp(W.double() - W.max())
    for _ in range(num_iters):
        P = c * P / P.sum(dim=0, keepdim=True).clamp_min(eps)
        P = r * P / P.sum(dim=1, keepdim=True).clamp_min(eps)
    return P


def _problem(shape, seed, sinkhorn=False):
    (W0,) = random_tensors([shape], seed=seed, dtype=torch.float64)
    grads = [random_tensors([shape], seed=100 + seed + t, dtype=torch.float64)[0] for t in range(STEPS)]
    return (sinkhorn_knopp(W0) if sinkhorn else W0), grads


# ------------------------------------------------------------------ Spel


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_spel_matches_float64_reference(shape, method):
    """8 steps: decay, momentum, the unscaled msign of the momentum, then the weight's own msign."""
    W0, grads = _problem(shape, seed=1)
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=method == "l2", weight_decay_method=method)
    p = nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "algorithm": "spel", **hp}])
    run_steps(opt, [p], [[g] for g in grads])
    hp["method"] = hp.pop("weight_decay_method")
    W_ref, B_ref = emerging_loop64(W0, grads, **hp, scale=1.0, post=msign64)
    # float64 both ways; the same polynomial in another order of operations, 16 Newton-Schulz runs.
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"], B_ref, atol=1e-11, rtol=0)
    assert (W_ref - msign64(W0)).abs().max() > 0.05  # the steps moved the weight along the manifold


@pytest.mark.parametrize(
    ("schedule", "table", "steps"),
    [
        # Emerging-Optimizers' names (aliases), as the reference takes them.
        ({"coefficient_type": "quintic", "num_ns_steps": 5}, QUINTIC, 5),
        # Cycles the 5 tuples twice. (7 steps would end on the first two tuples, which map the projected
        # weight's singular values, near 1, to near 0.12 and back: a map that grows rounding 1e7-fold.)
        ({"coefficient_type": "quintic", "num_ns_steps": 10}, QUINTIC, 10),
        ({"coefficient_type": "simple", "num_ns_steps": 6}, SIMPLE, 6),
        # Ours.
        ({"ns_coefficients": "you", "ns_steps": 5}, QUINTIC, 5),
        ({"ns_coefficients": "keller", "ns_steps": 6}, SIMPLE, 6),
    ],
    ids=["quintic-5", "quintic-10", "simple-6", "you-5", "keller-6"],
)
def test_spel_schedules_match_float64_reference(schedule, table, steps):
    """Emerging-Optimizers' ``coefficient_type``/``num_ns_steps`` and our ``ns_coefficients``/``ns_steps``, both
    matrix signs (the update's and the weight's) with them."""
    W0, grads = _problem((24, 12), seed=1)
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=True)
    p = nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "algorithm": "spel", **hp, **schedule}])
    run_steps(opt, [p], [[g] for g in grads])
    msign = functools.partial(msign64, steps=steps, table=table)
    W_ref, B_ref = emerging_loop64(W0, grads, **hp, method="decoupled", scale=1.0, post=msign, msign=msign)
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"], B_ref, atol=1e-11, rtol=0)


def test_spel_float32_and_every_piece_of_a_split_weight():
    """A fused QKV's pieces are projected apart; float32 with ns_dtype="float32" stays near the float64 formula."""
    W0, grads = _problem((12, 8), seed=2)
    rows = [list(range(0, 6)), list(range(6, 9)), list(range(9, 12))]  # split_sizes [6, 3, 3], one group

    def by_piece(M):
        out = torch.empty_like(M)
        for idx in rows:
            out[idx] = msign64(M[idx])
        return out

    W, B = W0.clone(), torch.zeros_like(W0)
    for G in grads:  # decoupled decay, EMA momentum, per piece on both msigns
        B = 0.9 * B + 0.1 * G
        W = by_piece(W * (1 - 0.05 * 0.1) - 0.05 * by_piece(B))
    for dtype, atol in ((torch.float64, 1e-11), (torch.float32, 2e-5)):  # float32: ~1e-6 per Newton-Schulz run
        p = nn.Parameter(W0.to(dtype, copy=True))
        group = {"params": [p], "algorithm": "spel", "lr": 0.05, "momentum": 0.9, "split_sizes": [6, 3, 3]}
        opt = Muon([{**group, "ns_dtype": "float32" if dtype == torch.float32 else None}])
        run_steps(opt, [p], [[g.to(dtype)] for g in grads])
        assert_close(p.detach().double(), W, atol=atol, rtol=0)


def test_spel_weights_have_singular_values_in_the_quintic_band():
    """After every step each weight is a quintic msign: its singular values lie in the polynomial's band near 1."""
    x = torch.linspace(0.01, 1.0, 10_001, dtype=torch.float64)
    for a, b, c in QUINTIC:  # the 5-step composition maps [0.01, 1] into about [0.978, 1.032]
        x = a * x + b * x**3 + c * x**5
    low, high = x.min().item(), x.max().item()
    W0, grads = _problem((32, 16), seed=3)
    p = nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "algorithm": "spel", "lr": 0.02}])
    for g in grads:
        p.grad = g.clone()
        opt.step()
        # W / ||W||_F before the projection has singular values near 1 / 4 (16 of them, each near 1): inside [0.01, 1].
        s = torch.linalg.svdvals(p.detach())
        assert low - 1e-9 <= s.min().item() and s.max().item() <= high + 1e-9, s


# ------------------------------------------------------------------ Sinkhorn-Muon


def _sinkhorn_case(shape, *, scale_mode="spectral", extra=1.0, method="decoupled", nesterov=False, names="ours"):
    """Our run and the reference's; ``names``: the scale given as our ``adjust_lr`` or as Emerging-Optimizers'
    ``scale_mode`` (an alias)."""
    W0, grads = _problem(shape, seed=4, sinkhorn=True)
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=nesterov)
    p = nn.Parameter(W0.clone())
    group = {"params": [p], "algorithm": "sinkhorn_muon", **hp, "weight_decay_method": method}
    scale_key = {"scale_mode": scale_mode} if names == "eo" else {"adjust_lr": ADJUST_LR[scale_mode]}
    opt = Muon([{**group, **scale_key, "extra_scale_factor": extra}])
    run_steps(opt, [p], [[g] for g in grads])
    scale = SCALE[scale_mode](*shape) * extra
    W_ref, B_ref = emerging_loop64(W0, grads, **hp, method=method, scale=scale, post=sinkhorn64)
    return p, opt, W0, W_ref, B_ref


@pytest.mark.parametrize("names", ["eo", "ours"])
@pytest.mark.parametrize("scale_mode", sorted(SCALE))
@pytest.mark.parametrize("shape", SHAPES)
def test_sinkhorn_muon_matches_float64_reference(shape, scale_mode, names):
    """8 steps of Emerging-Optimizers' Muon (its scale by shape), each followed by the Sinkhorn-Knopp map."""
    p, opt, W0, W_ref, B_ref = _sinkhorn_case(shape, scale_mode=scale_mode, extra=0.5, names=names)
    assert opt.param_groups[0]["adjust_lr"] == ADJUST_LR[scale_mode] and "scale_mode" not in opt.param_groups[0]
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"], B_ref, atol=1e-11, rtol=0)
    assert (W_ref - W0).abs().max() > 0.01 * W0.abs().max()  # the steps moved the weight


@pytest.mark.parametrize("method", METHODS)
def test_sinkhorn_muon_weight_decay_methods(method):
    p, _, _, W_ref, _ = _sinkhorn_case((24, 12), method=method, nesterov=method == "palm")
    assert_close(p.detach(), W_ref, atol=1e-11, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_sinkhorn_weights_keep_their_row_and_column_sums(shape):
    """After every step rows sum to r = max(1, N/M) and columns to c = max(1, M/N), entries positive."""
    rows, cols = shape
    W0, grads = _problem(shape, seed=5)
    p = nn.Parameter(sinkhorn_knopp(W0.float()))
    opt = Muon([{"params": [p], "algorithm": "sinkhorn_muon", "lr": 0.05, "ns_dtype": "float32"}])
    for g in grads:
        p.grad = g.float()
        opt.step()
        W = p.detach().double()
        assert W.min().item() > 0
        # The alternation ends on the rows (exact but for float32 rounding); the columns converge to c.
        assert_close(W.sum(dim=1), torch.full((rows,), max(1.0, cols / rows), dtype=W.dtype), atol=1e-6, rtol=0)
        assert_close(W.sum(dim=0), torch.full((cols,), max(1.0, rows / cols), dtype=W.dtype), atol=1e-6, rtol=0)


def test_sinkhorn_knopp_is_the_formula_and_passes_the_init_check():
    (X,) = random_tensors([(3, 10, 6)], seed=6, dtype=torch.float64)
    P = sinkhorn_knopp(X, num_iters=7, eps=1e-8)
    for x, q in zip(X, P):  # every matrix of a batch on its own
        assert_close(q, sinkhorn64(x, num_iters=7), atol=1e-14, rtol=0)
    assert sinkhorn_knopp(X.float()).dtype == torch.float32
    w = nn.Parameter(sinkhorn_knopp(X[0]))
    Muon([{"params": [("w", w)], "algorithm": "sinkhorn_muon"}])  # accepted as it is


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        (lambda X: sinkhorn_knopp(X) - 0.05, r"min -0\.0"),  # negative, its sums off too
        (lambda X: X.abs(), r"rows summing to 1 and columns to 1\.5 .* max row deviation"),
        (lambda X: X[None], r"maps whole 2-D matrices, got a 3-D tensor of shape \(1, 12, 8\)"),
    ],
)
def test_sinkhorn_refuses_a_weight_that_is_not_sinkhorn_normalized(weight, match):
    (X,) = random_tensors([(12, 8)], seed=7, dtype=torch.float64)
    w = nn.Parameter(weight(X))
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 \('w'\): .*" + match) as err:
        Muon([{"params": [("w", w)], "algorithm": "sinkhorn_muon"}])
    if w.ndim == 2:
        assert "sinkhorn_knopp(p)" in str(err.value)  # says how to fix it


def test_sinkhorn_tolerance_is_the_users():
    """A weight 0.05 off its sums passes the default tolerance 0.1 and is refused at 0.01."""
    (X,) = random_tensors([(8, 8)], seed=8, dtype=torch.float64)
    W = sinkhorn_knopp(X)
    W[0] *= 1 + 0.05 / W[0].sum()  # row 0 sums to 1.05, and some columns a little over 1
    Muon([{"params": [nn.Parameter(W.clone())], "algorithm": "sinkhorn_muon"}])
    with pytest.raises(ValueError, match=r"doubly_stochastic_tolerance=0\.01"):
        Muon([{"params": [nn.Parameter(W)], "algorithm": "sinkhorn_muon", "doubly_stochastic_tolerance": 0.01}])
    with pytest.raises(ValueError, match=r"a split matrix \(split_sizes\)"):
        Muon([{"params": [nn.Parameter(W)], "algorithm": "sinkhorn_muon", "split_sizes": [4, 4]}])


# ------------------------------------------------------------------ hyperparameters and checkpoints


# Emerging-Optimizers 0.3.0's Spel and SinkhornMuon constructors (with Muon's): their keywords and defaults, in
# its names.
EO_SHARED = dict(
    lr=3e-4,
    momentum=0.95,
    nesterov=False,
    weight_decay_method="decoupled",
    fp32_matmul_prec="medium",
    coefficient_type="quintic",
    num_ns_steps=5,
)
EO_CONSTRUCTORS = {
    "spel": {**EO_SHARED, "weight_decay": 0.1},
    "sinkhorn_muon": {**EO_SHARED, "weight_decay": 0.01, "scale_mode": "spectral", "extra_scale_factor": 1.0,
                      "use_syrk": False, "num_iters": 20, "eps": 1e-8, "doubly_stochastic_tolerance": 0.1},
}  # fmt: skip
# The same in our names, with our own settings (ns_dtype, ns_method, tp_mode); Spel does not scale by shape.
OUR_SHARED = dict(
    lr=3e-4,
    momentum=0.95,
    nesterov=False,
    weight_decay_method="decoupled",
    fp32_matmul_prec="medium",
    ns_coefficients="you",
    ns_steps=5,
    ns_dtype=None,
    ns_method="standard",
    tp_mode="duplicated",
    ns_eps=None,
)
OUR_DEFAULTS = {
    "spel": (SpelSettings, {**OUR_SHARED, "weight_decay": 0.1, "adjust_lr": "none", "extra_scale_factor": 1.0}),
    "sinkhorn_muon": (
        SinkhornMuonSettings,
        {**OUR_SHARED, "weight_decay": 0.01, "adjust_lr": "spectral", "extra_scale_factor": 1.0, "use_syrk": False,
         "num_iters": 20, "eps": 1e-8, "doubly_stochastic_tolerance": 0.1},
    ),
}  # fmt: skip


@pytest.mark.parametrize("algorithm", ["spel", "sinkhorn_muon"])
def test_defaults_are_emerging_optimizers_constructors(algorithm):
    """Spel's and SinkhornMuon's (with Muon's) constructor defaults in our names, which load by its names too."""
    settings, ours = OUR_DEFAULTS[algorithm]
    assert get_algorithm(algorithm).settings is settings
    assert settings().asdict() == ours
    assert get_algorithm(algorithm).make_settings(EO_CONSTRUCTORS[algorithm]) == settings()
    # A group given the constructor's keywords holds ours, at the same values, and none of its names.
    w = nn.Parameter(sinkhorn_knopp(torch.zeros(4, 4)))
    group = Muon([{"params": [w], "algorithm": algorithm, **EO_CONSTRUCTORS[algorithm]}]).param_groups[0]
    assert {k: group[k] for k in ours} == ours
    assert not {"coefficient_type", "num_ns_steps", "scale_mode"} & set(group)


# How an error names one of Emerging-Optimizers' keywords (an alias of one of ours).
EO_NAME_OF = r"\(Emerging-Optimizers' name for {}\)"
BAD = [
    ("spel", "lr", -1.0, r"lr must be a finite number in \[0.0, inf\), got -1.0"),
    ("spel", "momentum", 1.0, r"momentum must be a finite number in \[0.0, 1.0\), got 1.0"),
    ("spel", "num_ns_steps", 0, r"num_ns_steps " + EO_NAME_OF.format("ns_steps") + r" must be a positive int, got 0"),
    (
        "spel",
        "coefficient_type",
        "you",
        r"coefficient_type " + EO_NAME_OF.format("ns_coefficients") + r" must be one of \('simple', .*got 'you'",
    ),
    ("spel", "ns_steps", 0, r"ns_steps must be a positive int, got 0"),
    ("spel", "ns_coefficients", "quintic", r"ns_coefficients .*unknown schedule 'quintic'"),
    ("spel", "weight_decay_method", "adamw", r"weight_decay_method must be one of .*got 'adamw'"),
    ("sinkhorn_muon", "num_iters", 0, r"num_iters must be a positive int, got 0"),
    ("sinkhorn_muon", "eps", 0.0, r"eps must be a finite number in \(0.0, inf\), got 0.0"),
    ("sinkhorn_muon", "doubly_stochastic_tolerance", -0.1, r"doubly_stochastic_tolerance must be .* got -0.1"),
    (
        "sinkhorn_muon",
        "scale_mode",
        "original",
        r"scale_mode " + EO_NAME_OF.format("adjust_lr") + r" must be one of \('shape_scaling', .*got 'original'",
    ),
    ("sinkhorn_muon", "adjust_lr", "unit_rms_norm", r"adjust_lr must be one of \('original', .*got 'unit_rms_norm'"),
    ("sinkhorn_muon", "extra_scale_factor", 0.0, r"extra_scale_factor must be a finite number in \(0.0, inf\)"),
    ("sinkhorn_muon", "use_syrk", 1, r"use_syrk must be a bool, got 1"),
]


@pytest.mark.parametrize(("algorithm", "key", "value", "match"), BAD)
def test_bad_values_raise_naming_the_key(algorithm, key, value, match):
    w = nn.Parameter(sinkhorn_knopp(torch.zeros(4, 4)))
    with pytest.raises(HparamError, match=r"param group 0: " + match) as err:
        Muon([{"params": [w], "algorithm": algorithm, key: value}])
    assert err.value.field == key
    # The settings of a config (MuonConfig.others, as YAML gives them; Emerging-Optimizers' names among them).
    settings = get_algorithm(algorithm).settings
    with pytest.raises(HparamError, match=r"MuonConfig\.others\[0\]: " + match) as err:
        MuonConfig(others=[{"class_path": settings.__name__, "init_args": {key: value}}])
    assert err.value.field == key
    if key in settings.field_names():  # the settings themselves (Muon(settings=[...]), MuonConfig(others=[...]))
        with pytest.raises(HparamError, match=rf"{settings.__name__}\." + match) as err:
            settings(**{key: value})
        assert err.value.field == key


@pytest.mark.parametrize("algorithm", ["spel", "sinkhorn_muon"])
def test_checkpoint_round_trip_equals_an_uninterrupted_run(algorithm):
    W0, grads = _problem((12, 8), seed=9, sinkhorn=True)

    def make(w):
        p = nn.Parameter(w.clone())
        return p, Muon([{"params": [p], "algorithm": algorithm, "lr": 0.05, "nesterov": True}])

    p, opt = make(W0)
    run_steps(opt, [p], [[g] for g in grads[:4]])
    buf = io.BytesIO()
    torch.save({"w": p.detach(), "opt": opt.state_dict()}, buf)
    run_steps(opt, [p], [[g] for g in grads[4:]])
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    q, resumed = make(saved["w"])  # a stepped sinkhorn weight passes the init check again
    resumed.load_state_dict(saved["opt"])
    run_steps(resumed, [q], [[g] for g in grads[4:]])
    assert torch.equal(p, q)
    assert resumed.param_groups[0]["nesterov"] is True


# ------------------------------------------------------------------ sharded: equal to one process

SHARDED = {
    "spel": {"a": (5, 4), "b": (6, 7), "conv": (4, 2, 3, 3), "experts": (3, 4, 5)},
    "sinkhorn_muon": {"a": (5, 4), "b": (6, 7), "t": (3, 9)},
}


def _sharded_run(rank: int, world: int) -> dict:
    """Both algorithms, 3 steps in float64, under FSDP2 and under DDP (world > 1) or alone; the whole weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon.distributed.ddp import MuonDDPSharding
    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    out = {}
    for kind in ("fsdp", "ddp"):
        fsdp = kind == "fsdp" and mesh is not None
        place = (lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])) if fsdp else (lambda t: t.clone())
        for algorithm, shapes in SHARDED.items():
            gen = torch.Generator().manual_seed(0)
            init = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
            if algorithm == "sinkhorn_muon":  # checked whole at init: gathered from the row blocks
                init = {n: sinkhorn_knopp(t) for n, t in init.items()}
            params = {n: nn.Parameter(place(t)) for n, t in init.items()}
            hp = dict(algorithm=algorithm, lr=0.05, nesterov=True)
            groups = [{"params": [params[n] for n in ("a", "b", "conv", "t") if n in params], **hp}]
            if "experts" in params:
                groups.append({"params": [params["experts"]], "batched": True, **hp})
            opt = Muon(groups)
            sharding = None if mesh is None else MuonFSDPSharding(opt) if fsdp else MuonDDPSharding(opt)
            for _ in range(3):
                for n, p in params.items():
                    p.grad = place(torch.randn(shapes[n], generator=gen, dtype=torch.float64))
                if sharding is not None and not fsdp:
                    sharding.reduce_gradients()  # every rank has the same gradients: their mean
                opt.step()
            full = (lambda t: t.full_tensor()) if fsdp else (lambda t: t)
            out[kind, algorithm] = {n: full(p.detach()).clone() for n, p in params.items()}
    return out


@pytest.mark.distributed
def test_sharded_runs_equal_one_process():
    """The projection and the map run on whole weights, on their owners: two ranks equal one process."""
    single = _sharded_run(0, 1)
    for rank in run_distributed(_sharded_run, 2):
        for key, weights in single.items():
            for n, want in weights.items():
                # float64; Newton-Schulz stacks its matrices otherwise on an owner than alone.
                assert_close(rank[key][n], want, atol=1e-13, rtol=0, msg=lambda m, key=key, n=n: f"{key} {n}: {m}")
