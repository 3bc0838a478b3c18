"""Exact Muon under FSDP2: whole matrices orthogonalized by owner ranks, moved by all-to-all.

Under ``fully_shard`` every parameter, gradient and momentum buffer is a DTensor sharded
on dim 0 (``Shard(0)``, ``torch.chunk`` row blocks: 5 rows on 3 ranks are 2, 2, 1; 2 rows
on 3 ranks leave one rank an empty shard). Newton-Schulz needs whole matrices, so for one
Muon param group ``MuonFSDPSharding.orthogonalize`` (Newton-Schulz through ``map_whole``) does::

    U_i = momentum update of matrix i, rank r holding rows R_r(i)       # DTensor, Shard(0)
    owner(i) from plan_ownership(global shapes)                          # same plan on all ranks
    all_to_all_v:   rank r sends U_i[R_r(i)] to owner(i), for every i    # one call per group
    owner:          O_i = orthogonalize(cat_r U_i[R_r(i)])               # whole matrices, batched
    all_to_all_v:   owner sends O_i[R_r(i)] back to rank r               # one call per group
    returns         DTensor(O_i[R_r(i)], Shard(0), global shape)         # per update, its pieces

so the rest of ``Muon``'s step (second moments, weight decay, ``adjust_lr`` of the global
shape, the update) runs on DTensors exactly as on one process. Per rank, the bytes sent are
``(W - 1) / W * P`` each way for ``P`` Muon elements (balanced owners), in bf16 where the
Newton-Schulz dtype is bf16, on top of FSDP2's own all-gathers and reduce-scatters; the
Newton-Schulz work per rank is ``1 / W`` of the total.

Sending bf16 changes nothing when Newton-Schulz runs in bf16: ``orthogonalize`` casts its
input to bf16 before anything else and its result holds bf16 values, so the owner computes
on exactly the numbers a single process would, and the result travels back without rounding.
Otherwise the update's own dtype is sent.

``mode="blockwise"`` orthogonalizes each rank's own shard instead: no extra traffic, but
not Muon (the polar factor of a row block is not a row block of the polar factor); it is
there to compare against.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_muon.algorithms import per_matrix
from lightning_muon.distributed.comm import CommStats, all_reduce_, all_to_all_v
from lightning_muon.distributed.planning import plan_ownership
from lightning_muon.distributed.protocol import Observer, Sharding, WholeWork
from lightning_muon.layout import MatrixLayout, layout_of

__all__ = ["FSDP_MODES", "MuonFSDPSharding", "exchange_with_owners", "muon_params", "shard_rows"]

FSDP_MODES = ("owner", "blockwise")
ROWS = (Shard(0),)  # fully_shard's placement: row blocks of dim 0


def shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows each rank holds of a ``Shard(0)`` tensor with ``rows`` rows (``torch.chunk`` blocks)."""
    size = math.ceil(rows / world_size) if rows else 0
    return [max(0, min(size, rows - r * size)) for r in range(world_size)]


def _matrix_shape(shape: Sequence[int], layout: MatrixLayout) -> tuple[int, ...]:
    # The one piece of a tensor without splits, or of its row shard.
    return layout.piece_shapes(shape)[0]


def blocks_refused(sharding: str, where: str, layout: MatrixLayout) -> str:
    """The error for a 2-D expert concatenation (``blocks``) under a sharding that shards rows."""
    return (
        f"{sharding}: {where} holds 2-D tensors whose dim 0 concatenates {layout.blocks} experts (blocks="
        f"{layout.blocks}, DBRX's (E * F, H) layout); FSDP2's row shards cut across its experts, so it is not "
        "supported here: train it under muon_ddp, or store the experts as a 3-D (E, F, H) stack"
    )


