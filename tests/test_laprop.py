"""``"laprop"`` groups: LaProp step by step against a float64 reference of the paper, its checks, and its resume.

``_laprop64`` is Algorithm 1 of Ziyin, Wang, Ueda (arXiv 2002.04839) written per element in
Python floats, with its bias corrections accumulated step by step as the paper does
(``c <- beta c + (1 - beta)``, not ``1 - beta^t``), plus Emerging-Optimizers' ``LaProp``
options: where each weight decay method acts, and the Frobenius-norm preservation.
"""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch
from torch import nn

from lightning_muon import Muon, route_parameters
from lightning_muon.algorithms import HparamError, LaPropSettings, algorithm_names, get_algorithm, orthogonalizes

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

SHAPES = [(7,), (5, 3), (2, 3, 4)]
# Off the defaults, so that a swapped beta or a misplaced eps shows: gradients of scale 1e-2
# against eps 1e-3 make eps a tenth of the denominator.
HPARAMS = {"lr": 0.02, "betas": (0.8, 0.95), "eps": 1e-3, "weight_decay": 0.1}
METHODS = ("decoupled", "independent", "l2", "palm")


def _laprop64(
    W0: torch.Tensor,
    grads: list[torch.Tensor | None],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    correct_bias: bool = True,
    frob_normalize: bool = False,
    weight_decay_method: str = "decoupled",
) -> torch.Tensor:
    """LaProp in float64, one element at a time; a gradient of None skips the step (no count, no change)."""
    beta1, beta2 = betas
    w = W0.double().flatten().tolist()
    m, v = [0.0] * len(w), [0.0] * len(w)
    c1 = c2 = 0.0
    shrink = {"decoupled": lr * weight_decay, "independent": weight_decay, "palm": lr * lr * weight_decay}
    for G in grads:
        if G is None:
            continue
        g = G.double().flatten().tolist()
        c1, c2 = beta1 * c1 + (1 - beta1), beta2 * c2 + (1 - beta2)
        k1, k2 = (c1, c2) if correct_bias else (1.0, 1.0)
        radius = math.sqrt(sum(x * x for x in w))
        for i in range(len(w)):
            gi = g[i]
            if weight_decay_method == "l2":
                gi = gi + weight_decay * w[i]
            else:
                w[i] = w[i] - shrink[weight_decay_method] * w[i]
            v[i] = beta2 * v[i] + (1 - beta2) * gi * gi
            m[i] = beta1 * m[i] + (1 - beta1) * gi / (math.sqrt(v[i] / k2) + eps)
            w[i] = w[i] - lr * m[i] / k1
        if frob_normalize:
            scale = radius / max(math.sqrt(sum(x * x for x in w)), eps)
            w = [x * scale for x in w]
    return torch.tensor(w, dtype=torch.float64).reshape(W0.shape)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||``: entries near zero after a cancellation would make an elementwise ratio noise."""
    return ((got - want).norm() / want.norm()).item()


def _problem(dtype: torch.dtype = torch.float64, steps: int = 10):
    torch.manual_seed(0)
    W0 = [torch.randn(s, dtype=dtype) for s in SHAPES]
    grads = [[1e-2 * torch.randn(s, dtype=dtype) for s in SHAPES] for _ in range(steps)]
    return W0, grads


def _run(opt: Muon, params: list[nn.Parameter], grads: list[list[torch.Tensor | None]]) -> None:
    for step in grads:
        for p, g in zip(params, step):
            p.grad = None if g is None else g.clone()
        opt.step()


# ------------------------------------------------------------------ the rule


def test_laprop_is_registered_as_an_algorithm_that_does_not_orthogonalize():
    assert "laprop" in algorithm_names(orthogonal=False) and not orthogonalizes("laprop")
    # Emerging-Optimizers' LaProp constructor: the same names, the same defaults.
    eo_laprop = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "correct_bias": True,
        "frob_normalize": False,
        "weight_decay_method": "decoupled",
    }
    assert get_algorithm("laprop").settings is LaPropSettings
    assert LaPropSettings().asdict() == eo_laprop
    assert get_algorithm("laprop").make_settings(eo_laprop) == LaPropSettings()


@pytest.mark.parametrize(
    ("weight_decay_method", "correct_bias", "frob_normalize"),
    list(itertools.product(METHODS, (True, False), (False, True))),
)
def test_laprop_matches_the_float64_reference_step_by_step(weight_decay_method, correct_bias, frob_normalize):
    W0, grads = _problem()
    options = {**HPARAMS, "weight_decay_method": weight_decay_method}
    options.update(correct_bias=correct_bias, frob_normalize=frob_normalize)
    params = [nn.Parameter(w.clone()) for w in W0]
    opt = Muon([{"params": params, "algorithm": "laprop", **options}])
    for n in range(1, len(grads) + 1):
        _run(opt, params, grads[n - 1 : n])
        for i, p in enumerate(params):
            want = _laprop64(W0[i], [g[i] for g in grads[:n]], **options)
            assert _relative(p.detach(), want) < 1e-12, f"step {n}, shape {SHAPES[i]}"
    if frob_normalize:  # the rule's own promise: every parameter keeps its norm
        for p, w in zip(params, W0):
            assert p.detach().norm().item() == pytest.approx(w.norm().item(), rel=1e-12)


def test_each_parameter_counts_its_own_steps_and_gradients_are_left_as_they_were():
    W0, grads = _problem()
    for n in (0, 3, 4):  # the vector has no gradient on three steps: its bias correction lags
        grads[n][0] = None
    options = {**HPARAMS, "weight_decay_method": "l2"}
    params = [nn.Parameter(w.clone()) for w in W0]
    opt = Muon([{"params": params, "algorithm": "laprop", **options}])
    _run(opt, params, grads)
    for i, p in enumerate(params):
        assert _relative(p.detach(), _laprop64(W0[i], [g[i] for g in grads], **options)) < 1e-12
    assert [opt.state[p]["step"].item() for p in params] == [7.0, 10.0, 10.0]
    # "l2" adds the decay to the gradient it uses, not to p.grad (Emerging-Optimizers adds it in place).
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads[-1]))


def test_zero_weight_decay_is_the_same_under_every_method():
    W0, grads = _problem()
    results = []
    for method in METHODS:
        params = [nn.Parameter(w.clone()) for w in W0]
        options = {**HPARAMS, "weight_decay": 0.0, "weight_decay_method": method}
        _run(Muon([{"params": params, "algorithm": "laprop", **options}]), params, grads)
        results.append([p.detach() for p in params])
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


def test_bf16_moments_step_in_float32_and_stay_near_the_float32_run():
    W0, grads = _problem(torch.float32)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        params = [nn.Parameter(w.clone()) for w in W0]
        opt = Muon([{"params": params, "algorithm": "laprop", **HPARAMS}], exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
        _run(opt, params, grads)
        runs[dtype] = params
        assert {opt.state[p][k].dtype for p in params for k in ("exp_avg", "exp_avg_sq")} == {getattr(torch, dtype)}
    for a, b in zip(runs["bfloat16"], runs["float32"]):
        assert a.dtype == torch.float32
        # bf16 keeps 8 bits of each moment: 10 steps of lr 0.02 move W by ~0.2, its error by <1% of that.
        assert (a - b).abs().max().item() < 2e-3


# ------------------------------------------------------------------ checks


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("lr", -1e-3, r"lr must be a finite number in \[0.0, inf\), got -0.001"),
        ("betas", (1.0, 0.9), r"betas must be a pair \(beta1, beta2\), .* got \(1.0, 0.9\)"),
        ("betas", (0.9, -0.1), r"betas must be a pair \(beta1, beta2\), .* got \(0.9, -0.1\)"),
        ("betas", 0.9, r"betas must be a pair \(beta1, beta2\), .* got 0.9"),
        ("eps", -1e-8, r"eps must be a finite number in \[0.0, inf\), got -1e-08"),
        ("weight_decay", float("nan"), r"weight_decay must be a finite number"),
        ("correct_bias", 1, r"correct_bias must be a bool, got 1"),
        ("frob_normalize", "yes", r"frob_normalize must be a bool, got 'yes'"),
        ("weight_decay_method", "cautious", r"weight_decay_method must be one of \('decoupled', .*'palm'\)"),
    ],
)
def test_bad_values_raise_naming_the_key(key, value, match):
    gain = nn.Parameter(torch.ones(4))
    with pytest.raises(HparamError, match=r"param group 0 \('g'\): " + match) as err:
        Muon([{"params": [gain], "algorithm": "laprop", "name": "g", key: value}])
    assert err.value.field == key
    with pytest.raises(HparamError, match=r"^LaPropSettings\." + match) as err:
        LaPropSettings(**{key: value})
    assert err.value.field == key


def test_eps_zero_is_allowed_as_in_emerging_optimizers():
    assert LaPropSettings(eps=0.0).eps == 0.0
    gain = nn.Parameter(torch.ones(4, dtype=torch.float64))
    opt = Muon([{"params": [gain], "algorithm": "laprop", "eps": 0.0}])
    gain.grad = torch.tensor([1.0, -2.0, 3.0, -4.0], dtype=torch.float64)
    opt.step()
    # Step 1 with eps 0: m / c1 = g / |g|, so every entry moves by exactly lr against its gradient's sign.
    assert torch.allclose(gain.detach(), 1.0 - 1e-3 * gain.grad.sign(), rtol=0, atol=1e-15)


# ------------------------------------------------------------------ resume and routing


def test_a_checkpoint_resumes_to_the_same_bits_as_an_uninterrupted_run():
    W0, grads = _problem()
    options = {**HPARAMS, "weight_decay_method": "palm", "correct_bias": True, "frob_normalize": True}
    params = [nn.Parameter(w.clone()) for w in W0]
    opt = Muon([{"params": params, "algorithm": "laprop", **options}])
    _run(opt, params, grads[:4])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = Muon([{"params": resumed_params, "algorithm": "laprop", **options}])
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    _run(opt, params, grads[4:])
    _run(resumed, resumed_params, grads[4:])
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
    assert set(resumed.state[resumed_params[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert resumed.param_groups[0]["momentum"] == 0.8  # beta1, the read-out LearningRateMonitor logs


def test_laprop_takes_the_scalar_groups_of_the_default_rules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    groups = route_parameters(model, scalar_algorithm="laprop")
    assert {g["name"]: g["algorithm"] for g in groups} == {
        "laprop_no_decay": "laprop", "laprop": "laprop", "muon": "muon"
    }  # fmt: skip
    scalar = [g for g in groups if g["algorithm"] == "laprop"]
    opt = Muon(scalar, settings=[LaPropSettings(lr=0.01)])
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]  # the settings are the groups' defaults
    before = [p.detach().clone() for g in scalar for p in g["params"]]
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    after = [p.detach() for g in scalar for p in g["params"]]
    assert all(not torch.equal(a, b) for a, b in zip(after, before))
