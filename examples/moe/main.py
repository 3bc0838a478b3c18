"""A tiny transformers mixture of experts trained with routed Muon, against AdamW for the same steps.

Run (one CPU process; 2 Muon lrs and 2 AdamW lrs, 600 steps each, the best of each reported):
    python examples/moe/main.py
    python examples/moe/main.py --muon-lr 0.01 --adamw-lr 0.003 --max-steps 200
Several processes (FSDP2, gloo on CPU; Lightning starts the second by re-running this script):
    python examples/moe/main.py --strategy muon_fsdp --devices 2
    python examples/moe/main.py --strategy muon_fsdp --accelerator gpu --devices 8

The model is a transformers Mixtral (or Qwen3-MoE: ``model`` in ``config.yaml``) built from a
config with random weights: 2 layers, width 64, 4 experts, top-2, a byte vocabulary. Since
transformers 5 each layer stores its experts as two fused 3-D stacks, ``gate_up_proj``
``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``. The Muon run routes each stack as a batch of
per-expert matrices (gate and up apart), the attention matrices to Muon, and the embeddings,
head, routers and norms to AdamW (the routing report is printed); the AdamW run puts every
parameter on AdamW. Both train on the Python standard library's own source read as bytes
(nothing is downloaded), from the same initial weights and windows. Prints every run's final
validation loss and the gain of the best Muon run over the best AdamW run, and writes
``report.md``, ``report.json`` and ``loss_curves.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_muon import MuonConfig, MuonModuleMixin
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.experiment import ValLossRecorder, machine_name, plot_curves, steps_to_reach

HERE = Path(__file__).resolve().parent
NAMES = {"muon": "Muon", "adamw": "AdamW"}
say = rank_zero_only(print)


class MoEModule(MuonModuleMixin, pl.LightningModule):
    """A transformers causal LM built from ``model`` (AutoConfig fields); ``configure_optimizers`` from the mixin.

    Trains on next-byte cross-entropy plus the model's load-balancing loss (when the config
    has ``output_router_logits``); logs ``val_loss``, the cross-entropy alone (nats per byte).
    """

    def __init__(self, model: dict[str, Any], muon_config: MuonConfig | dict[str, Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        fields = dict(model)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        out = self.model(input_ids=inputs)
        loss = nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        if getattr(out, "aux_loss", None) is not None:  # the routers' load-balancing loss
            self.log("aux_loss", out.aux_loss)
            loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss


def train(name: str, lr: float, settings: dict, args: argparse.Namespace, report_routing: bool) -> dict[str, Any]:
    """One run: ``name`` is ``"muon"`` (``lr`` is the Muon lr) or ``"adamw"`` (``lr`` is every parameter's)."""
    t = settings["train"]
    written = MuonConfig.from_any(settings[f"{name}_config"])
    section = "matrix" if name == "muon" else "scalar"  # the AdamW run's every parameter is in the scalar section
    muon_config = dataclasses.replace(
        written,
        **{section: getattr(written, section).replace(lr=lr)},
        schedule=dataclasses.replace(written.schedule, total_steps=t["steps"]),
    )
    pl.seed_everything(t["seed"], verbose=False)  # the same initial weights for every run
    module = MoEModule(settings["model"], muon_config)
    if report_routing:
        say(f"\n{muon_config.route(module).report()}")
    data = CharTextDataModule(
        block_size=t["block_size"],
        batch_size=t["batch_size"] // args.devices,  # per process: the global batch stays the same
        val_samples=t["val_samples"],
        max_chars=t["max_chars"],
        train_samples_per_epoch=t["steps"] * t["batch_size"],
        seed=t["seed"],
    )
    recorder = ValLossRecorder()
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=t["steps"],
        val_check_interval=t["eval_every"],
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=t["gradient_clip_val"],
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset and num_workers notices
        trainer.fit(module, datamodule=data)
        if not recorder.steps or recorder.steps[-1] != trainer.global_step:
            trainer.validate(module, datamodule=data, verbose=False)
    label = f"{NAMES[name]} (lr {lr:g})"
    seconds = time.perf_counter() - start
    say(f"{label}: final validation loss {recorder.val_loss[-1]:.4f}, {trainer.global_step} steps in {seconds:.0f} s")
    return {"name": name, "lr": lr, "label": label, "steps": recorder.steps, "val_loss": recorder.val_loss,
            "seconds": seconds, "world_size": trainer.world_size}  # fmt: skip


def write_report(out: Path, runs: list[dict], best: dict[str, dict], settings: dict, where: str) -> Path:
    """``report.md`` and ``report.json``: every run's final loss and wall time, then both best curves."""
    muon, adamw = best["muon"], best["adamw"]
    gain = adamw["val_loss"][-1] - muon["val_loss"][-1]
    reached = steps_to_reach(muon["steps"], muon["val_loss"], adamw["val_loss"][-1])
    lines = [
        "# Mixture of experts: routed Muon vs AdamW",
        "",
        f"{where}. {settings['train']['steps']} steps per run, batch {settings['train']['batch_size']} "
        f"x {settings['train']['block_size']} bytes.",
        "",
        "| optimizer | lr | final val loss | wall time |",
        "|---|---:|---:|---:|",
        *(f"| {NAMES[r['name']]} | {r['lr']:g} | {r['val_loss'][-1]:.4f} | {r['seconds']:.0f} s |" for r in runs),
        "",
        f"Best Muon {muon['val_loss'][-1]:.4f} (lr {muon['lr']:g}), best AdamW {adamw['val_loss'][-1]:.4f} "
        f"(lr {adamw['lr']:g}): Muon lower by **{gain:.4f}**."
        + (f" Muon reached AdamW's final loss at step {reached}." if reached is not None else ""),
        "",
        "| step | Muon | AdamW |",
        "|---:|---:|---:|",
        *(f"| {s} | {m:.4f} | {a:.4f} |" for s, m, a in zip(muon["steps"], muon["val_loss"], adamw["val_loss"])),
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    summary = {"where": where, "gain": gain, "best": {k: v["lr"] for k, v in best.items()}}
    (out / "report.json").write_text(json.dumps({**summary, "runs": runs, "settings": settings}, indent=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument("--strategy", choices=("auto", "muon_ddp", "muon_fsdp"), default="auto")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="overrides train.steps")
    parser.add_argument("--eval-every", type=int, default=None, help="overrides train.eval_every")
    parser.add_argument("--val-samples", type=int, default=None, help="overrides train.val_samples")
    parser.add_argument("--muon-lr", type=float, nargs="+", default=None, help="overrides train.muon_lrs")
    parser.add_argument("--adamw-lr", type=float, nargs="+", default=None, help="overrides train.adamw_lrs")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (cores / devices)")
    parser.add_argument("--out", type=Path, default=Path("runs/moe"))
    args = parser.parse_args()
    settings = yaml.safe_load(args.config.read_text())
    t = settings["train"]
    overrides = {"steps": args.max_steps, "eval_every": args.eval_every, "val_samples": args.val_samples,
                 "muon_lrs": args.muon_lr, "adamw_lrs": args.adamw_lr}  # fmt: skip
    t |= {k: v for k, v in overrides.items() if v is not None}
    t["eval_every"] = min(t["eval_every"], t["steps"])
    if t["batch_size"] % args.devices:
        parser.error(f"train.batch_size {t['batch_size']} must divide among {args.devices} devices")
    if args.accelerator == "cpu":  # the processes share the cores; on a busy machine, --threads 1
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.devices))
    # Lightning's notices and the routing table it logs at every fit: the Muon run's table is printed below.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    runs = [train("muon", lr, settings, args, report_routing=i == 0) for i, lr in enumerate(t["muon_lrs"])]
    runs += [train("adamw", lr, settings, args, report_routing=False) for lr in t["adamw_lrs"]]
    if rank_zero_only.rank != 0:
        return
    best = {n: min((r for r in runs if r["name"] == n), key=lambda r: r["val_loss"][-1]) for n in ("muon", "adamw")}
    args.out.mkdir(parents=True, exist_ok=True)
    where = f"{machine_name()}; {runs[0]['world_size']} process(es), strategy {args.strategy}"
    report = write_report(args.out, runs, best, settings, where)
    model = settings["model"]
    title = f"{model['model_type']} MoE, {model['hidden_size']} wide, on stdlib source (bytes)"
    plot = plot_curves([best["muon"], best["adamw"]], args.out / "loss_curves.png", title)
    gain = best["adamw"]["val_loss"][-1] - best["muon"]["val_loss"][-1]
    print(
        f"\nFinal validation loss: Muon {best['muon']['val_loss'][-1]:.4f} (lr {best['muon']['lr']:g}), "
        f"AdamW {best['adamw']['val_loss'][-1]:.4f} (lr {best['adamw']['lr']:g}); Muon lower by {gain:.4f}"
    )
    print(f"report: {report}\nloss curves: {plot}")


if __name__ == "__main__":
    main()
