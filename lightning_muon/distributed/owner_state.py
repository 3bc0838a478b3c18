"""Optimizer state kept on owner ranks: gathered whole for a checkpoint, trimmed back after a load.

A sharding whose owners step whole matrices (``MuonDDPSharding``) keeps each Muon matrix's
optimizer state only where the matrix is stepped: on its owner or, for an expert stack split
by experts, on every rank of the owner group as a block of the stack's rows. A checkpoint
wants every state whole, and a loaded full state holds what other ranks own; these two
functions do that juggling for any sharding laid out so. FSDP2's and the tensor-parallel
mesh's state is sharded as its parameter is (DTensors that checkpoint as they are), so
``MuonFSDPSharding`` and ``MuonTPSharding`` need neither.

A unit is ``(parameter, first row, rows)``: a whole matrix ``(p, 0, dim 0)``, or a block of
an expert stack's experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.distributed.comm import CommStats, all_to_all_v
from lightning_muon.newton_schulz import DTYPES, dtype_name

__all__ = ["drop_foreign_states", "gather_owner_states"]

Unit = tuple[Tensor, int, int]
"""``(parameter, first row, rows)``."""


@torch.no_grad()
def gather_owner_states(
    optimizer,
    params: list[Tensor],
    by_owner: list[list[Unit]],
    split: set[int],
    local_rank: int,
    group,
    stats: CommStats,
) -> list[dict[str, object]]:
    """Every parameter's optimizer state, fetched from its owners; one dict per ``params``.

    ``by_owner[r]`` are the units local rank ``r`` of ``group`` steps; ``split`` holds the ids
    of parameters stepped in blocks of rows (expert stacks), whose parts are joined in row
    order. Every entry travels: momentum and whatever else a variant keeps (second moments
    of any shape, step counters). The owners first share which entries they hold (keys,
    shapes, dtypes: a few bytes per parameter), then the tensors in one all-to-all. Every
    rank of ``group`` must call it with the same units (checkpoint saving does, on all ranks).
    """
    group_size = len(by_owner)
    mine = by_owner[local_rank]
    local = [optimizer.state.get(p, {}) for p, _, _ in mine]  # a stack's part: its rows' state
    # (shape, dtype name, strides) per tensor entry; other values (plain numbers) go as they are.
    layout = [
        {
            k: (tuple(v.shape), dtype_name(v.dtype), _layout_strides(v)) if isinstance(v, Tensor) else ("value", v)
            for k, v in st.items()
        }
        for st in local
    ]
    layouts: list = [None] * group_size
    if group_size == 1:
        layouts = [layout]
    else:
        dist.all_gather_object(layouts, layout, group=group)
    dtypes = {d for lay in layouts for entry in lay for d in _tensor_dtypes(entry)}
    # float64 carries every float32/bf16/fp16 value and integer counters below 2**53 exactly.
    wire = torch.float64 if dtypes - {"float32", "bfloat16", "float16"} else torch.float32
    device = params[0].device if params else torch.device("cpu")
    # One device for the blob: a state entry kept on the CPU (a step counter) joins the rest.
    tensors = [
        v.detach().reshape(-1).to(device=device, dtype=wire)
        for st in local
        for v in st.values()
        if isinstance(v, Tensor)
    ]
    blob = torch.cat(tensors) if tensors else torch.empty(0, dtype=wire, device=device)
    sizes = [sum(_numel(shape) for entry in lay for shape in _tensor_shapes(entry)) for lay in layouts]
    if group_size == 1:
        parts = [blob]
    else:
        send_counts = [0 if r == local_rank else blob.numel() for r in range(group_size)]
        recv_counts = [0 if r == local_rank else sizes[r] for r in range(group_size)]
        recv = all_to_all_v(
            torch.cat([blob] * (group_size - 1)),
            send_counts,
            recv_counts,
            group,
            stats,
            "gather_state",
        )
        chunks = iter(recv.split([recv_counts[r] for r in range(group_size) if r != local_rank]))
        parts = [blob if r == local_rank else next(chunks) for r in range(group_size)]
    out: dict[int, dict[str, object]] = {}
    rows_of: dict[int, list[dict[str, object]]] = {}  # an expert stack: its parts' states, in rank order
    for owned, lay, part in zip(by_owner, layouts, parts):
        offset = 0
        for (p, start, _), entry in zip(owned, lay):
            state: dict[str, object] = {}
            for key, spec in entry.items():
                if spec[0] == "value":
                    state[key] = spec[1]
                    continue
                shape, dtype, strides = spec
                n = _numel(shape)
                # In the owner's memory layout (SOAP's eigenbases are column-major): a resumed
                # step then multiplies in the same order, bit for bit.
                value = torch.empty_strided(shape, strides, dtype=DTYPES[dtype], device=p.device)
                state[key] = value.copy_(part[offset : offset + n].view(shape))
                offset += n
            if id(p) in split:
                rows_of.setdefault(id(p), []).append((start, state))  # joined in expert order
            else:
                out[id(p)] = state
    for key, states in rows_of.items():
        out[key] = _join_rows([st for _, st in sorted(states, key=lambda e: e[0]) if st])
    return [out.get(id(p), {}) for p in params]


def drop_foreign_states(
    state: dict, params: list[Tensor], rows: dict[int, tuple[int, int]], owns: Callable[[Tensor], bool]
) -> None:
    """Forget the optimizer ``state`` of parameters this rank does not step (after loading a full state).

    ``rows[id(p)]``: ``(first row, rows)`` this rank steps of an expert stack, which keeps
    those rows of every per-expert entry (those with the stack's dim 0); any other parameter
    keeps its state where ``owns(p)``.
    """
    for p in params:
        if id(p) in rows:
            entries = state.get(p)
            if not entries:
                continue
            start, n = rows[id(p)]
            if n == 0:
                state.pop(p)
                continue
            state[p] = {k: v[start : start + n].clone() if _per_expert(v, p) else v for k, v in entries.items()}
        elif not owns(p):
            state.pop(p, None)


def _per_expert(v: object, p: Tensor) -> bool:
    return isinstance(v, Tensor) and v.ndim == p.ndim and v.shape[0] == p.shape[0]


def _join_rows(states: list[dict[str, object]]) -> dict[str, object]:
    """One expert stack's state from its parts' (in expert order): per-expert tensors joined along dim 0."""
    if not states:
        return {}
    joined: dict[str, object] = {}
    for key, value in states[0].items():
        if isinstance(value, Tensor) and value.ndim:
            joined[key] = torch.cat([st[key] for st in states])  # type: ignore[misc]
        else:
            joined[key] = value
    return joined


def _tensor_shapes(entry: dict) -> list[tuple[int, ...]]:
    return [spec[0] for spec in entry.values() if spec[0] != "value"]


def _tensor_dtypes(entry: dict) -> list[str]:
    return [spec[1] for spec in entry.values() if spec[0] != "value"]


def _layout_strides(t: Tensor) -> tuple[int, ...]:
    """``t``'s strides where its elements fill their memory densely in some order of dims (a column-major
    eigenbasis), else those of a contiguous tensor of its shape."""
    order = sorted(range(t.ndim), key=t.stride, reverse=True)
    if t.permute(order).is_contiguous():
        return tuple(t.stride())
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
