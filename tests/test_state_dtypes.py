"""Narrower optimizer state under Megatron-Core's names: ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``main_params_dtype``.

bf16 moments are stored in bf16 and computed in float32: one step equals a float32 step
whose buffers are rounded to bf16 afterwards (hand-written references for AdamW and Muon's
momentum). Master copies of bf16 parameters step like float32 parameters. Checkpoints
round-trip, and a checkpoint saved with other dtypes is cast. Every Newton-Schulz here is
pinned to float32, so nothing depends on the host's bf16 policy.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from param_sets import gpt_parameters
from torch import nn

from lightning_muon import (
    Muon,
    MuonConfig,
    MuonHyperballSettings,
    ScheduleFreeSettings,
    ScheduleSettings,
    StateSettings,
)
from lightning_muon.algorithms import HparamError
from lightning_muon.distributed.planning import plan_ownership
from lightning_muon.distributed.protocol import Sharding

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

BF16 = {"exp_avg_dtype": "bfloat16", "exp_avg_sq_dtype": "bfloat16"}


def _grads(params: list[torch.Tensor], seed: int, dtype: torch.dtype | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype or p.dtype)


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(12, 8), (8, 12), (10,), (6,)]
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _hybrid(params: list[nn.Parameter], **kwargs) -> Muon:
    """Two Muon matrices (NorMuon second moment), an AdamW vector and a Lion vector."""
    groups = [
        {"params": params[:2], "algorithm": "muon"},
        {"params": [params[2]], "algorithm": "adamw"},
        {"params": [params[3]], "algorithm": "lion"},
    ]
    return Muon(groups, ns_dtype="float32", second_moment="normuon", **kwargs)


def _dtypes(opt: Muon, p: torch.Tensor) -> dict[str, torch.dtype]:
    return {k: v.dtype for k, v in opt.state[p].items() if k != "step"}


# -------------------------------------------------------------- dtypes and sizes


def test_state_is_stored_in_the_configured_dtypes():
    for settings, first, second in [({}, torch.float32, torch.float32), (BF16, torch.bfloat16, torch.bfloat16)]:
        params = _params()
        opt = _hybrid(params, **settings)
        _grads(params, 1)
        opt.step()
        assert _dtypes(opt, params[0]) == {"momentum_buffer": first, "second_moment": second}
        assert _dtypes(opt, params[2]) == {"exp_avg": first, "exp_avg_sq": second}
        assert _dtypes(opt, params[3]) == {"exp_avg": first}
    # Each setting alone; the parameters stay float32.
    params = _params()
    opt = _hybrid(params, exp_avg_sq_dtype="bf16")
    _grads(params, 1)
    opt.step()
    assert _dtypes(opt, params[0]) == {"momentum_buffer": torch.float32, "second_moment": torch.bfloat16}
    assert _dtypes(opt, params[2]) == {"exp_avg": torch.float32, "exp_avg_sq": torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in params)


def test_state_is_never_wider_than_its_parameter():
    # "float32" keeps torch.optim's dtypes: a float64 parameter's state in float64, a bf16
    # parameter's in bf16; "bfloat16" narrows a float64 parameter's state too.
    for dtype, settings, expected in [
        (torch.float64, {}, torch.float64),
        (torch.bfloat16, {}, torch.bfloat16),
        (torch.float64, BF16, torch.bfloat16),
    ]:
        params = _params(dtype=dtype)
        opt = _hybrid(params, **settings)
        _grads(params, 1)
        opt.step()
        assert set(_dtypes(opt, params[0]).values()) == {expected}
        assert set(_dtypes(opt, params[2]).values()) == {expected}


def _state_bytes(opt: Muon) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.ndim)


def test_bf16_state_is_a_quarter_of_adamws_for_a_gpt():
    """Muon's bf16 momentum is 1/4 of AdamW's two fp32 moments; AdamW's two bf16 moments 1/2 of them.

    Overall <= 0.26 of an all-AdamW fp32 optimizer where the hidden matrices dominate (d=384 x 4
    with a 256-token vocabulary: embedding and head are 2.8% of the parameters); at d=64 x 2
    they are a quarter of them and the ratio is 0.31.
    """
    ratios = {}
    for d, layers in [(64, 2), (384, 4)]:
        hidden, other = gpt_parameters(d, layers, torch.device("cpu"))
        adamw = Muon([{"params": hidden + other, "algorithm": "adamw"}])
        hybrid = Muon(
            [{"params": hidden, "algorithm": "muon"}, {"params": other, "algorithm": "adamw"}],
            ns_dtype="float32",
            ns_steps=1,
            **BF16,
        )
        adamw.step()
        hybrid.step()
        by_part = {}
        for name, part in (("hidden", hidden), ("other", other)):
            ours = sum(v.numel() * v.element_size() for p in part for v in hybrid.state[p].values() if v.ndim)
            theirs = sum(v.numel() * v.element_size() for p in part for v in adamw.state[p].values() if v.ndim)
            by_part[name] = ours / theirs
        assert by_part == {"hidden": 0.25, "other": 0.5}
        ratios[(d, layers)] = _state_bytes(hybrid) / _state_bytes(adamw)
    assert ratios[(384, 4)] <= 0.26
    assert 0.30 < ratios[(64, 2)] < 0.32


# -------------------------------------------------------------- numerics: fp32 arithmetic, bf16 storage


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16, back in float32."""
    return t.to(torch.bfloat16).float()


