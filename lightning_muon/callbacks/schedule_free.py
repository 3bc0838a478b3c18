"""``ScheduleFreeModeSwitch``: Schedule-Free groups evaluate and save at their averaged weights."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_muon.algorithms.adamw_schedulefree import schedule_free_groups, schedule_free_training
from lightning_muon.muon import Muon

__all__ = ["ScheduleFreeModeSwitch"]


def _schedule_free_optimizers(trainer: pl.Trainer) -> list[Muon]:
    found = []
    for optimizer in trainer.optimizers:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if isinstance(optimizer, Muon) and schedule_free_groups(optimizer):
            found.append(optimizer)
    return found


class ScheduleFreeModeSwitch(Callback):
    """Switches ``Muon``'s ``"adamw_schedulefree"`` groups between train and eval mode.

    Schedule-Free AdamW takes gradients at ``y`` (train mode) and evaluates at the average
    ``x`` (eval mode); the parameters hold one or the other. This callback calls the
    optimizer's ``eval()`` when validation, test or predict starts and when training ends
    (the module then holds the averaged weights), and ``train()`` when training starts and
    before every training batch (so validation in the middle of an epoch hands back the
    training weights before the next step). ``MuonModuleMixin`` adds it when its config
    routes parameters to ``"adamw_schedulefree"``; add it yourself to a Trainer whose
    module builds a ``Muon`` with such groups another way. Optimizers without them are
    left alone.

    Checkpoints are written in eval mode, as ``schedulefree`` prescribes: the weights in
    ``state_dict`` are the averaged ones (what ``load_from_checkpoint`` gives for
    inference) and the optimizer state says eval; the ``train()`` at the start of the
    resumed fit recomputes the training weights. A checkpoint saved in train mode is
    re-dumped here in eval mode, and the running fit then goes back to train mode by the
    same ``train()`` call, so a resumed run continues bit for bit as the run that saved
    the checkpoint. ``MuonModuleMixin.on_save_checkpoint`` does the same for weights-only
    checkpoints, which skip the callbacks.

    References:
        Defazio et al., "The Road Less Scheduled", arXiv 2405.15682, 2024.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in _schedule_free_optimizers(trainer):
            optimizer.train()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Validation may have run since the last batch (val_check_interval): back to y.
        # Idempotent, and cheap in train mode (a flag per group).
        for optimizer in _schedule_free_optimizers(trainer):
            optimizer.train()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval(trainer)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval(trainer)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval(trainer)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        save_in_eval_mode(trainer, pl_module, checkpoint)

    @staticmethod
    def _eval(trainer: pl.Trainer) -> None:
        for optimizer in _schedule_free_optimizers(trainer):
            optimizer.eval()


def save_in_eval_mode(trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
    """Make ``checkpoint`` (being saved in train mode) what eval mode would have saved.

    Lightning dumps the weights and optimizer states before the save hooks run, so the
    entries eval mode changes are dumped again: the module's weights, with the
    schedule-free ones copied (the live tensors go back to train mode below), and the
    optimizer states when the checkpoint has them. Every rank runs this, as it runs the
    dump (strategies may gather in both).
    """
    optimizers = [o for o in _schedule_free_optimizers(trainer) if schedule_free_training(o)]
    if not optimizers:
        return  # eval mode already (after validation): Lightning's dump is the eval one
    for optimizer in optimizers:
        optimizer.eval()
    ids = {id(p) for o in optimizers for g in schedule_free_groups(o) for p in g["params"]}
    names = {n for n, p in pl_module.named_parameters(remove_duplicate=False) if id(p) in ids}
    state = trainer.strategy.lightning_module_state_dict()
    checkpoint["state_dict"] = {k: v.detach().clone() if k in names else v for k, v in state.items()}
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]
    for optimizer in optimizers:
        optimizer.train()
