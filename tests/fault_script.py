"""A NaN in a replicated gradient on one rank only: every rank must skip, or raise, alike.

Run as ``python tests/fault_script.py STRATEGY MODE OUT_DIR`` (``muon_ddp`` or ``muon_fsdp``;
``skip`` or ``raise``, the ``nonfinite`` setting; two processes launched by Lightning, which
re-runs this script for rank 1, hence one fit per run). Rank 1 puts a NaN into its
gradient of the head's bias (an AdamW parameter, never a Muon matrix) after backward at
step 2, as a per-rank hook or custom clipping could. Each rank writes what happened to
``OUT_DIR/<mode>-rank<r>.json`` whether its fit ended or raised, and rank 0 waits for every
file, so the caller (under a timeout) learns that every rank returned.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl
import torch
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


def fit(strategy: str, mode: str, out: Path) -> None:
    config = MuonConfig(
        matrix=MuonSettings(lr=0.02, ns_dtype="float32"),
        scalar=AdamWSettings(lr=1e-2),
        state=StateSettings(nonfinite=mode),
    )
    root = out / f"{strategy}-{mode}"
    if strategy == "muon_ddp":
        model, name = TinyRegressor(config), "head.bias"
        kwargs = dict(accelerator="cpu", max_steps=STEPS, logger=False, enable_progress_bar=False)
        kwargs.update(enable_model_summary=False, default_root_dir=root, use_distributed_sampler=False)
    else:
        model, name = FSDPRegressor(config), "net.head.bias"
        kwargs = trainer_kwargs(root, STEPS, 1, None, "32-true")
    trainer = pl.Trainer(devices=2, strategy=strategy, callbacks=[PoisonOneRank(name)], **kwargs)
    result: dict = {"mode": mode}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
        params = {}
        for n, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # every rank calls it
            params[n] = full.detach().reshape(-1).tolist()
        skipped = any("step was skipped" in str(w.message) for w in caught)
        result.update(ok=True, global_step=trainer.global_step, skipped=skipped, params=params)
    except FloatingPointError as err:
        result.update(ok=False, error=str(err))
    rank = trainer.global_rank
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        deadline = time.monotonic() + 60
        while not all((out / f"{mode}-rank{r}.json").exists() for r in range(2)):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank 1 never reported the {mode} fit")
            time.sleep(0.2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    fit(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
