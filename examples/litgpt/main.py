"""litgpt's GPT pretrained from scratch with Muon under Lightning Fabric, against AdamW for the same steps.

Run (2 CPU processes, gloo; Fabric starts the second one by re-running this script):
    python examples/litgpt/main.py
    python examples/litgpt/main.py --steps 50 --devices 1
    python examples/litgpt/main.py --accelerator gpu --devices 8 --strategy muon_fsdp

The model is a tiny ``litgpt.Config`` (grouped-query attention, LLaMA MLP, RMSNorm) with
litgpt's own GPT-NeoX initialization; the text is the Python standard library's own source,
read as bytes (nothing is downloaded). Both runs go through the same Fabric loop:
``fabric.setup``, ``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``. The Muon
run routes litgpt's parameters with ``route_parameters`` (printed: ``wte`` and ``lm_head`` to
AdamW, norms without decay, the 10 hidden matrices to Muon, Q, K and V of the fused ``qkv``
apart); the AdamW run puts every parameter on AdamW. Writes ``report.md``, ``report.json``
and ``loss_curves.png`` to ``--out`` and prints where they are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import lightning as L
import torch
import yaml
from litgpt.model import GPT, Config
from litgpt.pretrain import initialize_weights
from torch import Tensor, nn

from lightning_muon import MuonConfig
from lightning_muon.fabric import MuonFSDPStrategy
from lightning_muon_demo.data import encode, load_stdlib_corpus

HERE = Path(__file__).resolve().parent


def batch(tokens: Tensor, step: int, size: int, block: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """This rank's rows (``rank::world``) of ``size`` random windows drawn for ``step`` (alike on every rank)."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(tokens.numel() - block - 1, (size,), generator=gen)[rank::world]
    windows = torch.stack([tokens[s : s + block + 1] for s in starts.tolist()]).long()  # (B / W, T + 1)
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def validate(fabric: L.Fabric, model: nn.Module, tokens: Tensor, block: int, batches: int, size: int) -> float:
    """Mean next-byte loss on fixed validation windows, split across ranks, averaged over them."""
    model.eval()
    losses = []
    for i in range(batches):
        x, y = batch(tokens, -1 - i, size, block, fabric.global_rank, fabric.world_size)
        logits = model(fabric.to_device(x))
        losses.append(nn.functional.cross_entropy(logits.flatten(0, 1), fabric.to_device(y).flatten()))
    model.train()
    return float(fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean"))


def train(fabric: L.Fabric, name: str, settings: dict, config: Config, data: tuple[Tensor, Tensor]) -> list[tuple]:
    """One run; returns ``(step, validation loss)`` every ``eval_every`` steps and at the end."""
    t = settings["train"]
    fabric.seed_everything(t["seed"])
    with fabric.init_module():
        model = GPT(config)
    initialize_weights(fabric, model, config.n_layer, config.n_embd)  # litgpt's own pretraining init
    muon_config = MuonConfig.from_any(settings[f"{name}_config"])
    if isinstance(fabric.strategy, MuonFSDPStrategy):  # FSDP2: the optimizer after the model
        model = fabric.setup_module(model)
        optimizer, scheduler = muon_config.build(model, total_steps=t["steps"])
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        optimizer, scheduler = muon_config.build(model, total_steps=t["steps"])
        model, optimizer = fabric.setup(model, optimizer)
    fabric.print(f"\n{name}: routing of litgpt's parameters\n{muon_config.route(model).report()}")
    train_tokens, val_tokens = data
    curve, start = [], time.perf_counter()
    for step in range(t["steps"]):
        if step % t["eval_every"] == 0:
            curve.append((step, validate(fabric, model, val_tokens, config.block_size, t["val_batches"], 16)))
            fabric.print(f"{name} step {step:4d}  val loss {curve[-1][1]:.4f}  ({time.perf_counter() - start:.0f} s)")
        x, y = batch(train_tokens, step, t["batch_size"], config.block_size, fabric.global_rank, fabric.world_size)
        logits = model(fabric.to_device(x))
        fabric.backward(nn.functional.cross_entropy(logits.flatten(0, 1), fabric.to_device(y).flatten()))
        fabric.clip_gradients(model, optimizer, max_norm=t["max_norm"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    curve.append((t["steps"], validate(fabric, model, val_tokens, config.block_size, t["val_batches"], 16)))
    fabric.print(f"{name} step {t['steps']:4d}  val loss {curve[-1][1]:.4f}  ({time.perf_counter() - start:.0f} s)")
    return curve


def report(out: Path, curves: dict[str, list[tuple]], settings: dict, fabric: L.Fabric) -> None:
    """``report.md``, ``report.json`` and ``loss_curves.png`` (rank 0 only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    muon, adamw = curves["muon"], curves["adamw"]
    best = min(loss for _, loss in adamw)
    reached = next((step for step, loss in muon if loss <= best), None)
    rows = "\n".join(f"| {s} | {m:.4f} | {a:.4f} |" for (s, m), (_, a) in zip(muon, adamw))
    where = f"{fabric.world_size} process(es), strategy {type(fabric.strategy).__name__}"
    steps_line = f"Muon reached AdamW's best ({best:.4f}) at step {reached}." if reached is not None else ""
    (out / "report.md").write_text(
        f"# litgpt GPT: Muon vs AdamW under Fabric\n\n{where}, {settings['train']['steps']} steps each.\n\n"
        f"| step | Muon val loss | AdamW val loss |\n|---|---|---|\n{rows}\n\n{steps_line}\n"
    )
    (out / "report.json").write_text(json.dumps({"curves": curves, "where": where, "settings": settings}, indent=1))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot(*zip(*curve), marker="o", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title("litgpt GPT (2 layers, d=64, GQA) on stdlib source")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument("--strategy", choices=("muon_ddp", "muon_fsdp"), default="muon_ddp")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="overrides train.steps")
    parser.add_argument("--eval-every", type=int, default=None, help="overrides train.eval_every")
    parser.add_argument("--out", type=Path, default=Path("runs/litgpt"))
    args = parser.parse_args()
    settings = yaml.safe_load(args.config.read_text())
    for key in ("steps", "eval_every"):
        if getattr(args, key) is not None:
            settings["train"][key] = getattr(args, key)

    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy)
    fabric.launch()  # popen: re-runs this script once per further device
    if args.accelerator == "cpu":  # the processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    text, _ = load_stdlib_corpus(settings["train"]["max_chars"])
    tokens = encode(text)
    cut = math.floor(0.9 * tokens.numel())
    config = Config(**settings["model"])
    curves = {name: train(fabric, name, settings, config, (tokens[:cut], tokens[cut:])) for name in ("muon", "adamw")}
    if fabric.is_global_zero:
        report(args.out, curves, settings, fabric)
        print(f"\nreport: {args.out / 'report.md'}\nloss curves: {args.out / 'loss_curves.png'}")


if __name__ == "__main__":
    main()
