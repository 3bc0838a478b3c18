"""``Muon`` as a drop-in for ``torch.optim.Muon``: its arguments, in its order and with its meanings.

Side by side with torch's own optimizer on its own settings (fp32 Newton-Schulz on both sides),
its positional call, its one ``(a, b, c)``, its ``eps`` (our ``ns_eps``, on Muon's groups only)
and its Tensor lr under an LR scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import yaml
from torch import nn

from lightning_muon import AdamWSettings, LionSettings, Muon, MuonConfig, MuonSettings, Rule, orthogonalize
from lightning_muon.algorithms import HparamError, algorithm_names, sinkhorn_knopp
from lightning_muon.aliases import aliases_of

pytestmark = pytest.mark.numerics

KELLER = (3.4445, -4.7750, 2.0315)
# torch.optim.Muon's defaults, every one spelled out.
TORCH_SETTINGS = dict(
    lr=1e-3,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=KELLER,
    eps=1e-7,
    ns_steps=5,
    adjust_lr_fn=None,
)
VARIANTS = {
    "defaults": {},
    "no_nesterov": {"nesterov": False},
    "match_rms_adamw": {"adjust_lr_fn": "match_rms_adamw"},
    "original": {"adjust_lr_fn": "original"},
}
# Tall, wide, square, and a second tall one: ours stacks same-shape matrices in one batched
# iteration, torch iterates each alone.
SHAPES = [(48, 16), (16, 48), (32, 32), (48, 16)]


@pytest.fixture
def torch_ns_in_fp32(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch.optim.Muon's own Newton-Schulz, run in float32 instead of bf16; returns a call counter.

    torch's ``_zeropower_via_newtonschulz`` starts with ``grad.bfloat16()``: a copy that it then
    divides in place and iterates on. For the duration of that call only, ``Tensor.bfloat16``
    is made a plain copy in the input's own dtype (float32 here), so torch's iteration runs
    unchanged (its transposes, norm, clamp and ``addmm`` order) at the precision ours runs
    at with ``ns_dtype="float32"``. Nothing else of torch's step is touched.
    """
    original = torch.optim._muon._zeropower_via_newtonschulz
    calls = [0]

    def in_fp32(grad: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls[0] += 1
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self.clone())
            return original(grad, *args, **kwargs)

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", in_fp32)
    return calls


def run(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], steps: int = 10, scale: float = 1e-3):
    """``steps`` steps of ``make(params)`` on fixed random gradients; returns the parameters after them.

    The weights start at ``scale``, the size of ten updates at lr 1e-3, so that the relative
    error of the weights measures the updates rather than the float32 rounding of large weights.
    """
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(scale * torch.randn(shape, generator=gen)) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=gen) for shape in SHAPES] for _ in range(steps)]
    optimizer = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


