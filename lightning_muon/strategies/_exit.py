"""Leave a process group before the interpreter tears itself down.

Lightning destroys the default process group at exit for NCCL only. A gloo rank can then
abort after a successful fit (SIGABRT, "terminate called without an active exception";
seen on spawned CPU ranks, about one launch in thirty in a bare two-rank loop). The core
dump shows why: a gloo worker thread (``pt_gloo_runloop``) drops its reference to a
finished asynchronous work *after* ``wait()`` returned on the main thread. That last
reference frees the work's tensors, whose Python objects need the GIL; if the main thread
has begun interpreter finalization meanwhile, CPython ends the worker with
``pthread_exit``, and the forced unwind through a ``noexcept`` destructor terminates the
process.

So the ``atexit`` handler, which runs while the interpreter is whole, first lets those
threads finish: it sleeps (the GIL free) until every ``pt_gloo_runloop`` thread is seen
blocked and unchanged over two short intervals, then destroys the group. Both steps are
local: no collective, so a rank whose peers died cannot hang in them.
"""

from __future__ import annotations

import atexit
import signal
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["destroy_process_group_at_exit"]

_registered = False
_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
_POLL_S = 0.01
_QUIET_POLLS = 2  # unchanged snapshots in a row that count as idle
_LIMIT_S = 2.0  # never hold an exiting process longer than this
_TASKS = Path("/proc/self/task")


def _gloo_workers() -> dict[str, tuple[str, ...]] | None:
    """Each gloo worker thread's state and context-switch counts; None where /proc cannot tell."""
    if not _TASKS.is_dir():
        return None
    snapshot = {}
    for task in _TASKS.iterdir():
        try:
            if (task / "comm").read_text().strip() != _GLOO_WORKER:
                continue
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        except OSError:  # the thread ended between the listing and the read
            continue
        snapshot[task.name] = tuple(
            fields.get(key, "").strip() for key in ("State", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        )
    return snapshot


def _wait_for_gloo_workers() -> None:
    """Sleep, the GIL released, until no gloo worker thread has moved for ``_QUIET_POLLS`` polls."""
    deadline = time.monotonic() + _LIMIT_S
    previous = _gloo_workers()
    if previous is None:  # no /proc (not Linux): a fixed pause covers the same race
        time.sleep(0.1)
        return
    quiet = 0
    while previous and quiet < _QUIET_POLLS and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        current = _gloo_workers()
        blocked = all(state.startswith("S") for state, *_ in (current or {}).values())
        quiet = quiet + 1 if current == previous and blocked else 0
        previous = current


def _destroy() -> None:
    # Ctrl+C while the group goes would leave it half destroyed: ignore it for the moment.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if dist.is_available() and dist.is_initialized():
            _wait_for_gloo_workers()
            dist.destroy_process_group()
    finally:
        signal.signal(signal.SIGINT, previous)


def destroy_process_group_at_exit() -> None:
    """Register (once per process) an ``atexit`` handler that destroys the default process group."""
    global _registered
    if not _registered:
        atexit.register(_destroy)
        _registered = True
