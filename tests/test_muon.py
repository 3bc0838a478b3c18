"""The hybrid Muon optimizer: parity with references, parameter layouts, state, edge cases, errors."""

from __future__ import annotations

import copy
import io
import math
import re
import warnings

import pytest
import torch
from muon_reference import muon64, random_tensors, run_steps
from torch import nn
from torch.testing import assert_close

from lightning_muon import LionSettings, Muon

pytestmark = pytest.mark.numerics

# -------------------------------------------------------------- parity: torch.optim.Muon


@pytest.mark.parametrize("shape", [(32, 32), (48, 24), (24, 48)])
def test_matches_torch_muon_in_bfloat16(shape):
    """10 steps equal torch.optim.Muon (keller, nesterov, adjust "original", weight decay)."""
    lr, wd = 0.02, 0.1
    (W0,) = random_tensors([shape], seed=0, dtype=torch.float32)
    ours_p, ref_p = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    ours = Muon(
        [ours_p], lr=lr, momentum=0.95, nesterov=True, weight_decay=wd, ns_coefficients="keller",
        ns_dtype="bfloat16", adjust_lr="original",
    )  # fmt: skip
    ref = torch.optim.Muon([ref_p], lr=lr, momentum=0.95, nesterov=True, weight_decay=wd, adjust_lr_fn="original")
    # torch.optim.Muon always iterates in bf16 (8 significant bits, ~3 digits) and normalizes
    # by max(||X||, 1e-7) where we use ||X|| + 1e-7 (a 1e-7 relative change, far below a bf16
    # ulp). Both iterate the same bf16 matmuls, so their NS outputs may differ at the ulp
    # level: each step's update may differ by one bf16 ulp of an entry <= 1 (2^-8), times
    # lr * adjust (sqrt(2) at most here). Measured on this CPU: identical NS outputs, update
    # differences of 3e-8 (the float32 rounding of the final add). Iterating in float32
    # instead would differ by 2-4 ulps per step and fail.
    step_atol = lr * math.sqrt(2) * 2**-8
    for t in range(10):
        (g,) = random_tensors([shape], seed=1 + t, dtype=torch.float32)
        before = ours_p.detach().clone(), ref_p.detach().clone()
        ours_p.grad, ref_p.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert_close(ours_p.detach() - before[0], ref_p.detach() - before[1], atol=step_atol, rtol=0)
        # The momentum is float32 lerps on both sides, op for op: exact.
        assert torch.equal(ours.state[ours_p]["momentum_buffer"], ref.state[ref_p]["momentum_buffer"])
    # The gradients are fixed, so differences add up but do not compound.
    assert_close(ours_p.detach(), ref_p.detach(), atol=10 * step_atol, rtol=0)
    assert (ours_p - W0).abs().max() > 40 * step_atol  # the comparison is not vacuous


# ------------------------------------------------------ parity: own float64 reference

REFERENCE_CASES = [
    # (coefficients, steps, nesterov, adjust_lr, extra_scale_factor)
    ("polar_express", 5, True, "original", 1.0),
    ("keller", 5, False, "match_rms_adamw", 1.0),
    ("you", 5, True, "spectral_norm", 0.5),
    ("polar_express_paper", 8, True, "none", 2.0),
    ("polar_express", 7, True, "original", 1.0),  # more steps than listed: repeat the last
    ("keller", 5, True, "spectral", 0.2),
    ("polar_express", 5, False, "spectral_norm", 1.0),
    ([(3.0, -3.2, 1.2), (1.875, -1.25, 0.375)], 6, True, "original", 1.0),
    ("cans", 5, True, "original", 1.0),
    ("deepseekv4", 10, True, "original", 1.0),
]


