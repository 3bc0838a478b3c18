"""Overhead of ``UpdateSpectrumMonitor`` on the demo model at its default interval.

The same training run (model, data, seed, logger) is timed without the callback and with
it, alternating, in one process; the result is the ratio of the two, next to the share of
the monitored run's time spent inside the callback itself (measured directly, so it is
immune to neighbours on a shared machine, unlike the ratio). Target: <= 5%.

Usage::

    python benchmarks/bench_spectra.py                 # demo model (configs/muon.yaml's), 3 x 2 runs of 50 steps
    python benchmarks/bench_spectra.py --steps 200 --repeats 5
    python benchmarks/bench_spectra.py --quick         # tiny model, a few steps (smoke test)
    python benchmarks/bench_spectra.py --device cuda   # on a GPU
    python benchmarks/bench_spectra.py --memory        # the step's memory with the post-step callbacks instead

Columns: ``matrices`` watched and ``logged`` steps in the monitored run; seconds per
training step without and with the callback (medians over ``--repeats``); ``ratio``: the
median over the back-to-back pairs of monitored / baseline time (neighbours on a shared
machine move it by several percent either way, more when their load changes); ``in callback``:
time inside the callback's hooks and observer over the monitored run's time, which the
verdict checks against the target. The JSON holds the machine, the settings and every run.

``--memory`` measures instead what the callbacks that work after the optimizer step add to
its memory: ``UpdateSpectrumMonitor`` (every step), ``QKClip`` and both, against none
(``benchlib.memory_callbacks``; benchmarks/README.md, "Memory").
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from benchlib.harness import check_device, demo_fit, describe_machine, machine_line, sync, write_report
from benchlib.memory import add_memory_arguments, memory_settings, run_memory
from benchlib.memory_callbacks import bench_callbacks, model_size, print_callbacks

from lightning_muon import UpdateSpectrumMonitor

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_spectra.json"
MEMORY_OUT = DEFAULT_OUT.with_name("bench_spectra_memory.json")
TARGET_OVERHEAD = 0.05

# configs/muon.yaml's model and batch; --quick shrinks both.
DEMO = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32)
QUICK = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8)


class _TimedMonitor(UpdateSpectrumMonitor):
    """``UpdateSpectrumMonitor`` that adds up the time spent in its hooks and its observer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inside = 0.0
        self.device = torch.device("cpu")

    def _timed(self, fn, *args: Any, device_work: bool = False) -> Any:
        # On CUDA, calls that launch kernels are timed between synchronizations: the training
        # work queued before them is not theirs, their own kernels are.
        if device_work:
            sync(self.device)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            if device_work:
                sync(self.device)
            self.inside += time.perf_counter() - t0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device = pl_module.device
        self._timed(super().on_train_start, trainer, pl_module)
        observe = self._collector.observe
        self._collector.observe = lambda *args: self._timed(observe, *args, device_work=True)  # type: ignore[method-assign]

    def on_train_batch_start(self, *args: Any) -> None:
        self._timed(super().on_train_batch_start, *args)

    def on_train_batch_end(self, *args: Any) -> None:
        # Only a step that was observed collects and logs there (synchronizing every step would
        # slow the monitored run for nothing).
        self._timed(super().on_train_batch_end, *args, device_work=self._due_step is not None)


