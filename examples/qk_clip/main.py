"""QK-clip on the demo GPT at a high Muon lr: the max attention logit per step, with and without.

    python examples/qk_clip/main.py                   # 80 steps each (~5 s a run on 2 CPU cores), or a GPU
    python examples/qk_clip/main.py --steps 20        # a quick look

Three runs from the same seed and data: ``QKClip(clip=False)`` (measures and logs only),
``QKClip(threshold=100)`` (Kimi K2's clip, after each step) and
``QKClip(threshold=100, cap_forward=True)`` (the same clip, and every training forward caps
its own heads over 100). For each step the largest logit a training softmax used: the
forward's maximum, or for the capped run ``min(maximum, 100)``, which is what the cap makes
of it (the tests check the softmax's inputs). Prints each run's largest such logit and
final validation loss, and writes ``report.json`` and ``max_logit.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_muon import AdamWSettings, MuonConfig, MuonSettings, QKClip, ScheduleSettings
from lightning_muon_demo import CharGPTModule, CharTextDataModule


class MaxLogitRecorder(pl.Callback):
    """Keeps ``qk_clip/max_logit`` of every step (logged by ``QKClip`` just before this runs)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.values.append(float(trainer.callback_metrics["qk_clip/max_logit"]))


def run(clip: QKClip, args: argparse.Namespace) -> dict:
    pl.seed_everything(0, verbose=False)
    config = MuonConfig(
        matrix=MuonSettings(lr=args.lr, weight_decay=0.0, adjust_lr="match_rms_adamw"),
        scalar=AdamWSettings(lr=3e-3),
        schedule=ScheduleSettings(warmup=0, falloff="constant"),
    )
    model = CharGPTModule(block_size=64, n_layer=2, n_head=4, n_embd=64, muon_config=config)
    data = CharTextDataModule(block_size=64, batch_size=16, max_chars=400_000, val_samples=64, seed=0)
    recorder = MaxLogitRecorder()
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        val_check_interval=args.steps,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # QKClip logs on the steps Lightning writes: here every step
        callbacks=[clip, recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset notices
        trainer.fit(model, data)
    forward = recorder.values  # each step's maximum before any cap or clip
    used = [min(v, clip.threshold) for v in forward] if clip.cap_forward else forward
    return {"max_logit": used, "forward_max_logit": forward, "val_loss": float(trainer.callback_metrics["val_loss"])}


def plot(runs: dict, threshold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for (label, result), color in zip(runs.items(), ("C0", "C1", "C2")):
        steps = range(1, len(result["max_logit"]) + 1)
        ax.plot(steps, result["max_logit"], color=color, label=label)
        if result["forward_max_logit"] != result["max_logit"]:
            ax.plot(steps, result["forward_max_logit"], color=color, linestyle=":", linewidth=1,
                    label=f"{label}: its forward's maximum before the cap")  # fmt: skip
    ax.axhline(threshold, color="gray", linestyle="--", linewidth=1, label=f"tau = {threshold:g}")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("largest logit a training softmax used")
    ax.set_title("Demo GPT at Muon lr 0.1: largest attention logit per step", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=0.1, help="Muon lr (5x configs/muon.yaml)")
    parser.add_argument("--threshold", type=float, default=100.0)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--out", type=Path, default=Path("runs/qk_clip"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tau = args.threshold
    runs = {
        "without QK-clip": run(QKClip(threshold=tau, clip=False), args),
        f"QKClip(threshold={tau:g})": run(QKClip(threshold=tau), args),
        f"QKClip(threshold={tau:g}, cap_forward=True)": run(QKClip(threshold=tau, cap_forward=True), args),
    }
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.accelerator != "cpu" else "CPU"
    report = {"device": device, "steps": args.steps, "lr": args.lr, "threshold": args.threshold, "runs": runs}
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    plot(runs, args.threshold, args.out / "max_logit.png")
    for label, result in runs.items():
        print(f"{label:>42}: max logit {max(result['max_logit']):9.1f}   final val loss {result['val_loss']:.4f}")
    print(f"device: {device}; wrote {args.out / 'report.json'} and {args.out / 'max_logit.png'}")


if __name__ == "__main__":
    main()