@pytest.mark.parametrize(
    "case", REFERENCE_CASES, ids=lambda c: f"{c[0] if isinstance(c[0], str) else 'list'}-{c[1]}-{c[3]}"
)
@pytest.mark.parametrize("shape", [(16, 16), (24, 12), (12, 24), (8, 3, 3, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_float64_reference(case, shape, dtype):
    """10 steps of momentum, Nesterov, Newton-Schulz, decoupled decay and lr scaling, vs the formula."""
    coefficients, steps, nesterov, adjust, extra = case
    hp = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1)
    (W0,) = random_tensors([shape], seed=2, dtype=torch.float64)
    grads = [random_tensors([shape], seed=10 + t, dtype=torch.float64)[0] for t in range(10)]
    p = nn.Parameter(W0.to(dtype, copy=True))
    ns_dtype = "float32" if dtype == torch.float32 else None  # None keeps float64 in float64
    opt = Muon(
        [p], **hp, ns_coefficients=coefficients, ns_steps=steps, ns_dtype=ns_dtype, adjust_lr=adjust,
        extra_scale_factor=extra,
    )  # fmt: skip
    run_steps(opt, [p], [[g.to(dtype)] for g in grads])
    W_ref, B_ref, _ = muon64(W0, grads, **hp, coefficients=coefficients, steps=steps, adjust=adjust, extra=extra)
    if dtype == torch.float64:
        # Same math, different association (baddbmm vs a @ b + c): rounding only, measured <= 1.4e-15.
        atol, momentum_atol = 1e-12, 1e-14
    else:
        # float32 (unit roundoff 6e-8) against float64: Newton-Schulz amplifies rounding by up
        # to its slope near 0 (~1e3 for Polar Express), so each orthogonalized update may be
        # off by ~1e-5 (measured ~2e-6); times lr * adjust (<= 0.1 here) over 10 steps, 1e-5.
        # Measured <= 1.2e-6 on the weights, 6e-8 on the momentum.
        atol, momentum_atol = 1e-5, 1e-6
    assert_close(p.detach().double(), W_ref, atol=atol, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"].double(), B_ref, atol=momentum_atol, rtol=0)
    assert (W_ref - W0).abs().max() > 0.1  # the parameters did move


# ---------------------------------------------------------------- AdamW and Lion groups


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_group_matches_torch_adamw(foreach):
    """12 steps equal torch.optim.AdamW bit for bit (same op order as its loops)."""
    shapes = [(7,), (5, 3), (2, 3, 4), ()]
    W0 = random_tensors(shapes, seed=3, dtype=torch.float32)
    ours_ps, ref_ps = [nn.Parameter(w.clone()) for w in W0], [nn.Parameter(w.clone()) for w in W0]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    ours = Muon([{"params": ours_ps, "algorithm": "adamw", **hp}])
    ref = torch.optim.AdamW(ref_ps, **hp, foreach=foreach)
    grads = [random_tensors(shapes, seed=20 + t, dtype=torch.float32) for t in range(12)]
    run_steps(ours, ours_ps, grads)
    run_steps(ref, ref_ps, grads)
    for p, q in zip(ours_ps, ref_ps):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[p][key], ref.state[q][key]), key


def test_adamw_defaults_come_from_constructor_arguments():
    """adamw_lr, adamw_betas, adamw_eps and adamw_weight_decay reach AdamW groups and their math."""
    W0 = random_tensors([(6,)], seed=4, dtype=torch.float32)[0]
    p, q = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    ours = Muon([p], adamw_lr=3e-3, adamw_betas=(0.8, 0.9), adamw_eps=1e-5, adamw_weight_decay=0.2)
    ref = torch.optim.AdamW([q], lr=3e-3, betas=(0.8, 0.9), eps=1e-5, weight_decay=0.2)
    grads = [random_tensors([(6,)], seed=30 + t, dtype=torch.float32) for t in range(10)]
    run_steps(ours, [p], grads)
    run_steps(ref, [q], grads)
    assert ours.param_groups[0]["algorithm"] == "adamw"
    assert torch.equal(p, q)


def test_lion_group_matches_formula():
    """W <- W (1 - lr wd) - lr sign(b1 m + (1 - b1) g); m <- b2 m + (1 - b2) g, 10 steps in float64."""
    lr, wd, (b1, b2) = 1e-2, 0.3, (0.9, 0.99)
    shapes = [(5, 4), (9,)]
    W = random_tensors(shapes, seed=5, dtype=torch.float64)
    ps = [nn.Parameter(w.clone()) for w in W]
    opt = Muon([{"params": ps, "algorithm": "lion", "lr": lr, "betas": (b1, b2), "weight_decay": wd}])
    m = [torch.zeros_like(w) for w in W]
    for t in range(10):
        grads = random_tensors(shapes, seed=40 + t, dtype=torch.float64)
        for p, g in zip(ps, grads):
            p.grad = g
        opt.step()
        for i, g in enumerate(grads):
            W[i] = W[i] * (1 - lr * wd) - lr * torch.sign(b1 * m[i] + (1 - b1) * g)
            m[i] = b2 * m[i] + (1 - b2) * g
    for p, w, mi in zip(ps, W, m):
        # lerp vs b m + (1 - b) g: ulp-level in m (float64), and sign() of a random mix is
        # never that close to 0, so W agrees to rounding.
        assert_close(p.detach(), w, atol=1e-14, rtol=0)
        assert_close(opt.state[p]["exp_avg"], mi, atol=1e-14, rtol=0)


def test_lion_takes_its_own_defaults_and_lion_settings_sets_them():
    """Lion's groups start from LionSettings (lr 3e-4, no decay, betas (0.9, 0.99)), whatever AdamW's keywords
    say; ``settings=[LionSettings(...)]`` sets them."""
    vec = nn.Parameter(torch.zeros(3))
    opt = Muon([{"params": [vec], "algorithm": "lion"}], adamw_lr=4e-3, adamw_weight_decay=0.07)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (3e-4, 0.0, (0.9, 0.99))
    assert {k: group[k] for k in LionSettings.field_names()} == LionSettings().asdict()
    lion = LionSettings(lr=1e-4, weight_decay=0.5, betas=(0.95, 0.98))
    opt = Muon([{"params": [vec], "algorithm": "lion"}], settings=[lion])
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (1e-4, 0.5, (0.95, 0.98))


# ------------------------------------------------------------------- parameter layouts


def test_conv_weight_equals_its_flattened_matrix():
    """A (out, in, kh, kw) weight is orthogonalized as (out, in * kh * kw), in any memory format."""
    (c4,) = random_tensors([(6, 4, 3, 3)], seed=6, dtype=torch.float32)
    conv = nn.Parameter(c4.clone())
    conv_cl = nn.Parameter(c4.clone().to(memory_format=torch.channels_last))
    flat = nn.Parameter(c4.flatten(1).clone())
    opts = [Muon([p], lr=0.05, weight_decay=0.1) for p in (conv, conv_cl, flat)]
    for t in range(5):
        (g,) = random_tensors([(6, 4, 3, 3)], seed=50 + t, dtype=torch.float32)
        conv.grad, conv_cl.grad, flat.grad = g.clone(), g.to(memory_format=torch.channels_last), g.flatten(1)
        for opt in opts:
            opt.step()
    # Same kernels on the same numbers: exact.
    assert torch.equal(conv.flatten(1), flat)
    assert torch.equal(conv_cl, conv)
    assert opts[0].state[conv]["momentum_buffer"].shape == (6, 4, 3, 3)


def test_non_contiguous_matrix_equals_contiguous():
    """A transposed-storage parameter takes the same update as a contiguous copy."""
    (W0,) = random_tensors([(8, 12)], seed=7, dtype=torch.float32)
    a, b = nn.Parameter(W0.clone()), nn.Parameter(W0.t().contiguous().t())
    assert not b.is_contiguous()
    grads = [random_tensors([(8, 12)], seed=60 + t, dtype=torch.float32) for t in range(5)]
    run_steps(Muon([a], lr=0.05, weight_decay=0.1), [a], grads)
    run_steps(Muon([b], lr=0.05, weight_decay=0.1), [b], grads)
    assert torch.equal(a, b)


@pytest.mark.parametrize("adjust_lr", ["original", "spectral_norm", "match_rms_adamw"])
def test_split_sizes_equal_separate_parameters(adjust_lr):
    """A fused (24 + 8 + 16, 8) QKV weight with split_sizes equals three separate matrices."""
    sizes, cols = (24, 8, 16), 8
    (W0,) = random_tensors([(sum(sizes), cols)], seed=8, dtype=torch.float32)
    fused = nn.Parameter(W0.clone())
    parts = [nn.Parameter(w.clone()) for w in W0.split(sizes)]
    hp = dict(lr=0.05, weight_decay=0.1, adjust_lr=adjust_lr)
    fused_opt = Muon([{"params": [fused], "split_sizes": list(sizes)}], **hp)
    parts_opt = Muon([{"params": parts}], **hp)
    for t in range(5):
        (g,) = random_tensors([(sum(sizes), cols)], seed=70 + t, dtype=torch.float32)
        fused.grad = g.clone()
        for p, gp in zip(parts, g.split(sizes)):
            p.grad = gp.clone()
        fused_opt.step()
        parts_opt.step()
    # Each block is orthogonalized and scaled by adjust(block shape) (sqrt(3), 1, sqrt(2) for
    # "original", not sqrt(6) for the whole); same kernels on the same numbers: exact.
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in parts]))
    assert fused_opt.state[fused]["momentum_buffer"].shape == fused.shape