def test_adamw_step_equals_a_float32_step_with_rounded_moments():
    lr, (beta1, beta2), eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.1
    gen = torch.Generator().manual_seed(0)
    w0, g = torch.randn(7, 5, generator=gen), torch.randn(7, 5, generator=gen)
    m0, v0 = _bf16(torch.randn(7, 5, generator=gen)), _bf16(torch.rand(7, 5, generator=gen))
    p = nn.Parameter(w0.clone())
    opt = Muon(
        [{"params": [p], "algorithm": "adamw"}],
        adamw_lr=lr, adamw_betas=(beta1, beta2), adamw_eps=eps, adamw_weight_decay=wd, **BF16,
    )  # fmt: skip
    opt.state[p].update(step=torch.tensor(3.0), exp_avg=m0.bfloat16(), exp_avg_sq=v0.bfloat16())
    p.grad = g.clone()
    opt.step()
    # By hand, in float32 from the stored (bf16) moments; the moments are rounded once at the end.
    m = m0.lerp(g, 1 - beta1)
    v = v0 * beta2 + (1 - beta2) * g * g
    t = 4
    denom = (v.sqrt() / (1 - beta2**t) ** 0.5) + eps
    w = w0 * (1 - lr * wd) - (lr / (1 - beta1**t)) * m / denom
    torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-7)
    assert torch.equal(opt.state[p]["exp_avg"], m.bfloat16())
    assert torch.equal(opt.state[p]["exp_avg_sq"], v.bfloat16())
    assert opt.state[p]["step"].item() == 4.0