class MuonFSDPSharding(Sharding):
    """Owner-based, exact Newton-Schulz for one ``Muon`` optimizer over FSDP2-sharded parameters.

    A ``Sharding`` that attaches itself to the optimizer. Every Muon parameter must be a DTensor
    sharded on dim 0 over one 1-D device mesh (what ``fully_shard`` makes). Owners are
    planned once, over all Muon parameters by their global shapes, balancing Newton-Schulz
    FLOPs (``plan_ownership``); every rank computes the same plan.

    Args:
        optimizer: a ``Muon`` whose Muon parameters are ``Shard(0)`` DTensors.
        mode: ``"owner"`` (exact) or ``"blockwise"`` (each rank orthogonalizes its own rows;
            an approximation with no extra traffic).
        stats: where bytes and calls are counted; a new ``CommStats`` by default.

    Notes:
        Batched stacks (mixture-of-experts ``(E, out, in)``, ``Shard(0)`` over the experts)
        leave every rank whole experts: each rank orthogonalizes its own, and nothing is sent
        for them (``"to_owner"`` counts no bytes of theirs). Splits along the columns (GPT-2's
        ``Conv1D`` fused QKV with ``split_qkv=True``) go to owners whole and come back as row
        blocks of each piece. Splits along dim 0 (a fused QKV stored ``(out, in)``) and
        batched tensors with more than three dims are not supported: their pieces cut across
        the row shards.
        The optimizer's update hooks (``Muon.register_update_hook``, ``UpdateSpectrumMonitor``)
        are run here, on owner ranks with the full matrices they orthogonalized, before any
        second-moment normalization; in blockwise mode no rank holds a full matrix and they
        are not run.
    """

    observes_updates = True
    agrees_on_grads = True  # FSDP2 gives a Muon matrix a gradient on all ranks or on none

    def __init__(self, optimizer, mode: str = "owner", stats: CommStats | None = None) -> None:
        if mode not in FSDP_MODES:
            raise ValueError(f"mode must be one of {FSDP_MODES}, got {mode!r}")
        self.mode = mode
        groups, params = muon_params(optimizer, "MuonFSDPSharding", _check_group)
        self.mesh = params[0].device_mesh
        layouts = [layout_of(g) for g in groups for _ in g["params"]]
        plan = plan_ownership(
            [tuple(p.shape) for p in params],
            self.mesh.size(),
            layouts=layouts,
            spread=[lay.row_blocks_hold_whole_matrices for lay in layouts],  # expert stacks: every rank its own experts
        )
        self._warned_observer = False
        super().__init__(
            optimizer,
            params,
            plan,
            group=self.mesh.get_group(),
            rank=self.mesh.get_local_rank(),
            world_size=self.mesh.size(),
            stats=stats,
        )

    # ------------------------------------------------------------------ the protocol

    def stepped(self, p: Tensor) -> Tensor:
        """Every rank steps its shard of every parameter."""
        return p

    def local_shard(self, t: Tensor) -> Tensor:
        """This rank's part of ``t``: the local tensor of a DTensor, ``t`` itself otherwise."""
        return t.to_local() if isinstance(t, DTensor) else t

    def holds_whole(self, layout: MatrixLayout) -> bool:
        """A ``Shard(0)`` row block holds whole matrices where the layout's dim 0 indexes them (expert stacks)."""
        return layout.row_blocks_hold_whole_matrices

    def round_owners(self, group: dict, params: list[Tensor]) -> list[int | None] | None:
        """Each parameter's owner; None where every rank works on its own rows (whole experts, blockwise mode)."""
        return None if self.mode == "blockwise" else super().round_owners(group, params)

    @torch.no_grad()
    def reduce_matrix_sums(self, params: list[Tensor], partial: Tensor, layout: MatrixLayout) -> Tensor:
        """Whole-matrix sums: one all-reduce of the ``(K, k)`` per-rank sums (``Sharding.reduce_matrix_sums``).

        Every rank holds a row block of every matrix, so whole-matrix sums are the sums of the
        ranks' own (``"matrix_sums"`` in ``stats``): one collective of ``K k`` numbers per Muon
        group, where sending whole matrices to owners would move every element again. A piece
        that several ranks hold alike (replicated on a tensor-parallel mesh dim) counts once:
        each holder adds its share.
        """
        if self.holds_whole(layout):
            return partial  # whole experts here: their sums are complete
        copies = [_copies(p, self.world_size) for p in params]
        total = partial.clone()
        if any(c > 1 for c in copies):
            total /= torch.tensor(copies, dtype=total.dtype, device=total.device).unsqueeze(1)
        if self.world_size > 1:
            all_reduce_(total, group=self.group, stats=self.stats, name="matrix_sums")
        return total

    # ------------------------------------------------------------------ work on whole matrices

    @torch.no_grad()
    def map_whole(
        self,
        params: list[Tensor],
        tensors: list[list[Tensor]],
        fn: WholeWork,
        *,
        layout: MatrixLayout | None = None,
        wire_dtype: torch.dtype | None = None,
        observe: Observer | None = None,
        newton_schulz: dict[str, Any] | None = None,
    ) -> list[list[Tensor]]:
        """``Sharding.map_whole`` by owners: each parameter's tensors whole on its owner, ``fn`` there, rows back.

        Every tensor is a ``Shard(0)`` DTensor on the parameters' mesh (``torch.chunk`` row
        blocks); one ``exchange_with_owners`` carries them all, in ``wire_dtype`` or else their
        own dtypes' widest, and each result comes back in its tensor's dtype. With a ``layout``
        whose matrices a row block holds whole (``holds_whole``: expert stacks), and in
        blockwise mode (each rank's rows stand for whole matrices: an approximation), ``fn``
        runs on every rank's own rows and nothing is sent.
        """
        if layout is not None and (self.mode == "blockwise" or self.holds_whole(layout)):
            return self._map_here(tensors, fn, layout, observe)
        counts = [len(ts) for ts in tensors]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        flat = [t for ts in tensors for t in ts]
        param_of = [i for i, n in enumerate(counts) for _ in range(n)]
        owners = [self.plan.owners[self._index[id(params[i])]] for i in param_of]
        wire = wire_dtype or flat[0].dtype
        if wire_dtype is None:
            for t in flat[1:]:
                wire = torch.promote_types(wire, t.dtype)

        def compute(mine: list[int], full: list[Tensor]) -> list[Tensor]:
            whole = dict(zip(mine, full))
            indices = list(dict.fromkeys(param_of[k] for k in mine))  # this rank's parameters, in order
            wholes = [[whole[starts[i] + j] for j in range(counts[i])] for i in indices]
            results = fn(indices, wholes)
            if observe is not None:
                observe(indices, wholes, results)
            if layout is not None:  # the pieces laid back out in the tensor's shape, so that its row blocks travel
                results = [[_join_pieces(ws[0], pieces, layout)] for ws, pieces in zip(wholes, results)]
            return [r for rs in results for r in rs]

        def place(k: int, rows: Tensor) -> list[Tensor]:
            if layout is None:
                return [rows]
            return self._pieces_as_dtensors(layout.views(rows.contiguous()), flat[k], layout)

        rank = self.rank
        parts = exchange_with_owners(
            [self.local_shard(t) for t in flat],
            [tuple(t.shape) for t in flat],
            owners,
            [t.dtype for t in flat],
            wire,
            self.group,
            rank,
            self.world_size,
            self.stats,
            compute,
            place,
            mismatch=lambda k, shard, expected: (
                f"MuonFSDPSharding: a shard of shape {shard} of a {tuple(flat[k].shape)} tensor on rank {rank}; "
                f"expected {expected} rows (torch.chunk blocks of dim 0)"
            ),
        )
        if layout is not None:
            return parts
        return [[parts[starts[i] + j][0] for j in range(counts[i])] for i in range(len(tensors))]

    def _map_here(
        self, tensors: list[list[Tensor]], fn: WholeWork, layout: MatrixLayout, observe: Observer | None
    ) -> list[list[Tensor]]:
        """``fn`` on every rank's own rows of each tensor; nothing is sent.

        Exact for expert stacks sharded over their experts (whole matrices on every rank), an
        approximation in blockwise mode. The pieces come back in their tensors' dtypes.
        """
        if observe is not None:
            self._warn_unobserved(
                "blockwise mode never holds a whole matrix"
                if self.mode == "blockwise"
                else "expert stacks are worked on where their experts live, without owners"
            )
        local = [self.local_shard(ts[0]).contiguous() for ts in tensors]
        filled = [i for i, u in enumerate(local) if u.numel()]  # an empty shard stays empty
        out = [layout.views(u) for u in local]
        for i, pieces in zip(filled, fn(filled, [[local[i]] for i in filled])):
            out[i] = pieces
        return [
            self._pieces_as_dtensors([o.to(ts[0].dtype) for o in pieces], ts[0], layout)
            for pieces, ts in zip(out, tensors)
        ]

    def _warn_unobserved(self, why: str) -> None:
        if not self._warned_observer:
            self._warned_observer = True
            warnings.warn(
                f"MuonFSDPSharding: {why}; the update hooks are not run for them", RuntimeWarning, stacklevel=4
            )

    def _pieces_as_dtensors(self, local_pieces: list[Tensor], like: Tensor, layout: MatrixLayout) -> list[Tensor]:
        """DTensors of the pieces of ``like`` (a DTensor sharded on dim 0 only) from this rank's rows of each.

        Each piece is placed as ``like`` is: its dim 0 holds the same rows (or experts).
        """
        return [
            self._as_dtensor(piece, like.device_mesh, shape, like.placements)
            for piece, shape in zip(local_pieces, layout.piece_shapes(like.shape))
        ]

    def _as_dtensor(self, local: Tensor, mesh, shape: Sequence[int], placements=ROWS) -> Tensor:
        """A DTensor of global ``shape`` with ``local`` as this rank's rows (``Shard(0)`` unless told)."""
        shape = torch.Size(shape)
        local = local.reshape(-1, *shape[1:]) if len(shape) > 1 else local
        return DTensor.from_local(
            local.contiguous(), mesh, tuple(placements), run_check=False, shape=shape, stride=_strides(shape)
        )


