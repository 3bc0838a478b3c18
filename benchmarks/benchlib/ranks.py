"""The multi-process benchmarks' ranks: the launcher, the flags, the model and the batches.

- :func:`run_ranks` runs ``fn(rank, world_size, *args)`` on W processes (gloo on CPU, NCCL
  with one GPU per rank) and returns what each returned. The test suite starts its gloo
  ranks with its own launcher (``tests/dist_utils.py``): the benchmarks need NCCL and
  threads per rank, the tests neither, and neither side imports the other.
- :class:`RankSettings` and :func:`add_rank_arguments` / :func:`check_rank_arguments` are
  the world, model and flags ``bench_ddp.py``, ``bench_fsdp.py`` and ``bench_moe.py`` share;
  :func:`char_gpt` and :func:`char_batch` the model and the data they train on;
  :func:`slowest_rank_median` how a timed step across ranks is read.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from lightning_muon_demo.models import CharGPT

VOCAB = 256  # byte-level tokens

# ---------------------------------------------------------------- the launcher


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


# ---------------------------------------------------------------- world, model, flags


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


def add_rank_arguments(
    parser: argparse.ArgumentParser, default_out: Path, quick_help: str, memory_out: Path | None = None
) -> None:
    """The flags every multi-process benchmark takes: --quick, --world-size, --threads, --out, --device.

    With ``memory_out`` (a benchmark with ``--memory``) ``--out`` defaults to None: the script
    picks ``memory_out`` or ``default_out`` by the mode.
    """
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2; targets scale with it)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank and per baseline process")
    if memory_out is None:
        parser.add_argument("--out", type=Path, default=default_out, help=f"JSON output (default {default_out})")
    else:
        parser.add_argument(
            "--out", type=Path, help=f"JSON output (default {default_out}; {memory_out.name} with --memory)"
        )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo (default); cuda: NCCL, rank r on cuda:r"
    )


def slowest_rank_median(ranks: list[dict[str, Any]], config: str, key: str) -> float:
    """Median over steps of the slowest rank's ``ranks[r]["configs"][config]["times_s"][key]``.

    Each timed step starts at a barrier, so it lasts as long as its slowest rank; the
    median over steps drops outliers.
    """
    per_step = zip(*(r["configs"][config]["times_s"][key] for r in ranks))
    return statistics.median(max(values) for values in per_step)


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