def test_adamw_and_lion_equal_float32_runs_whose_moments_are_rounded_every_step():
    """Ten steps, bit for bit: torch.optim.AdamW and our float32 Lion, each buffer rounded to bf16 after every step."""
    params, ref_params = _params(), _params()
    ours = Muon([{"params": [params[2]], "algorithm": "adamw"}, {"params": [params[3]], "algorithm": "lion"}], **BF16)
    torch_adamw = torch.optim.AdamW([ref_params[2]], lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    lion = Muon([{"params": [ref_params[3]], "algorithm": "lion"}])
    for t in range(10):
        _grads([params[2], params[3]], t)
        _grads([ref_params[2], ref_params[3]], t)
        ours.step()
        torch_adamw.step()
        lion.step()
        for state in (torch_adamw.state[ref_params[2]], lion.state[ref_params[3]]):
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key].copy_(_bf16(state[key]))
        assert torch.equal(params[2], ref_params[2]) and torch.equal(params[3], ref_params[3]), t
    assert torch.equal(ours.state[params[2]]["exp_avg_sq"].float(), torch_adamw.state[ref_params[2]]["exp_avg_sq"])


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_momentum_step_is_computed_in_float32_and_rounded_once(nesterov):
    mu = 0.95
    gen = torch.Generator().manual_seed(0)
    w0, g, b0 = (torch.randn(12, 8, generator=gen) for _ in range(3))
    b0 = _bf16(b0)
    p, ref = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    kwargs = dict(lr=0.02, momentum=mu, nesterov=nesterov, weight_decay=0.1, ns_dtype="float32")
    ours = Muon([p], **kwargs, exp_avg_dtype="bfloat16")
    plain = Muon([ref], **kwargs)  # the float32 reference, from the same (bf16-representable) buffer
    ours.state[p]["momentum_buffer"] = b0.bfloat16()
    plain.state[ref]["momentum_buffer"] = b0.clone()
    seen = []
    ours.register_update_hook(lambda group, params, updates, ortho: seen.append(updates[0].clone()))
    p.grad, ref.grad = g.clone(), g.clone()
    ours.step()
    plain.step()
    # By hand: B <- mu B + (1 - mu) G in float32, U = (1 - mu) G + mu B (Nesterov) or B, B stored rounded.
    b = b0.lerp(g, 1 - mu)
    update = g.lerp(b, mu) if nesterov else b
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], update)
    assert torch.equal(ours.state[p]["momentum_buffer"], b.bfloat16())
    assert torch.equal(plain.state[ref]["momentum_buffer"], b)
    assert torch.equal(p, ref)  # the same float32 update, orthogonalized and applied alike


def test_normuon_second_moment_is_computed_in_float32_and_rounded_once():
    params, ref_params = _params()[:2], _params()[:2]
    ours = Muon(params, ns_dtype="float32", second_moment="normuon", exp_avg_sq_dtype="bfloat16")
    plain = Muon(ref_params, ns_dtype="float32", second_moment="normuon")
    for t in range(5):
        _grads(params, t)
        _grads(ref_params, t)
        ours.step()
        plain.step()
        for p, ref in zip(params, ref_params):
            assert torch.equal(ours.state[p]["second_moment"], plain.state[ref]["second_moment"].bfloat16()), t
            assert torch.equal(p, ref), t
            plain.state[ref]["second_moment"].copy_(_bf16(plain.state[ref]["second_moment"]))


# -------------------------------------------------------------- main_params_dtype


def test_bf16_parameters_step_on_float32_master_copies():
    """With main_params_dtype="float32" a bf16 run is the float32 run of the same gradients, rounded into bf16."""
    params = _params(dtype=torch.bfloat16)
    ref_params = [nn.Parameter(p.detach().float()) for p in params]
    opt = _hybrid(params, main_params_dtype="float32")
    plain = _hybrid(ref_params)
    for t in range(4):
        _grads(params, t)
        for p, ref in zip(params, ref_params):
            ref.grad = p.grad.float()
        opt.step()
        plain.step()
    for p, ref in zip(params, ref_params):
        assert p.dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["main_param"], ref.detach())
        assert torch.equal(p.detach(), ref.detach().bfloat16())
        assert {v.dtype for k, v in opt.state[p].items() if k != "step"} == {torch.float32}
    assert len(opt.state) == len(params)  # no master copy left under a key of its own
    # Without master copies the bf16 parameters drift from the float32 run.
    bare = _params(dtype=torch.bfloat16)
    plain_bare = _hybrid(bare)
    for t in range(4):
        _grads(bare, t)
        plain_bare.step()
    assert not all(torch.equal(b, p) for b, p in zip(bare, params))


