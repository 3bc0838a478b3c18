"""Leave a process group before the interpreter tears itself down.

Lightning destroys the default process group at exit for NCCL only. A gloo group left to
interpreter finalization can abort a rank after a successful fit: its worker threads are
still joinable when their C++ objects go ("terminate called without an active
exception", SIGABRT; seen on spawned CPU ranks), and ``mp.spawn`` then reports the rank
as failed. Destroying the group in an ``atexit`` handler, while the interpreter is whole,
joins those threads first. It is local teardown: no collective, so a rank whose peers
died cannot hang in it.
"""

from __future__ import annotations

import atexit
import signal

import torch.distributed as dist

__all__ = ["destroy_process_group_at_exit"]

_registered = False


def _destroy() -> None:
    # Ctrl+C while the group goes would leave it half destroyed: ignore it for the moment.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        signal.signal(signal.SIGINT, previous)


def destroy_process_group_at_exit() -> None:
    """Register (once per process) an ``atexit`` handler that destroys the default process group."""
    global _registered
    if not _registered:
        atexit.register(_destroy)
        _registered = True