def exchange_with_owners(
    local: list[Tensor],
    shapes: list[tuple[int, ...]],
    owners: list[int],
    dtypes: list[torch.dtype],
    wire: torch.dtype,
    group,
    rank: int,
    world_size: int,
    stats: CommStats,
    compute: Callable[[list[int], list[Tensor]], list[Tensor]],
    place: Callable[[int, Tensor], list[Tensor]],
    mismatch: Callable[[int, tuple[int, ...], int], str],
) -> list[list[Tensor]]:
    """Rows to their owners, ``compute`` on the owners' whole tensors, rows back: the owner path.

    Tensor ``i`` has shape ``shapes[i]``, row-sharded over ``group`` in ``torch.chunk``
    blocks; this rank holds ``local[i]`` (``(rows[i][rank], ...)``)::

        all_to_all_v   rank r sends its rows of tensor i to owners[i], in ``wire``    "to_owner"
        owner          results = compute(mine, [whole tensor i for i in mine])        (shapes[i]-sized)
        all_to_all_v   owner sends rank r its rows of each result, in ``wire``        "from_owner"
        returns        per i, place(i, this rank's rows of result i in dtypes[i]): its pieces

    ``rank`` of ``world_size`` is this rank's place in ``group``; every rank of ``group``
    calls it with the same shapes and owners. A local shard with the wrong row count
    raises ``RuntimeError(mismatch(i, shard shape, expected rows))``.
    """
    W = world_size
    row_numel = [math.prod(s[1:]) for s in shapes]
    rows = [shard_rows(s[0], W) for s in shapes]  # rows[i][r]: rows of tensor i on rank r
    for i, u in enumerate(local):
        if u.shape[0] != rows[i][rank]:
            raise RuntimeError(mismatch(i, tuple(u.shape), rows[i][rank]))
    by_owner = [[i for i in range(len(local)) if owners[i] == r] for r in range(W)]
    mine = by_owner[rank]

    # 1. Every rank sends its rows of each tensor to the tensor's owner: one flat blob,
    #    grouped by owner rank, each tensor's rows (rows[i][rank], row_numel_i) flattened.
    send = [local[i].reshape(-1) for r in range(W) for i in by_owner[r]]
    send_counts = [sum(local[i].numel() for i in by_owner[r]) for r in range(W)]
    recv_counts = [sum(rows[i][s] * row_numel[i] for i in mine) for s in range(W)]
    blob = _cat_as(send, wire, local[0])
    recv = all_to_all_v(blob, send_counts, recv_counts, group, stats, name="to_owner")
    del send, blob

    # 2. The owner stacks the row blocks of each of its tensors and computes on them all.
    blocks: dict[int, list[Tensor]] = {i: [] for i in mine}
    for chunk, s in zip(recv.split(recv_counts), range(W)):
        for i, part in zip(mine, _split(chunk, [rows[i][s] * row_numel[i] for i in mine])):
            blocks[i].append(part)
    full = [torch.cat(blocks[i]).view(shapes[i]) for i in mine]  # (rows_i, ...) whole tensors
    del recv, blocks  # the whole tensors are copies: the received rows can go before Newton-Schulz
    computed = compute(mine, full)
    del full

    # 3. The owner sends each rank its rows of every result.
    results = [c.reshape(shapes[i][0], -1) for i, c in zip(mine, computed)]  # (rows_i, row_numel_i)
    back, back_counts = [], []
    for r in range(W):
        for i, res in zip(mine, results):
            start = sum(rows[i][:r])
            back.append(res[start : start + rows[i][r]].reshape(-1))
        back_counts.append(sum(rows[i][r] * row_numel[i] for i in mine))
    from_counts = [sum(rows[i][rank] * row_numel[i] for i in by_owner[s]) for s in range(W)]
    blob = _cat_as(back, wire, local[0])
    del back, results, computed
    got = all_to_all_v(blob, back_counts, from_counts, group, stats, name="from_owner")
    del blob

    out: list[list[Tensor] | None] = [None] * len(local)
    for chunk, s in zip(got.split(from_counts), range(W)):
        for i, part in zip(by_owner[s], _split(chunk, [rows[i][rank] * row_numel[i] for i in by_owner[s]])):
            out[i] = place(i, part.view(local[i].shape).to(dtypes[i]))
    return out  # type: ignore[return-value]