def test_master_copies_with_bf16_moments_and_no_effect_on_float32_parameters():
    params = _params(dtype=torch.bfloat16)
    opt = _hybrid(params, main_params_dtype="float32", **BF16)
    _grads(params, 0)
    opt.step()
    assert _dtypes(opt, params[0]) == {
        "main_param": torch.float32,
        "momentum_buffer": torch.bfloat16,
        "second_moment": torch.bfloat16,
    }
    # float32 parameters: nothing changes, bit for bit.
    a, b = _params(), _params()
    with_main, without = _hybrid(a, main_params_dtype="float32"), _hybrid(b)
    for t in range(3):
        _grads(a, t)
        _grads(b, t)
        with_main.step()
        without.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all("main_param" not in with_main.state[p] for p in a)


def test_master_copies_are_refused_under_a_sharding():
    params = _params(dtype=torch.bfloat16)[:2]
    opt = Muon(params, ns_dtype="float32", main_params_dtype="float32")
    Sharding(opt, params, plan_ownership([p.shape for p in params], 1), rank=0, world_size=1)
    _grads(params, 0)
    with pytest.raises(HparamError, match=r"main_params_dtype='float32' .* under a sharding") as info:
        opt.step()
    assert info.value.field == "main_params_dtype"
    assert not opt.state or all("main_param" not in st for st in opt.state.values())


def test_hyperball_takes_its_radius_on_the_master_copy():
    params = _params(dtype=torch.bfloat16)[:2]
    opt = Muon(
        [{"params": params, "algorithm": "muon_hyperball", "hyperball_radius": 3.0}],
        settings=[MuonHyperballSettings(ns_dtype="float32")],  # Muon's own keywords set "muon" groups only
        main_params_dtype="float32",
    )
    _grads(params, 0)
    opt.step()
    for p in params:
        assert torch.linalg.vector_norm(opt.state[p]["main_param"]).item() == pytest.approx(3.0, rel=1e-5)


# -------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("name", "value", "choices"),
    [
        ("exp_avg_dtype", "float16", r"\('float32', 'bfloat16'\)"),
        ("exp_avg_sq_dtype", torch.float64, r"\('float32', 'bfloat16'\)"),
        ("main_params_dtype", "bfloat16", r"\(None, 'float32'\)"),
    ],
)
def test_a_bad_value_names_the_setting_and_its_choices(name, value, choices):
    with pytest.raises(HparamError, match=rf"^{name} must be one of {choices}, got") as info:
        Muon([nn.Parameter(torch.ones(4, 4))], **{name: value})
    assert info.value.field == name
    for make in (lambda: StateSettings(**{name: value}), lambda: MuonConfig(state={name: value})):
        with pytest.raises(HparamError, match=rf"^{name} must be one of {choices}, got") as info:
            make()
        assert info.value.field == name


def test_names_are_normalized_and_flow_from_muon_config():
    config = MuonConfig(
        state=StateSettings(exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16", main_params_dtype="float32")
    )
    assert (config.state.exp_avg_dtype, config.state.main_params_dtype) == ("bfloat16", "float32")
    keywords = dataclasses.asdict(config.state)  # the state section's fields are Muon's keywords
    assert {k: keywords[k] for k in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")} == {
        "exp_avg_dtype": "bfloat16",
        "exp_avg_sq_dtype": "bfloat16",
        "main_params_dtype": "float32",
    }
    assert Muon([nn.Parameter(torch.ones(4, 4))], **keywords).state_settings == config.state
    aliases = StateSettings(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype="bf16", main_params_dtype="fp32")
    assert (aliases.exp_avg_dtype, aliases.exp_avg_sq_dtype, aliases.main_params_dtype) == (
        "bfloat16",
        "bfloat16",
        "float32",
    )
    optimizer, _ = config.build(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8)))
    assert optimizer.state_settings.exp_avg_dtype == "bfloat16"


