"""Muon's share of a whole training step: GPT-2 small on one device, ours against torch.optim.Muon.

Two copies of transformers' ``GPT2LMHeadModel`` (the same weights) train on the same fixed
random token batches, one with our routed ``Muon`` (Newton-Schulz on the hidden matrices,
AdamW on embeddings, LayerNorms and biases), one with ``torch.optim.Muon`` on the same
matrices plus ``torch.optim.AdamW`` (foreach) on the rest. They step in turn, one step each
per round, so drift and background load fall on both alike. Each step is timed in two
parts: forward + backward, then ``optimizer.step()`` + ``zero_grad()``. On a GPU the parts
are CUDA events on the device's timeline (no host sync inside the step: the optimizer's
part is what the step adds to the timeline, launch gaps included); on a CPU they are host
clocks with a sync at each end.

The optimizer's share is its part of the whole step (median of each over the timed
steps); the anchor is modded-nanogpt's Muon, under 2% of its step, and the target is ours
at most 3% on a GPU. The share shrinks as tokens per step grow (the forward and backward
grow, the optimizer does not): the table states the tokens each step saw.

Usage::

    python benchmarks/bench_train_step.py                 # GPT-2 small, batch 16 x 1024, cuda if available
    python benchmarks/bench_train_step.py --quick         # a tiny GPT-2 on the CPU (a smoke test, seconds)
    python benchmarks/bench_train_step.py --batch 32 --accumulate 2 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib.harness import (
    check_device,
    describe_machine,
    machine_line,
    table,
    target,
    targets_met,
    verdict,
    write_report,
)
from torch import nn

from lightning_muon import Muon, route_parameters

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_train_step.json"
SHARE_MAX_CUDA = 0.03  # target: our optimizer step at most 3% of a GPT-2-small step on one GPU
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.01
ADAMW_LR, ADAMW_BETAS = 3e-4, (0.9, 0.95)


def gpt2(quick: bool, seq: int) -> nn.Module:
    """GPT-2 small (124M: d=768, 12 layers, 12 heads, vocab 50257), or a tiny one for ``--quick``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=seq)
    else:
        config = GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=max(seq, 1024))
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def our_optimizer(model: nn.Module, nonfinite: str = "raise") -> tuple[Muon, list[nn.Parameter]]:
    """Our hybrid Muon with the default routing, and the parameters it sends to Newton-Schulz."""
    groups = route_parameters(model)
    optimizer = Muon(
        list(groups),
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        adamw_lr=ADAMW_LR,
        adamw_betas=ADAMW_BETAS,
        nonfinite=nonfinite,
    )
    hidden = [p for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    return optimizer, hidden


class TorchMuonAdamW:
    """torch.optim.Muon on ``hidden`` and torch.optim.AdamW on the rest, stepped as one."""

    def __init__(self, model: nn.Module, hidden_names: set[str]) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        hidden = [p for n, p in named if n in hidden_names]
        other = [p for n, p in named if n not in hidden_names]
        self.muon = torch.optim.Muon(hidden, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True)
        self.adamw = torch.optim.AdamW(other, lr=ADAMW_LR, betas=ADAMW_BETAS, weight_decay=0.0, foreach=True)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self) -> None:
        self.muon.zero_grad()
        self.adamw.zero_grad()


