"""Learning-rate and Muon-momentum schedules as pure functions of the optimizer step.

An lr schedule is a multiplier of every group's base lr, so the AdamW groups keep
their ratio to the Muon groups as it moves. Its phases, for step ``s`` (0-based,
the number of optimizer steps already taken)::

    warmup   s < W          (s + 1) / W
    stable   s < W + S      1
    falloff  the rest       shape(progress) from 1 down to min_lr_ratio

Falloff shapes: ``constant``, ``linear``, ``cosine``, ``wsd`` (stable until the
last ``cooldown`` steps, then linear to ``min_lr_ratio``: warmup-stable-decay) and
``inverse_sqrt`` (``sqrt((W + S) / (s + 1))``, floored at ``min_lr_ratio``).
Momentum warmup moves Muon's momentum linearly from ``start`` to each group's
own momentum over ``steps``.

Schedule-Free groups (``"adamw_schedulefree"``) take the warmup only: after it their
multiplier stays 1 whatever the falloff, since Schedule-Free replaces the falloff by
its weight averaging (and weights that average by the lr it is given).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_muon._warn import warn_user
from lightning_muon.algorithms import get_algorithm, orthogonalizes

__all__ = [
    "FALLOFFS",
    "LRSchedule",
    "MomentumWarmup",
    "MuonScheduler",
    "ScheduleSettings",
    "lr_multiplier",
    "momentum_at",
    "steps_of",
]

FALLOFFS = ("constant", "linear", "cosine", "wsd", "inverse_sqrt")
Falloff = Literal["constant", "linear", "cosine", "wsd", "inverse_sqrt"]
# Falloffs whose shape depends on the run's length.
NEEDS_TOTAL = ("linear", "cosine", "wsd")


def check_phase(value: float, name: str) -> None:
    """Check a phase length: a whole number of steps (``>= 1``, or 0) or a fraction of the total (``< 1``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of steps or a fraction in [0, 1), got {value!r}")
    if value >= 1 and value != int(value):
        raise ValueError(f"{name} must be a whole number of steps or a fraction in (0, 1), got {value!r}")


def steps_of(value: float, total: int | None, name: str) -> int:
    """A phase length given as steps (``>= 1``, or 0) or as a fraction of ``total`` (``< 1``)."""
    check_phase(value, name)
    if 0 < value < 1:
        if total is None:
            raise ValueError(f"{name}={value} is a fraction of the total steps, but total_steps is unknown")
        return int(round(value * total))
    return int(value)


def check_min_lr_ratio(value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {value!r}")


def check_total_steps(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"total_steps must be a positive int or None, got {value!r}")


def check_fits(warmup_steps: int, stable_steps: int, total_steps: int) -> None:
    """A warmup and a stable phase longer than the run would never reach (or leave) the peak lr."""
    if warmup_steps + stable_steps > total_steps:
        raise ValueError(f"warmup ({warmup_steps}) + stable ({stable_steps}) steps exceed total_steps ({total_steps})")


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """A resolved lr schedule: every phase in steps. Build with ``LRSchedule.create``."""

    falloff: str = "constant"
    warmup_steps: int = 0
    stable_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    @classmethod
    def create(
        cls,
        falloff: str = "constant",
        *,
        warmup: float = 0,
        stable: float = 0,
        cooldown: float = 0.2,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
    ) -> LRSchedule:
        """Resolve phase lengths given in steps or fractions of ``total_steps``.

        ``cooldown`` is only used by ``wsd``: its stable phase is everything between
        the warmup and the last ``cooldown`` steps.
        """
        if falloff not in FALLOFFS:
            raise ValueError(f"falloff must be one of {FALLOFFS}, got {falloff!r}")
        check_total_steps(total_steps)
        if falloff in NEEDS_TOTAL and total_steps is None:
            raise ValueError(f"falloff={falloff!r} needs total_steps")
        check_min_lr_ratio(min_lr_ratio)
        warmup_steps = steps_of(warmup, total_steps, "warmup")
        stable_steps = steps_of(stable, total_steps, "stable")
        if falloff == "wsd":
            cooldown_steps = steps_of(cooldown, total_steps, "cooldown")
            if warmup_steps + cooldown_steps > total_steps:
                raise ValueError(
                    f"warmup ({warmup_steps}) + cooldown ({cooldown_steps}) steps exceed total_steps ({total_steps})"
                )
            stable_steps = total_steps - warmup_steps - cooldown_steps
        if total_steps is not None:
            check_fits(warmup_steps, stable_steps, total_steps)
        return cls(
            falloff="linear" if falloff == "wsd" else falloff,
            warmup_steps=warmup_steps,
            stable_steps=stable_steps,
            total_steps=total_steps,
            min_lr_ratio=float(min_lr_ratio),
        )


def lr_multiplier(step: int, schedule: LRSchedule) -> float:
    """The factor on every base lr at optimizer step ``step`` (0-based)."""
    w, s = schedule.warmup_steps, schedule.stable_steps
    if step < w:
        return (step + 1) / w
    if step < w + s or schedule.falloff == "constant":
        return 1.0
    low = schedule.min_lr_ratio
    if schedule.falloff == "inverse_sqrt":
        return max(low, math.sqrt(max(1, w + s) / (step + 1)))
    decay_steps = max(1, schedule.total_steps - w - s)
    progress = min(1.0, (step - w - s) / decay_steps)
    if schedule.falloff == "linear":
        return 1.0 - (1.0 - low) * progress
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


@dataclass(frozen=True, kw_only=True)
class MomentumWarmup:
    """Muon momentum from ``start`` to the group's own momentum over ``steps`` steps."""

    start: float = 0.85
    """Muon momentum at step 0, in [0, 1)."""
    steps: int = 0
    """Steps over which the momentum rises to each group's own; 0: no warmup."""

    def __post_init__(self) -> None:
        if not (isinstance(self.start, (int, float)) and 0.0 <= self.start < 1.0):
            raise ValueError(f"momentum_warmup start must be in [0, 1), got {self.start!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"momentum_warmup steps must be an int >= 0, got {self.steps!r}")


def momentum_at(step: int, target: float, warmup: MomentumWarmup) -> float:
    """Muon momentum at optimizer step ``step`` for a group whose momentum is ``target``."""
    if warmup.steps == 0 or step >= warmup.steps:
        return target
    return warmup.start + (target - warmup.start) * step / warmup.steps


@dataclass(frozen=True, kw_only=True)
class ScheduleSettings:
    """The lr schedule and Muon momentum warmup of a run (``MuonConfig.schedule``); ``build()`` resolves it."""

    falloff: Falloff = "constant"
    """lr falloff after warmup and stable: constant, linear, cosine, wsd, inverse_sqrt."""
    warmup: float = 0
    """Warmup length: steps (>= 1) or a fraction of total steps (< 1)."""
    stable: float = 0
    """Steps (or fraction) held at the peak lr after warmup."""
    cooldown: float = 0.2
    """``wsd`` only: length of the final linear decay, steps or fraction."""
    min_lr_ratio: float = 0.0
    """Lowest lr as a fraction of the peak."""
    total_steps: int | None = None
    """Total optimizer steps; None takes ``trainer.estimated_stepping_batches``."""
    momentum_warmup: MomentumWarmup = field(default_factory=MomentumWarmup)
    """Muon momentum warmup."""

    def __post_init__(self) -> None:
        if self.falloff not in FALLOFFS:
            raise ValueError(f"falloff must be one of {FALLOFFS}, got {self.falloff!r}")
        check_phase(self.warmup, "warmup")
        check_phase(self.stable, "stable")
        check_phase(self.cooldown, "cooldown")  # only wsd reads it, but a bad value is a mistake under any falloff
        check_min_lr_ratio(self.min_lr_ratio)
        check_total_steps(self.total_steps)
        if self.total_steps is not None:
            object.__setattr__(self, "_built", self._create(self.total_steps))  # the one schedule of the run

    @property
    def needs_total_steps(self) -> bool:
        """True when the schedule depends on the run's length: a falloff over it, or a phase given as a fraction."""
        phases = (self.warmup, self.stable, *((self.cooldown,) if self.falloff == "wsd" else ()))
        return self.falloff in NEEDS_TOTAL or any(0 < v < 1 for v in phases)

    def check_fits(self, total_steps: int) -> None:
        """Raise when warmup and stable (given in steps) outlast a run of ``total_steps``."""
        check_fits(
            steps_of(self.warmup, total_steps, "warmup"), steps_of(self.stable, total_steps, "stable"), total_steps
        )

    def build(self, total_steps: int | None) -> LRSchedule:
        """The resolved ``LRSchedule`` for a run of ``total_steps`` (None: unknown; fine for constant and inverse_sqrt).

        For ``self.total_steps`` it is the one built (and checked) with the config.
        """
        built = getattr(self, "_built", None)
        return built if built is not None and built.total_steps == total_steps else self._create(total_steps)

    def _create(self, total_steps: int | None) -> LRSchedule:
        return LRSchedule.create(
            self.falloff,
            warmup=self.warmup,
            stable=self.stable,
            cooldown=self.cooldown,
            total_steps=total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )


def _warmup_only(group: dict[str, Any]) -> bool:
    """True for a group whose algorithm takes the schedule's warmup only (Schedule-Free AdamW)."""
    name = group.get("algorithm")
    try:
        return name is not None and not get_algorithm(name).follows_falloff
    except ValueError:  # another optimizer's group
        return False


class MuonScheduler(LRScheduler):
    """Drives every group's lr by one ``LRSchedule`` and Muon groups' momentum by a warmup.

    Schedule-Free groups follow the schedule's warmup and then keep their base lr: no
    stable phase or falloff reaches them. Groups added to the optimizer after the scheduler
    was made (``BackboneFinetuning`` unfreezing a backbone) keep the lr they were given, as
    with torch's schedulers: the code that added them moves it.

    Its state (the step, base lrs and momenta, and the schedule itself) is made of
    plain numbers, so it survives ``torch.load(weights_only=True)`` in checkpoints.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedule: LRSchedule,
        momentum_warmup: MomentumWarmup | None = None,
        last_epoch: int = -1,
    ) -> None:
        self.schedule = schedule
        self.momentum_warmup = momentum_warmup or MomentumWarmup()
        # Muon's momentum (and its variants') warms up; other algorithms' "momentum" is a read-out.
        self.base_momenta = [g.get("momentum") if orthogonalizes(g) else None for g in optimizer.param_groups]
        self.warmup_only = [_warmup_only(g) for g in optimizer.param_groups]
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        factor = lr_multiplier(self.last_epoch, self.schedule)
        warmup = replace(self.schedule, falloff="constant", stable_steps=0)
        warmup_factor = lr_multiplier(self.last_epoch, warmup)
        lrs = [base * (warmup_factor if only else factor) for base, only in zip(self.base_lrs, self.warmup_only)]
        # Groups added since the scheduler was made keep their lr: whoever added them moves it
        # (BackboneFinetuning does, each epoch, for the backbone it unfroze).
        return lrs + [group["lr"] for group in self.optimizer.param_groups[len(lrs) :]]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        for group, target in zip(self.optimizer.param_groups, self.base_momenta):
            if target is not None:
                group["momentum"] = momentum_at(self.last_epoch, target, self.momentum_warmup)

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedule", "momentum_warmup")}
        state["schedule"] = asdict(self.schedule)
        state["momentum_warmup"] = asdict(self.momentum_warmup)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the checkpoint's step, on this run's schedule, base lrs and momenta.

        torch would restore the checkpoint's schedule and lrs, silently overriding the config
        the run was started with: a run resumed with a longer ``max_steps`` would keep the old
        horizon and train at lr 0 past it, and a changed lr would be ignored. Here the step
        count comes from the checkpoint and everything else from this run (the horizon from
        ``total_steps`` or the trainer's new estimate); a warning names both when they differ.
        Other group hyperparameters (weight decay, betas) are the optimizer's and come from
        the checkpoint.
        """
        state = dict(state_dict)
        saved = {
            "schedule": LRSchedule(**state.pop("schedule")),
            "momentum_warmup": MomentumWarmup(**state.pop("momentum_warmup")),
            "base_lrs": state.pop("base_lrs", self.base_lrs),
            "base_momenta": state.pop("base_momenta", self.base_momenta),
        }
        state.pop("_last_lr", None)
        state.pop("warmup_only", None)  # which groups are Schedule-Free: this run's routing says
        self.__dict__.update(state)  # the step counters
        ours = {key: getattr(self, key) for key in saved}
        changed = [key for key in saved if _differs(saved[key], ours[key])]
        if changed:
            lines = "; ".join(f"{key}: checkpoint {saved[key]}, now {ours[key]}" for key in changed)
            # At the user's line (their trainer.fit), not at Lightning's checkpoint connector.
            warn_user(
                f"MuonScheduler: resuming at step {self.last_epoch} with this run's settings, not the "
                f"checkpoint's ({lines})"
            )
        lrs = self.get_lr()  # this run's schedule at the checkpoint's step (warmup only for Schedule-Free groups)
        for group, base, lr, target in zip(self.optimizer.param_groups, self.base_lrs, lrs, self.base_momenta):
            group["initial_lr"] = base
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # a Tensor lr stays the same object, as torch's schedulers keep it
            else:
                group["lr"] = lr
            if target is not None:
                group["momentum"] = momentum_at(self.last_epoch, target, self.momentum_warmup)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a is None or b is None or not math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a != b