@pytest.mark.parametrize("shape", [(3, 12, 6), (2, 2, 5, 9)])
def test_batched_tensor_equals_separate_matrices(shape):
    """batched=True on an (E, m, n) expert tensor equals E separate (m, n) parameters."""
    (W0,) = random_tensors([shape], seed=9, dtype=torch.float64)
    experts = nn.Parameter(W0.clone())
    singles = [nn.Parameter(w.clone()) for w in W0.reshape(-1, *shape[-2:])]
    hp = dict(lr=0.05, weight_decay=0.1)
    batched_opt = Muon([{"params": [experts], "batched": True}], **hp)
    singles_opt = Muon([{"params": singles}], **hp)
    for t in range(5):
        (g,) = random_tensors([shape], seed=80 + t, dtype=torch.float64)
        experts.grad = g.clone()
        for p, gp in zip(singles, g.reshape(-1, *shape[-2:])):
            p.grad = gp.clone()
        batched_opt.step()
        singles_opt.step()
    # Both run one batched iteration over the same stack of matrices; allow float64 rounding
    # in case the stacks are laid out differently (measured: exact).
    assert_close(
        experts.detach().reshape(-1, *shape[-2:]), torch.stack([p.detach() for p in singles]), atol=1e-13, rtol=0
    )
    # ... and it is not the flattened (E, m * n) update.
    flat = nn.Parameter(W0.clone())
    flat_opt = Muon([flat], **hp)
    for t in range(5):
        flat.grad = random_tensors([shape], seed=80 + t, dtype=torch.float64)[0]
        flat_opt.step()
    assert (flat - experts).abs().max() > 1e-3


