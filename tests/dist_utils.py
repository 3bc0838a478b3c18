"""Run a function on several gloo processes on CPU and collect what each rank returns.

The suite's own launcher: ``run_distributed(fn, W, *args)`` forks W ranks from a server
process that imported torch, Lightning and the package once, each rank joins one gloo
group over TCP, runs ``fn(rank, W, *args)``, and its result comes back through a file.
(The benchmarks start their ranks, NCCL ones too, with their own launcher in
``benchmarks/benchlib/ranks.py``; neither imports the other.)

``run_main(target, args, cwd)`` runs a command from the same server: ``python -m target``
or ``python target.py`` with its own process, working directory, ``sys.argv``, path and
output, without importing torch and Lightning again (seconds a command on CI's 2 cores).
"""

from __future__ import annotations

import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What a rank needs imported before it runs fn; the forkserver imports it once.
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_muon"]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in ranks]``, each in its own gloo process.

    One torch thread per rank: ``world_size`` processes share the CI's 2 cores. ``fn``
    must be importable (module level); a failure on any rank raises here, after every
    process ended. With ``timeout`` (seconds), ranks still running then are killed and
    ``TimeoutError`` names them: a test of "no rank hangs" fails instead of hanging. The
    results travel through files in a temporary folder removed afterwards.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank,
            args=(world_size, _free_port(), out_dir, fn, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        while not context.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                hung = [r for r, p in enumerate(context.processes) if p.is_alive()]
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"rank(s) {hung} of {world_size} still running after {timeout} s")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def run_main(
    target: str | Path, args: list[str], cwd: Path, *, pythonpath: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m target *args`` (a module name) or ``python target *args`` (a script) in ``cwd``.

    As ``subprocess.run(..., capture_output=True, text=True)`` answers: the exit code, stdout
    and stderr. ``pythonpath`` goes first on the path, as ``PYTHONPATH`` would put it; a
    script's own folder goes first too, as Python does. The process is forked from the
    server that preloaded ``PRELOAD``; whatever else it imports, it imports itself.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        out = Path(out_dir)
        context = mp.get_context(_start_method())
        process = context.Process(
            target=_main, args=(str(target), list(args), str(cwd), pythonpath, out, dict(os.environ))
        )
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise TimeoutError(f"{target} {' '.join(args)} still running after {timeout} s")
        stdout, stderr = ((out / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess([target, *args], process.exitcode, stdout, stderr)


def _main(target: str, args: list[str], cwd: str, pythonpath: Path | None, out: Path, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for name in ("stdout", "stderr"):  # the file descriptors, so that child processes write there too
        stream = getattr(sys, name)
        stream.flush()
        with open(out / name, "wb") as file:
            os.dup2(file.fileno(), stream.fileno())
    script = target.endswith(".py")
    sys.argv = [target if script else sys.executable, *args]
    sys.path[:0] = [str(Path(target).parent)] if script else []
    sys.path[:0] = [str(pythonpath)] if pythonpath is not None else []
    code = 0
    try:
        if script:
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as _rank: no interpreter finalization with gloo threads about


def _start_method() -> str:
    """``"forkserver"`` with ``PRELOAD`` imported once, where it exists.

    A fresh interpreter per rank would import them again: seconds per rank, since
    ``import lightning`` pulls in torchmetrics, which imports transformers and scipy where
    they are installed.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, environ: dict[str, str]
) -> None:
    # A forkserver child starts with the server's environment: take the caller's, then
    # meet the group over TCP on the port the parent found free (env://).
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", "env://", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank leaves (rank 0 serves the TCP store) while a peer still talks
    finally:
        dist.destroy_process_group()
    # Done, and the result is saved: leave without the interpreter's finalization. There the
    # last references to the gloo process groups go, and a worker thread of theirs that
    # still holds a finished collective's tensors reaches for the GIL of an interpreter being
    # torn down: SIGABRT ("terminate called without an active exception"), seen in CI on one
    # rank of finished FSDP2 fits. A failure in fn still raises above (start_processes reports it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
