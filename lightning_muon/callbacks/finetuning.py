"""``UnfreezeOnResume``: a backbone that ``BaseFinetuning`` unfroze before a checkpoint trains again after it.

Lightning's ``BaseFinetuning`` (``BackboneFinetuning`` included) freezes its modules in
``setup`` on every fit, a resumed one too, and on resume puts the param groups it had added
back on the optimizer, but not the ``requires_grad`` of their parameters: a backbone
unfrozen before the checkpoint comes back frozen and never trains again, without a word
(Lightning-AI/pytorch-lightning#21901, lightning 2.6). ``MuonModuleMixin`` adds this callback
when the trainer has a ``BaseFinetuning``; it runs after it at fit start and makes trainable
again every module with a parameter in a ``Muon``'s groups that does not require grad
(``BaseFinetuning.make_trainable``: BatchNorm statistics tracked again too). The mixin's
routing leaves frozen parameters out of the groups, so on a fresh fit there are none.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from typing_extensions import override

from lightning_muon.muon import Muon

__all__ = ["UnfreezeOnResume"]


class UnfreezeOnResume(Callback):
    """At fit start, after ``BaseFinetuning``: the parameters its restored groups hold require grad again."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        frozen = set()
        for optimizer in trainer.optimizers:
            inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if isinstance(inner, Muon):
                frozen |= {id(p) for g in inner.param_groups for p in g["params"] if not p.requires_grad}
        owners = [m for m in pl_module.modules() if any(id(p) in frozen for p in m.parameters(recurse=False))]
        BaseFinetuning.make_trainable(owners)
