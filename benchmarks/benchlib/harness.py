"""What every benchmark shares: tables, targets, reports and the machine they ran on.

- Tables: :func:`table` lays rows out in aligned columns (text left, numbers right);
  :func:`cell` writes a float with 3 decimals below 10, 1 above, and in scientific
  notation outside [1e-3, 1e5).
- Targets: :func:`target` is one checked bound (``{"name", "value", "op", "bound",
  "passed"}``), :func:`verdict` its ``ok`` / ``MISS``; :func:`write_report` the JSON.
- The machine: :func:`describe_machine` (CPU model, cores, torch build, GPUs, load) and
  :func:`machine_line`, the line every benchmark prints first, so that each number in a
  run comes with the machine it was measured on; :func:`sync` before every clock read.
- Fits: :func:`timed_fit`, a Lightning fit timed from its first batch to its end;
  :func:`demo_fit`, the same for the demo CharGPT at a given shape.

The multi-process benchmarks' launcher, flags, model and batches are in ``ranks``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_muon.newton_schulz import bf16_matmul_is_fast

# ---------------------------------------------------------------- tables and targets


def cell(value: Any) -> str:
    """A table cell: floats to 3 decimals below 10 and 1 above, scientific outside [1e-3, 1e5)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def fixed_cell(value: Any) -> str:
    """A table cell with every float to 3 decimals (tables whose columns compare digit by digit)."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(headers: list[str], rows: list[list[Any]], fmt: Callable[[Any], str] = cell) -> str:
    """``rows`` under ``headers`` in aligned columns: text columns left, numbers right."""
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    left = [all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if lf else v.rjust(w) for v, w, lf in zip(values, widths, left)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in cells)])


def target(name: str, value: float, op: str, bound: float) -> dict[str, Any]:
    """One checked bound: ``value op bound`` with ``op`` one of ``"<="`` and ``">="``."""
    if op not in ("<=", ">="):
        raise ValueError(f"target {name!r}: op must be '<=' or '>=', got {op!r}")
    passed = value <= bound if op == "<=" else value >= bound
    return {"name": name, "value": value, "op": op, "bound": bound, "passed": bool(passed)}


def verdict(passed: bool) -> str:
    return "ok" if passed else "MISS"


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None: JSON has no NaN or inf."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def targets_met(targets: list[dict[str, Any]]) -> dict[str, int]:
    """``{"targets_passed": ..., "targets_total": ...}`` for a report."""
    return {"targets_passed": sum(t["passed"] for t in targets), "targets_total": len(targets)}


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Writes ``report`` as JSON (non-finite numbers as null) and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite_or_none(report), indent=1, allow_nan=False) + "\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------- the machine


def load_average() -> float:
    # Other processes on the same cores distort every time; the load says how much.
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return -1.0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def describe_machine(device: torch.device | str = "cpu") -> dict[str, Any]:
    """CPU model, cores, torch build, GPUs and load: the context every number in a run needs."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "bf16_matmul_fast": bf16_matmul_is_fast(device),
        "gpu": None,
        "load_avg_1m_at_start": load_average(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device if device.type == "cuda" else 0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def machine_line(machine: dict[str, Any]) -> str:
    """The machine in one line, as every benchmark prints it (after ``machine: ``) under its title."""
    gpu = machine["gpu"] or "none"
    return (
        f"{machine['cpu']}, {machine['cpu_cores']} cores ({machine['torch_threads']} torch threads), "
        f"torch {machine['torch']}, CPU capability {machine['cpu_capability']}, GPU {gpu}; "
        f"device {machine['device']}, fast bf16 matmul: {'yes' if machine['bf16_matmul_fast'] else 'no'}; "
        f"load average {machine['load_avg_1m_at_start']:.2f}"
    )


def sync(device: torch.device | str) -> None:
    # CUDA runs asynchronously: a clock read must wait for the queued kernels.
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainClock(pl.Callback):
    """Wall time from the first training batch to the end of training (setup excluded)."""

    def __init__(self) -> None:
        self.start = self.end = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync(pl_module.device)
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync(pl_module.device)
        self.end = time.perf_counter()


def timed_fit(
    model: pl.LightningModule,
    data: pl.LightningDataModule,
    device: torch.device,
    steps: int,
    logger: Any,
    callbacks: list[pl.Callback],
    log_every_n_steps: int,
) -> float:
    """Seconds of ``steps`` training steps (``TrainClock``: setup excluded), without validation or checkpoints."""
    clock = TrainClock()
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else "auto",
        max_steps=steps,
        logger=logger,
        callbacks=[clock, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=log_every_n_steps,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset and logging notices
        trainer.fit(model, data)
    return clock.end - clock.start


def demo_fit(
    shape: dict[str, int], steps: int, device: torch.device, logger: Any, callbacks: list[pl.Callback], log_every: int
) -> float:
    """``timed_fit`` of the demo CharGPT (``lightning_muon_demo``) at ``shape``'s ``n_layer``, ``n_head``,
    ``n_embd``, ``block_size`` and ``batch_size``, from seed 0, on exactly ``steps`` batches of the bundled text."""
    from lightning_muon_demo.data import CharTextDataModule
    from lightning_muon_demo.module import CharGPTModule

    pl.seed_everything(0, verbose=False)
    dims = {k: shape[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    batch = shape["batch_size"]
    data = CharTextDataModule(
        block_size=shape["block_size"], batch_size=batch, max_chars=300_000, train_samples_per_epoch=batch * steps
    )
    return timed_fit(CharGPTModule(**dims), data, device, steps, logger, callbacks, log_every)


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuses (argparse error, exit 2) ``--device cuda[:i]`` where CUDA is not available."""
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args