def test_zero_size_parameters_are_left_alone():
    """Empty tensors (a zero-width layer) in any group do not break the step of the others."""
    empties = [nn.Parameter(torch.zeros(s)) for s in [(0, 5), (3, 0, 2), (0,)]]
    W, b = nn.Parameter(torch.ones(4, 6)), nn.Parameter(torch.ones(4))
    opt = Muon([{"params": [W, *empties[:2]], "algorithm": "muon"}, {"params": [b, empties[2]], "algorithm": "adamw"}])
    for p in [W, b, *empties]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(e.shape == e.grad.shape for e in empties)
    assert not torch.equal(W, torch.ones(4, 6)) and not torch.equal(b, torch.ones(4))


# ------------------------------------------------------------------- building groups


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)).relu())


def test_flat_parameter_list_splits_matrices_from_the_rest():
    """Tensors with 2+ dims go to a "muon" group, the rest to an "adamw" group, in order."""
    model = Tiny()
    opt = Muon(model.parameters(), lr=0.01, adamw_lr=1e-3)
    muon, adamw = opt.param_groups
    assert (muon["algorithm"], muon["name"], muon["lr"]) == ("muon", "muon", 0.01)
    assert (adamw["algorithm"], adamw["name"], adamw["lr"]) == ("adamw", "adamw", 1e-3)
    assert muon["params"] == [model.fc1.weight, model.fc2.weight]
    assert adamw["params"] == [model.fc1.bias, model.norm.weight, model.norm.bias, model.fc2.bias]
    assert "betas" not in muon and "ns_steps" not in adamw  # no key leaks across algorithms
    assert adamw["momentum"] == adamw["betas"][0]  # beta1 read-out for loggers
    assert "param_names" not in muon


def test_named_parameters_give_param_names():
    """(name, tensor) pairs become param_names in both groups, aligned with params."""
    model = Tiny()
    opt = Muon(model.named_parameters())
    muon, adamw = opt.param_groups
    assert muon["param_names"] == ["fc1.weight", "fc2.weight"]
    assert adamw["param_names"] == ["fc1.bias", "norm.weight", "norm.bias", "fc2.bias"]
    named = dict(model.named_parameters())
    for group in opt.param_groups:
        assert [named[n] for n in group["param_names"]] == group["params"]
    # Pairs inside a dict work too.
    opt = Muon([{"params": [("w", model.fc1.weight)]}])
    assert opt.param_groups[0]["param_names"] == ["w"] and opt.param_groups[0]["algorithm"] == "muon"


def test_group_without_algorithm_is_inferred():
    """All matrices -> muon, no matrices -> adamw; explicit algorithms are kept."""
    model = Tiny()
    opt = Muon(
        [
            {"params": [model.fc1.weight, model.fc2.weight]},
            {"params": [model.fc1.bias, model.fc2.bias]},
            {"params": [model.norm.weight], "algorithm": "lion"},
            {"params": [model.norm.bias], "algorithm": "adamw", "lr": 5e-4},
        ]
    )
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw", "lion", "adamw"]
    assert opt.param_groups[3]["lr"] == 5e-4
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3))], "momentum": 0.8})
    assert opt.param_groups[-1]["algorithm"] == "muon" and opt.param_groups[-1]["momentum"] == 0.8


def test_group_mixing_matrices_and_vectors_without_algorithm_is_split_by_rule():
    """A dict mixing 2-D and 1-D tensors becomes one group per algorithm (tests/test_added_groups.py has the rule)."""
    model = Tiny()
    opt = Muon([{"params": [model.fc2.weight]}, {"params": [model.fc1.weight, model.fc1.bias], "name": "mixed"}])
    assert [(g.get("name"), g["algorithm"]) for g in opt.param_groups] == [
        (None, "muon"),
        ("mixed.adamw", "adamw"),
        ("mixed.muon", "muon"),
    ]
    assert opt.param_groups[1]["params"] == [model.fc1.bias] and opt.param_groups[2]["params"] == [model.fc1.weight]


def test_ns_dtype_is_stored_as_a_plain_name():
    """Groups keep ns_dtype as a string (checkpoints load with weights_only=True)."""
    W = nn.Parameter(torch.zeros(3, 3))
    for given, stored in [(None, None), (torch.bfloat16, "bfloat16"), ("bf16", "bfloat16"), (torch.float64, "float64")]:
        assert Muon([W], ns_dtype=given).param_groups[0]["ns_dtype"] == stored


# -------------------------------------------------------------------------- state


