"""``bench_spectra.py --memory``: what the callbacks that work after the optimizer step add to its memory.

One process, a Lightning fit of the demo CharGPT (d=768 x 2; d=64 quick), the second
optimizer step measured from ``on_before_optimizer_step`` (gradients ready) to the end of
``on_train_batch_end`` (the callbacks' post-step work): with ``UpdateSpectrumMonitor``
(every step), with ``QKClip`` (a threshold under the logits, so that heads are clipped),
with both, against none.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from benchlib.harness import progress, table
from benchlib.memory import StepMeter, mib, our_kwargs, print_sites
from benchlib.step_table import ADAMW_LR, LR, VOCAB, WEIGHT_DECAY
from lightning_muon import AdamWSettings, MuonConfig, MuonSettings, QKClip, StateSettings, UpdateSpectrumMonitor
from lightning_muon_demo.module import CharGPTModule

QK_CLIP_THRESHOLD = 1e-3  # under the logits at initialization: heads are clipped, the clip's work runs
CALLBACK_CONFIGS = {
    "none": "no callbacks",
    "monitor": "UpdateSpectrumMonitor",
    "qk_clip": "QKClip",
    "both": "UpdateSpectrumMonitor + QKClip",
}


def model_size(quick: bool) -> dict[str, int]:
    """The CharGPT fitted, and its batch."""
    if quick:
        return dict(n_embd=64, n_layer=2, n_head=2, block_size=16, batch=2)
    return dict(n_embd=768, n_layer=2, n_head=12, block_size=64, batch=4)


class StepProbe(pl.Callback):
    """Measures one optimizer step of a fit: from ``on_before_optimizer_step`` (gradients ready) to the end of
    ``on_train_batch_end`` (list it after the callbacks it measures)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.meter: StepMeter | None = None
        self.result: dict[str, Any] | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.at_step or self.meter is not None:
            return
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self.meter = StepMeter(pl_module.device, params, list(trainer.optimizers))
        self.meter.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.meter is not None and self.result is None:
            self.result = self.meter.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.meter is not None and self.result is None:
            self.result = self.meter.stop()  # leaves the tracker's dispatch mode


def _fit(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    m, device = cfg["callbacks_model"], torch.device(cfg["device"])
    pl.seed_everything(0, verbose=False)
    config = MuonConfig(
        matrix=MuonSettings(lr=LR, weight_decay=WEIGHT_DECAY),
        scalar=AdamWSettings(lr=ADAMW_LR),
        state=StateSettings(**our_kwargs(cfg)),
    )
    module = CharGPTModule(
        n_layer=m["n_layer"], n_head=m["n_head"], n_embd=m["n_embd"], block_size=m["block_size"], muon_config=config
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (2 * m["batch"], m["block_size"] + 1), generator=gen)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=m["batch"]
    )
    monitor = UpdateSpectrumMonitor(every_n_steps=1) if name in ("monitor", "both") else None
    clip = QKClip(threshold=QK_CLIP_THRESHOLD) if name in ("qk_clip", "both") else None
    callbacks: list[pl.Callback] = [c for c in (monitor, clip) if c is not None]
    probe = StepProbe(at_step=1)
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=2,
        logger=False,
        callbacks=[*callbacks, probe],  # the probe last: its batch end comes after theirs
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,  # QKClip's exact maxima on every step, as on a logged one
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no logger, small data, few steps
        trainer.fit(module, data)
    if probe.result is None:
        raise RuntimeError(f"callbacks {name}: the second optimizer step was not measured")
    # What the callbacks did in the fit's two steps: spectra logged, heads clipped (H per layer and step).
    return {
        **probe.result,
        "monitor_logged_steps": monitor.logged_steps if monitor is not None else 0,
        "qk_clip_clipped_heads": clip.clipped_heads_total if clip is not None else 0,
    }


def bench_callbacks(cfg: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for key, label in CALLBACK_CONFIGS.items():
        row = _fit(key, cfg)
        progress(f"callbacks: {label}: peak {mib(row['peak_bytes']):.1f} MiB")
        rows.append({"config": key, "label": label, **row})
    base = rows[0]
    for row in rows:
        row["transient_over_none_bytes"] = row["transient_bytes"] - base["transient_bytes"]
        row["peak_per_none"] = row["peak_bytes"] / base["peak_bytes"]
    return {"model": cfg["callbacks_model"], "qk_clip_threshold": QK_CLIP_THRESHOLD, "rows": rows}


def print_callbacks(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    m = section["model"]
    clipped = max(r["qk_clip_clipped_heads"] for r in section["rows"])
    print(
        f"\n== callbacks: one process, a Lightning fit of CharGPT d={m['n_embd']} x {m['n_layer']} "
        f"({m['n_head']} heads), batch {m['batch']} x {m['block_size']}; the second optimizer step =="
    )
    rows = [
        [
            r["label"],
            mib(r["params_bytes"]),
            mib(r["grads_bytes"]),
            mib(r["state_bytes"]),
            mib(r["peak_bytes"]),
            mib(r["transient_bytes"]),
            mib(r["transient_over_none_bytes"]),
            r["peak_per_none"],
        ]
        for r in section["rows"]
    ]
    headers = ["callbacks", "params MiB", "grads MiB", "state MiB", "peak MiB", "transient MiB"]
    headers += ["transient - none's MiB", "peak / none's"]
    print(table(headers, rows))
    print(
        "measured from on_before_optimizer_step to the end of on_train_batch_end (the callbacks' post-step work):\n"
        f"UpdateSpectrumMonitor(every_n_steps=1) observes every update (an update hook: the Nesterov update is then\n"
        f"not donated to Newton-Schulz); QKClip(threshold={section['qk_clip_threshold']}) clipped "
        f"{clipped} of {m['n_layer'] * m['n_head'] * 2} heads over the fit's 2 steps"
    )
    print_sites([(r["label"], r) for r in section["rows"]])
