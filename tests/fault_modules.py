"""A NaN in a replicated gradient on one rank only: every rank must skip, or raise, alike.

``fault_worker(rank, world_size, strategy, mode)`` is one two-rank fit under ``muon_ddp`` or
``muon_fsdp`` with ``nonfinite`` set to ``skip`` or ``raise``, on a rank of
``dist_utils.run_distributed`` (whose timeout tells a hung rank from one that returned).
Rank 1 puts a NaN into its gradient of the head's bias (an AdamW parameter, never a Muon
matrix) after backward at step 2, as a per-rank hook or custom clipping could. Each rank
returns what happened, whether its fit ended or raised.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl
from ddp_modules import TinyRegressor
from fsdp_modules import FSDPRegressor, trainer_kwargs

from lightning_muon import AdamWSettings, MuonConfig, MuonSettings, StateSettings

BAD_RANK, BAD_STEP, STEPS = 1, 2, 4


class PoisonOneRank(pl.Callback):
    def __init__(self, name: str) -> None:
        self.name = name

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == BAD_RANK and trainer.global_step == BAD_STEP:
            grad = pl_module.get_parameter(self.name).grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan")


def fault_worker(rank: int, world_size: int, strategy: str, mode: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes made outside Lightning
    config = MuonConfig(
        matrix=MuonSettings(lr=0.02, ns_dtype="float32"),
        scalar=AdamWSettings(lr=1e-2),
        state=StateSettings(nonfinite=mode),
    )
    root = tempfile.mkdtemp()
    if strategy == "muon_ddp":
        model, name = TinyRegressor(config), "head.bias"
        kwargs = dict(accelerator="cpu", max_steps=STEPS, logger=False, enable_progress_bar=False)
        kwargs.update(enable_model_summary=False, default_root_dir=root, use_distributed_sampler=False)
    else:
        model, name = FSDPRegressor(config), "net.head.bias"
        kwargs = trainer_kwargs(root, STEPS, 1, None, "32-true")
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=[PoisonOneRank(name)], **kwargs)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
    except FloatingPointError as err:
        return {"ok": False, "error": str(err)}
    params = {}
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # every rank calls it
        params[n] = full.detach().reshape(-1).tolist()
    skipped = any("step was skipped" in str(w.message) for w in caught)
    return {"ok": True, "global_step": trainer.global_step, "skipped": skipped, "params": params}
