"""Muon gradients on their way to owners while backward still runs: bucketed, asynchronous all-to-alls.

DDP overlaps its all-reduce with backward by launching a bucket as soon as its gradients
are ready. ``MuonDDPSharding`` does the same for the matrices DDP ignores, with its own
post-accumulate-grad hooks (Lightning registers DDP communication hooks on CUDA only, and
the same code must run under gloo on CPU):

    backward produces grad(p), p in bucket b     # hook on every Muon parameter
    all of b's gradients ready                   # buckets launch in index order only,
        -> async all_to_all_v(b) in the group    #   so every rank issues the same sequence
    an earlier bucket's all-to-all completed     # polled from the hooks, in order
        -> rows summed, async all_reduce across groups
    MuonDDPSharding.reduce_gradients()           # the step: launch what is left (a parameter
        -> wait on every handle, in order        #   without a gradient this time), wait,
                                                 #   then the same owned gradients as unbucketed

Only a backward that synchronizes launches anything: under DDP's ``no_sync`` (the
micro-batches that accumulate without stepping) the hooks return at once and gradients
accumulate locally, as DDP's own do. Every bucket carries the flags and the same element
order per owner as the unbucketed path, and rows are summed in the same rank order, so the
owned gradients are bitwise the same as without overlap.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.distributed.comm import all_reduce_bytes, owner_groups, unit_rows

__all__ = ["OverlappedReduce"]


class OverlappedReduce:
    """Buckets of Muon gradients sent to their owners from backward hooks; ``finish`` waits for them.

    Args:
        sharding: the ``MuonDDPSharding`` whose parameters, plan and groups are used.
        should_sync: returns True during a backward whose gradients are to be reduced (a DDP
            module's ``require_backward_grad_sync``).
        bucket_cap_mb: bucket size; buckets fill in reverse parameter order (backward's).
    """

    def __init__(self, sharding, should_sync: Callable[[], bool], bucket_cap_mb: float = 25.0) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        self.sharding = sharding
        self.should_sync = should_sync
        # A group of its own: DDP's reducer issues all-reduces on the default group from the
        # same hooks, and two streams of collectives on one group could interleave
        # differently on different ranks.
        self.group, _ = owner_groups(sharding.group, sharding.world_size, sharding.group_size, fresh=True)
        self.buckets = self._buckets(bucket_cap_mb * 1024**2)
        self._bucket_of = {id(p): b for b, members in enumerate(self.buckets) for p in members}
        self.issued: list[tuple[str, int]] = []
        """("all_to_all" | "all_reduce", bucket) in the order this rank issued them, since the last ``finish``."""
        self.issued_last: list[tuple[str, int]] = []
        """``issued`` as it was when the last ``finish`` began waiting."""
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in sharding.params]

    def _buckets(self, cap_bytes: float) -> list[list[Tensor]]:
        """Muon parameters in reverse order (backward's), cut when a bucket reaches ``cap_bytes``."""
        out: list[list[Tensor]] = [[]]
        size = 0
        for p in reversed(self.sharding.params):
            out[-1].append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                out.append([])
                size = 0
        return [b for b in out if b]

    def _reset(self) -> None:
        n = len(self.buckets)
        self._ready = [set() for _ in range(n)]
        self._a2a: list = [None] * n  # (work, send, recv) per launched bucket
        self._summed: list = [None] * n  # (total, work or None) per bucket past its all-to-all
        self._launched = 0
        self._processed = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def pending(self) -> bool:
        """True between a synchronizing backward's first launch and ``finish``."""
        return self._launched > 0

    # ------------------------------------------------------------------ from backward

    @torch.no_grad()
    def _hook(self, p: Tensor) -> None:
        if not self.should_sync():
            return  # an accumulating micro-batch: nothing leaves this rank
        b = self._bucket_of[id(p)]
        if id(p) in self._ready[b] or b < self._launched:
            raise RuntimeError(
                "MuonDDPSharding: a Muon gradient was accumulated twice in synchronizing backward passes before the "
                "optimizer step; its first value is already on its way to its owner. Accumulate the micro-batches "
                "but the last inside DDP's no_sync (under Fabric: with fabric.no_backward_sync(model)), or build "
                "the strategy with overlap=False"
            )
        self._ready[b].add(id(p))
        while self._launched < len(self.buckets) and len(self._ready[self._launched]) == len(
            self.buckets[self._launched]
        ):
            self._launch(self._launched)
        self._progress(block=False)

    def _launch(self, b: int) -> None:
        """Issue bucket ``b``'s all-to-all to the owners (async); the same layout as the unbucketed path."""
        s = self.sharding
        members = {id(p) for p in self.buckets[b]}
        by_owner = [[u for u in owned if id(u[0]) in members] for owned in s._by_owner()]
        dtype, device = s.params[0].dtype, s.params[0].device
        pieces, send_counts = [], []
        for owned in by_owner:
            # Each owner's units (whole matrices, blocks of experts), one extra element per unit:
            # 1 where this rank has a gradient.
            for p, start, rows in owned:
                pieces.append(unit_rows(p.grad if p.grad is not None else torch.zeros_like(p), start, rows).to(dtype))
            pieces.append(torch.tensor([p.grad is not None for p, _, _ in owned], dtype=dtype, device=device))
            send_counts.append(sum(unit_rows(p, start, rows).numel() for p, start, rows in owned) + len(owned))
        mine = by_owner[s.local_rank]
        size = sum(unit_rows(p, start, rows).numel() for p, start, rows in mine) + len(mine)
        send = torch.cat(pieces)
        recv = send.new_empty(size * s.group_size)  # (S, size) once summed
        work = None
        if s.group_size > 1:
            work = dist.all_to_all_single(
                recv, send, [size] * s.group_size, send_counts, group=self.group, async_op=True
            )
            s.stats.record("reduce_scatter", (send.numel() - send_counts[s.local_rank]) * send.element_size())
        else:
            recv.copy_(send)
        self.issued.append(("all_to_all", b))
        self._a2a[b] = (work, send, recv, mine)
        self._launched = b + 1

    def _progress(self, block: bool) -> None:
        """Sum the rows of launched buckets whose all-to-all completed (all of them if ``block``), in order."""
        s = self.sharding
        while self._processed < self._launched:
            b = self._processed
            work, _, recv, mine = self._a2a[b]
            if work is not None and not block and not work.is_completed():
                return
            if work is not None:
                work.wait()
            view = recv.view(s.group_size, -1)  # (S, size): what each rank of the group sent this one
            total = view[0]
            for row in view[1:]:
                total.add_(row)  # in rank order, as the unbucketed path sums
            across = None
            if s.peer_group is not None and total.numel():
                across = dist.all_reduce(total, group=s.peer_group, async_op=True)
                peers = dist.get_world_size(s.peer_group)
                s.stats.record("reduce_across", all_reduce_bytes(total.numel(), total.element_size(), peers))
                self.issued.append(("all_reduce", b))
            self._summed[b] = (total, across, mine)
            self._processed = b + 1

    # ------------------------------------------------------------------ from the step

    @torch.no_grad()
    def finish(self) -> list[tuple[list[Tensor], Tensor]]:
        """Launch what is left, wait for everything; per bucket, (its owned parameters, summed grads + flags)."""
        self.issued_last = list(self.issued)  # what went out from backward's hooks
        try:
            for b in range(self._launched, len(self.buckets)):
                self._launch(b)  # parameters without a gradient this time go as zeros, flagged
            self._progress(block=True)
            out = []
            for total, across, mine in self._summed:
                if across is not None:
                    across.wait()
                out.append((mine, total))
            return out
        finally:
            self.issued = []
            self._reset()
