"""One lr for every param group, as Lightning's lr finder and SWA set it, read as the Muon lr.

Lightning's tools assume one lr scale per optimizer. ``Tuner.lr_find`` (and the
``LearningRateFinder`` callback) sets every param group to the same lr at each step of its
sweep; ``StochasticWeightAveraging(swa_lrs=x)`` anneals every group towards ``x``. In a
hybrid optimizer that trains AdamW at Muon's lr, or Muon at AdamW's. ``MuonModuleMixin``
reads such a single lr ``x`` as the Muon lr and gives every group its share of it::

    lr_i = x * B_i / L_muon

``L_muon`` is the config's matrix lr (``MuonConfig.matrix.lr``) and ``B_i`` the lr group ``i``
is configured with: its routing rule's ``lr`` option, else its algorithm's lr in the config
(the ``matrix``, ``scalar`` or ``others`` section's). So the configured ratios between groups hold at
every step of the lr finder's sweep, its recorded lr and its suggestion are Muon lrs, and
SWA anneals each group to its share of ``swa_lrs``. A ``swa_lrs`` list (one value per group,
not all equal) is used as given.

The lr finder's suggestion reaches the config through ``MuonModuleMixin.lr``:
``MuonConfig.with_lr`` moves every other lr by the same factor as the Muon lr.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from torch.optim.swa_utils import SWALR

from lightning_muon.muon import Muon
from lightning_muon.schedules import MuonScheduler

if TYPE_CHECKING:
    from lightning_muon.config import MuonConfig

__all__ = ["apply_one_lr", "lr_shares", "reapply_schedule", "retune_running_schedule"]

# The group key that records the swa_lr this module gave a group: SWALR, made again on
# resume, writes the single value back, and the spread is then applied again.
_SPREAD_SWA_LR = "swa_lr_spread"


def lr_shares(config: MuonConfig, groups: list[dict[str, Any]]) -> list[float]:
    """``B_i / L_muon`` per group: the share of a single lr that each group takes (module docstring).

    Raises:
        ValueError: the config's Muon lr is 0, so no group has a ratio to it.
    """
    lr = config.matrix.lr
    if lr == 0:
        raise ValueError(
            "MuonConfig.matrix.lr is 0: a single lr for every group (the lr finder's sweep, SWA's swa_lrs) is read as "
            "the matrix lr, and every other group's lr by its ratio to it; set a positive lr"
        )
    rule_lrs = {r.group_name: r.options["lr"] for r in config.routing.rules if "lr" in r.options}
    return [rule_lrs.get(g.get("name"), config.settings_of(g["algorithm"]).lr) / lr for g in groups]


def _lr_finder_schedulers() -> tuple[type, ...]:
    # Lightning's lr finder steps its sweep with these two (lightning/pytorch/tuner/lr_finder.py);
    # they are private there, so a Lightning without them has no sweep for us to follow.
    try:
        from lightning.pytorch.tuner.lr_finder import _ExponentialLR, _LinearLR
    except ImportError:
        return ()
    return (_ExponentialLR, _LinearLR)


def apply_one_lr(trainer: pl.Trainer, config: Callable[[], MuonConfig]) -> None:
    """Before an optimizer step: spread the single lr a Lightning tool set over the groups by their shares.

    Acts on one ``Muon`` driven by the lr finder's sweep (each step) or by ``SWALR`` with
    one ``swa_lr`` for every group (once per SWALR); otherwise does nothing. ``config``
    gives the module's ``MuonConfig`` (read only when a tool is at work).
    """
    configs = trainer.lr_scheduler_configs
    if len(configs) != 1 or not isinstance(configs[0].scheduler.optimizer, Muon):
        return
    scheduler = configs[0].scheduler
    groups = scheduler.optimizer.param_groups
    if isinstance(scheduler, _lr_finder_schedulers()):
        # Its lrs come from its own base lrs each step (closed form): the spread never compounds.
        for group, lr, share in zip(groups, scheduler.get_last_lr(), lr_shares(config(), groups)):
            group["lr"] = lr * share
    elif isinstance(scheduler, SWALR):
        if all(g.get(_SPREAD_SWA_LR) == g["swa_lr"] for g in groups) or len({g["swa_lr"] for g in groups}) != 1:
            return  # spread already, or a swa_lrs list: per group as given
        for group, share in zip(groups, lr_shares(config(), groups)):
            group["swa_lr"] = group[_SPREAD_SWA_LR] = group["swa_lr"] * share


def retune_running_schedule(trainer: pl.Trainer | None, factor: float) -> MuonScheduler | None:
    """Multiply the base lrs of a ``MuonScheduler`` the trainer runs by ``factor``; returns it (or None).

    After ``LearningRateFinder`` (the callback) the fit goes on with the scheduler it began
    with: its base lrs take the tuned config's (``MuonModuleMixin.lr``), from the next step on.
    """
    if trainer is None:
        return None
    for scheduler_config in trainer.lr_scheduler_configs:
        scheduler = scheduler_config.scheduler
        if isinstance(scheduler, MuonScheduler):
            scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["initial_lr"] = base
            return scheduler
    return None


def reapply_schedule(trainer: pl.Trainer) -> None:
    """Set the groups a ``MuonScheduler`` drives to its lrs at its current step (after a write to all of them)."""
    for scheduler_config in trainer.lr_scheduler_configs:
        scheduler = scheduler_config.scheduler
        if isinstance(scheduler, MuonScheduler):
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_lr()):
                group["lr"] = lr