class PhaseClock:
    """Times the phases of one step: CUDA events on a GPU, host clocks (after a sync) elsewhere."""

    def __init__(self, device: torch.device, phases: int) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[Any] = []
        self.phases = phases

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """The phases' durations, in order (waits for the device's queued work first)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            times = [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []
        return times


def train_step(model: nn.Module, optimizer: Any, batches: list[torch.Tensor], clock: PhaseClock) -> list[float]:
    """One optimizer step over ``batches`` (gradient accumulation): [forward + backward, step] seconds."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=clock.cuda)
    clock.mark()
    for tokens in batches:
        with autocast:
            loss = model(input_ids=tokens, labels=tokens).loss / len(batches)
        loss.backward()
    clock.mark()
    optimizer.step()
    optimizer.zero_grad()
    clock.mark()
    return clock.seconds()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, 3 timed steps (a smoke test)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 16; quick 4)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; quick 64)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per optimizer (default 20; quick 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer first (default 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    for name in ("batch", "seq", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.accumulate < 1 or args.warmup < 0:
        parser.error("--accumulate must be at least 1 and --warmup at least 0")
    return check_device(parser, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    batch = args.batch or (4 if args.quick else 16)
    seq = args.seq or (64 if args.quick else 1024)
    steps = args.steps or (3 if args.quick else 20)
    machine = describe_machine(device)
    print(f"lightning_muon: Muon's share of a training step, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_line(machine)}")

    base = gpt2(args.quick, seq).to(device)
    ours_model, unchecked_model, torch_model = base, copy.deepcopy(base), copy.deepcopy(base)
    ours, hidden = our_optimizer(ours_model)
    hidden_ids = {id(p) for p in hidden}
    hidden_names = {n for n, p in ours_model.named_parameters() if id(p) in hidden_ids}
    # nonfinite="raise" (the default) reads one flag back per step, a host sync: the step's
    # launches then start after the backward ends instead of queueing behind it. "ignore" checks nothing.
    runs = {
        "ours": (ours_model, ours),
        "ours_unchecked": (unchecked_model, our_optimizer(unchecked_model, "ignore")[0]),
        "torch": (torch_model, TorchMuonAdamW(torch_model, hidden_names)),
    }
    labels = {
        "ours": "ours (routed Muon + AdamW)",
        "ours_unchecked": 'ours, nonfinite="ignore"',
        "torch": "torch.optim.Muon + AdamW",
    }
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=gen).to(device) for _ in range(args.accumulate)]
    params = sum(p.numel() for p in base.parameters())
    print(f"GPT-2 d={base.config.n_embd} x {base.config.n_layer}: {params / 1e6:.1f}M parameters,", end=" ")
    print(f"{len(hidden)} hidden matrices on Muon; {args.accumulate} x {batch} x {seq} tokens per step")

    clock = PhaseClock(device, 2)
    for _ in range(args.warmup):
        for model, optimizer in runs.values():
            train_step(model, optimizer, batches, clock)
    samples: dict[str, list[list[float]]] = {key: [] for key in runs}
    for i in range(steps):
        order = list(runs)[i % len(runs) :] + list(runs)[: i % len(runs)]  # each first in turn
        for key in order:
            samples[key].append(train_step(*runs[key], batches, clock))

    tokens = args.accumulate * batch * seq
    rows, table_rows, targets = [], [], []
    for key, times in samples.items():
        fb = statistics.median(t[0] for t in times)
        opt = statistics.median(t[1] for t in times)
        full = statistics.median(t[0] + t[1] for t in times)
        row = {
            "optimizer": labels[key],
            "fwd_bwd_ms": fb * 1e3,
            "step_ms": opt * 1e3,
            "full_ms": full * 1e3,
            "step_share": opt / full,
            "tokens_per_s": tokens / full,
        }
        rows.append(row)
    *ours_rows, torch_row = rows
    for row in ours_rows:
        row["step_ratio_vs_torch"] = row["step_ms"] / torch_row["step_ms"]
    for row in rows:
        check = ""
        if row is ours_rows[0] and device.type == "cuda":
            targets.append(target("train step: ours' share of the step", row["step_share"], "<=", SHARE_MAX_CUDA))
            check = f"<= {SHARE_MAX_CUDA}: {verdict(targets[-1]['passed'])}"
        ratio = row.get("step_ratio_vs_torch", 1.0)
        cells = [row["optimizer"], row["fwd_bwd_ms"], row["step_ms"], row["full_ms"]]
        table_rows.append([*cells, f"{100 * row['step_share']:.2f}%", ratio, row["tokens_per_s"], check])
    print(f"\n== training step, medians of {steps} steps each (interleaved), {tokens} tokens per step ==")
    headers = ["optimizer", "fwd+bwd ms", "step ms", "full ms", "step share", "step / torch", "tokens/s", "target"]
    print(table(headers, table_rows))
    report: dict[str, Any] = {
        "machine": machine,
        "settings": {"quick": args.quick, "batch": batch, "seq": seq, "accumulate": args.accumulate, "steps": steps},
        "model": {"n_embd": base.config.n_embd, "n_layer": base.config.n_layer, "params": params},
        "rows": rows,
        "targets": targets,
    }
    report.update(targets_met(targets))
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