def _fit(
    shape: dict[str, int], steps: int, every: int, monitored: bool, workdir: Path, device: torch.device
) -> dict[str, Any]:
    callbacks: list[pl.Callback] = []
    monitor = _TimedMonitor(every_n_steps=every) if monitored else None
    if monitor is not None:
        callbacks.append(monitor)
    try:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger: Any = TensorBoardLogger(workdir, name="monitored" if monitored else "baseline")
    except ModuleNotFoundError:  # pragma: no cover - without tensorboard: scalars only
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(workdir, name="monitored" if monitored else "baseline")
    seconds = demo_fit(shape, steps, device, logger, callbacks, every)
    return {
        "monitored": monitored,
        "seconds": seconds,
        "s_per_step": seconds / steps,
        "inside_seconds": monitor.inside if monitor else 0.0,
        "logged_steps": monitor.logged_steps if monitor else 0,
        "matrices": len({k[len("spectra/") : k.rindex("/")] for k in monitor.last_metrics}) if monitor else 0,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 50; quick 12)")
    parser.add_argument("--every", type=int, default=None, help="logging interval (default: the callback's, 50)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="baseline/monitored pairs, alternating (default 3; quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and a few steps: a smoke test")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before measuring")
    parser.add_argument("--out", type=Path, help=f"JSON path (default {DEFAULT_OUT}; {MEMORY_OUT.name} with --memory)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    add_memory_arguments(parser, "a Lightning fit's second step with UpdateSpectrumMonitor, QKClip, both, none")
    args = parser.parse_args(argv)
    if any(v is not None and v < 1 for v in (args.steps, args.every, args.repeats)):
        parser.error("--steps, --every and --repeats must be >= 1")
    if args.memory and any(v is not None for v in (args.steps, args.every, args.repeats)):
        parser.error("--memory fits its own 2 steps: --steps, --every and --repeats do not apply")
    if args.out is None:
        args.out = MEMORY_OUT if args.memory else DEFAULT_OUT
    return check_device(parser, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # routing reports, tips
    if args.memory:
        cfg = memory_settings(args, callbacks_model=model_size(args.quick))
        return run_memory(cfg, {"callbacks": (bench_callbacks, print_callbacks)}, args.out)
    shape = QUICK if args.quick else DEMO
    steps = args.steps or (12 if args.quick else 50)
    repeats = args.repeats or (1 if args.quick else 3)
    every = args.every or (5 if args.quick else UpdateSpectrumMonitor().every_n_steps)

    machine = describe_machine(device)
    # On CUDA the GPU is what runs the model: the lines below name it.
    gpu = f", GPU {machine['gpu']} ({device})" if device.type == "cuda" else ""
    print(f"machine: {machine_line(machine)}")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        _fit(shape, min(steps, 3), every, True, workdir, device)  # warm-up: imports, allocator, threads
        for _ in range(repeats):
            for monitored in (False, True):
                runs.append(_fit(shape, steps, every, monitored, workdir, device))
                print(f"  run: monitored={monitored} {runs[-1]['s_per_step']:.4f} s/step", file=sys.stderr)

    base = statistics.median(r["s_per_step"] for r in runs if not r["monitored"])
    mon = statistics.median(r["s_per_step"] for r in runs if r["monitored"])
    # Each pair ran back to back: the median of the pairs' ratios is what drifting load on a
    # shared machine disturbs least.
    ratio = statistics.median(m["s_per_step"] / b["s_per_step"] for b, m in zip(runs[::2], runs[1::2]))
    measured = ratio - 1.0
    inside = statistics.median(r["inside_seconds"] / r["seconds"] for r in runs if r["monitored"])
    monitored_run = next(r for r in runs if r["monitored"])
    model = f"CharGPT L{shape['n_layer']} d{shape['n_embd']} T{shape['block_size']} B{shape['batch_size']}"
    # The target is set for the demo model at the default interval; a quick run only smoke-tests.
    verdict = "n/a (quick)" if args.quick else "ok" if inside <= TARGET_OVERHEAD else "MISS"
    print("== spectra overhead")
    print(
        "| model | steps | every | matrices | logged | baseline s/step | monitored s/step | ratio | in callback "
        "| target | verdict | machine |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    line = (
        f"| {model} | {steps} | {every} | {monitored_run['matrices']} | {monitored_run['logged_steps']} "
        f"| {base:.4f} | {mon:.4f} | {ratio:.3f} ({measured:+.1%}) | {inside:.2%} "
        f"| <= {TARGET_OVERHEAD:.0%} | {verdict} | {machine['cpu']}, {machine['torch_threads']} threads{gpu} |"
    )
    print(line)
    report = {
        "machine": machine,
        "settings": {"model": shape, "steps": steps, "every_n_steps": every, "repeats": repeats},
        "runs": runs,
        "result": {
            "baseline_s_per_step": base,
            "monitored_s_per_step": mon,
            "ratio": ratio,
            "measured_overhead": measured,
            "in_callback_share": inside,
            "target": TARGET_OVERHEAD,
            "verdict": verdict,
            "line": line,
        },
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