class Net(nn.Module):
    """Conv + linear (Muon), biases (AdamW) and a gain vector (Lion)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(64, 8)
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.fc(self.conv(x).tanh().flatten(1)) * self.gain


def build_optimizer(net: Net) -> Muon:
    return Muon(
        [
            {"params": [net.conv.weight, net.fc.weight], "algorithm": "muon", "name": "hidden"},
            {"params": [net.conv.bias, net.fc.bias], "algorithm": "adamw", "name": "biases"},
            {"params": [net.gain], "algorithm": "lion", "lr": 1e-3, "name": "gain"},
        ],
        lr=0.02,
        weight_decay=0.01,
        ns_dtype="float32",
        adamw_lr=1e-2,
        adamw_weight_decay=0.01,
    )


def train(net: Net, opt: Muon, steps: range) -> None:
    """Steps on batches that depend only on the step index, so a resumed run sees the same data."""
    for t in steps:
        gen = torch.Generator().manual_seed(1000 + t)
        x, y = torch.randn(4, 3, 6, 6, generator=gen), torch.randn(4, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def test_state_dict_round_trip_resumes_exactly():
    """Save after 5 steps, train 5 more; a fresh model + optimizer loaded from the save does the same."""
    torch.manual_seed(0)
    net = Net()
    opt = build_optimizer(net)
    train(net, opt, range(5))
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, buf)
    train(net, opt, range(5, 10))

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # plain types only: dtype names, tuples, tensors
    torch.manual_seed(123)  # a different init, overwritten by the load
    resumed = Net()
    resumed.load_state_dict(saved["model"])
    resumed_opt = build_optimizer(resumed)
    resumed_opt.load_state_dict(saved["optim"])
    train(resumed, resumed_opt, range(5, 10))

    for (name, p), q in zip(net.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
        for key, value in opt.state[p].items():
            assert torch.equal(value, resumed_opt.state[q][key]), (name, key)
    strip = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]
    assert strip(resumed_opt.param_groups) == strip(opt.param_groups)


def test_state_is_per_parameter_and_shaped_like_it():
    """momentum_buffer (Muon), exp_avg/exp_avg_sq/step (AdamW), exp_avg (Lion): one entry per param."""
    net = Net()
    opt = build_optimizer(net)
    train(net, opt, range(3))
    expected_keys = {"muon": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}, "lion": {"exp_avg"}}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            assert set(state) == expected_keys[group["algorithm"]]
            for key, value in state.items():
                if key == "step":
                    assert value.ndim == 0 and value.item() == 3
                else:
                    assert value.shape == p.shape and value.dtype == p.dtype, key
                    assert value.data_ptr() != p.data_ptr()
    assert len(opt.state) == sum(len(g["params"]) for g in opt.param_groups)


# -------------------------------------------------------------------- step behaviour


def hybrid_params():
    return [nn.Parameter(t) for t in random_tensors([(6, 4), (3, 2, 2), (4,), (5,)], seed=11, dtype=torch.float32)]


def hybrid_optimizer(params, lr: float, **kwargs) -> Muon:
    w, conv, b, s = params
    return Muon(
        [
            {"params": [w, conv], "algorithm": "muon"},
            {"params": [b], "algorithm": "adamw"},
            {"params": [s], "algorithm": "lion"},
        ],
        lr=lr,
        weight_decay=0.1,
        adamw_lr=lr,
        adamw_weight_decay=0.1,
        settings=[LionSettings(lr=lr, weight_decay=0.1)],
        **kwargs,
    )


@pytest.mark.parametrize("grads", ["random", "zero"])
def test_zero_lr_step_changes_no_parameter(grads):
    """At lr = 0 weight decay and every update vanish, in all three algorithms (DCP's resume step)."""
    params = hybrid_params()
    before = [p.detach().clone() for p in params]
    opt = hybrid_optimizer(params, lr=0.0)
    for t in range(2):  # the second step runs with state present
        for i, p in enumerate(params):
            p.grad = (
                random_tensors([p.shape], seed=90 + 10 * t + i, dtype=torch.float32)[0]
                if grads == "random"
                else torch.zeros_like(p)
            )
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert all(bool(v.isfinite().all()) for state in opt.state.values() for v in state.values())


def test_step_with_closure_returns_its_loss_and_uses_its_grads():
    """step(closure) evaluates the closure with grad enabled, returns its loss, steps on its grads."""
    torch.manual_seed(1)
    net = Net()
    twin = copy.deepcopy(net)
    opt, twin_opt = build_optimizer(net), build_optimizer(twin)
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 8)
    returned = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        returned.append(loss)
        return loss

    loss = opt.step(closure)
    assert loss is returned[0]
    twin_opt.zero_grad()
    nn.functional.mse_loss(twin(x), y).backward()
    twin_opt.step()
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert opt.step() is None


def test_parameters_without_grad_are_skipped():
    """A parameter whose grad is None keeps its value and gets no state, in every algorithm."""
    used, unused = hybrid_params(), hybrid_params()
    opt = Muon(
        [
            {"params": [used[0], unused[0], used[1], unused[1]], "algorithm": "muon"},
            {"params": [used[2], unused[2]], "algorithm": "adamw"},
            {"params": [used[3], unused[3]], "algorithm": "lion"},
        ],
        weight_decay=0.1,
        adamw_weight_decay=0.1,
    )
    before = [p.detach().clone() for p in unused]
    for p in used:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    for p, b in zip(unused, before):
        assert p.grad is None and p not in opt.state
        assert torch.equal(p.detach(), b)
    assert all(p in opt.state for p in used)


