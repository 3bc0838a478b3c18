"""Exact Muon on a 2-D (data x tensor) mesh: FSDP2 owners on the data dim, a ``tp_mode`` on the tensor dim.

Under Lightning's ``ModelParallelStrategy`` layout a module applies ``parallelize_module``
on the mesh's ``"tensor_parallel"`` dim, then ``fully_shard`` on ``"data_parallel"``. A
Muon weight is then one of (placements on (data, tensor))::

    ColwiseParallel:  (_StridedShard(0), Shard(0))   rank (d, t): row chunk d of row block t
    RowwiseParallel:  (Shard(0), Shard(1))           rank (d, t): row chunk d of column block t
    not in the plan:  (Shard(0), Replicate()) or a 1-D (Shard(0),) on the data dim

For one Muon param group ``MuonTPSharding.map_whole`` with a layout (Newton-Schulz, through
``orthogonalize``; MOP's SVD, Sinkhorn, Spel's projection) does::

    1. data dim:   all_to_all_v: each rank sends its rows of every matrix to the matrix's
                   owner among its data-parallel peers (the same owner d* for every t)
                   -> rank (d*, t) holds the tensor-parallel block t of each matrix it owns
    2. tensor dim: on the owners' tensor-parallel groups, by tp_mode:
       duplicated   all_to_all_v of the blocks -> the whole matrix on every rank of the
                    group, orthogonalized there (T times the Newton-Schulz work), each rank
                    keeping its block. Exact.
       distributed  Newton-Schulz on the blocks: per step one all-reduce of the m x m
                    Gram matrix (tp_math.newton_schulz_on_shards); a block split along
                    the short side is first re-split along the long side by an
                    all-to-all, and back after. Exact; no rank holds a whole matrix.
                    Work other than Newton-Schulz (a map) gathers its matrices as
                    duplicated does.
       blockwise    each block orthogonalized alone: no traffic, and not Muon (the polar
                    factor of a block is not a block of the polar factor): an
                    approximation, to compare against.
       A matrix replicated on the tensor dim is orthogonalized whole on each rank.
    3. data dim:   all_to_all_v: the owners send every rank its rows of the results,
                   returned as DTensors placed like the update.

Bytes are counted per mesh dim (``stats_by_dim``: "data_parallel", "tensor_parallel", and
"world" for the step's finiteness check and gradient clipping); ``tp_math.tp_bytes`` has
the formulas of step 2.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_muon.distributed.comm import CommStats, all_reduce_, all_to_all_v
from lightning_muon.distributed.fsdp import (
    MuonFSDPSharding,
    _matrix_shape,
    blocks_refused,
    exchange_with_owners,
    muon_params,
    shard_rows,
)
from lightning_muon.distributed.planning import plan_ownership
from lightning_muon.distributed.protocol import Observer, Sharding, WholeWork
from lightning_muon.distributed.tp_math import TP_MODES, long_side_split, newton_schulz_on_shards
from lightning_muon.layout import MatrixLayout, layout_of
from lightning_muon.newton_schulz import resolve_coefficients, resolve_ns_dtype

__all__ = ["DP_DIM", "TP_DIM", "MuonTPSharding", "tp_split_dim"]

DP_DIM, TP_DIM = "data_parallel", "tensor_parallel"  # ModelParallelStrategy's mesh dim names


class _Layout(NamedTuple):
    split: int | None
    """The dim the tensor dim splits the matrix along; None when every rank holds it whole."""
    shape: tuple[int, ...]
    """The whole matrix's shape."""


