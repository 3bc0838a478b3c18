"""Schedule-Free AdamW groups inside ``Muon``: stepped by the ``schedulefree`` package over this optimizer's state.

``"adamw_schedulefree"`` groups are stepped by the package's own ``AdamWScheduleFree``
(Defazio et al., "The Road Less Scheduled", arXiv 2405.15682; ``pip install
lightning_muon[schedulefree]``), which keeps two sequences per parameter: ``z`` (the
SGD-like iterate) and the average ``x`` of the ``z`` seen so far. The parameter holds
``y = (1 - beta1) z + beta1 x`` in train mode, where gradients are taken, and ``x`` in
eval mode. Their groups and state are ``Muon``'s own, so ``state_dict()`` resumes them.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_muon.hparams import SCHEDULE_FREE

__all__ = ["ScheduleFreeGroups", "schedulefree", "schedulefree_group"]


def schedulefree_group(params: list, knobs: dict[str, Any]) -> dict[str, Any]:
    """What ``AdamWScheduleFree`` puts in a group of its own (step count ``k``, ``weight_sum``,
    ``lr_max``, ``train_mode``, ...), taken from the package rather than copied here."""
    return schedulefree().AdamWScheduleFree([{"params": params}], **knobs).param_groups[0]


class ScheduleFreeGroups:
    """``train()``, ``eval()`` and the step of ``Muon``'s schedule-free groups (a mixin over ``param_groups``)."""

    param_groups: list[dict[str, Any]]
    state: Any
    # A schedulefree.AdamWScheduleFree run over this optimizer's schedule-free groups and state.
    _schedule_free = None

    def train(self) -> None:
        """Schedule-free groups to train mode: their parameters hold ``y``, where gradients are taken.

        Call it before the training steps (``step`` refuses eval mode) and after every
        ``eval()``. A no-op for the other groups and for groups already in train mode.
        """
        inner = self._schedule_free_optimizer()
        if inner is not None:
            inner.train()

    def eval(self) -> None:
        """Schedule-free groups to eval mode: their parameters hold the averaged weights ``x``.

        Call it before validation, testing, inference and saving a checkpoint (the saved
        weights are then the averaged ones and the saved groups say eval; ``train()`` after
        loading brings back the training weights). A no-op for the other groups.
        """
        inner = self._schedule_free_optimizer()
        if inner is not None:
            inner.eval()

    @property
    def schedule_free_groups(self) -> list[dict[str, Any]]:
        """The ``"adamw_schedulefree"`` param groups (empty when there are none)."""
        return [g for g in self.param_groups if g["algorithm"] == SCHEDULE_FREE]

    @property
    def schedule_free_training(self) -> bool:
        """True when a schedule-free group is in train mode."""
        return any(g["train_mode"] for g in self.schedule_free_groups)

    def _schedule_free_optimizer(self) -> Optimizer | None:
        """``AdamWScheduleFree`` over this optimizer's schedule-free groups and state, or None.

        The groups and the state dict are this optimizer's own objects (rebound on every
        call, since ``load_state_dict`` replaces them), so what the package updates (step
        counts, mode flags, ``z``, ``exp_avg_sq``) is what ``state_dict()`` saves.
        """
        groups = self.schedule_free_groups
        if not groups:
            return None
        inner = self._schedule_free
        if inner is None:
            inner = self._schedule_free = schedulefree().AdamWScheduleFree([{"params": g["params"]} for g in groups])
        inner.param_groups = groups
        inner.state = self.state
        return inner

    def _check_train_mode(self) -> None:
        for i, group in enumerate(self.param_groups):
            if group["algorithm"] == SCHEDULE_FREE and not group["train_mode"]:
                raise RuntimeError(
                    f"Muon: param group {i} ({group.get('name', SCHEDULE_FREE)!r}) is schedule-free and in eval mode "
                    "(its parameters hold the averaged weights); call optimizer.train() before step() and "
                    "optimizer.eval() before evaluating or saving (under Lightning, MuonModuleMixin adds "
                    "ScheduleFreeModeSwitch, which does both)"
                )


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
