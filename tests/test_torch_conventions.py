"""``Muon`` follows torch.optim's conventions: copies and pickles, state dicts named or not, hooks, dtype casting,
``zero_grad``, groups added later, empty and duplicate parameters, ``torch.compile``, a mixed group's lr.

Our own tests of each convention (torch's generic optimizer tests were the yardstick, not the source).
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn

import lightning_muon.muon as muon_module
import lightning_muon.routing.added_groups as added_groups
import lightning_muon.routing.checkpoint as checkpoint
from lightning_muon import LionSettings, Muon, MuonConfig, build_optimizers
from lightning_muon.algorithms import HparamError

pytestmark = pytest.mark.numerics


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)


def _grads(model: nn.Module, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=generator).to(p.dtype) for p in model.parameters()] for _ in range(steps)]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    optimizer.step()


def _hybrid(model: nn.Module, **kwargs) -> Muon:
    """Weights to Muon, biases and norms to AdamW, with settings off their defaults so a copy must carry them."""
    options = dict(lr=0.03, momentum=0.9, weight_decay=0.01, ns_dtype="float32", adamw_lr=2e-3, adamw_eps=1e-6)
    return Muon(model.parameters(), **{**options, **kwargs})


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------ copy and pickle


def _deepcopy(model: nn.Module, optimizer: Muon) -> tuple[nn.Module, Muon]:
    # Copied together, as torch's own tests and EMA/SWA helpers do: the copy's groups hold the copied parameters.
    return copy.deepcopy((model, optimizer))


def _pickle(model: nn.Module, optimizer: Muon) -> tuple[nn.Module, Muon]:
    return pickle.loads(pickle.dumps((model, optimizer)))


def _torch_save(model: nn.Module, optimizer: Muon) -> tuple[nn.Module, Muon]:
    buffer = io.BytesIO()
    torch.save((model, optimizer), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [_deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch_save"])
def test_a_copied_optimizer_steps_exactly_as_the_original(copier):
    model = _model()
    optimizer = _hybrid(model, settings=[LionSettings(lr=1e-4)])
    grads = _grads(model, 5)
    for g in grads[:2]:
        _step(model, optimizer, g)
    model_copy, copied = copier(model, optimizer)
    assert copied.settings == optimizer.settings and copied.state_settings == optimizer.state_settings
    assert copied.nonfinite == optimizer.nonfinite
    assert [{k: v for k, v in g.items() if k != "params"} for g in copied.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]
    for g in grads[2:]:
        _step(model, optimizer, g)
        _step(model_copy, copied, g)
    assert _same_params(model, model_copy)


def test_copies_of_the_optimizers_build_optimizers_returns_step_as_the_originals():
    model = _model()
    optimizers = build_optimizers(model, MuonConfig(state={"nonfinite": "skip"}))
    model_copy, copies = copy.deepcopy((model, optimizers))
    assert [c.nonfinite for c in copies] == ["skip"] * len(optimizers)
    for g in _grads(model, 3):
        for m, opts in ((model, optimizers), (model_copy, copies)):
            for p, grad in zip(m.parameters(), g):
                p.grad = grad.clone()
            for opt in opts:
                opt.step()
    assert _same_params(model, model_copy)


def test_a_copy_leaves_update_hooks_and_the_router_behind():
    model = _model()
    optimizer = _hybrid(model)
    seen = []
    optimizer.register_update_hook(lambda group, params, updates, ortho: seen.append(len(params)))
    optimizer.attach_router(lambda params, names: [])
    model_copy, copied = copy.deepcopy((model, optimizer))
    assert not copied.has_update_hooks and copied.router is None and copied.sharding is None
    _step(model_copy, copied, _grads(model, 1)[0])
    assert seen == []  # the original's hook did not run for the copy


def test_a_copy_that_lost_its_sharding_says_so_when_it_steps_with_several_processes(monkeypatch):
    model = _model()
    optimizer = _hybrid(model)
    optimizer._sharding = object()  # stands for an attached sharding: only its class name travels
    copied = copy.deepcopy(optimizer)
    optimizer._sharding = None
    assert copied.sharding is None and copied._lost_sharding == "object"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.warns(RuntimeWarning, match="copy .* of one that had a object, which does not travel"):
        muon_module._warn_lost_sharding(copied._lost_sharding)
    for p in copied.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    with pytest.warns(RuntimeWarning, match="steps every matrix on every rank"):
        copied.step()


# ------------------------------------------------------------------ state dicts, named and not


def _named_or_not(model: nn.Module, named: bool):
    return model.named_parameters() if named else model.parameters()


@pytest.mark.parametrize(("saved_named", "loaded_named"), [(True, False), (False, True), (True, True), (False, False)])
def test_state_dicts_load_named_or_not_in_the_hybrid(saved_named, loaded_named):
    model = _model()
    grads = _grads(model, 4)
    saved = Muon(_named_or_not(model, saved_named), ns_dtype="float32")
    for g in grads[:2]:
        _step(model, saved, g)
    twin = copy.deepcopy(model)
    loaded = Muon(_named_or_not(twin, loaded_named), ns_dtype="float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatched = checkpoint._warned_unnamed
        checkpoint._warned_unnamed = False
        try:
            # A copy, as a checkpoint on disk is: a state dict holds the optimizer's own tensors, and torch's
            # load keeps them where no cast is needed (torch.optim's optimizers alike).
            loaded.load_state_dict(copy.deepcopy(saved.state_dict()))
        finally:
            checkpoint._warned_unnamed = monkeypatched
    said = [str(w.message) for w in caught if "could not be checked by name" in str(w.message)]
    assert len(said) == (saved_named != loaded_named)
    if saved_named and not loaded_named:
        assert "this optimizer's parameters have no param_names" in said[0]
        # torch's rule: the saved names are taken over
        assert [g["param_names"] for g in loaded.param_groups] == [g["param_names"] for g in saved.param_groups]
    for g in grads[2:]:
        _step(model, saved, g)
        _step(twin, loaded, g)
    assert _same_params(model, twin)


def test_the_routing_check_runs_when_both_sides_are_named():
    model = _model()
    saved = Muon(model.named_parameters())
    # The same parameters under other groups: a routing that changed since the checkpoint.
    named = list(model.named_parameters())
    moved = Muon([{"params": named[:1], "algorithm": "adamw"}, {"params": named[1:], "algorithm": "adamw"}])
    with pytest.raises(ValueError, match="'0.weight' was routed to param group 0 'muon' .* when the checkpoint"):
        moved.load_state_dict(saved.state_dict())


def test_an_unnamed_state_dict_of_other_shapes_is_refused_by_shape():
    saved_model, other = _model(), nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 4))
    saved = Muon(saved_model.parameters())
    _step(saved_model, saved, _grads(saved_model, 1)[0])
    with pytest.raises(ValueError, match="parameter 0 of param group 0 has shape \\(12, 8\\)"):
        Muon(other.parameters()).load_state_dict(saved.state_dict())


@pytest.mark.parametrize(
    "params",
    [
        lambda w, b: [("w", w), b],
        lambda w, b: [{"params": [("w", w), b]}],
        lambda w, b: [{"params": [("w", w), b], "algorithm": "adamw"}],
    ],
    ids=["flat", "group", "group_with_algorithm"],
)
def test_named_and_unnamed_parameters_mixed_raise_value_error_as_torch_does(params):
    w, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="mixes \\(name, tensor\\) pairs with bare tensors"):
        Muon(params(w, b))


def test_load_state_dict_casts_the_state_to_each_parameters_dtype_as_torch_does():
    model = _model()
    saved = _hybrid(model)
    _step(model, saved, _grads(model, 1)[0])
    wide = _model(dtype=torch.float64)
    loaded = _hybrid(wide)
    loaded.load_state_dict(saved.state_dict())
    for p in wide.parameters():
        for key, value in loaded.state[p].items():
            expected = torch.float32 if key == "step" else torch.float64  # torch keeps a step count as it was
            assert value.dtype == expected, (key, value.dtype)


# ------------------------------------------------------------------ hooks, zero_grad, groups, edge cases


def test_step_pre_and_post_hooks_run_around_each_step():
    model = _model()
    optimizer = _hybrid(model)
    calls = []
    pre = optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt is optimizer)))
    post = optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt is optimizer)))
    _step(model, optimizer, _grads(model, 1)[0])
    pre.remove()
    post.remove()
    _step(model, optimizer, _grads(model, 1)[0])
    assert calls == [("pre", True), ("post", True)]


def test_zero_grad_sets_gradients_to_none_and_a_step_without_gradients_moves_nothing():
    model = _model()
    optimizer = _hybrid(model)
    _step(model, optimizer, _grads(model, 1)[0])
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is None for p in model.parameters())  # none were there to zero


def test_a_group_added_later_is_routed_and_steps():
    model, extra = _model(), nn.Linear(4, 6)
    optimizer = _hybrid(model)
    optimizer.add_param_group({"params": extra.parameters()})
    assert sorted(g["algorithm"] for g in optimizer.param_groups[-2:]) == ["adamw", "muon"]
    weight = extra.weight.detach().clone()
    extra.weight.grad, extra.bias.grad = torch.randn(6, 4), torch.randn(6)
    optimizer.step()
    assert not torch.equal(weight, extra.weight) and len(optimizer.state[extra.weight]) > 0


def test_empty_parameters_are_refused_and_duplicates_are_treated_as_torch_treats_them():
    with pytest.raises(ValueError, match="params is empty"):
        Muon([])
    w = nn.Parameter(torch.randn(4, 4))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        Muon([w, w])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        Muon([{"params": [w]}, {"params": [w]}])


# ------------------------------------------------------------------ torch.compile


def _warmed_up(nonfinite: str = "raise") -> tuple[nn.Module, Muon, list[list[torch.Tensor]]]:
    model = _model()
    optimizer = _hybrid(model, nonfinite=nonfinite)
    grads = _grads(model, 5)
    _step(model, optimizer, grads[0])  # the first step makes the state (checked on the host)
    return model, optimizer, grads


def test_the_default_step_compiles_without_graph_breaks():
    model, optimizer, grads = _warmed_up()
    for p, g in zip(model.parameters(), grads[1]):
        p.grad = g
    explained = torch._dynamo.explain(optimizer.step)()
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]


@pytest.fixture(scope="module")
def compiled_runs():
    """An eager and an inductor-compiled optimizer from one start, over the same gradients (compiled once)."""
    torch._dynamo.reset()
    eager_model, eager, grads = _warmed_up()
    model, optimizer, _ = _warmed_up()
    step = torch.compile(optimizer.step, backend="inductor")
    for g in grads[1:4]:
        _step(eager_model, eager, g)
        for p, grad in zip(model.parameters(), g):
            p.grad = grad.clone()
        step()
    return eager_model, eager, model, optimizer, step, grads


def test_a_compiled_step_equals_the_eager_step_to_float32_rounding(compiled_runs):
    eager_model, eager, model, optimizer, _, _ = compiled_runs
    for p, q in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        for key in eager.state[p]:
            torch.testing.assert_close(optimizer.state[q][key], eager.state[p][key], rtol=1e-6, atol=1e-7)


def test_a_compiled_step_with_a_non_finite_gradient_applies_nothing_and_raises_at_the_next_eager_step(compiled_runs):
    _, _, model, optimizer, step, grads = compiled_runs
    before = [p.detach().clone() for p in model.parameters()]
    state = {p: {k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()}
    bad = [g.clone() for g in grads[4]]
    bad[4][0, 1] = float("nan")  # the second Linear's weight
    for p, g in zip(model.parameters(), bad):
        p.grad = g
    step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for p in model.parameters():
        for key, value in state[p].items():
            assert torch.equal(optimizer.state[p][key], value), key
    culprit = "param group 0 \\('muon'\\), parameter 1 of shape \\(4, 16\\) in a compiled step"
    with pytest.raises(FloatingPointError, match=culprit):
        optimizer.step()  # eager: reads the compiled step's verdict first


def test_a_compiled_skip_step_warns_at_the_next_eager_step():
    model, optimizer, grads = _warmed_up(nonfinite="skip")
    bad = [g.clone() for g in grads[1]]
    bad[0][3, 3] = float("inf")
    for p, g in zip(model.parameters(), bad):
        p.grad = g
    before = [p.detach().clone() for p in model.parameters()]
    torch.compile(optimizer.step, backend="eager")()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.warns(RuntimeWarning, match="parameter 0 of shape \\(16, 8\\) and applied nothing"):
        optimizer.finite_checks.raise_pending()


# ------------------------------------------------------------------ a mixed group's lr


def test_a_constructed_group_that_mixes_algorithms_says_how_its_lr_reaches_each_part(monkeypatch):
    monkeypatch.setattr(added_groups, "_explained_lr", False)
    w, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    with pytest.warns(UserWarning, match="its adamw part \\(pg0.adamw\\) at lr 0.00015") as caught:
        optimizer = Muon([{"params": [w, b], "lr": 1e-2}], lr=0.02, adamw_lr=3e-4)
    assert caught[0].filename == __file__  # points at the Muon(...) call
    lrs = [(g["algorithm"], g["lr"]) for g in optimizer.param_groups]
    assert lrs == [("muon", 1e-2), ("adamw", 1e-2 * 3e-4 / 0.02)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([{"params": [w, b], "lr": 1e-2}])  # once per process
        Muon([{"params": [w], "lr": 1e-2}, {"params": [b], "lr": 1e-3}])  # one algorithm per group: as given


def test_a_setting_of_another_algorithm_in_a_group_is_refused_and_the_users_own_keys_stay():
    w, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    with pytest.raises(HparamError, match=r"\['eps'\] are settings of other algorithms, not of 'lion'") as err:
        Muon([{"params": [b], "algorithm": "lion", "eps": 1e-6}])  # Lion has no eps: it would be ignored
    assert err.value.field == "eps"
    with pytest.raises(HparamError, match=r"\['betas'\] are settings of other algorithms, not of 'muon'"):
        Muon([{"params": [w], "algorithm": "muon", "betas": (0.9, 0.95)}])
    # torch keeps any key of the user's own in a group (a layer id for layer-wise lr decay, a tag).
    optimizer = Muon([{"params": [w], "algorithm": "muon", "layer_id": 3}, {"params": [b], "layer_id": 4}])
    assert [g["layer_id"] for g in optimizer.param_groups] == [3, 4]


def test_load_state_dict_keeps_what_a_copy_leaves_behind():
    # torch's load_state_dict ends in __setstate__: hooks, router and sharding of a live optimizer stay.
    model = _model()
    optimizer = _hybrid(model)
    _step(model, optimizer, _grads(model, 1)[0])
    seen = []
    optimizer.register_update_hook(lambda group, params, updates, ortho: seen.append(len(params)))
    router = lambda params, names: []
    optimizer.attach_router(router)
    sharding = optimizer._sharding = object()  # stands for an attached sharding
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert optimizer.router is router and optimizer.sharding is sharding and optimizer.has_update_hooks
    optimizer._sharding = None
    _step(model, optimizer, _grads(model, 1, seed=2)[0])
    assert seen == [2]
