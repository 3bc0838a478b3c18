"""``"adamw_schedulefree"`` groups: Schedule-Free AdamW, stepped by the ``schedulefree`` package over ``Muon``'s state.

The package's own ``AdamWScheduleFree`` (``pip install lightning_muon[schedulefree]``) keeps
two sequences per parameter: ``z`` (the SGD-like iterate) and the average ``x`` of the ``z``
seen so far. The parameter holds ``y = (1 - beta1) z + beta1 x`` in train mode, where
gradients are taken, and ``x`` in eval mode. It runs over ``Muon``'s own groups and state
dict, so ``state_dict()`` saves what it updates (step counts, mode flags, ``z``,
``exp_avg_sq``) and resumes it. The lr schedule gives these groups its warmup only: the
average replaces the decay.

References:
    Defazio et al., "The Road Less Scheduled", arXiv 2405.15682, 2024.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.algorithms.adamw import momentum_readout, sync_beta1
from lightning_muon.algorithms.base import Algorithm, StepContext, group_lr, register_algorithm
from lightning_muon.algorithms.families import AdamLikeSettings, checked_betas
from lightning_muon.algorithms.settings import setting

__all__ = [
    "SCHEDULE_FREE",
    "SCHEDULE_FREE_ADAMW",
    "ScheduleFreeAdamW",
    "ScheduleFreeSettings",
    "eval_mode_error",
    "schedule_free_groups",
    "schedule_free_training",
    "schedulefree",
    "schedulefree_group",
]

SCHEDULE_FREE = "adamw_schedulefree"


@dataclass(frozen=True, kw_only=True)
class ScheduleFreeSettings(AdamLikeSettings, algorithm=SCHEDULE_FREE, defaults={"betas": (0.9, 0.999)}):
    """Schedule-Free AdamW groups, ``AdamWScheduleFree``'s own settings; warmup only, never a falloff."""

    warmup_steps: int = setting(0, low=0, integer=True)
    """schedulefree's own warmup inside the optimizer."""
    r: float = setting(0.0, low=0.0)
    """Polynomial weighting power of the average."""
    weight_lr_power: float = setting(2.0, low=0.0)
    """The averaging weight is lr_max ** weight_lr_power."""

    def normalize(self) -> None:
        self._set("betas", checked_betas(self, self.betas, beta1_open=True))  # eval() divides by beta1


def schedulefree() -> Any:
    """The ``schedulefree`` package, or an ImportError that says how to install it."""
    try:
        import schedulefree
    except ImportError as err:
        raise ImportError(
            f"algorithm {SCHEDULE_FREE!r} needs the schedulefree package (1.4.x), an optional extra: "
            "pip install 'lightning_muon[schedulefree]'"
        ) from err
    return schedulefree


def eval_mode_error(index: int, group: dict[str, Any]) -> RuntimeError:
    """The error of a step with a schedule-free group in eval mode (its parameters hold the averaged weights)."""
    return RuntimeError(
        f"Muon: param group {index} ({group.get('name', SCHEDULE_FREE)!r}) is schedule-free and in eval mode "
        "(its parameters hold the averaged weights); call optimizer.train() before step() and "
        "optimizer.eval() before evaluating or saving (under Lightning, MuonModuleMixin adds "
        "ScheduleFreeModeSwitch, which does both)"
    )


def schedulefree_group(params: list, knobs: dict[str, Any]) -> dict[str, Any]:
    """What ``AdamWScheduleFree`` puts in a group of its own (step count ``k``, ``weight_sum``,
    ``lr_max``, ``train_mode``, ...), taken from the package rather than copied here."""
    return schedulefree().AdamWScheduleFree([{"params": params}], **knobs).param_groups[0]