def _join_pieces(whole: Tensor, pieces: list[Tensor], layout: MatrixLayout) -> Tensor:
    """``pieces`` (``layout.views`` of a tensor shaped like ``whole``) written into one such tensor, in their dtype."""
    if layout.split_sizes is None:
        return pieces[0]  # the one piece is the tensor, reshaped
    out = whole.new_empty(whole.shape, dtype=pieces[0].dtype)
    for slot, piece in zip(layout.slots(out), pieces):
        slot.copy_(piece.view(slot.shape))
    return out


def _cat_as(pieces: list[Tensor], dtype: torch.dtype, like: Tensor) -> Tensor:
    """``torch.cat(pieces).to(dtype)`` in one pass: each piece cast as it is copied in (no full-size copy first)."""
    out = like.new_empty(sum(t.numel() for t in pieces), dtype=dtype)
    offset = 0
    for t in pieces:
        out[offset : offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return out


def _copies(p: Tensor, world_size: int) -> int:
    """How many of the ``world_size`` ranks hold the same piece of ``p`` (1 when every rank's piece differs)."""
    if not isinstance(p, DTensor):
        return world_size
    sharded = [p.device_mesh.size(i) for i, place in enumerate(p.placements) if not isinstance(place, Replicate)]
    return world_size // math.prod(sharded)


def _split(flat: Tensor, sizes: list[int]) -> Sequence[Tensor]:
    return flat.split(sizes) if sizes else ()


def _strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def muon_params(
    optimizer, who: str, check: Callable[[dict, str, list[Tensor]], None]
) -> tuple[list[dict], list[Tensor]]:
    """The optimizer's Muon param groups (Muon and its variants) and their parameters, in order, each checked.

    ``check(group, where, params)`` runs on every Muon group (``where`` names it for error
    messages, ``params`` are all the Muon parameters); ``who`` prefixes the error raised
    when there are none.
    """
    groups = [g for g in optimizer.param_groups if per_matrix(g)]  # Muon, its variants, SOAP: per-matrix work
    params: list[Tensor] = [p for g in groups for p in g["params"]]
    if not params:
        raise ValueError(f"{who}: the optimizer has no Muon parameters")
    for index, g in enumerate(optimizer.param_groups):
        if not per_matrix(g):
            continue
        check(g, f"param group {index}" + (f" ({g['name']!r})" if "name" in g else ""), params)
    return groups, params


def _check_group(g: dict, where: str, params: list[Tensor]) -> None:
    layout = layout_of(g)
    if layout.blocks is not None:
        raise ValueError(blocks_refused("MuonFSDPSharding", where, layout))
    if not layout.row_blocks_hold_piece_rows:
        raise ValueError(
            f"MuonFSDPSharding: {where} has split_sizes {layout.split_sizes} along dim 0, which is not supported "
            "under FSDP2 (its pieces cut across the row shards): route it without a split (MuonConfig "
            "split_qkv=False, or drop split_sizes/split_parts from the rule that routes it). Splits along the "
            "columns (transposed=True, GPT-2's Conv1D) and batched expert stacks are supported"
        )
    for p in g["params"]:
        _check_param(p, where, layout.batched, params[0])


def _check_param(p: Tensor, where: str, batched: bool, first: Tensor) -> None:
    shape = tuple(p.shape)
    if not isinstance(p, DTensor):
        raise ValueError(
            f"MuonFSDPSharding: {where} holds a plain tensor of shape {shape}; every Muon parameter must be "
            "sharded by fully_shard (a DTensor), so apply fully_shard to the module that holds it"
        )
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(
            f"MuonFSDPSharding: {where} holds a DTensor of shape {shape} placed {tuple(p.placements)} on a "
            f"{p.device_mesh.ndim}-D mesh; only Shard(0) on a 1-D mesh (fully_shard's default) is supported"
        )
    if p.device_mesh != first.device_mesh:  # ``first`` was checked first
        raise ValueError(f"MuonFSDPSharding: {where}: all Muon parameters must live on one device mesh")
    if batched and p.ndim > 3:
        raise ValueError(
            f"MuonFSDPSharding: {where}: batched tensors with more than 3 dims (shape {shape}) are not supported"
        )
