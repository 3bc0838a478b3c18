"""The sharding protocol and update hooks, on one process: what ``Muon`` asks of a ``Sharding``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_muon import Muon
from lightning_muon.distributed.planning import plan_ownership
from lightning_muon.distributed.protocol import Sharding


def _model() -> tuple[list[nn.Parameter], Muon]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5, 6)), nn.Parameter(torch.randn(5))]
    return params, Muon(params, lr=0.05, ns_dtype="float32", adamw_lr=0.01)


def _grads(params: list[nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _one_rank_sharding(opt: Muon) -> Sharding:
    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    return Sharding(opt, muon, plan_ownership([p.shape for p in muon], 1), rank=0, world_size=1)


def test_base_sharding_of_one_rank_steps_like_no_sharding():
    plain_params, plain = _model()
    params, opt = _model()
    sharding = _one_rank_sharding(opt)
    assert opt.sharding is sharding and sharding.plan.owners == (0, 0)
    assert all(sharding.stepped(p) is p for p in params)  # the AdamW bias is no Muon parameter: stepped here
    for step in range(3):
        _grads(plain_params, step)
        _grads(params, step)
        plain.step()
        opt.step()
    for a, b in zip(params, plain_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt.attach_sharding(None)
    assert opt.sharding is None


class _CountingSharding(Sharding):
    """A user-written sharding: whole tensors on one rank, every per-matrix job counted through ``map_whole``."""

    def __init__(self, opt: Muon) -> None:
        muon = [p for g in opt.param_groups if g["algorithm"] != "adamw" for p in g["params"]]
        self.calls: list[int] = []
        super().__init__(opt, muon, plan_ownership([p.shape for p in muon], 1), rank=0, world_size=1)

    def map_whole(self, params, tensors, fn, **kwargs):
        self.calls.append(len(params))
        return super().map_whole(params, tensors, fn, **kwargs)


@pytest.mark.parametrize("algorithm", ["muon", "mop", "spel"])
def test_every_per_matrix_job_runs_through_map_whole(algorithm):
    torch.manual_seed(0)
    plain_params = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5, 6))]
    params = [nn.Parameter(p.detach().clone()) for p in plain_params]
    plain = Muon([{"params": plain_params, "algorithm": algorithm}])
    opt = Muon([{"params": params, "algorithm": algorithm}])
    sharding = _CountingSharding(opt)
    for step in range(2):
        _grads(plain_params, step)
        _grads(params, step)
        plain.step()
        opt.step()
    # Newton-Schulz (muon), the SVD (mop), and for spel the update's and the weight's projection.
    assert sharding.calls == [2] * (4 if algorithm == "spel" else 2)
    for a, b in zip(params, plain_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_base_sharding_agrees_on_finiteness_and_names_the_parameter():
    params, opt = _model()
    _one_rank_sharding(opt)  # attached: the agreement goes through it
    _grads(params, 0)
    params[1].grad[2, 3] = float("inf")
    verdict = opt.finite_checks.agree()
    assert not verdict.finite and not verdict.local_finite
    assert verdict.culprit == "param group 0 ('muon'), parameter 1 of shape (5, 6)"
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in param group 0 \('muon'\), parameter 1"):
        opt.step()  # uses the agreement made above, then forgets it
    params[1].grad.zero_()
    assert opt.finite_checks.agree().finite  # a new agreement: the gradients are finite now


def test_a_sharding_attaches_only_to_its_own_optimizer():
    _, opt = _model()
    sharding = _one_rank_sharding(opt)
    _, other = _model()
    with pytest.raises(ValueError, match="built for another optimizer"):
        other.attach_sharding(sharding)
    with pytest.raises(ValueError, match="plan has 1 owners for 2 parameters"):
        Sharding(opt, sharding.params, plan_ownership([(6, 4)], 1), rank=0, world_size=1)


def test_update_hooks_run_in_order_and_are_removable():
    params, opt = _model()
    calls: list[tuple[str, int]] = []
    first = opt.register_update_hook(lambda group, ps, updates, ortho: calls.append(("first", len(ps))))
    opt.register_update_hook(lambda group, ps, updates, ortho: calls.append(("second", len(ortho))))
    assert opt.has_update_hooks
    _grads(params, 0)
    opt.step()
    assert calls == [("first", 2), ("second", 2)]  # one Muon group of two matrices; AdamW groups run none
    first.remove()
    _grads(params, 1)
    opt.step()
    assert calls[2:] == [("second", 2)]
