"""Lightning's lr finder on the bundled character-level GPT, against the lr the quality benchmark found best.

``Tuner(trainer).lr_find`` on ``CharGPTModule`` as ``bench_quality.py`` trains its Muon run
(``lightning_muon_demo.experiment``: 2 layers, width 128, context 64, batch 32, Muon with
``match_rms_adamw`` at lr 0.01, AdamW at 3e-3 on embeddings, head and vectors). The sweep
moves every param group by one factor (``MuonModuleMixin`` reads the finder's lr as the Muon
lr and gives each group its configured share: ``lightning_muon.one_lr``), so its curve and
suggestion are in Muon lrs. Prints the suggestion beside the quality benchmark's best Muon lr
(``DEFAULT_LR["muon"]``: 0.01, the best of 0.0025, 0.005 and 0.01 at seed 0; 0.02 and 0.04
did worse in a first sweep), writes the curve as a PNG and a JSON report. With ``--train``
it also trains the benchmark's 300 steps at the suggestion and at the benchmark's lr (seed 0)
and prints both final validation losses.

Usage::

    python benchmarks/bench_lr_find.py                           # the sweep, about a minute on a 2-core CPU
    python benchmarks/bench_lr_find.py --train                   # and two 300-step runs
    python benchmarks/bench_lr_find.py --plot docs/lr_finder.png
    python benchmarks/bench_lr_find.py --quick                   # a tiny model (smoke test)

Writes JSON (default benchmarks/results/bench_lr_find.json) and the PNG (default
benchmarks/results/lr_finder.png).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from benchlib.harness import check_device, describe_machine, machine_line
from lightning.pytorch.tuner import Tuner

from lightning_muon_demo.experiment import DEFAULT_LR, RunSpec, build_run, train

RESULTS = Path(__file__).resolve().parent / "results"
# The quality benchmark's Muon lrs at seed 0 (bench_quality.MUON_LRS), for the plot's marks.
QUALITY_SWEEP = (0.0025, 0.005, 0.01)


def find_lr(spec: RunSpec, min_lr: float, max_lr: float, num_training: int, device: str, root: Path) -> dict[str, Any]:
    """``Tuner.lr_find`` on ``spec``'s module and data; the curve, the suggestion and the config it tuned.

    ``root``: where the finder keeps its checkpoint of the initial state while it sweeps.
    """
    module, data = build_run(spec)
    before = module.resolve_muon_config()
    device = torch.device(device)
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=spec.steps,
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    start = time.perf_counter()
    finder = Tuner(trainer).lr_find(
        module, datamodule=data, min_lr=min_lr, max_lr=max_lr, num_training=num_training, early_stop_threshold=None
    )
    seconds = time.perf_counter() - start
    suggestion = finder.suggestion()
    after = module.resolve_muon_config()  # update_attr: the suggestion, every other lr by the same factor
    return {
        "finder": finder,
        "lr": finder.results["lr"],
        "loss": finder.results["loss"],
        "suggestion": suggestion,
        "suggestion_index": finder._optimal_idx,
        "config_before": {"lr": before.matrix.lr, "adamw_lr": before.scalar.lr},
        "config_after": {"lr": after.matrix.lr, "adamw_lr": after.scalar.lr},
        "seconds": seconds,
    }


def plot(result: dict[str, Any], best: float, path: Path, title: str) -> Path:
    """The finder's curve (Lightning's ``_LRFinder.plot``), its suggestion, and the quality benchmark's lrs."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    result["finder"].plot(suggest=True, ax=ax)
    for lr in QUALITY_SWEEP:
        ax.axvline(lr, color="grey", alpha=0.3, linewidth=1)
    ax.axvline(best, color="green", linestyle="--", label=f"quality benchmark's best Muon lr ({best:g})")
    if result["suggestion"] is not None:
        ax.axvline(
            result["suggestion"],
            color="red",
            linestyle=":",
            label=f"lr finder's suggestion ({result['suggestion']:.3g})",
        )
    ax.set_xlabel("Muon lr (every other group at its configured share)")
    ax.set_ylabel("training loss (smoothed, nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-lr", type=float, default=1e-4, help="the sweep's first Muon lr")
    parser.add_argument("--max-lr", type=float, default=1.0, help="the sweep's last Muon lr")
    parser.add_argument("--num-training", type=int, default=100, help="steps of the sweep")
    parser.add_argument("--train", action="store_true", help="also train at the suggestion and at the benchmark's lr")
    parser.add_argument("--quick", action="store_true", help="a tiny model and a short sweep (smoke test)")
    parser.add_argument("--plot", type=Path, default=RESULTS / "lr_finder.png", help="the curve's PNG")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_lr_find.json", help="JSON output")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    args = parser.parse_args(argv)
    if not (0 < args.min_lr < args.max_lr) or args.num_training < 13:
        parser.error("need 0 < --min-lr < --max-lr and --num-training >= 13 (the suggestion skips 10 + 1 points)")
    return check_device(parser, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = RunSpec(optimizer="muon")  # the quality benchmark's Muon run, at its best lr
    if args.quick:
        spec = RunSpec(optimizer="muon", n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, val_samples=8,
                       max_chars=100_000, steps=40, eval_every=20)  # fmt: skip
        args.num_training = min(args.num_training, 16)
    best = DEFAULT_LR["muon"]
    machine = machine_line(describe_machine(args.device))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = find_lr(spec, args.min_lr, args.max_lr, args.num_training, args.device, args.out.parent)
    suggestion = result["suggestion"]
    print(f"machine: {machine}")
    print(
        f"lr finder: {args.num_training} steps, Muon lr {args.min_lr:g} to {args.max_lr:g} ({result['seconds']:.0f} s)"
    )
    shown = "none (too few finite points)" if suggestion is None else f"{suggestion:.4g}"
    print(f"lr finder's suggestion (Muon lr): {shown}")
    print(f"quality benchmark's best Muon lr: {best:g} (swept {', '.join(f'{lr:g}' for lr in QUALITY_SWEEP)})")
    if suggestion is not None:
        print(f"suggestion / best: {suggestion / best:.3g}")
        after = result["config_after"]
        print(
            f"the tuned config: lr {after['lr']:.4g}, adamw_lr {after['adamw_lr']:.4g} (ratio kept from 0.01 : 0.003)"
        )
    trained = {}
    if args.train and suggestion is not None:
        adamw_share = spec.adamw_lr / best
        for name, lr in (("suggestion", suggestion), ("quality_best", best)):
            run = train(RunSpec(**{**asdict(spec), "lr": lr, "adamw_lr": lr * adamw_share}), device=args.device)
            trained[name] = {"lr": lr, "final_val_loss": run["val_loss"][-1], "seconds": run["seconds"]}
            print(
                f"trained at Muon lr {lr:.4g} (AdamW {lr * adamw_share:.3g}): final val loss {run['val_loss'][-1]:.4f}"
            )
    png = plot(result, best, args.plot, "lr finder on the bundled char-level GPT (Muon + AdamW, ratio kept)")
    finite = [v for v in result["loss"] if math.isfinite(v)]
    report = {
        "machine": machine,
        "spec": asdict(spec),
        "min_lr": args.min_lr,
        "max_lr": args.max_lr,
        "num_training": args.num_training,
        "quality_best_lr": best,
        "trained": trained,
        "finite_points": len(finite),
        **{k: v for k, v in result.items() if k != "finder"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nplot: {png}\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