def test_works_under_grad_scaler():
    """GradScaler("cpu"): a normal step equals the unscaled step; an inf step is skipped entirely."""
    torch.manual_seed(2)
    net = Net()
    twin = copy.deepcopy(net)
    opt, twin_opt = build_optimizer(net), build_optimizer(twin)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # a power of 2: unscaling is exact
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 8)

    scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    nn.functional.mse_loss(twin(x), y).backward()
    twin_opt.step()
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q)

    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
    net.fc.weight.grad[0, 0] = float("inf")
    params = [p.detach().clone() for p in net.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    scaler.step(opt)  # must not reach Muon.step (which would raise on the inf)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    for p, b in zip(net.parameters(), params):
        assert torch.equal(p.detach(), b)
    for k, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state[k][key]), key


# ----------------------------------------------------------------- non-finite gradients


def snapshot(params, opt):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def assert_unchanged(params, opt, snap):
    values, state = snap
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for k in state:
        for key in state[k]:
            assert torch.equal(now[k][key], state[k][key]), key


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(("index", "group", "position", "shape"), [(1, 0, 1, (3, 2, 2)), (3, 2, 0, (5,))])
def test_nonfinite_raise_names_the_parameter_and_changes_nothing(bad, index, group, position, shape):
    """nonfinite="raise": FloatingPointError with group, parameter index and shape; nothing is touched."""
    params = hybrid_params()
    opt = hybrid_optimizer(params, lr=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # state exists now
    snap = snapshot(params, opt)
    params[index].grad.view(-1)[1] = bad
    pattern = rf"param group {group} .*parameter {position} of shape {re.escape(str(shape))}"
    with pytest.raises(FloatingPointError, match=pattern):
        opt.step()
    assert_unchanged(params, opt, snap)


def test_nonfinite_raise_names_a_named_parameter():
    """With named parameters the message carries the name (norms and biases are routed by name to adamw_no_decay)."""
    model = Tiny()
    opt = Muon(model.named_parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.norm.bias.grad[0] = float("nan")
    match = r"param group 1 \('adamw_no_decay'\), parameter 2 'norm.bias' of shape \(8,\)"
    with pytest.raises(FloatingPointError, match=match):
        opt.step()


def test_nonfinite_skip_warns_changes_nothing_and_recovers():
    """nonfinite="skip": a warning, every group untouched, then training continues as if it never happened."""
    params, clean = hybrid_params(), hybrid_params()
    opt = hybrid_optimizer(params, lr=0.01, nonfinite="skip")
    clean_opt = hybrid_optimizer(clean, lr=0.01)

    grads = [random_tensors([p.shape for p in params], seed=200 + t, dtype=torch.float32) for t in range(3)]
    run_steps(opt, params, grads[:1])
    run_steps(clean_opt, clean, grads[:1])
    snap = snapshot(params, opt)
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    params[0].grad[2, 1] = float("nan")  # one bad entry in the Muon group only
    with pytest.warns(RuntimeWarning, match="skipped for all groups"):
        opt.step()
    assert_unchanged(params, opt, snap)
    assert all(bool(v.isfinite().all()) for state in opt.state.values() for v in state.values())
    run_steps(opt, params, grads[2:])
    run_steps(clean_opt, clean, grads[2:])
    for p, q in zip(params, clean):
        assert torch.equal(p, q)


def test_nonfinite_ignore_checks_nothing_and_steps_like_raise_on_finite_gradients():
    """nonfinite="ignore": finite steps equal the checked ones; a NaN goes through, as in torch.optim."""
    params, checked = hybrid_params(), hybrid_params()
    opt = hybrid_optimizer(params, lr=0.01, nonfinite="ignore")
    checked_opt = hybrid_optimizer(checked, lr=0.01)
    grads = [random_tensors([p.shape for p in params], seed=300 + t, dtype=torch.float32) for t in range(2)]
    run_steps(opt, params, grads)
    run_steps(checked_opt, checked, grads)
    for p, q in zip(params, checked):
        assert torch.equal(p, q)
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    params[0].grad[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        opt.step()
    assert not bool(params[0].isfinite().all())


# -------------------------------------------------------------------------- errors

W = nn.Parameter(torch.zeros(4, 6))
BIAS = nn.Parameter(torch.zeros(4))
BETAS = r"must be a pair \(beta1, beta2\), beta1 in \[0, 1\) and beta2 in \[0, 1\), got "
NS_DTYPE = r"ns_dtype must be one of \('float32', 'bfloat16', 'float64', 'float16', None\), got "


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, r"Muon\(\): lr must be a finite number in \[0.0, inf\), got -1.0"),
        ({"lr": float("nan")}, r"lr must be a finite number .* got nan"),
        ({"lr": True}, r"lr must be a finite number .* got True"),
        ({"lr": "0.02"}, r"lr must be a finite number .* got '0.02'"),
        ({"momentum": 1.0}, r"momentum must be a finite number in \[0.0, 1.0\), got 1.0"),
        ({"momentum": -0.1}, r"momentum must be a finite number in \[0.0, 1.0\), got -0.1"),
        ({"weight_decay": -0.1}, r"weight_decay must be a finite number .* got -0.1"),
        ({"nesterov": 1}, r"nesterov must be a bool, got 1"),
        ({"extra_scale_factor": 0.0}, r"extra_scale_factor must be a finite number in \(0.0, inf\), got 0.0"),
        ({"adamw_lr": -1e-3}, r"adamw_lr must be a finite number .* got -0.001"),
        ({"adamw_betas": (0.9,)}, r"adamw_betas " + BETAS + r"\(0.9,\)"),
        ({"adamw_betas": (0.9, 0.95, 0.99)}, r"adamw_betas must be a pair .* got \(0.9, 0.95, 0.99\)"),
        ({"adamw_betas": (0.9, 1.0)}, r"adamw_betas " + BETAS + r"\(0.9, 1.0\)"),
        ({"adamw_betas": (-0.1, 0.9)}, r"adamw_betas " + BETAS + r"\(-0.1, 0.9\)"),
        ({"adamw_eps": 0.0}, r"adamw_eps must be a finite number in \(0.0, inf\), got 0.0"),
        ({"adamw_weight_decay": float("inf")}, r"adamw_weight_decay must be a finite number .* got inf"),
        ({"ns_steps": 0}, r"ns_steps must be a positive int, got 0"),
        ({"ns_steps": 1.5}, r"ns_steps must be a positive int, got 1.5"),
        ({"ns_steps": True}, r"ns_steps must be a positive int, got True"),
        ({"ns_coefficients": "polar"}, r"ns_coefficients unknown schedule 'polar'; choose one of \[.*\]"),
        ({"ns_coefficients": []}, r"ns_coefficients must be a non-empty list of \(a, b, c\) tuples, got \[\]"),
        ({"ns_coefficients": [(1.0, 2.0)]}, r"ns_coefficients must be a non-empty list .* got \[\(1.0, 2.0\)\]"),
        ({"ns_coefficients": [(1.0, 2.0, 3.0, 4.0)]}, r"ns_coefficients must be a non-empty list of \(a, b, c\)"),
        ({"ns_coefficients": [(1.5, -0.5, float("inf"))]}, r"ns_coefficients must be finite numbers, got .*inf"),
        ({"adjust_lr": "sqrt"}, r"adjust_lr must be one of .* got 'sqrt'"),
        ({"nonfinite": "warn"}, r"nonfinite must be one of \('raise', 'skip', 'ignore'\), got 'warn'"),
        ({"ns_dtype": "int8"}, NS_DTYPE + "'int8'"),
        ({"ns_dtype": torch.int32}, NS_DTYPE + "'int32'"),  # a torch dtype, by its name
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    """Every bad keyword raises ValueError naming the argument and the value."""
    with pytest.raises(ValueError, match=match):
        Muon([W, BIAS], **kwargs)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"lr": -1.0}, r"LionSettings\.lr must be a finite number .* got -1.0"),
        ({"betas": (1.0, 0.99)}, r"LionSettings\.betas " + BETAS + r"\(1.0, 0.99\)"),
        ({"weight_decay": -1.0}, r"LionSettings\.weight_decay must be .* got -1.0"),
    ],
)
def test_other_algorithms_settings_reject_bad_values(settings, match):
    """Lion's defaults (Muon's ``settings=[LionSettings(...)]``) are checked when made, naming the field."""
    with pytest.raises(ValueError, match=match) as info:
        Muon([W, BIAS], settings=[LionSettings(**settings)])
    assert info.value.field == next(iter(settings))


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"params": [W], "algorithm": "sgd"}, r"param group 0: algorithm must be one of .* got 'sgd'"),
        (
            {"params": [BIAS], "algorithm": "muon"},
            r"parameter 0: Muon needs a matrix, got a 1-D tensor of shape \(4,\)",
        ),
        ({"params": [W], "batched": True}, r"batched=True needs a tensor with 3\+ dims, got shape \(4, 6\)"),
        ({"params": [W], "batched": "yes"}, r"batched must be a bool, got 'yes'"),
        ({"params": [W], "split_sizes": [2, 1]}, r"split_sizes \(2, 1\) sum to 3, but dim 0 has size 4"),
        (
            {"params": [nn.Parameter(torch.zeros(2, 4, 6))], "split_sizes": [3, 2], "batched": True},
            r"split_sizes \(3, 2\) sum to 5, but dim 1 has size 4",
        ),
        (
            {"params": [W], "split_sizes": [4, 0]},
            r"split_sizes must be a non-empty list of positive ints, got \[4, 0\]",
        ),
        ({"params": [W], "split_sizes": []}, r"split_sizes must be a non-empty list of positive ints"),
        ({"params": [W], "lr": -0.5, "name": "hidden"}, r"param group 0 \('hidden'\): lr must be .* got -0.5"),
        ({"params": [W], "ns_dtype": "int8"}, r"param group 0: " + NS_DTYPE + "'int8'"),
        ({"params": [W], "ns_steps": 0}, r"ns_steps must be a positive int, got 0"),
        ({"params": [BIAS], "algorithm": "adamw", "eps": 0}, r"param group 0: eps must be .* \(0.0, inf\), got 0"),
        (
            {"params": [BIAS], "algorithm": "adamw", "betas": (0.9, 1.5)},
            r"param group 0: betas " + BETAS + r"\(0.9, 1.5\)",
        ),
        ({"params": [BIAS], "algorithm": "lion", "betas": [0.9]}, r"betas must be a pair .* got \[0.9\]"),
        (
            {"params": [nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))]},
            r"parameter 0: complex parameters are not supported by Muon",
        ),
    ],
)
def test_param_group_rejects_bad_settings(group, match):
    """Bad group settings raise ValueError naming the group, the key and the value."""
    with pytest.raises(ValueError, match=match):
        Muon([group])


