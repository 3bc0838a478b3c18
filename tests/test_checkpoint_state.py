"""What loading an optimizer state does besides loading it: nothing.

- torch's distributed checkpoint makes a new optimizer's state with one ``step()`` at zero
  gradients and lr 0 (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, hence every
  ``muon_fsdp`` resume). For each of the 14 algorithms, with the forms that act on a weight
  without the lr (Spel's projection, Sinkhorn-Muon's map, a fixed hyperball radius,
  PolarGrad's "independent" decay, Schedule-Free's eval mode), that step makes the state and
  changes no parameter, group key or mode (``lightning_muon.state_creation``). A first step
  at lr 0 with gradients is a step.
- ``muon_ddp`` saves every matrix's state gathered from its owner, in the memory layout the
  owner keeps it in (SOAP's eigenbases are column-major), so a resumed step multiplies in the
  same order, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from resume_modules import MATRIX, SCALAR, Lanes, config
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_muon import Muon
from lightning_muon.module import configure_muon_optimizers

pytestmark = [pytest.mark.policy_free]  # see conftest.py


def _groups_but_params(optimizer: Muon) -> list[dict]:
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]


def _one_algorithm(algorithm: str, **settings) -> tuple[Lanes, Muon]:
    """``Lanes`` and a ``Muon`` over the parameters the matrix routes to ``algorithm`` alone."""
    model = Lanes(config())
    groups = configure_muon_optimizers(model, config())["optimizer"].param_groups
    mine = [{k: v for k, v in g.items() if k != "param_names"} for g in groups if g["algorithm"] == algorithm]
    return model, Muon(mine, **settings)


@pytest.mark.parametrize("algorithm", MATRIX + SCALAR)
def test_the_loaders_state_creating_step_moves_nothing(algorithm):
    model, optimizer = _one_algorithm(algorithm)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = _groups_but_params(optimizer)
    state = get_optimizer_state_dict(model, optimizer)  # torch's step: zero gradients, lr 0
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, weights[n])]
    assert moved == [], f"{algorithm}: the state-creating step moved {moved}"
    assert _groups_but_params(optimizer) == groups  # lr, modes, Schedule-Free's k and weight_sum
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(optimizer.state[p] for p in params)  # the state a load fills in
    assert len(state["state"]) == len(params)
    assert all(p.grad is None for p in params)
    if algorithm == "adamw_schedulefree":
        assert [g["train_mode"] for g in optimizer.param_groups] == [False]  # still eval, as made


def test_the_state_creating_step_restores_master_copies():
    """bf16 weights with fp32 master copies (``main_params_dtype``): each copy is the weight's again."""
    model, optimizer = _one_algorithm("spel", main_params_dtype="float32")
    model.to(torch.bfloat16)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    get_optimizer_state_dict(model, optimizer)
    (p,) = optimizer.param_groups[0]["params"]
    name = next(n for n, q in model.named_parameters() if q is p)
    assert p.dtype == torch.bfloat16 and torch.equal(p, weights[name])
    assert torch.equal(optimizer.state[p]["main_param"], p.float())


def test_a_first_step_at_lr_zero_with_gradients_is_a_step():
    """Only zero gradients make the step torch's state creation: Spel projects its weights at lr 0 otherwise."""
    model, optimizer = _one_algorithm("spel")
    (p,) = optimizer.param_groups[0]["params"]
    before = p.detach().clone()
    optimizer.param_groups[0]["lr"] = 0.0
    p.grad = torch.ones_like(p)
    optimizer.step()
    assert not torch.equal(p, before)
    assert optimizer.state[p]["momentum_buffer"].abs().max() > 0


def test_muon_ddp_gathers_state_in_its_memory_layout(tmp_path):
    """The full state ``muon_ddp`` saves keeps SOAP's column-major eigenbases column-major."""
    from lightning_muon.distributed.ddp import MuonDDPSharding

    dist.init_process_group("gloo", (tmp_path / "rendezvous").as_uri(), rank=0, world_size=1)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(9, 8))
    optimizer = Muon([{"params": [p], "algorithm": "soap"}])
    sharding = MuonDDPSharding(optimizer)
    for _ in range(2):
        p.grad = torch.randn(9, 8)
        optimizer.step()
    live = optimizer.state[p]
    assert not live["Q_L"].is_contiguous()  # QR's and eigh's bases: column-major
    (gathered,) = sharding.gather_states()
    assert gathered.keys() == live.keys()
    for key, value in live.items():
        assert torch.equal(gathered[key], value), key
        assert gathered[key].stride() == value.stride(), key
        assert gathered[key].data_ptr() != value.data_ptr(), key  # a copy
