"""Counting what a rank really does: bytes it sends and Newton-Schulz FLOPs it runs.

Both counters wrap the calls themselves (``torch.distributed``'s collectives,
``lightning_muon.functional.orthogonalize_many``), so what is counted is what ran, not
what a plan says. They count per ``phase`` (a configuration of a benchmark); calls made
while ``phase`` is None (setup, barriers) are not counted. Install them in a worker
process only: they replace module attributes for the rest of the process.

Bytes per rank follow the bandwidth-optimal algorithms, as
``lightning_muon.distributed.comm.CommStats`` counts them::

    all_reduce                      2 (W - 1) / W x the tensor
    reduce_scatter_*                (W - 1) / W x the input
    all_gather_*                    (W - 1) x the local piece
    all_to_all_single               the elements addressed to other ranks
    broadcast                       the tensor, on the source rank only
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from typing import Any

import torch.distributed as dist

import lightning_muon.functional as functional
from benchlib.harness import sync
from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.newton_schulz import ns_flops_as_run


def _bound(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


class WireCounter:
    """Bytes (and calls) this rank sends, per phase and collective, read off the tensors passed in.

    Args:
        rank: This process's rank.
        world_size: The number of ranks W.
        ops: The names of the ``torch.distributed`` functions to wrap (each one of the
            collectives in the module docstring).
    """

    KNOWN = (
        "all_reduce",
        "all_to_all_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_gather_into_tensor",
        "all_gather_single",
        "broadcast",
    )

    def __init__(self, rank: int, world_size: int, ops: tuple[str, ...]) -> None:
        unknown = [op for op in ops if op not in self.KNOWN]
        if unknown:
            raise ValueError(f"WireCounter: ops {unknown} are not counted; known: {self.KNOWN}")
        self.rank, self.world, self.ops = rank, world_size, ops
        self.phase: str | None = None
        self.bytes: dict[str, Counter[str]] = {}
        self.calls: dict[str, Counter[str]] = {}

    def install(self) -> None:
        for op in self.ops:
            setattr(dist, op, self._wrap(op, getattr(dist, op)))

    def _wrap(self, op: str, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase is not None:
                sent = self._sent(op, _bound(original, args, kwargs))
                self.bytes.setdefault(self.phase, Counter())[op] += sent
                self.calls.setdefault(self.phase, Counter())[op] += 1
            return original(*args, **kwargs)

        return counted

    def _sent(self, op: str, a: dict[str, Any]) -> float:
        w = self.world
        if op == "all_to_all_single":
            x, splits = a["input"], a["input_split_sizes"]
            own = splits[self.rank] if splits else x.numel() // w
            return float((x.numel() - own) * x.element_size())
        if op == "broadcast":  # the source sends the tensor once
            t = a["tensor"]
            return float(t.numel() * t.element_size()) if a["src"] == self.rank else 0.0
        x = a.get("input_tensor", a.get("input", a.get("tensor")))
        if op == "all_reduce":
            return all_reduce_bytes(x.numel(), x.element_size(), w)
        nbytes = x.numel() * x.element_size()
        if op.startswith("all_gather"):
            return float((w - 1) * nbytes)
        return (w - 1) / w * nbytes  # reduce_scatter


class NSCounter:
    """Newton-Schulz FLOPs and matrices per phase: ``ns_flops_as_run`` of every matrix ``Muon`` orthogonalizes.

    Wraps ``lightning_muon.functional.orthogonalize_many``, the call through which ``Muon``
    orthogonalizes its updates. A stacked ``(K, m, n)`` batch counts K matrices.
    ``seconds`` adds up the wall time of every call, counted or not (synchronized with the
    GPU on ``device`` ``"cuda"``).
    """

    def __init__(self, device: str = "cpu") -> None:
        self.phase: str | None = None
        self.flops: Counter[str] = Counter()
        self.matrices: Counter[str] = Counter()
        self.seconds = 0.0
        self.device = device

    def install(self) -> None:
        original = functional.orthogonalize_many

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase is not None:
                a = _bound(original, args, kwargs)
                for M in a["matrices"]:
                    rows, cols = M.shape[-2:]
                    self.flops[self.phase] += ns_flops_as_run(M, a["steps"], a["method"], a["dtype"])
                    self.matrices[self.phase] += M.numel() // max(1, rows * cols)
            sync(self.device)
            start = time.perf_counter()
            out = original(*args, **kwargs)
            sync(self.device)
            self.seconds += time.perf_counter() - start
            return out

        functional.orthogonalize_many = counted
