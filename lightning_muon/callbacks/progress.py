"""``MaxStepsProgressBar``: Lightning's Rich progress bar, with an epoch counter that is true under ``max_steps``.

``Trainer(max_steps=N)`` without ``max_epochs`` sets ``max_epochs=-1``, and
``RichProgressBar`` writes ``Epoch {e}/{max_epochs - 1}``: ``Epoch 0/-2``. This bar writes
the epoch in which the run ends instead (``last_epoch``), or no total where that cannot be
known. ``MuonModuleMixin`` puts it in place of a plain ``RichProgressBar`` (with that bar's
settings) when ``max_steps`` is set; Lightning's ``TQDMProgressBar`` shows no total and is
left alone.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["MaxStepsProgressBar", "last_epoch"]


def last_epoch(trainer: pl.Trainer) -> int | None:
    """The index of the epoch in which the fit ends, or None where it is not known.

    Lightning steps the optimizer every ``accumulate_grad_batches`` batches and on the last
    batch of an epoch, so an epoch of ``b`` batches takes ``s = ceil(b / accumulate_grad_batches)``
    steps, and step ``max_steps`` falls in epoch ``ceil(max_steps / s) - 1`` of a run that
    began at step 0 (a resumed run included). ``max_epochs`` caps it. Without ``max_steps``
    the answer is ``max_epochs - 1``; where the steps per epoch are not known (a loader
    without a length, manual optimization, whose steps per batch are the module's), only
    ``max_epochs`` can say, and with ``max_epochs=-1`` nothing can.
    """
    max_epochs = trainer.max_epochs
    by_epochs = max_epochs - 1 if max_epochs is not None and max_epochs >= 0 else None
    max_steps = trainer.max_steps
    if max_steps is None or max_steps < 0:
        return by_epochs
    batches = trainer.num_training_batches
    module = trainer.lightning_module
    if not math.isfinite(batches) or batches < 1 or not module.automatic_optimization:
        return by_epochs
    steps_per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
    by_steps = max(0, math.ceil(max_steps / steps_per_epoch) - 1)
    return by_steps if by_epochs is None else min(by_steps, by_epochs)


class MaxStepsProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training description reads ``Epoch {e}/{last_epoch(trainer)}``.

    ``Epoch {e}`` alone where the last epoch is not known. ``like(bar)`` makes one with the
    settings of an existing ``RichProgressBar``.
    """

    @classmethod
    def like(cls, bar: RichProgressBar) -> MaxStepsProgressBar:
        """A ``MaxStepsProgressBar`` with ``bar``'s refresh rate, ``leave``, theme and console settings."""
        return cls(refresh_rate=bar.refresh_rate, leave=bar._leave, theme=bar.theme, console_kwargs=bar._console_kwargs)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        # RichProgressBar's one place for this text: "Epoch e/last", padded to the
        # validation description's width as it does (the two bars share a column).
        last = last_epoch(self.trainer)
        description = f"Epoch {current_epoch}" + ("" if last is None else f"/{last}")
        return f"{description:{len(self.validation_description)}}"


def replaces_default_bar(trainer: Any) -> MaxStepsProgressBar | None:
    """A ``MaxStepsProgressBar`` to replace the trainer's plain ``RichProgressBar`` when ``max_steps`` is set."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if type(bar) is not RichProgressBar or trainer.max_steps is None or trainer.max_steps < 0:
        return None
    return MaxStepsProgressBar.like(bar)