def tp_split_dim(p: Tensor) -> int | None:
    """The dim a 2-D-mesh parameter is split along on the tensor dim (0 or 1), or None when replicated there."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim == 1:
        return None
    placement = p.placements[1]
    return placement.dim if isinstance(placement, Shard) else None


class MuonTPSharding(MuonFSDPSharding):
    """Muon's Newton-Schulz for parameters on a (data, tensor) device mesh, with a ``tp_mode``.

    A ``Sharding`` (through ``MuonFSDPSharding``, whose finiteness agreement, ``owns`` and
    ``local_shard`` it keeps, over every rank). Every Muon parameter must be a DTensor on
    the 2-D mesh (dims named ``"data_parallel"`` and ``"tensor_parallel"``) placed as
    ``fully_shard`` after ``parallelize_module`` places it, or on the 1-D data-parallel
    mesh alone (a layer left out of the tensor-parallel plan). Owners are planned over
    the data-parallel ranks by global shapes and Newton-Schulz FLOPs, the same plan on
    every rank.

    Args:
        optimizer: a ``Muon`` whose Muon parameters are such DTensors.
        tp_mode: ``"duplicated"`` (exact), ``"distributed"`` (exact, no whole matrix on a
            rank) or ``"blockwise"`` (approximate); see the module docstring.

    Notes:
        Matrices split on the tensor dim must be 2-D, without ``split_sizes`` or
        ``batched``. The update hooks (``UpdateSpectrumMonitor``) see each matrix
        once, on tensor-parallel rank 0 of its owners: in ``distributed`` mode the whole
        update and result are gathered there for it, only on the steps it observes; in
        ``blockwise`` mode matrices split on the tensor dim are not observed.
        ``distributed`` mode runs the standard iteration whatever ``ns_method`` says (the
        Gram variant would need fewer all-reduces, one per restart; not done here).
    """

    def __init__(self, optimizer, tp_mode: str = "duplicated") -> None:
        if tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {TP_MODES}, got {tp_mode!r}")
        self.mode = "owner"
        self.tp_mode = tp_mode
        self.stats_by_dim = {DP_DIM: CommStats(), TP_DIM: CommStats(), "world": CommStats()}
        groups, params = muon_params(optimizer, "MuonTPSharding", _check_tp_group)
        meshes = [p.device_mesh for p in params]
        self.mesh_2d = next((m for m in meshes if m.ndim == 2), None)
        dp_mesh = self.mesh_2d[DP_DIM] if self.mesh_2d is not None else meshes[0]
        for m in meshes:
            if m.ndim == 1 and m != dp_mesh:
                raise ValueError("MuonTPSharding: all 1-D Muon parameters must live on the data-parallel mesh")
        self.mesh = dp_mesh
        self.dp_group, self.dp_rank, self.dp_size = dp_mesh.get_group(), dp_mesh.get_local_rank(), dp_mesh.size()
        if self.mesh_2d is not None:
            tp_mesh = self.mesh_2d[TP_DIM]
            self.tp_group, self.tp_rank, self.tp_size = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()
        else:
            self.tp_group, self.tp_rank, self.tp_size = None, 0, 1
        self._tp = _TensorDim(self.tp_group, self.tp_rank, self.tp_size, self.stats_by_dim[TP_DIM])
        layouts = [layout_of(g) for g in groups for _ in g["params"]]
        plan = plan_ownership(
            [tuple(p.shape) for p in params],
            self.dp_size,
            layouts=layouts,
            spread=[lay.row_blocks_hold_whole_matrices for lay in layouts],  # expert stacks: where their experts are
        )
        self._warned_observer = False
        # The owners are data-parallel ranks; the finiteness agreement spans every rank
        # (tensor-parallel peers wait on each other too), in the "world" counts.
        Sharding.__init__(
            self,
            optimizer,
            params,
            plan,
            group=None,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            stats=self.stats_by_dim["world"],
        )

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
        """``Sharding.map_whole`` on a 2-D mesh: with a ``layout``, the module docstring's steps 1 to 3.

        Matrices whose rows a rank holds whole (``holds_whole``: expert stacks, sharded over
        their experts on either mesh dim) are worked on where they are, sending nothing.
        Without a ``layout`` (SOAP's tensors), every tensor is gathered whole on every rank
        and ``fn`` runs on each: exact whatever the placements, at the cost of the duplicated
        work and an all-gather of every tensor; each rank keeps its own part of every result.
        """
        if layout is None:
            return self._map_everywhere(tensors, fn)
        if self.holds_whole(layout):
            return self._map_here(tensors, fn, layout, observe)
        updates = [ts[0] for ts in tensors]
        d = self.dp_rank
        shapes = [_tp_local_shape(p, self.tp_size, self.tp_rank) for p in params]  # this tensor-parallel rank's blocks
        wire = wire_dtype or updates[0].dtype
        if wire_dtype is None:
            for u in updates[1:]:
                wire = torch.promote_types(wire, u.dtype)

        def compute(mine: list[int], whole: list[Tensor]) -> list[Tensor]:
            # Steps 1 and 3 run in exchange_with_owners; step 2 here, on the owners' blocks.
            return self._work_on_blocks(params, mine, whole, fn, layout, observe, newton_schulz)

        return exchange_with_owners(
            [self.local_shard(u) for u in updates],
            shapes,
            [self.plan.owners[self._index[id(p)]] for p in params],
            [u.dtype for u in updates],
            wire,
            self.dp_group,
            d,
            self.dp_size,
            self.stats_by_dim[DP_DIM],
            compute,
            lambda i, piece: [self._placed_like(piece, updates[i], layout)],
            mismatch=lambda i, shard, expected: (
                f"MuonTPSharding: a shard of shape {shard} of a {tuple(updates[i].shape)} tensor on data rank {d}; "
                f"expected {expected} rows of its {shapes[i]} tensor-parallel block"
            ),
        )

    def _map_everywhere(self, tensors: list[list[Tensor]], fn: WholeWork) -> list[list[Tensor]]:
        out = []
        for i, ts in enumerate(tensors):
            (results,) = fn([i], [[t.full_tensor() if isinstance(t, DTensor) else t for t in ts]])
            out.append(
                [
                    distribute_tensor(r, t.device_mesh, t.placements, src_data_rank=None).to_local()
                    if isinstance(t, DTensor)
                    else r
                    for r, t in zip(results, ts)
                ]
            )
        return out

    def _placed_like(self, local: Tensor, like: Tensor, layout: MatrixLayout) -> Tensor:
        if like.device_mesh.ndim == 1:  # the FSDP2 case: the piece has the matrix shape
            return self._as_dtensor(local, like.device_mesh, _matrix_shape(like.shape, layout))
        return DTensor.from_local(
            local.contiguous(),
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )

    def _work_on_blocks(
        self,
        params: list[Tensor],
        mine: list[int],
        whole: list[Tensor],
        fn: WholeWork,
        layout: MatrixLayout,
        observe: Observer | None,
        newton_schulz: dict[str, Any] | None,
    ) -> list[Tensor]:
        """Step 2 on the owner: each owned matrix's block of the result, shaped like its block.

        ``newton_schulz`` (``map_whole``'s): ``fn`` is Newton-Schulz with these settings, which
        ``tp_mode="distributed"`` runs on the blocks instead of gathering each matrix.
        """
        # Per owned matrix: the dim the tensor dim splits (None: whole here) and the whole shape.
        lay = [_Layout(tp_split_dim(params[i]) if self.tp_size > 1 else None, tuple(params[i].shape)) for i in mine]
        out: list[Tensor | None] = [None] * len(mine)
        observed: dict[int, tuple[Tensor, Tensor]] = {}  # k -> (update, result), whole matrices
        replicated = [k for k, entry in enumerate(lay) if entry.split is None]
        if replicated:  # whole here already: worked on by every rank of the group
            wholes = [[whole[k].view(_matrix_shape(whole[k].shape, layout))] for k in replicated]
            for k, w, (result,) in zip(replicated, wholes, fn([mine[k] for k in replicated], wholes)):
                out[k] = result
                observed[k] = (w[0], result)
        split_ks = [k for k, entry in enumerate(lay) if entry.split is not None]
        # Only Newton-Schulz iterates on blocks; other work needs its matrix whole, as "duplicated" has it.
        on_blocks = newton_schulz is not None and self.tp_mode == "distributed"
        if split_ks and self.tp_mode != "blockwise" and not on_blocks:
            fulls = self._tp.gather(split_ks, lay, whole, dst=None)
            for k, full, (result,) in zip(split_ks, fulls, fn([mine[k] for k in split_ks], [[f] for f in fulls])):
                out[k] = _own_block(result, lay[k].split, self.tp_size, self.tp_rank)
                observed[k] = (full, result)
        elif split_ks and on_blocks:
            for k, res in self._tp.newton_schulz(split_ks, lay, whole, newton_schulz).items():
                out[k] = res
            if observe is not None:  # gathered for the hooks, only when they watch
                fulls = self._tp.gather(split_ks, lay, whole, dst=0)
                results = self._tp.gather(split_ks, lay, out, dst=0)
                for k, full, res in zip(split_ks, fulls, results):
                    observed[k] = (full, res)
        elif split_ks:  # blockwise: each block alone
            for k, (result,) in zip(split_ks, fn([mine[k] for k in split_ks], [[whole[k]] for k in split_ks])):
                out[k] = result
        self._observe_owned(mine, observed, bool(split_ks), observe)
        return out  # type: ignore[return-value]

    def _observe_owned(self, mine, observed, has_split, observe: Observer | None) -> None:
        if observe is None:
            return
        if self.tp_mode == "blockwise" and has_split and not self._warned_observer:
            self._warned_observer = True
            warnings.warn(
                "MuonTPSharding: blockwise mode never holds a whole tensor-parallel matrix; update hooks skip those",
                RuntimeWarning,
                stacklevel=6,  # the caller of orthogonalize, through exchange_with_owners
            )
        if self.tp_rank != 0 or not observed:
            return  # each matrix once: on tensor-parallel rank 0 of its owners
        ks = sorted(observed)
        observe([mine[k] for k in ks], [[observed[k][0]] for k in ks], [[observed[k][1]] for k in ks])


def _check_tp_group(g: dict, where: str, params: list[Tensor]) -> None:
    for p in g["params"]:
        _check_tp_param(p, g, where)


def _check_tp_param(p: Tensor, group: dict, where: str) -> None:
    shape = tuple(p.shape)
    if not isinstance(p, DTensor):
        raise ValueError(
            f"MuonTPSharding: {where} holds a plain tensor of shape {shape}; every Muon parameter must be a "
            "DTensor (apply fully_shard on the data-parallel mesh to the module that holds it)"
        )
    mesh, placements = p.device_mesh, tuple(p.placements)
    layout = layout_of(group)
    if layout.blocks is not None:
        raise ValueError(blocks_refused("MuonTPSharding", where, layout))
    if layout.split_sizes is not None and not layout.row_blocks_hold_whole_matrices:
        raise ValueError(
            f"MuonTPSharding: {where}: split_sizes {layout.split_sizes} are not supported on a tensor-parallel "
            "mesh (only expert stacks may be split); route the tensor without a split (MuonConfig split_qkv=False)"
        )
    if mesh.ndim == 1:
        if placements != (Shard(0),):
            raise ValueError(f"MuonTPSharding: {where}: a 1-D mesh parameter of shape {shape} placed {placements}")
        if layout.batched and p.ndim > 3:
            raise ValueError(f"MuonTPSharding: {where}: batched tensors with more than 3 dims ({shape})")
        return
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != (DP_DIM, TP_DIM):
        raise ValueError(
            f"MuonTPSharding: {where}: a parameter on a mesh with dims {mesh.mesh_dim_names}; expected "
            f"({DP_DIM!r}, {TP_DIM!r}) (ModelParallelStrategy's device mesh)"
        )
    dp_place, tp_place = placements
    split = tp_place.dim if isinstance(tp_place, Shard) else None
    if split is None and not isinstance(tp_place, Replicate):
        raise ValueError(f"MuonTPSharding: {where}: tensor-dim placement {tp_place} of {shape} is not supported")
    # fully_shard after parallelize_module: rows of the tensor-parallel block, chunked on the data dim.
    # On a tensor dim of size 1 the two nestings coincide, and fully_shard places Shard(0).
    tp_size = mesh.size(1)
    expected = _StridedShard(0, split_factor=tp_size) if split == 0 and tp_size > 1 else Shard(0)
    if dp_place != expected:
        raise ValueError(
            f"MuonTPSharding: {where}: a parameter of shape {shape} placed {placements}; expected {expected} on "
            "the data dim (apply parallelize_module first, then fully_shard on the data-parallel mesh)"
        )
    if layout.row_blocks_hold_whole_matrices:
        if split not in (None, 0) or p.ndim != 3:
            raise ValueError(
                f"MuonTPSharding: {where}: an expert stack of shape {shape} placed {placements} must be 3-D and "
                "split on the tensor dim along its experts (dim 0, expert parallelism) or not at all"
            )
        return
    if split is not None and (p.ndim != 2 or layout.split_sizes is not None):
        raise ValueError(
            f"MuonTPSharding: {where}: a tensor-parallel parameter of shape {shape} must be a 2-D matrix "
            "without split_sizes or batched"
        )


def _tp_local_shape(p: Tensor, T: int, t: int) -> tuple[int, ...]:
    """The shape of tensor-parallel rank ``t``'s block of ``p`` (of ``T``; ``p``'s shape when replicated)."""
    split = tp_split_dim(p)
    shape = list(p.shape)
    if split is not None:
        shape[split] = shard_rows(shape[split], T)[t]
    return tuple(shape)


class _TensorDim(NamedTuple):
    """The collectives of step 2 on one tensor-parallel group: ``T`` ranks, this one ``t``.

    Blocks are indexed by ``k`` (an owned matrix); ``lay[k]`` is its ``_Layout``. Every
    rank of the group calls each method with the same ``ks`` and layouts. Bytes go to
    ``stats`` under "tp_gather", "tp_gram" and "tp_resplit".
    """

    group: dist.ProcessGroup | None
    """The tensor-parallel process group; None on a 1-D mesh (then nothing is split)."""
    t: int
    """This rank's place in ``group``."""
    T: int
    """The group's size."""
    stats: CommStats
    """Where the tensor-dim bytes are counted."""

    def gather(self, ks: list[int], lay: list[_Layout], blocks: list, dst: int | None) -> list[Tensor]:
        """Whole matrices from their tensor-parallel blocks, on every rank (``dst`` None) or on ``dst`` only.

        One ``all_to_all_v`` over the tensor-parallel group; returns ``[]`` where nothing arrives.
        """
        T, t = self.T, self.t
        flat = torch.cat([blocks[k].reshape(-1) for k in ks]) if ks else blocks[0].new_empty(0)
        targets = [r for r in range(T) if r != t and (dst is None or r == dst)]
        send_counts = [flat.numel() if r in targets else 0 for r in range(T)]
        receives = dst is None or dst == t
        block_shapes = [[_block_shape(lay[k].shape, lay[k].split, T, r) for k in ks] for r in range(T)]
        block_numels = [[math.prod(s) for s in shapes] for shapes in block_shapes]
        recv_counts = [sum(block_numels[r]) if receives and r != t else 0 for r in range(T)]
        send = torch.cat([flat] * len(targets)) if targets else flat[:0]
        got = all_to_all_v(send, send_counts, recv_counts, self.group, self.stats, name="tp_gather")
        if not receives:
            return []
        parts = iter(got.split([c for r, c in enumerate(recv_counts) if r != t]))
        per_rank = [flat if r == t else next(parts) for r in range(T)]
        fulls = []
        for j, k in enumerate(ks):
            pieces = []
            for r in range(T):
                offset = sum(block_numels[r][:j])
                shape = block_shapes[r][j]
                pieces.append(per_rank[r][offset : offset + block_numels[r][j]].view(shape))
            fulls.append(torch.cat(pieces, dim=lay[k].split))
        return fulls

    def newton_schulz(self, ks: list[int], lay: list[_Layout], whole: list[Tensor], ns_kwargs: dict) -> dict:
        """``distributed`` mode: per ``k``, this rank's block of the polar factor, shaped like ``whole[k]``.

        Newton-Schulz on the blocks of the wide form (m <= n) split along its long side,
        one all-reduce of the (K, m, m) Gram matrices per step and bucket
        (``tp_math.newton_schulz_on_shards``); blocks split along the short side are
        re-split first (``resplit``) and back after (``resplit_back``).
        """
        schedule, norm = resolve_coefficients(
            ns_kwargs["ns_coefficients"], ns_kwargs["ns_steps"], ns_kwargs.get("ns_eps")
        )
        work = resolve_ns_dtype(ns_kwargs["ns_dtype"], whole[ks[0]].device, whole[ks[0]].dtype)
        full_shape = {k: lay[k].shape for k in ks}
        # The wide form's blocks along its long side: (m, n_t) each.
        wide: dict[int, Tensor] = {}
        short = [k for k in ks if not long_side_split(*full_shape[k], lay[k].split)]
        for k in ks:
            if k not in short:
                block = whole[k].to(work)
                wide[k] = block if full_shape[k][0] <= full_shape[k][1] else block.mT
        if short:
            wide.update(self.resplit(short, whole, full_shape, work))

        def reduce(x: Tensor) -> Tensor:
            return all_reduce_(x, group=self.group, stats=self.stats, name="tp_gram")

        # Buckets by the whole wide shape: the same on every rank of the group, whatever its block.
        buckets: dict[tuple[int, int], list[int]] = {}
        for k in ks:
            buckets.setdefault(_wide(full_shape[k]), []).append(k)
        result_wide: dict[int, Tensor] = {}
        for members in buckets.values():
            X = torch.stack([wide[k] for k in members])  # (K, m, n_t)
            Y = newton_schulz_on_shards([X], schedule, norm, reduce)[0]
            for j, k in enumerate(members):
                result_wide[k] = Y[j]
        out = self.resplit_back(short, result_wide, full_shape) if short else {}
        for k in ks:
            if k not in short:
                y = result_wide[k]
                out[k] = y if full_shape[k][0] <= full_shape[k][1] else y.mT
        return {k: out[k] for k in ks}

    def resplit(self, ks, whole, full_shape, work) -> dict[int, Tensor]:
        """Blocks split along the wide form's short side, re-split along its long side (one all-to-all).

        Rank t holds rows ``R_t`` of the wide form (m x n); it sends rank u its columns
        ``C_u`` and gets back ``(R_s, C_t)`` from every rank s: the wide form's columns ``C_t``.
        """
        T, t = self.T, self.t
        send, send_counts, recv_counts = [], [0] * T, [0] * T
        wides = {}
        for k in ks:
            block = whole[k].to(work)
            rows, cols = full_shape[k]
            wides[k] = block if rows <= cols else block.mT  # (m_t, n)
        for u in range(T):
            for k in ks:
                m, n = _wide(full_shape[k])
                c0, cn = _span(n, T, u)
                send.append(wides[k][:, c0 : c0 + cn].reshape(-1))
                send_counts[u] += wides[k].shape[0] * cn
                recv_counts[u] += shard_rows(m, T)[u] * shard_rows(n, T)[t]
        pieces = self._tiles(ks, send, send_counts, recv_counts, full_shape, lambda u: (u, t))
        return {k: torch.cat(pieces[k], dim=0) for k in ks}  # (m, n_t)

    def resplit_back(self, ks, result_wide, full_shape) -> dict[int, Tensor]:
        """The inverse of ``resplit``: column blocks of the result back to this rank's row block."""
        T, t = self.T, self.t
        send, send_counts, recv_counts = [], [0] * T, [0] * T
        for u in range(T):
            for k in ks:
                m, n = _wide(full_shape[k])
                r0, rn = _span(m, T, u)
                send.append(result_wide[k][r0 : r0 + rn].reshape(-1))
                send_counts[u] += rn * result_wide[k].shape[1]
                recv_counts[u] += shard_rows(m, T)[t] * shard_rows(n, T)[u]
        pieces = self._tiles(ks, send, send_counts, recv_counts, full_shape, lambda u: (t, u))
        out = {}
        for k in ks:
            block = torch.cat(pieces[k], dim=1)  # (m_t, n): this rank's rows of the wide result
            rows, cols = full_shape[k]
            out[k] = block if rows <= cols else block.mT
        return out

    def _tiles(self, ks, send, send_counts, recv_counts, full_shape, which) -> dict[int, list[Tensor]]:
        """One "tp_resplit" all-to-all; per ``k``, the tile each rank ``u`` sent.

        The tile from ``u`` is row chunk ``which(u)[0]`` by column chunk ``which(u)[1]`` of
        ``k``'s wide form (``torch.chunk`` chunks in ``T``).
        """
        T = self.T
        got = all_to_all_v(torch.cat(send), send_counts, recv_counts, self.group, self.stats, "tp_resplit")
        pieces: dict[int, list[Tensor]] = {k: [] for k in ks}
        for u, chunk in enumerate(got.split(recv_counts)):
            offset = 0
            for k in ks:
                m, n = _wide(full_shape[k])
                i, j = which(u)
                size = (shard_rows(m, T)[i], shard_rows(n, T)[j])
                pieces[k].append(chunk[offset : offset + size[0] * size[1]].view(size))
                offset += size[0] * size[1]
        return pieces


def _span(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of ``torch.chunk`` block ``index`` of ``size`` elements in ``parts``."""
    sizes = shard_rows(size, parts)
    return sum(sizes[:index]), sizes[index]


def _wide(shape: tuple[int, int]) -> tuple[int, int]:
    return min(shape), max(shape)


def _block_shape(shape: tuple[int, ...], split: int, T: int, r: int) -> tuple[int, ...]:
    """Tensor-parallel rank ``r``'s block of a whole ``shape`` split along ``split`` (``torch.chunk`` sizes)."""
    out = list(shape)
    out[split] = shard_rows(shape[split], T)[r]
    return tuple(out)


def _own_block(full: Tensor, split: int, T: int, t: int) -> Tensor:
    start, length = _span(full.shape[split], T, t)
    return full.narrow(split, start, length)