def max_relative_error(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest ``max|ours - ref| / max|ref|`` over the tensors."""
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, ref))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_torch_muon_on_its_settings(variant, torch_ns_in_fp32):
    """torch's settings, spelled out, give torch's weights to float32 rounding after 10 steps."""
    settings = {**TORCH_SETTINGS, **VARIANTS[variant]}
    ref = run(lambda params: torch.optim.Muon(params, **settings))
    assert torch_ns_in_fp32[0] == 10 * len(SHAPES)  # torch's step went through the fp32 wrapper
    ours = run(lambda params: Muon(params, **settings, ns_dtype="float32"))
    # Measured 3.0e-7 to 3.5e-7 on a 2-core CPU (torch 2.13): float32 products summed in another
    # order (ours stacks same-shape matrices and forms symmetric products by blocks).
    assert max_relative_error(ours, ref) <= 1e-6
    start = run(lambda params: torch.optim.SGD(params, lr=0.0), steps=1)
    assert max_relative_error(ref, start) > 0.5  # the updates are as large as the weights: not vacuous


def test_positional_call_is_torch_order_and_the_keyword_call():
    """``Muon(params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)``."""
    positional = run(lambda params: Muon(params, 1e-3, 0.1, 0.95, True, KELLER, 1e-7, 5, "original"))
    keywords = run(lambda params: Muon(params, **{**TORCH_SETTINGS, "adjust_lr_fn": "original"}))
    assert all(torch.equal(a, b) for a, b in zip(positional, keywords))
    w = nn.Parameter(torch.zeros(4, 4))
    group = Muon([w], 1e-3, 0.1, 0.9, False, KELLER, 1e-6, 7, "match_rms_adamw").param_groups[0]
    expected = dict(lr=1e-3, weight_decay=0.1, momentum=0.9, nesterov=False, ns_coefficients=[KELLER])
    expected.update(ns_eps=1e-6, ns_steps=7, adjust_lr="match_rms_adamw")
    assert {k: group[k] for k in expected} == expected


def test_one_coefficient_triple_is_stored_as_a_list_of_one_and_round_trips():
    """torch's ``(a, b, c)``: every step's triple, stored as ``[(a, b, c)]`` (state_dict, YAML)."""
    assert MuonSettings(ns_coefficients=KELLER) == MuonSettings(ns_coefficients=[KELLER])
    assert MuonSettings(ns_coefficients=KELLER).ns_coefficients == [KELLER]
    G = torch.randn(24, 40, dtype=torch.float64)
    assert torch.equal(orthogonalize(G, 5, KELLER), orthogonalize(G, 5, "keller"))  # keller is (a, b, c) 5 times
    w = nn.Parameter(torch.randn(8, 4))
    optimizer = Muon([w], ns_coefficients=KELLER)
    assert optimizer.param_groups[0]["ns_coefficients"] == [KELLER]
    w.grad = torch.randn_like(w)
    optimizer.step()
    again = Muon([w], ns_coefficients=[KELLER])
    again.load_state_dict(optimizer.state_dict())
    assert again.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    config = MuonConfig(matrix=MuonSettings(ns_coefficients=KELLER))
    assert MuonConfig.from_any(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config
    with pytest.raises(HparamError, match=r"ns_coefficients must be .* or one \(a, b, c\), got \(1.0, 2.0\)"):
        Muon([w], ns_coefficients=(1.0, 2.0))


@pytest.mark.parametrize("eps", [1e-7, 2e-14, 1e-20])  # above, about, below the momentum's norms
def test_eps_floors_the_norm_as_torch_does(eps, torch_ns_in_fp32):
    """A momentum whose norm is below ``eps`` is divided by ``eps``, as in torch (a floor, not an added term).

    In float64 on both sides (the wrapper leaves torch's iteration in its input's dtype), so that
    the one step compared is the update itself to rounding.
    """
    gen = torch.Generator().manual_seed(1)
    grads = [1e-14 * torch.randn(shape, generator=gen, dtype=torch.float64) for shape in SHAPES]  # norms ~3e-13
    updates = {}
    for name, make in (
        ("torch", lambda ps: torch.optim.Muon(ps, **{**TORCH_SETTINGS, "eps": eps})),
        ("ours", lambda ps: Muon(ps, **{**TORCH_SETTINGS, "eps": eps}, ns_dtype="float64")),
    ):
        params = [nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in SHAPES]  # the weights: the update
        optimizer = make(params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        updates[name] = [p.detach().clone() for p in params]
    assert max_relative_error(updates["ours"], updates["torch"]) <= 1e-12
    largest = max(u.abs().max().item() for u in updates["ours"])
    if eps == 1e-7:  # the momentum divided by eps has singular values ~1e-7: five steps grow them ~500x only
        assert largest < 1e-7
    elif eps == 1e-20:  # normalized: an orthogonal update's entries times lr
        assert largest > 1e-4


def test_eps_is_muon_only_and_leaves_adamw_eps_alone():
    w, b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))
    matrices, vectors = Muon([w, b], eps=1e-5).param_groups
    assert (matrices["algorithm"], matrices["ns_eps"]) == ("muon", 1e-5)
    assert (vectors["algorithm"], vectors["eps"]) == ("adamw", 1e-8) and "ns_eps" not in vectors
    assert Muon([w, b], adamw_eps=1e-6).param_groups[1]["eps"] == 1e-6  # AdamW's own, as before
    group = Muon([{"params": [b], "algorithm": "adamw", "eps": 1e-3}]).param_groups[0]
    assert group["eps"] == 1e-3 and "ns_eps" not in group
    assert "eps" not in aliases_of(AdamWSettings) and "eps" not in aliases_of(LionSettings)
    with pytest.raises(ValueError, match=r"option 'eps' is not a hyperparameter of 'lion' groups"):
        Rule(name="norms", algorithm="lion", names="*.bias", options={"eps": 1e-3})
    with pytest.raises(ValueError, match=r"option 'ns_eps' is not a hyperparameter of 'adamw' groups"):
        Rule(name="norms", algorithm="adamw", names="*.bias", options={"ns_eps": 1e-3})
    adaptive = Muon([{"params": [w], "algorithm": "adaptive_muon", "eps": 1e-3}]).param_groups[0]
    assert (adaptive["second_moment_eps"], adaptive["ns_eps"]) == (1e-3, None)  # Emerging-Optimizers' eps there
    with pytest.raises(HparamError, match=r"eps=1e-05 \(torch.optim.Muon's name for ns_eps\) and ns_eps=1e-06"):
        Muon([w], eps=1e-5, ns_eps=1e-6)
    with pytest.raises(HparamError, match=r"eps \(torch.optim.Muon's name for ns_eps\) must be a finite number"):
        Muon([w], eps=0.0)


def test_tensor_lr_under_step_lr_equals_the_float_lr():
    """A Tensor lr stays in the groups (StepLR fills it in place) and steps as its value does."""
    lrs = {"muon": 2.0**-7, "adamw": 2.0**-9}  # exact in float32, and so is every halving

    def train(as_tensor: bool) -> tuple[list[torch.Tensor], list]:
        gen = torch.Generator().manual_seed(2)
        w1, w2 = (nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((16, 8), (8, 16)))
        bias = nn.Parameter(torch.randn(8, generator=gen))
        given = {k: torch.tensor(v) if as_tensor else v for k, v in lrs.items()}
        groups = [{"params": [w1, w2], "algorithm": "muon"}, {"params": [bias], "algorithm": "adamw"}]
        groups[1]["lr"] = given["adamw"]
        optimizer = Muon(groups, lr=given["muon"], ns_dtype="float32")
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for _ in range(6):
            for p in (w1, w2, bias):
                p.grad = torch.randn(p.shape, generator=gen)
            optimizer.step()
            scheduler.step()
        if as_tensor:
            assert [g["lr"] for g in optimizer.param_groups] == [given["muon"], given["adamw"]]
            assert all(g["lr"] is given[g["algorithm"]] for g in optimizer.param_groups)  # filled, not replaced
        return [p.detach() for p in (w1, w2, bias)], [float(g["lr"]) for g in optimizer.param_groups]

    tensor_params, tensor_lrs = train(as_tensor=True)
    float_params, float_lrs = train(as_tensor=False)
    assert tensor_lrs == float_lrs == [lrs["muon"] / 8, lrs["adamw"] / 8]
    assert all(torch.equal(a, b) for a, b in zip(tensor_params, float_params))


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_builtin_algorithm_steps_a_tensor_lr_as_its_value(algorithm):
    results = []
    for lr in (torch.tensor(0.01), torch.tensor(0.01).item()):  # the float32 Tensor and its value
        gen = torch.Generator().manual_seed(3)
        weight = torch.randn(6, 10, generator=gen)
        if algorithm == "sinkhorn_muon":
            weight = sinkhorn_knopp(weight)  # its weights live on that set
        p = nn.Parameter(weight)
        optimizer = Muon([{"params": [p], "algorithm": algorithm, "lr": lr}], fp32_matmul_prec="highest")
        optimizer.train()  # Schedule-Free's groups step in train mode
        for _ in range(3):
            p.grad = torch.randn(p.shape, generator=gen)
            optimizer.step()
        assert isinstance(optimizer.param_groups[0]["lr"], type(lr))
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_tensor_lr_must_hold_one_floating_number():
    w = nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"Muon\(\): lr must be a number or a 1-element floating Tensor.*\(2,\)"):
        Muon([w], lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match=r"lr must be a number or a 1-element floating Tensor.*torch.int64"):
        Muon([w], lr=torch.tensor(1))
    with pytest.raises(ValueError, match=r"lr must be a finite number in \[0.0, inf\), got -0.001"):
        Muon([w], lr=torch.tensor(-1e-3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"adamw_lr must be a number or a 1-element floating Tensor"):
        Muon([w], adamw_lr=torch.zeros(2))
