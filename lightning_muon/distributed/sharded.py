"""Newton-Schulz sharded across data-parallel ranks: each matrix orthogonalized once, by its owner.

``MuonSharding`` (a ``Sharding``) attaches to a ``Muon`` optimizer. In ``reduce_scatter`` mode, DDP
leaves the Muon matrices alone and ``reduce_gradients()`` (called after backward,
before any unscaling or clipping) averages each matrix's gradient straight onto its
owner with one uneven all-to-all; every other rank drops that gradient. The owner
runs momentum, ``orthogonalize`` and the update; ``gather_parameters()`` (called by
``Muon.step``) sends the new values to every rank. Per rank, the bytes sent are
``P - P_own`` then ``(W - 1) P_own``: for W = 2 exactly plain DDP's all-reduce of the
same P elements, and for balanced owners ``2 (W - 1) / W * P`` in general.

In ``all_gather`` mode DDP all-reduces everything as usual; owners still split the
Newton-Schulz work and share their results (+50% traffic; a fallback and a baseline).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.distributed.comm import CommStats, all_to_all_v
from lightning_muon.distributed.planning import plan_ownership
from lightning_muon.distributed.protocol import Sharding
from lightning_muon.newton_schulz import DTYPES, dtype_name

__all__ = ["MODES", "MuonSharding"]

MODES = ("reduce_scatter", "all_gather")


class MuonSharding(Sharding):
    """Owner-based Newton-Schulz for one ``Muon`` optimizer over a process group (DDP: whole tensors everywhere).

    Args:
        optimizer: the ``Muon`` optimizer; it gets this sharding attached.
        mode: ``"reduce_scatter"`` or ``"all_gather"`` (module docstring).
        group: the process group (None: the default group).
        stats: where bytes and calls are counted; a new ``CommStats`` by default.
    """

    def __init__(self, optimizer, mode: str = "reduce_scatter", group=None, stats: CommStats | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        world_size = dist.get_world_size(group)
        groups = [g for g in optimizer.param_groups if g["algorithm"] == "muon"]
        params = [p for g in groups for p in g["params"]]
        plan = plan_ownership(
            [p.shape for p in params],
            world_size,
            split_sizes=[g["split_sizes"] for g in groups for _ in g["params"]],
            batched=[g["batched"] for g in groups for _ in g["params"]],
            transposed=[g["transposed"] for g in groups for _ in g["params"]],
        )
        # Flat send/receive buffers kept across steps: a fresh multi-megabyte tensor per step
        # costs more in page faults than copying into it (measured 7x on CPU).
        self._buffers: dict[str, Tensor] = {}
        super().__init__(
            optimizer, params, plan, group=group, rank=dist.get_rank(group), world_size=world_size, stats=stats
        )

    def _buffer(self, name: str, numel: int, like: Tensor) -> Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = like.new_empty(numel)
        return buf

    def _by_owner(self) -> list[list[Tensor]]:
        return [[self.params[i] for i in self.plan.owned(r)] for r in range(self.world_size)]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average Muon gradients onto their owners; drop them elsewhere (``reduce_scatter`` mode).

        A parameter with no gradient on some rank counts as zeros there; with no gradient on
        any rank it stays without one on its owner, so the step skips it as a single process
        would. Then the ranks agree whether every gradient any of them reads is finite
        (``agree_finite``), so that ``Muon``'s check skips or raises on all ranks alike
        instead of leaving one rank waiting in a collective; under AMP, ``MuonDDPStrategy``
        gives the GradScaler a ``ShardedGradScaler``, which agrees on overflows likewise.
        """
        if self.mode != "reduce_scatter" or not self.params:
            self.agree_finite()
            return
        by_owner = self._by_owner()
        dtype = self.params[0].dtype
        pieces, send_counts = [], []
        for owned in by_owner:
            # One extra element per parameter: 1 where this rank has a gradient.
            flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in owned]
            flags = torch.tensor([p.grad is not None for p in owned], dtype=dtype, device=self.params[0].device)
            pieces += [*flat, flags]
            send_counts.append(sum(p.numel() for p in owned) + len(owned))
        mine = by_owner[self.rank]
        size = sum(p.numel() for p in mine) + len(mine)
        ref = self.params[0].detach()
        send = torch.cat(pieces, out=self._buffer("reduce_send", sum(send_counts), ref))
        # The owned gradients below are views of this buffer, until the next reduce refills it.
        recv = self._buffer("reduce_recv", size * self.world_size, ref)
        all_to_all_v(send, send_counts, [size] * self.world_size, self.group, self.stats, "reduce_scatter", out=recv)
        rows = recv.view(self.world_size, size)  # (W, size): what each rank sent this one
        total = rows[0]
        for row in rows[1:]:
            total.add_(row)  # summed in place, in rank order
        grads, flags = total[: size - len(mine)], total[size - len(mine) :]
        grads.div_(self.world_size)
        offset = 0
        for p, flag in zip(mine, flags.tolist()):
            n = p.numel()
            p.grad = grads[offset : offset + n].view_as(p).to(p.dtype) if flag > 0 else None
            offset += n
        for owned in by_owner:
            if owned is not mine:
                for p in owned:
                    p.grad = None
        # The owned Muon gradients in one pass over the flat buffer (absent ones are zeros
        # there), with every other gradient this rank's step reads.
        self.agree_finite([grads, *self._replicated_grads()])

    def _replicated_grads(self) -> list[Tensor]:
        """Gradients of this optimizer's other parameters (AdamW, Lion: replicated on every rank)."""
        muon = {id(p) for p in self.params}
        return [
            p.grad
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and p.grad.numel() and id(p) not in muon
        ]

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Send every owner's Muon parameters to all other ranks (after the owners stepped)."""
        if self.world_size == 1 or not self.params:
            return
        by_owner = self._by_owner()
        mine = by_owner[self.rank]
        ref = self.params[0].detach()
        sizes = [sum(p.numel() for p in owned) for owned in by_owner]
        blob = self._buffer("gather_send", sizes[self.rank], ref)
        if mine:
            torch.cat([p.detach().reshape(-1) for p in mine], out=blob)
        send_counts = [0 if r == self.rank else blob.numel() for r in range(self.world_size)]
        recv_counts = [0 if r == self.rank else sizes[r] for r in range(self.world_size)]
        send = blob if self.world_size == 2 else torch.cat([blob] * (self.world_size - 1))
        recv = self._buffer("gather_recv", sum(recv_counts), ref)
        all_to_all_v(send, send_counts, recv_counts, self.group, self.stats, name="all_gather", out=recv)
        offset = 0
        for r, owned in enumerate(by_owner):
            if r == self.rank:
                continue
            for p in owned:
                n = p.numel()
                p.copy_(recv[offset : offset + n].view_as(p))
                offset += n

    @torch.no_grad()
    def gather_states(self) -> list[dict[str, object]]:
        """Every Muon parameter's optimizer state, fetched from its owner; one dict per ``self.params``.

        Every entry travels: momentum and whatever else a variant keeps (second moments of
        any shape, step counters). The owners first share which entries they hold (keys,
        shapes, dtypes: a few bytes per parameter), then the tensors in one all-to-all.
        Every rank must call it (checkpoint saving does, on all ranks).
        """
        by_owner = self._by_owner()
        mine = by_owner[self.rank]
        local = [self.optimizer.state.get(p, {}) for p in mine]
        # (key, shape, dtype name) per tensor entry; other values (plain numbers) go as they are.
        layout = [
            {k: (tuple(v.shape), dtype_name(v.dtype)) if isinstance(v, Tensor) else ("value", v) for k, v in st.items()}
            for st in local
        ]
        layouts: list = [None] * self.world_size
        if self.world_size == 1:
            layouts = [layout]
        else:
            dist.all_gather_object(layouts, layout, group=self.group)
        dtypes = {d for lay in layouts for entry in lay for d in _tensor_dtypes(entry)}
        # float64 carries every float32/bf16/fp16 value and integer counters below 2**53 exactly.
        wire = torch.float64 if dtypes - {"float32", "bfloat16", "float16"} else torch.float32
        device = self.params[0].device if self.params else torch.device("cpu")
        # One device for the blob: a state entry kept on the CPU (a step counter) joins the rest.
        tensors = [
            v.detach().reshape(-1).to(device=device, dtype=wire)
            for st in local
            for v in st.values()
            if isinstance(v, Tensor)
        ]
        blob = torch.cat(tensors) if tensors else torch.empty(0, dtype=wire, device=device)
        sizes = [sum(_numel(shape) for entry in lay for shape in _tensor_shapes(entry)) for lay in layouts]
        if self.world_size == 1:
            parts = [blob]
        else:
            send_counts = [0 if r == self.rank else blob.numel() for r in range(self.world_size)]
            recv_counts = [0 if r == self.rank else sizes[r] for r in range(self.world_size)]
            recv = all_to_all_v(
                torch.cat([blob] * (self.world_size - 1)),
                send_counts,
                recv_counts,
                self.group,
                self.stats,
                "gather_state",
            )
            chunks = iter(recv.split([recv_counts[r] for r in range(self.world_size) if r != self.rank]))
            parts = [blob if r == self.rank else next(chunks) for r in range(self.world_size)]
        out: dict[int, dict[str, object]] = {}
        for owned, lay, part in zip(by_owner, layouts, parts):
            offset = 0
            for p, entry in zip(owned, lay):
                state: dict[str, object] = {}
                for key, (shape, meta) in entry.items():
                    if shape == "value":
                        state[key] = meta
                        continue
                    n = _numel(shape)
                    state[key] = part[offset : offset + n].view(shape).to(DTYPES[meta]).to(p.device).clone()
                    offset += n
                out[id(p)] = state
        return [out[id(p)] for p in self.params]

    def drop_foreign_state(self) -> None:
        """Forget the optimizer state of matrices another rank owns (after loading a full state)."""
        for p in self.params:
            if not self.owns(p):
                self.optimizer.state.pop(p, None)


def _tensor_shapes(entry: dict) -> list[tuple[int, ...]]:
    return [shape for shape, _ in entry.values() if shape != "value"]


def _tensor_dtypes(entry: dict) -> list[str]:
    return [dtype for shape, dtype in entry.values() if shape != "value"]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
