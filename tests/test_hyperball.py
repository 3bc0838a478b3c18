"""MuonHyperball (``"muon_hyperball"`` groups): its formula against a float64 reference, the sphere, its checks.

Under MuonDDPSharding (DDP) and MuonFSDPSharding (FSDP2) on two ranks: test_update_rules_distributed.py.
"""

from __future__ import annotations

import io

import pytest
import torch
from muon_reference import hyperball64, random_tensors, run_steps
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon, MuonConfig, MuonHyperballSettings

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

HB = "muon_hyperball"
HP = dict(lr=0.05, momentum=0.9, weight_decay=0.1)


def hyperball(params, **settings) -> Muon:
    """A ``Muon`` whose muon_hyperball groups start from ``MuonHyperballSettings(**settings)`` (Muon's own
    keywords set "muon" groups only)."""
    return Muon(params, settings=[MuonHyperballSettings(**settings)])


def _norm(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.detach().double()).item()


@pytest.mark.parametrize("radius", [None, 3.0])
@pytest.mark.parametrize("shape", [(16, 16), (24, 12), (12, 24), (8, 3, 3, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_float64_reference(radius, shape, dtype):
    """8 steps of momentum, Newton-Schulz, decay, normalized update and renormalized weight, vs the formula."""
    (W0,) = random_tensors([shape], seed=2, dtype=torch.float64)
    grads = [random_tensors([shape], seed=10 + t, dtype=torch.float64)[0] for t in range(8)]
    p = nn.Parameter(W0.to(dtype, copy=True))
    ns_dtype = "float32" if dtype == torch.float32 else None  # None keeps float64 in float64
    # adjust_lr scales O before it is normalized: it must change nothing (the reference has none).
    group = {"params": [p], "algorithm": HB, "hyperball_radius": radius, "adjust_lr": "match_rms_adamw"}
    opt = hyperball([group], **HP, ns_dtype=ns_dtype)
    run_steps(opt, [p], [[g.to(dtype)] for g in grads])
    W_ref, B_ref = hyperball64(W0, grads, **HP, radius=radius)
    # float64: the same math, the new norm by expansion instead of directly: rounding only.
    # float32 against float64: Newton-Schulz amplifies float32 rounding as for Muon (its
    # reference test: ~1e-5 over 10 steps); normalizing only rescales that error.
    atol = 1e-12 if dtype == torch.float64 else 1e-5
    assert_close(p.detach().double(), W_ref, atol=atol, rtol=0)
    assert_close(opt.state[p]["momentum_buffer"].double(), B_ref, atol=atol, rtol=0)
    assert (W_ref - W0).abs().max() > 0.1  # the parameters did move
    # On the sphere: the radius, or the first norm shrunk by the decay, (1 - lr wd) per step.
    R = radius if radius is not None else _norm(W0) * (1 - HP["lr"] * HP["weight_decay"]) ** 8
    assert _norm(p) == pytest.approx(R, rel=1e-6)


def test_split_matrices_are_orthogonalized_apart_and_normalized_together():
    """A fused QKV (split_sizes) orthogonalizes each piece; the norms span the whole parameter."""
    (W0,) = random_tensors([(12, 4)], seed=3, dtype=torch.float64)
    grads = [random_tensors([(12, 4)], seed=30 + t, dtype=torch.float64)[0] for t in range(5)]
    p = nn.Parameter(W0.clone())
    opt = hyperball([{"params": [p], "algorithm": HB, "split_sizes": [2, 1, 1]}], **HP)
    run_steps(opt, [p], [[g] for g in grads])
    W_ref, _ = hyperball64(W0, grads, **HP, split_sizes=[2, 1, 1])
    assert_close(p.detach(), W_ref, atol=1e-12, rtol=0)


def test_every_kind_of_parameter_stays_on_its_sphere():
    """A matrix, a conv, a batch of experts (each expert on its own sphere) and a channels_last conv."""
    torch.manual_seed(0)
    params = [
        nn.Parameter(torch.randn(6, 5)),
        nn.Parameter(torch.randn(4, 2, 3, 3)),
        nn.Parameter(torch.randn(3, 4, 5)),
        nn.Parameter(torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)),
    ]
    before = [_norm(p) for p in params]
    experts_before = [_norm(e) for e in params[2]]
    opt = hyperball(
        [
            {"params": [params[0], params[1], params[3]], "algorithm": HB},
            {"params": [params[2]], "algorithm": HB, "batched": True},
        ],
        lr=0.1,
        ns_dtype="float32",
    )
    for _ in range(6):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p, norm in zip(params, before):
        assert _norm(p) == pytest.approx(norm, rel=1e-6)
    assert [_norm(e) for e in params[2]] == pytest.approx(experts_before, rel=1e-6)
    assert params[3].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("radius", [None, 2.0])
@pytest.mark.parametrize("grads", ["random", "zero"])
def test_zero_lr_step_changes_nothing(radius, grads):
    """At lr = 0 nothing moves but a fixed radius's rescale before the first step; with zero gradients
    the step is DCP's state creation (a resume's), and that moves nothing at all."""
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(5, 4))
    before = p.detach().clone()
    group = {"params": [p], "algorithm": HB, "hyperball_radius": radius}
    opt = hyperball([group], lr=0.0, weight_decay=0.1, ns_dtype="float32")
    for _ in range(2):
        p.grad = torch.randn_like(p) if grads == "random" else torch.zeros_like(p)
        opt.step()
    if radius is None or grads == "zero":
        assert torch.equal(p.detach(), before)
    else:  # rescaled onto the sphere before the first step, then left alone
        assert_close(p.detach(), before * (2.0 / _norm(before)), atol=1e-6, rtol=0)


def test_a_fixed_radius_resumes_exactly():
    """The rescale onto the sphere happens once, before a parameter's first step, never again on resume."""
    torch.manual_seed(2)
    W0 = torch.randn(6, 4)
    grads = [torch.randn(6, 4) for _ in range(6)]

    def make(w):
        p = nn.Parameter(w.clone())
        return p, hyperball([{"params": [p], "algorithm": HB, "hyperball_radius": 1.5}], ns_dtype="float32")

    p, opt = make(W0)
    run_steps(opt, [p], [[g] for g in grads[:3]])
    buf = io.BytesIO()
    torch.save({"w": p.detach(), "opt": opt.state_dict()}, buf)
    run_steps(opt, [p], [[g] for g in grads[3:]])
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    q, resumed = make(saved["w"])
    resumed.load_state_dict(saved["opt"])
    run_steps(resumed, [q], [[g] for g in grads[3:]])
    assert torch.equal(p, q)
    assert resumed.param_groups[0]["hyperball_radius"] == 1.5


def test_config_trains_hidden_matrices_with_it():
    """MuonConfig's matrix section (MuonHyperballSettings) routes the hidden matrices to it and sets its radius."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 16))
    config = MuonConfig(matrix=MuonHyperballSettings(hyperball_radius=2.0))
    optimizer, _ = config.build(model)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups[HB]["algorithm"] == HB and groups[HB]["hyperball_radius"] == 2.0
    assert [p.shape for p in groups[HB]["params"]] == [torch.Size([8, 8])]  # the head and embedding: AdamW
    assert MuonConfig.from_any(config.to_dict()) == config


def test_an_all_zero_parameter_is_refused_by_name():
    w = nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 \('w'\): muon_hyperball .* \(4, 3\) is all"):
        Muon([{"params": [("w", w)], "algorithm": HB}])


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"hyperball_radius": 0.0}, r"hyperball_radius must be a finite number in \(0.0, inf\), got 0.0"),
        ({"hyperball_radius": float("inf")}, r"hyperball_radius must be a finite number .* got inf"),
        ({"hyperball_eps": -1e-8}, r"hyperball_eps must be a finite number in \(0.0, inf\), got -1e-08"),
        # It decays before it measures the radius: decoupled decay only.
        ({"weight_decay_method": "cautious"}, r"weight_decay_method must be one of \('decoupled',\), got 'cautious'"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(settings, match):
    """In a param group, in MuonHyperballSettings and in a config's matrix section."""
    w = nn.Parameter(torch.ones(4, 3))
    (field,) = settings
    with pytest.raises(ValueError, match=r"param group 0: " + match) as info:
        Muon([{"params": [w], "algorithm": HB, **settings}])
    assert info.value.field == field
    with pytest.raises(ValueError, match=r"MuonHyperballSettings\." + match) as info:
        MuonHyperballSettings(**settings)
    assert info.value.field == field
    with pytest.raises(ValueError, match=r"MuonConfig\.matrix: " + match) as info:
        MuonConfig(matrix={"class_path": "MuonHyperballSettings", "init_args": settings})
    assert info.value.field == field
