"""What every benchmark shares: tables, targets, the machine, and the gloo/NCCL launcher.

- Tables: :func:`table` lays rows out in aligned columns (text left, numbers right);
  :func:`cell` writes a float with 3 decimals below 10, 1 above, and in scientific
  notation outside [1e-3, 1e5).
- Targets: :func:`target` is one checked bound (``{"name", "value", "op", "bound",
  "passed"}``), :func:`verdict` its ``ok`` / ``MISS``.
- The machine: :func:`describe_machine` (CPU model, cores, torch build, GPUs, load) and
  :func:`machine_line`, the line every benchmark prints first, so that each number in a
  run comes with the machine it was measured on.
- Processes: :func:`run_ranks` runs ``fn(rank, world_size, *args)`` on W spawned
  processes (gloo on CPU, NCCL with one GPU per rank) and returns what each returned;
  ``tests/dist_utils.py`` uses it for the multi-process tests. :class:`RankSettings` and
  :func:`add_rank_arguments` are the flags the multi-process benchmarks share,
  :func:`char_gpt` and :func:`char_batch` the model and the data they train on.

The benchmarks are scripts, not a package: each puts this folder on ``sys.path`` and
imports ``harness`` as a sibling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from lightning_muon.newton_schulz import bf16_matmul_is_fast
from lightning_muon_demo.models import CharGPT

VOCAB = 256  # byte-level tokens

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


def slowest_rank_median(ranks: list[dict[str, Any]], config: str, key: str) -> float:
    """Median over steps of the slowest rank's ``ranks[r]["configs"][config]["times_s"][key]``.

    Each timed step starts at a barrier, so it lasts as long as its slowest rank; the
    median over steps drops outliers.
    """
    per_step = zip(*(r["configs"][config]["times_s"][key] for r in ranks))
    return statistics.median(max(values) for values in per_step)


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


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_process(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    backend: str,
    threads: int,
    fn: Callable,
    args: tuple,
    environ: dict[str, str],
) -> None:
    # A forkserver child starts with the server's environment: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    # The group meets over TCP on a port the parent found free (env://).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_method = "env://"
    torch.set_num_threads(threads)
    if backend == "nccl":
        # One GPU per rank; "cuda" in fn (models, batches, meshes) means this rank's GPU.
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method, rank=rank, world_size=world_size, device_id=device_id)
    else:
        dist.init_process_group("gloo", init_method, rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank leaves (rank 0 serves the TCP store) while a peer still talks
    finally:
        dist.destroy_process_group()
    # Done, and the result is saved: leave without the interpreter's finalization, as a
    # forked child does. There the last references to the gloo process groups go, and a
    # worker thread of theirs that still holds a finished collective's tensors reaches for
    # the GIL of an interpreter being torn down: SIGABRT ("terminate called without an
    # active exception"), seen in CI on one rank of finished FSDP2 fits, over TCP and file
    # rendezvous alike. A failure in fn still raises above and is reported by start_processes.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# What a rank needs imported before it runs fn; the forkserver imports it once.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_muon"]


def _rank_start_method() -> str:
    """``"forkserver"`` with torch, Lightning and the package preloaded, where it exists.

    Each rank is forked from one server process that imported them once, instead of a fresh
    interpreter importing them again (seconds per rank: ``import lightning`` pulls in
    torchmetrics, which imports transformers and scipy where they are installed). The
    server imports nothing that starts CUDA, so NCCL ranks are unaffected.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return "forkserver"


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", threads: int = 1
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process.

    Each process joins a process group (``backend`` ``"gloo"``, or ``"nccl"`` with rank r on
    ``cuda:r``) with ``threads`` torch threads. ``fn`` must be importable (module level);
    the results travel through files in a temporary folder removed afterwards. A failure
    on any rank raises here, after every process ended.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank_process,
            args=(world_size, free_port(), out_dir, backend, threads, fn, args, dict(os.environ)),
            nprocs=world_size,
            join=True,
            start_method=_rank_start_method(),
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@dataclass(frozen=True, kw_only=True)
class RankSettings:
    """What the multi-process benchmarks share: the world, the CharGPT and the step counts."""

    quick: bool
    world_size: int
    threads: int
    """torch threads per rank; the single-process baseline uses the same."""
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch: int
    """Sequences per rank; the single process takes ``world_size * batch``."""
    warmup: int
    steps: int
    """Timed steps per configuration, after ``warmup`` untimed ones."""
    device: str = "cpu"
    """``"cpu"`` (gloo ranks) or ``"cuda"`` (NCCL ranks, rank r on ``cuda:r``)."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def as_json(self) -> dict[str, Any]:
        settings = asdict(self)
        if self.device == "cpu":
            del settings["device"]  # CPU reports keep the keys they had before --device existed
        return settings


def ranks_line(s: RankSettings, machine: dict[str, Any]) -> str:
    """``"2 gloo ranks x 1 torch thread(s)"`` (NCCL: the GPUs they run on)."""
    ranks_on = f"{s.world_size} gloo ranks"
    if s.device == "cuda":
        ranks_on = f"{s.world_size} NCCL ranks on cuda:0-{s.world_size - 1} ({machine['gpu']})"
    return f"{ranks_on} x {s.threads} torch thread(s)"


def char_gpt(s: RankSettings) -> CharGPT:
    """The model the multi-process benchmarks train, the same on every rank and device."""
    torch.manual_seed(0)  # initialized on the CPU, so every rank and device starts from the same weights
    return CharGPT(VOCAB, s.block_size, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd).to(s.device)


def char_batch(s: RankSettings, step: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """Rows ``lo:hi`` of the global batch of ``step`` (W * batch sequences): inputs and next-token targets."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (s.world_size * s.batch, s.block_size + 1), generator=gen)[lo:hi]
    return tokens[:, :-1].to(s.device), tokens[:, 1:].to(s.device)


def add_rank_arguments(parser: argparse.ArgumentParser, default_out: Path, quick_help: str) -> None:
    """The flags every multi-process benchmark takes: --quick, --world-size, --threads, --steps, --out, --device."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2; targets scale with it)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank and per baseline process")
    parser.add_argument("--out", type=Path, default=default_out, help=f"JSON output (default {default_out})")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo (default); cuda: NCCL, rank r on cuda:r"
    )


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuses (argparse error, exit 2) ``--device cuda[:i]`` where CUDA is not available."""
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def check_rank_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuses (argparse error, exit 2) a world under 2, non-positive counts, or fewer GPUs than ranks."""
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")
    if args.threads < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--threads and --steps must be positive")
    if args.device == "cuda" and args.world_size > torch.cuda.device_count():
        parser.error(
            f"--device cuda needs one GPU per rank (NCCL): --world-size {args.world_size}, "
            f"but torch.cuda.device_count() is {torch.cuda.device_count()}"
        )
    return args