def test_an_algorithm_that_does_not_take_a_setting_is_refused():
    pytest.importorskip("schedulefree")
    gain = nn.Parameter(torch.ones(4))
    with pytest.raises(HparamError, match=r"exp_avg_sq_dtype='bfloat16' does not apply to 'adamw_schedulefree'"):
        Muon([{"params": [gain], "algorithm": "adamw_schedulefree"}], exp_avg_sq_dtype="bfloat16")
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8))
    config = MuonConfig(
        scalar=ScheduleFreeSettings(),
        state=StateSettings(main_params_dtype="float32"),
        schedule=ScheduleSettings(warmup=0),
    )
    with pytest.raises(HparamError, match=r"main_params_dtype='float32' does not apply") as info:
        config.build(model)
    assert info.value.field == "main_params_dtype"


# -------------------------------------------------------------- checkpoints


def _run(opt: Muon, params: list[torch.Tensor], steps: range) -> None:
    for t in steps:
        _grads(params, t)
        opt.step()


def test_checkpoint_round_trip_with_bf16_state():
    params, twin = _params(), _params()
    opt = _hybrid(params, **BF16)
    _run(opt, params, range(3))
    saved = copy.deepcopy(opt.state_dict())  # as written to disk: no tensor shared with the live state
    assert saved["state"][0]["momentum_buffer"].dtype == torch.bfloat16
    for p, q in zip(params, twin):
        q.data.copy_(p.data)
    resumed = _hybrid(twin, **BF16)
    resumed.load_state_dict(saved)
    for p, q in zip(params, twin):
        assert _dtypes(opt, p) == _dtypes(resumed, q)
        assert all(torch.equal(opt.state[p][k], resumed.state[q][k]) for k in opt.state[p])
    _run(opt, params, range(3, 6))
    _run(resumed, twin, range(3, 6))
    assert all(torch.equal(p, q) for p, q in zip(params, twin))


def test_checkpoint_with_float32_state_is_cast_on_load():
    params = _params()
    opt = _hybrid(params)
    _run(opt, params, range(2))
    saved = opt.state_dict()
    narrow = _hybrid(params, **BF16)
    narrow.load_state_dict(saved)
    for p in params:
        for key, value in narrow.state[p].items():
            if key != "step":
                assert value.dtype == torch.bfloat16
                assert torch.equal(value, opt.state[p][key].bfloat16())
    # And back: a bf16-state checkpoint into a float32-state optimizer (exactly: bf16 fits in fp32).
    wide = _hybrid(params)
    wide.load_state_dict(narrow.state_dict())
    assert _dtypes(wide, params[0]) == {"momentum_buffer": torch.float32, "second_moment": torch.float32}
    assert torch.equal(wide.state[params[0]]["momentum_buffer"], narrow.state[params[0]]["momentum_buffer"].float())


def test_checkpoint_keeps_master_copies_in_float32():
    params = _params(dtype=torch.bfloat16)
    opt = _hybrid(params, main_params_dtype="float32")
    _run(opt, params, range(2))
    saved = opt.state_dict()
    resumed = _hybrid(params, main_params_dtype="float32")
    resumed.load_state_dict(saved)
    for p in params:
        # torch's load casts state to the parameter's dtype (bf16); the master copy comes back whole.
        assert resumed.state[p]["main_param"].dtype == torch.float32
        assert torch.equal(resumed.state[p]["main_param"], opt.state[p]["main_param"])
        assert resumed.state[p]["main_param"] is not saved["state"][0]["main_param"]
    # An optimizer without master copies drops them and keeps the state in the parameters' dtype.
    bare = _hybrid(params)
    bare.load_state_dict(saved)
    assert all("main_param" not in bare.state[p] for p in params)
    assert set(_dtypes(bare, params[0]).values()) == {torch.bfloat16}