class ScheduleFreeAdamW(Algorithm):
    """``"adamw_schedulefree"``: every such group stepped at once by ``AdamWScheduleFree`` over ``Muon``'s state.

    ``train()`` and ``eval()`` switch the groups' parameters between the training and the
    averaged weights; ``step`` refuses eval mode, where gradients would be taken at the
    averaged weights.
    """

    name = SCHEDULE_FREE
    settings = ScheduleFreeSettings
    follows_falloff = False

    def __init__(self) -> None:
        # Per optimizer: an AdamWScheduleFree over its schedule-free groups and state (not saved:
        # made again from the groups on use).
        self._inner: weakref.WeakKeyDictionary[StepContext, Optimizer] = weakref.WeakKeyDictionary()

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        knobs = {name: group[name] for name in ScheduleFreeSettings.field_names()}
        for key, value in schedulefree_group(params, knobs).items():
            group.setdefault(key, value)
        momentum_readout(group)

    def init_state(self, ctx: StepContext, group: dict[str, Any], params: list[Tensor]) -> None:
        """What ``AdamWScheduleFree`` makes at a parameter's first step: ``z`` (the parameter's copy) and
        ``exp_avg_sq`` (zeros)."""
        for p in params:
            entry = ctx.state[p]
            if "z" not in entry:
                entry["z"] = torch.clone(p, memory_format=torch.preserve_format)
                entry["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        """Nothing per group: ``finish_step`` steps every schedule-free group at once."""

    def finish_step(self, ctx: StepContext, groups: list[dict[str, Any]]) -> None:
        # All groups at once, as AdamWScheduleFree steps its own: a group without gradients
        # still counts the step (its k and weight_sum advance). A Tensor lr is lent as its value:
        # the package's arithmetic would run in the Tensor's dtype (and keep lr_max as a Tensor),
        # not in the Python floats of a float lr; the Tensor goes back for a scheduler to fill.
        for group in groups:
            sync_beta1(ctx, group)  # a scheduler or a user may have moved beta1 since
        tensor_lrs = {i: g["lr"] for i, g in enumerate(groups) if isinstance(g["lr"], Tensor)}
        for i in tensor_lrs:
            groups[i]["lr"] = group_lr(groups[i])
        try:
            self._optimizer(ctx, groups).step()
        finally:
            for i, lr in tensor_lrs.items():
                groups[i]["lr"] = lr

    def train(self, ctx: StepContext, groups: list[dict[str, Any]]) -> None:
        """Parameters to ``y``, where gradients are taken (a no-op for groups already in train mode)."""
        self._optimizer(ctx, groups).train()

    def eval(self, ctx: StepContext, groups: list[dict[str, Any]]) -> None:
        """Parameters to the averaged weights ``x`` (validation, testing, inference, saving)."""
        self._optimizer(ctx, groups).eval()

    def _optimizer(self, ctx: StepContext, groups: list[dict[str, Any]]) -> Optimizer:
        """``AdamWScheduleFree`` over ``groups`` and the optimizer's state (``ctx``).

        The groups and the state dict are the optimizer's own objects, rebound on every call
        (``load_state_dict`` replaces them), so what the package updates is what
        ``state_dict()`` saves.
        """
        inner = self._inner.get(ctx)
        if inner is None:
            inner = self._inner[ctx] = schedulefree().AdamWScheduleFree([{"params": g["params"]} for g in groups])
        inner.param_groups = groups
        inner.state = ctx.state
        return inner


SCHEDULE_FREE_ADAMW = register_algorithm(ScheduleFreeAdamW())


def schedule_free_groups(optimizer: Optimizer) -> list[dict[str, Any]]:
    """The ``"adamw_schedulefree"`` param groups of ``optimizer`` (empty when there are none)."""
    return [g for g in optimizer.param_groups if g.get("algorithm") == SCHEDULE_FREE]


def schedule_free_training(optimizer: Optimizer) -> bool:
    """True when a schedule-free group of ``optimizer`` is in train mode (its parameters hold ``y``)."""
    return any(g["train_mode"] for g in schedule_free_groups(optimizer))
