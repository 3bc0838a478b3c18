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

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.algorithms.adamw import Betas, momentum_readout
from lightning_muon.algorithms.base import Algorithm, HparamsSource, StepContext, register_algorithm
from lightning_muon.algorithms.checks import check_betas, check_int, check_number, normalize, with_placeholders
from lightning_muon.algorithms.lion import with_adamw_fallbacks

__all__ = [
    "SCHEDULE_FREE",
    "SCHEDULE_FREE_ADAMW",
    "ScheduleFreeAdamW",
    "ScheduleFreeHparams",
    "check_schedule_free",
    "schedule_free_groups",
    "schedule_free_training",
    "schedulefree",
    "schedulefree_group",
]

SCHEDULE_FREE = "adamw_schedulefree"


@dataclass(frozen=True, kw_only=True)
class ScheduleFreeHparams:
    """Schedule-Free AdamW groups (``Muon``'s ``adamw_schedulefree_*`` keywords), ``AdamWScheduleFree``'s own."""

    lr: float | None = None
    """Learning rate; None takes AdamW's. Warmup only, never a falloff."""
    betas: Betas = (0.9, 0.999)
    """(beta1, beta2); beta1 in (0, 1) interpolates between the average and the iterate."""
    eps: float = 1e-8
    """Added to the root of the second moment; > 0."""
    weight_decay: float | None = None
    """Weight decay (at y, times the lr); None takes AdamW's."""
    warmup_steps: int = 0
    """schedulefree's own warmup inside the optimizer."""
    r: float = 0.0
    """Polynomial weighting power of the average."""
    weight_lr_power: float = 2.0
    """The averaging weight is ``lr_max ** weight_lr_power``."""

    prefix = "adamw_schedulefree_"  # not a field: the prefix of these knobs among Muon's keywords

    def __post_init__(self) -> None:
        normalize(self, check_schedule_free(with_placeholders(self), "Muon()", self.prefix))


def check_schedule_free(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check Schedule-Free AdamW's hyperparameters in ``group``; returns the normalized values."""
    check_number(group["lr"], prefix + "lr", where, 0.0)
    check_number(group["weight_decay"], prefix + "weight_decay", where, 0.0)
    betas = check_betas(group["betas"], where, prefix, beta1_open=True)  # eval() divides by beta1
    check_number(group["eps"], prefix + "eps", where, 0.0, low_open=True)
    check_int(group["warmup_steps"], prefix + "warmup_steps", where, 0)
    check_number(group["r"], prefix + "r", where, 0.0)
    check_number(group["weight_lr_power"], prefix + "weight_lr_power", where, 0.0)
    return {"betas": betas}


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
    hparams = ScheduleFreeHparams
    follows_falloff = False

    def __init__(self) -> None:
        # Per optimizer: an AdamWScheduleFree over its schedule-free groups and state (not saved:
        # made again from the groups on use).
        self._inner: weakref.WeakKeyDictionary[StepContext, Optimizer] = weakref.WeakKeyDictionary()

    def check(self, values: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
        return check_schedule_free(values, where, prefix)

    def group_defaults(self, config: HparamsSource) -> dict[str, Any]:
        return with_adamw_fallbacks(dataclasses.asdict(config.hparams_of("adamw_schedulefree")), config)

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        knobs = {f.name: group[f.name] for f in dataclasses.fields(ScheduleFreeHparams)}
        for key, value in schedulefree_group(params, knobs).items():
            group.setdefault(key, value)
        momentum_readout(group)

    def prepare_step(self, ctx: StepContext, groups: list[dict[str, Any]]) -> None:
        if ctx.creates_state:
            # A new optimizer's groups are in eval mode, and the package steps in train mode
            # only; this step moves nothing, and Muon gives every group its own mode back.
            for group in groups:
                group["train_mode"] = True
            return
        for group in groups:
            if not group["train_mode"]:
                i = ctx.group_index(group)
                raise RuntimeError(
                    f"Muon: param group {i} ({group.get('name', SCHEDULE_FREE)!r}) is schedule-free and in eval mode "
                    "(its parameters hold the averaged weights); call optimizer.train() before step() and "
                    "optimizer.eval() before evaluating or saving (under Lightning, MuonModuleMixin adds "
                    "ScheduleFreeModeSwitch, which does both)"
                )

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        """Nothing per group: ``finish_step`` steps every schedule-free group at once."""

    def finish_step(self, ctx: StepContext, groups: list[dict[str, Any]]) -> None:
        # All groups at once, as AdamWScheduleFree steps its own: a group without gradients
        # still counts the step (its k and weight_sum advance).
        self._optimizer(ctx, groups).step()

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
