"""The step torch's distributed checkpoint takes to create optimizer state: told apart, and made to move nothing.

To load a saved optimizer state into an optimizer that has none yet,
``torch.distributed.checkpoint.state_dict`` (``get_optimizer_state_dict`` and
``set_optimizer_state_dict``, under Lightning's ``muon_fsdp`` and ``ModelParallelStrategy``
resume and Fabric's alike) first makes the state: it gives every parameter a zero gradient,
sets every group's lr to 0 and calls ``step()`` once (``_init_optim_state``). torch skips that
step only when the optimizer has state already, and every algorithm makes its state in its
first step, so the step runs. Most updates scale with the lr and leave the weights as they
are, but not all: Spel's projection and Sinkhorn-Muon's map act on the weight itself, a fixed
hyperball radius rescales a weight before its first step, ``weight_decay_method=
"independent"`` decays by ``1 - wd``, and a new optimizer's Schedule-Free groups are in eval
mode, where a step is refused. Lightning has loaded the weights by then, so any of these
would resume from other weights.

``Muon.step`` tells that step apart (``is_state_creation``) and runs it inside
``StateCreation``: the groups step as in a first step, so each algorithm makes its state the
way it always does, and ``StepContext.creates_state`` lets Schedule-Free step its groups
whatever their mode; afterwards every parameter (and fp32 master copy) and every group key
(lr, mode, Schedule-Free's step count) holds what it held before, bit for bit. The state
keeps what a first step from zero gradients made of it, as torch's own optimizers' does; a
checkpoint load then overwrites it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.algorithms.state_dtypes import MAIN_PARAM
from lightning_muon.distributed.comm import all_reduce_

__all__ = ["StateCreation", "is_state_creation"]


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def is_state_creation(optimizer: Optimizer) -> bool:
    """Whether the step ``optimizer`` (a ``Muon``) is about to take is torch's state creation (module docstring).

    It is when the optimizer has neither stepped nor loaded a state since it was made, every
    group's lr is 0, and every parameter that requires a gradient has one, all zeros, on every
    rank of the optimizer's sharding. Only a step of a new optimizer at lr 0 checks the
    gradients (one all-reduce under a sharding, which every rank runs alike: the first two
    conditions are the same on every rank); the steps of a run do not.
    """
    if not optimizer.fresh:
        return False
    lrs = [g["lr"] for g in optimizer.param_groups if "lr" in g]
    if not lrs or any(lr is None or float(lr) != 0.0 for lr in lrs):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    zero = all(p.grad is not None and not bool(_local(p.grad).any()) for p in params)
    sharding = optimizer.sharding
    if sharding is not None and sharding.world_size > 1:
        device = params[0].device if params else torch.device("cpu")  # NCCL takes no CPU tensors
        flag = torch.tensor([int(zero)], dtype=torch.int32, device=device)
        all_reduce_(flag, dist.ReduceOp.MIN, sharding.group, sharding.stats, name="state_creation")
        zero = bool(flag.item())
    return zero


class StateCreation:
    """A context in which ``optimizer`` (a ``Muon``) steps to make its state, and after which nothing else changed.

    On entry it copies every parameter with a gradient (a DTensor: this rank's shard) and every
    group's keys but ``params``; on exit it writes them back, and each fp32 master copy made in
    the step (``main_params_dtype``) is made again from its restored parameter, as it was made.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._params: list[tuple[Tensor, Tensor]] = []
        self._groups: list[dict[str, Any]] = []

    def __enter__(self) -> StateCreation:
        groups = self.optimizer.param_groups
        self._groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in groups]
        self._params = [(p, _local(p).detach().clone()) for g in groups for p in g["params"] if p.grad is not None]
        self.optimizer.creating_state = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.optimizer.creating_state = False
        with torch.no_grad():
            for p, saved in self._params:
                _local(p).copy_(saved)
                master = self.optimizer.state.get(p, {}).get(MAIN_PARAM)
                if master is not None:
                    master.copy_(p)
        for group, saved in zip(self.optimizer.param_groups, self._groups):
            for key in [k for k in group if k != "params" and k not in saved]:
                del group[key]
            group.update(saved)
        self._params, self._groups = [], []
