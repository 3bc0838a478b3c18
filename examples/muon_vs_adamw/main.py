"""The main job: train the bundled character-level GPT with Muon and with AdamW, and show the difference.

Run: python examples/muon_vs_adamw/main.py [--config examples/muon_vs_adamw/config.yaml] [--steps 300]
    [--out runs/muon_vs_adamw] [--device cpu|cuda]

Both runs train the same model on the same windows of the default corpus (the Python
standard library's own source) for the same number of steps, with the same schedule.
Writes to ``--out``:

- ``report.md`` and ``report.json``: validation loss per evaluation for both runs, the
  steps each needed to reach AdamW's best validation loss, and a summary of the Muon
  run's last update spectra (UpdateSpectrumMonitor);
- ``loss_curves.png``: both validation-loss curves;
- ``muon/`` and ``adamw/``: the CSV logs of each run.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import torch
import yaml
from lightning.pytorch.loggers import CSVLogger

from lightning_muon import UpdateSpectrumMonitor
from lightning_muon_demo.experiment import RunSpec, machine_name, plot_curves, steps_to_reach, train

SPECTRA_COLUMNS = (
    "sigma_max",
    "sigma_min",
    "stable_rank",
    "effective_rank",
    "orthogonality_error",
    "update_to_weight_rms",
)


def last_spectra(metrics_csv: Path) -> dict[str, dict[str, float]]:
    """``{matrix: {metric: value}}`` from the last logged values of the ``spectra/...`` columns."""
    latest: dict[str, float] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            latest.update({k: float(v) for k, v in row.items() if k.startswith("spectra/") and v not in ("", None)})
    table: dict[str, dict[str, float]] = {}
    for key, value in latest.items():
        _, name, metric = key.split("/", 2) if key.count("/") >= 2 else (None, key, "")
        table.setdefault(name, {})[metric] = value
    return table


def summarize(muon: dict, adamw: dict) -> dict:
    target = min(adamw["val_loss"])
    adamw_steps = steps_to_reach(adamw["steps"], adamw["val_loss"], target)
    muon_steps = steps_to_reach(muon["steps"], muon["val_loss"], target)
    return {
        "adamw_best_val_loss": target,
        "adamw_steps_to_best": adamw_steps,
        "muon_steps_to_adamw_best": muon_steps,
        "step_ratio": None if muon_steps is None else muon_steps / adamw_steps,
        "muon_final_val_loss": muon["val_loss"][-1],
        "adamw_final_val_loss": adamw["val_loss"][-1],
    }


def write_report(out: Path, runs: dict, summary: dict, spectra: dict, machine: str) -> Path:
    muon, adamw = runs["muon"], runs["adamw"]
    lines = [
        "# Muon vs AdamW on the bundled character-level GPT",
        "",
        f"Machine: {machine}. Same model, data order, schedule and step budget for both.",
        "",
        f"- AdamW's best validation loss: **{summary['adamw_best_val_loss']:.4f}** "
        f"(reached at step {summary['adamw_steps_to_best']})",
    ]
    if summary["muon_steps_to_adamw_best"] is None:
        lines.append("- Muon did not reach it within the budget")
    else:
        lines.append(
            f"- Muon reached it at step **{summary['muon_steps_to_adamw_best']}**: "
            f"{summary['step_ratio']:.2f}x the steps AdamW needed"
        )
    lines += [
        f"- Final validation loss: Muon {summary['muon_final_val_loss']:.4f}, "
        f"AdamW {summary['adamw_final_val_loss']:.4f}",
        f"- Wall time: Muon {muon['seconds']:.0f} s, AdamW {adamw['seconds']:.0f} s",
        "",
        "## Validation loss per evaluation (nats per byte)",
        "",
        "| step | Muon | AdamW |",
        "|---:|---:|---:|",
    ]
    adamw_by_step = dict(zip(adamw["steps"], adamw["val_loss"]))
    for step, loss in zip(muon["steps"], muon["val_loss"]):
        other = adamw_by_step.get(step)
        lines.append(f"| {step} | {loss:.4f} | {'' if other is None else f'{other:.4f}'} |")
    if spectra:
        lines += [
            "",
            "## Last update spectra of the Muon run (UpdateSpectrumMonitor)",
            "",
            "| matrix | " + " | ".join(SPECTRA_COLUMNS) + " |",
            "|---|" + "---:|" * len(SPECTRA_COLUMNS),
        ]
        for name, metrics in sorted(spectra.items()):
            cells = [f"{metrics[c]:.4g}" if c in metrics else "" for c in SPECTRA_COLUMNS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (overrides the config)")
    parser.add_argument("--eval-every", type=int, default=None, help="validation interval in steps")
    parser.add_argument("--out", type=Path, default=Path("runs/muon_vs_adamw"), help="output folder")
    parser.add_argument(
        "--device", default="cpu", help="cpu (the default, what the README's numbers come from) or cuda[:i]: one GPU"
    )
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    settings = yaml.safe_load(args.config.read_text())
    overrides = {"steps": args.steps, "eval_every": args.eval_every}
    settings |= {k: v for k, v in overrides.items() if v is not None}
    spectra_every = settings.pop("spectra_every_n_steps")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{machine_name(args.device)}; trained on {args.device}"

    runs = {}
    for optimizer in ("muon", "adamw"):
        spec = RunSpec(optimizer=optimizer, **settings)
        print(f"\n== {spec.label}: {spec.steps} steps ==")
        callbacks = [UpdateSpectrumMonitor(every_n_steps=spectra_every)] if optimizer == "muon" else []
        logger = CSVLogger(out, name=optimizer, version="")
        runs[optimizer] = train(
            spec, progress_bar=True, callbacks=callbacks, logger=logger, root_dir=out, device=args.device
        )
    spectra = last_spectra(out / "muon" / "metrics.csv")
    summary = summarize(runs["muon"], runs["adamw"])
    plot = plot_curves(
        [runs["muon"], runs["adamw"]], out / "loss_curves.png", "Character-level GPT on the Python stdlib source"
    )
    (out / "report.json").write_text(json.dumps({"machine": machine, "summary": summary, "runs": runs}, indent=2))
    report = write_report(out, runs, summary, spectra, machine)
    print()
    print(report.read_text().split("## Validation")[0].strip())
    print(f"\nreport: {report}\nplot:   {plot}\njson:   {out / 'report.json'}")


if __name__ == "__main__":
    main()
