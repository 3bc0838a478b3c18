"""Overhead of ``QKClip`` on the demo model, and what measuring the per-head maxima costs.

Two tables, one process:

1. ``== qk_clip overhead``: the same training run (model, data, seed) timed without the
   callback and with ``QKClip(threshold=100)``, alternating; next to the ratio, the share
   of the clipped run's time spent measuring maxima (``head_max_logits``, called by the
   SDPA drop-in) and inside the callback's hook (MAX all-reduce when distributed, factors,
   scaling, logging), timed directly, which neighbours on a shared machine disturb far
   less than the ratio. The verdict checks that share against the target (<= 3%).
2. ``== maxima``: one attention forward at the demo's shapes: SDPA alone, SDPA plus the
   drop-in's second ``Q K^T`` and masked max, and (CUDA) flex attention with and without
   the kernel's own ``max_scores``; on CPU torch 2.13 refuses ``max_scores``, and the
   line says so.

Usage::

    python benchmarks/bench_qk_clip.py                 # demo model (configs/muon.yaml's), 3 x 2 runs of 30 steps
    python benchmarks/bench_qk_clip.py --quick         # tiny model, a few steps (smoke test)
    python benchmarks/bench_qk_clip.py --device cuda   # on a GPU

The JSON holds the machine, the settings and every run.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import describe_machine, machine_line, sync  # a sibling script, not a package

from lightning_muon import QKClip
from lightning_muon.attention import maxima
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.module import CharGPTModule

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_qk_clip.json"
TARGET_OVERHEAD = 0.03

# configs/muon.yaml's model and batch; --quick shrinks both.
DEMO = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32)
QUICK = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8)


class _Clock(pl.Callback):
    """Wall time from the first training batch to the end of training (setup excluded)."""

    def __init__(self) -> None:
        self.start = self.end = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync(pl_module.device)
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync(pl_module.device)
        self.end = time.perf_counter()


class _TimedQKClip(QKClip):
    """``QKClip`` that adds up the time in its per-step hook and in the maxima measurement."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook = self.measure = 0.0
        self.device = torch.device("cpu")
        self._original = maxima.head_max_logits

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self.device = pl_module.device

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            sync(self.device)  # the attention work queued before is not the measurement's
            t0 = time.perf_counter()
            out = self._original(*args, **kwargs)
            sync(self.device)
            self.measure += time.perf_counter() - t0
            return out

        maxima.head_max_logits = timed  # the SDPA drop-in looks it up at each call

    def on_train_batch_end(self, *args: Any) -> None:
        sync(self.device)
        t0 = time.perf_counter()
        super().on_train_batch_end(*args)
        sync(self.device)
        self.hook += time.perf_counter() - t0

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        maxima.head_max_logits = self._original
        super().teardown(trainer, pl_module, stage)


def _fit(shape: dict[str, int], steps: int, clipped: bool, workdir: Path, device: torch.device) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = CharGPTModule(
        n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"], block_size=shape["block_size"]
    )
    data = CharTextDataModule(
        block_size=shape["block_size"],
        batch_size=shape["batch_size"],
        max_chars=300_000,
        train_samples_per_epoch=shape["batch_size"] * steps,
    )
    clock = _Clock()
    clip = _TimedQKClip(threshold=100.0) if clipped else None
    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else "auto",
        max_steps=steps,
        logger=CSVLogger(workdir, name="clipped" if clipped else "baseline"),
        callbacks=[clock] + ([clip] if clip else []),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    seconds = clock.end - clock.start
    return {
        "clipped": clipped,
        "seconds": seconds,
        "s_per_step": seconds / steps,
        "measure_seconds": clip.measure if clip else 0.0,
        "hook_seconds": clip.hook if clip else 0.0,
    }


