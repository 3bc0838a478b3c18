"""Collectives with a byte count: what each rank puts on the wire, per operation.

Counts follow the bandwidth-optimal algorithms' cost per rank for W ranks and a
payload of B bytes: all-reduce 2 (W - 1) / W * B, reduce-scatter and all-gather
(W - 1) / W * B each, and for an all-to-all exactly the bytes sent to other ranks.
The strategies compare their totals with plain DDP's all-reduce of the same
parameters (``all_reduce_bytes``). ``owner_groups`` makes the subgroups they run in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

__all__ = ["CommStats", "all_reduce_", "all_reduce_bytes", "all_to_all_v", "owner_groups", "unit_rows"]


def unit_rows(t: Tensor, start: int, rows: int) -> Tensor:
    """Rows ``[start, start + rows)`` of dim 0 of a contiguous ``t``, flat: one owner's unit of a tensor.

    A view (``t`` is contiguous): a unit is a whole matrix (all its rows) or an expert stack's
    block of experts, whose elements are consecutive in memory.
    """
    per_row = t.numel() // t.shape[0] if t.shape[0] else 0
    return t.reshape(-1)[start * per_row : (start + rows) * per_row]


class CommStats:
    """Bytes sent by this rank and calls made, by operation name."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def record(self, op: str, nbytes: float) -> None:
        self.bytes[op] += nbytes
        self.calls[op] += 1

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def all_reduce_bytes(numel: int, element_size: int, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements."""
    return 2.0 * (world_size - 1) / world_size * numel * element_size


def all_reduce_(
    tensor: Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group=None,
    stats: CommStats | None = None,
    name: str = "all_reduce",
) -> Tensor:
    """In-place all-reduce of ``tensor``, counted in ``stats``."""
    world = dist.get_world_size(group)
    if world > 1:
        dist.all_reduce(tensor, op=op, group=group)
        if stats is not None:
            stats.record(name, all_reduce_bytes(tensor.numel(), tensor.element_size(), world))
    return tensor


def all_to_all_v(
    send: Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group=None,
    stats: CommStats | None = None,
    name: str = "all_to_all",
    out: Tensor | None = None,
) -> Tensor:
    """Uneven all-to-all of a flat tensor: ``send_counts[r]`` elements go to rank ``r``.

    Returns the flat received tensor: ``recv_counts[r]`` elements from each rank ``r``,
    in rank order (written into ``out`` when given). A rank may send or receive nothing;
    every rank must call it.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if len(send_counts) != world or len(recv_counts) != world:
        raise ValueError(f"send_counts and recv_counts need one entry per rank ({world})")
    if send.numel() != sum(send_counts):
        raise ValueError(f"send has {send.numel()} elements but send_counts sum to {sum(send_counts)}")
    if out is not None and (out.numel() != sum(recv_counts) or out.dtype != send.dtype):
        raise ValueError(f"out must hold {sum(recv_counts)} elements of {send.dtype}, got {out.numel()} of {out.dtype}")
    recv = send.new_empty(sum(recv_counts)) if out is None else out
    if world == 1:
        recv.copy_(send)
        return recv
    dist.all_to_all_single(recv, send.contiguous(), list(recv_counts), list(send_counts), group=group)
    if stats is not None:
        stats.record(name, (sum(send_counts) - send_counts[rank]) * send.element_size())
    return recv


def owner_groups(group, world_size: int, size: int, fresh: bool = False):
    """(this rank's owner group, its peer group across groups or None) for groups of ``size`` ranks.

    Every rank creates every subgroup, in the same order, as ``torch.distributed.new_group``
    requires. With one group (``size == world_size``) the owner group is ``group`` itself,
    unless ``fresh`` asks for a new one (and then no peer group is made).
    """
    if size == world_size and not fresh:
        return group, None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
    me = ranks[dist.get_rank(group)]
    mine = peers = None
    for g in range(world_size // size):
        members = ranks[g * size : (g + 1) * size]
        created = dist.new_group(members)
        if me in members:
            mine = created
    if fresh:
        return mine, None
    for local in range(size):
        members = ranks[local::size]
        created = dist.new_group(members)
        if me in members:
            peers = created
    return mine, peers