def test_bad_params_containers_raise():
    """No parameters, a bare tensor, or dicts mixed with tensors are refused."""
    with pytest.raises(ValueError, match=r"params is empty"):
        Muon([])
    with pytest.raises(TypeError, match=r"params argument given to the optimizer should be an iterable of Tensors"):
        Muon(W)  # torch.optim's words
    with pytest.raises(ValueError, match=r"params mixes dicts with tensors"):
        Muon([W, {"params": [BIAS]}])
    with pytest.raises(TypeError, match=r"params must hold tensors, got str"):
        Muon([W, "bias"])


@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
def test_sparse_gradients_raise_at_step(algorithm):
    """An nn.Embedding(sparse=True) gradient is refused, naming group and parameter."""
    emb = nn.Embedding(10, 4, sparse=True)
    other = nn.Parameter(torch.zeros(3, 3))
    opt = Muon([{"params": [other], "algorithm": "muon"}, {"params": [emb.weight], "algorithm": algorithm}])
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(ValueError, match=r"param group 1, parameter 0: sparse gradients are not supported"):
        opt.step()


def test_complex_gradients_raise_at_step():
    """A complex parameter outside a Muon group is refused at the first step."""
    z = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    opt = Muon([{"params": [z], "algorithm": "adamw"}])
    z.grad = torch.ones_like(z)
    with pytest.raises(ValueError, match=r"param group 0, parameter 0: complex gradients are not supported"):
        opt.step()
    assert torch.equal(z.detach(), torch.zeros(3, dtype=torch.complex64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_sees_nan_and_both_infinities_in_any_dtype(bad):
    from lightning_muon.functional import all_finite

    fine = [torch.ones(3, dtype=torch.bfloat16), torch.tensor([1e300], dtype=torch.float64), torch.zeros(0)]
    assert all_finite(fine)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        broken = torch.randn(50).to(dtype)
        broken[17] = bad
        assert not all_finite([*fine, broken])


@pytest.mark.parametrize("half_stacks", [True, False])
@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_step_on_donated_temporaries_equals_the_observed_path(monkeypatch, ns_dtype, half_stacks):
    """Without an observer a Nesterov update that runs alone is made in the work dtype and iterated in place.

    With an observer attached the step keeps the momentum update intact (the observer reads
    it) and orthogonalizes a copy laid wide: the same math, so the weights agree to rounding.
    Shapes: a tall and a wide matrix past ``BATCH_MAX_ELEMENTS`` and a small batched one. In
    float32 the two run alone; in bf16 they share a stack (``stacks``), or run alone where
    half-precision stacks are switched off (``half_stacks=False``).
    """
    import lightning_muon.newton_schulz as ns

    if not half_stacks:
        monkeypatch.setattr(ns, "HALF_BATCH_MAX_ELEMENTS", 0)
    shapes = [(520, 256), (256, 520), (16, 24)]
    alone = ns.runs_alone([torch.empty(s) for s in shapes], dtype=ns_dtype)
    assert alone == [ns_dtype == "float32" or not half_stacks] * 2 + [False]
    runs = []
    for observed in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
        opt = Muon([{"params": params, "algorithm": "muon", "ns_dtype": ns_dtype}], lr=0.02, weight_decay=0.01)
        if observed:
            opt.register_update_hook(lambda group, ps, updates, ortho: None)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append([p.detach().clone() for p in params])
    # Per step the update differs by the orientation's rounding in the Gram products (fp32:
    # ~1e-6 of the unit-size O; bf16: a few ulps, u = 2^-8, of some entries); times lr 0.02,
    # adjust <= 1.43 and 3 steps, bounded by 3 * 0.02 * 1.43 * 4u (measured: fp32 4e-8, bf16 equal).
    tol = 1e-6 if ns_dtype == "float32" else 3 * 0.02 * 1.43 * 4 * 2**-8
    for a, b in zip(*runs):
        assert_close(a, b, atol=tol, rtol=0)