def _time(fn: Any, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (and compilation, for flex)
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def attention_costs(shape: dict[str, int], device: torch.device, repeats: int = 10) -> dict[str, Any]:
    """One causal attention forward at the model's shapes: SDPA, SDPA + maxima, flex with/without max_scores."""
    B, H, T = shape["batch_size"], shape["n_head"], shape["block_size"]
    d = shape["n_embd"] // H
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=gen, device=device) for _ in range(3))
    sdpa = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats)
    with_max = _time(
        lambda: (maxima.head_max_logits(q, k, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        device,
        repeats,
    )
    out: dict[str, Any] = {"sdpa_s": sdpa, "sdpa_plus_maxima_s": with_max, "maxima_share": with_max / sdpa - 1}
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    if device.type != "cuda":
        # Ask once, on tiny inputs, what this build says (torch 2.13: not supported on CPU);
        # eager flex attention on CPU would only time an unfused reference implementation.
        tiny = torch.zeros(1, 1, 16, 8)
        try:
            flex_attention(tiny, tiny, tiny, return_aux=AuxRequest(max_scores=True))
            out["flex_note"] = "max_scores available here, not timed on CPU (eager flex is unfused)"
        except NotImplementedError as err:
            out["flex_note"] = str(err).splitlines()[0][:120]
        return out
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, T, T, device=str(device))
    flex = torch.compile(flex_attention)
    plain = _time(lambda: flex(q, k, v, block_mask=mask), device, repeats)
    aux = _time(lambda: flex(q, k, v, block_mask=mask, return_aux=AuxRequest(max_scores=True)), device, repeats)
    out.update(flex_s=plain, flex_max_scores_s=aux, flex_share=aux / plain - 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30; quick 6)")
    parser.add_argument("--repeats", type=int, default=None, help="baseline/clipped pairs (default 3; quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny model and a few steps: a smoke test")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before measuring")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path (git-ignored folder by default)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    args = parser.parse_args(argv)
    if any(v is not None and v < 1 for v in (args.steps, args.repeats)):
        parser.error("--steps and --repeats must be >= 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # routing reports, tips
    shape = QUICK if args.quick else DEMO
    steps = args.steps or (6 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 3)
    machine = describe_machine(device)
    gpu = f", GPU {machine['gpu']} ({device})" if device.type == "cuda" else ""
    where = f"{machine['cpu']}, {machine['torch_threads']} threads{gpu}"
    print(f"machine: {machine_line(machine)}")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        _fit(shape, min(steps, 3), True, workdir, device)  # warm-up: imports, allocator, threads
        for _ in range(repeats):
            for clipped in (False, True):
                runs.append(_fit(shape, steps, clipped, workdir, device))
                print(f"  run: clipped={clipped} {runs[-1]['s_per_step']:.4f} s/step", file=sys.stderr)

    base = statistics.median(r["s_per_step"] for r in runs if not r["clipped"])
    clip = statistics.median(r["s_per_step"] for r in runs if r["clipped"])
    ratio = statistics.median(c["s_per_step"] / b["s_per_step"] for b, c in zip(runs[::2], runs[1::2]))
    share_measure = statistics.median(r["measure_seconds"] / r["seconds"] for r in runs if r["clipped"])
    share_hook = statistics.median(r["hook_seconds"] / r["seconds"] for r in runs if r["clipped"])
    inside = share_measure + share_hook
    dims = ("L", "n_layer"), ("d", "n_embd"), ("H", "n_head"), ("T", "block_size"), ("B", "batch_size")
    model = "CharGPT " + " ".join(f"{k}{shape[n]}" for k, n in dims)
    verdict = "n/a (quick)" if args.quick else "ok" if inside <= TARGET_OVERHEAD else "MISS"
    print("== qk_clip overhead")
    print(
        "| model | steps | baseline s/step | QKClip s/step | ratio | maxima | hook | inside QKClip | target | verdict "
        "| machine |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    line = (
        f"| {model} | {steps} | {base:.4f} | {clip:.4f} | {ratio:.3f} ({ratio - 1:+.1%}) | {share_measure:.2%} "
        f"| {share_hook:.2%} | {inside:.2%} | <= {TARGET_OVERHEAD:.0%} | {verdict} | {where} |"
    )
    print(line)
    costs = attention_costs(shape, device)
    print("== maxima (one causal attention forward at the model's shapes, best of 10)")
    print("| SDPA ms | SDPA + maxima ms | maxima / SDPA | flex ms | flex + max_scores ms | machine |")
    print("|---|---|---|---|---|---|")
    flex = (
        f"{costs['flex_s'] * 1e3:.3f} | {costs['flex_max_scores_s'] * 1e3:.3f} ({costs['flex_share']:+.1%})"
        if "flex_s" in costs
        else f"- | {costs.get('flex_note', '-')}"
    )
    maxima_line = (
        f"| {costs['sdpa_s'] * 1e3:.3f} | {costs['sdpa_plus_maxima_s'] * 1e3:.3f} | {costs['maxima_share']:+.1%} "
        f"| {flex} | {where} |"
    )
    print(maxima_line)
    report = {
        "machine": machine,
        "settings": {"model": shape, "steps": steps, "repeats": repeats, "threshold": 100.0},
        "runs": runs,
        "attention": costs,
        "result": {
            "baseline_s_per_step": base,
            "clipped_s_per_step": clip,
            "ratio": ratio,
            "maxima_share": share_measure,
            "hook_share": share_hook,
            "inside_share": inside,
            "target": TARGET_OVERHEAD,
            "verdict": verdict,
            "line": line,
            "maxima_line": maxima_line,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
