"""Newton-Schulz sharded across data-parallel ranks: each matrix orthogonalized once, by its owner.

``MuonDDPSharding`` (a ``Sharding``) attaches to a ``Muon`` optimizer. In ``reduce_scatter`` mode, DDP
leaves the Muon matrices alone and ``reduce_gradients()`` (called after backward,
before any unscaling or clipping) averages each matrix's gradient straight onto its
owner with one uneven all-to-all; every other rank drops that gradient. The owner
runs momentum, ``orthogonalize`` and the update; ``gather_parameters()`` (called by
``Muon.step``) sends the new values to every rank. Per rank, the bytes sent are
``P - P_own`` then ``(W - 1) P_own``: for W = 2 exactly plain DDP's all-reduce of the
same P elements, and for balanced owners ``2 (W - 1) / W * P`` in general.

Expert stacks (3-D ``(E, out, in)``, whose row blocks hold whole matrices: ``MatrixLayout``) are not planned whole: in
``reduce_scatter`` mode every rank of a group owns a ``torch.chunk`` block of every stack's
experts (``planning.expert_blocks``: rotated from stack to stack, so that with fewer experts
than ranks the ranks one stack misses take the next's), so the experts of a 64-expert stack
are orthogonalized by every rank, not by one. Its part travels like a whole matrix: gradients
to it, results back; it steps a view of those rows, whose optimizer state lives under the
stack between steps (a slice of the rows; ``gather_states`` joins them for a checkpoint,
``owner_state``).

In ``all_gather`` mode DDP all-reduces everything as usual; owners still split the
Newton-Schulz work and share their results (+50% traffic; a fallback and a baseline).

Owner groups (``owner_group_size=S``, HSDP's pattern): ranks ``[g S, (g + 1) S)`` form
group g, and every group holds the same plan over its S ranks. The all-to-all to owners and
the all-gather of results stay inside the group (a node, by default); each owner's summed
gradients are then all-reduced with the same local rank of every other group
(``reduce_across``: one peer per node). Per rank that is ``2 (W/S - 1) / (W/S) * P / S``
inter-node, plain DDP's share, instead of an all-to-all across every node, and no rank
idles while S stays below the number of matrices. ``S = W`` is the single-group design.
With ``overlap_with_backward`` the reduce leaves in buckets from backward's hooks
(``OverlappedReduce``); ``reduce_gradients`` then waits for it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.algorithms import per_matrix
from lightning_muon.distributed.comm import CommStats, all_reduce_, all_to_all_v, owner_groups, unit_rows
from lightning_muon.distributed.overlap import OverlappedReduce
from lightning_muon.distributed.owner_state import drop_foreign_states, gather_owner_states
from lightning_muon.distributed.planning import expert_blocks, plan_ownership
from lightning_muon.distributed.protocol import Sharding
from lightning_muon.functional import all_finite
from lightning_muon.layout import layout_of
from lightning_muon.step_memory import step_memory_bytes

__all__ = ["MODES", "MuonDDPSharding"]

MODES = ("reduce_scatter", "all_gather")


class MuonDDPSharding(Sharding):
    """Owner-based Newton-Schulz for one ``Muon`` optimizer over a process group (DDP: whole tensors everywhere).

    Args:
        optimizer: the ``Muon`` optimizer; it gets this sharding attached.
        mode: ``"reduce_scatter"`` or ``"all_gather"`` (module docstring).
        group: the process group (None: the default group).
        stats: where bytes and calls are counted; a new ``CommStats`` by default.
        owner_group_size: S, ranks per owner group; must divide the world size (None: one
            group of every rank). Every rank must construct it (it creates the subgroups).
    """

    def __init__(
        self,
        optimizer,
        mode: str = "reduce_scatter",
        group=None,
        stats: CommStats | None = None,
        owner_group_size: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        world_size = dist.get_world_size(group)
        size = world_size if owner_group_size is None else owner_group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world_size % size:
            raise ValueError(
                f"owner_group_size must be a positive int that divides the world size {world_size}, "
                f"got {owner_group_size!r}"
            )
        self.group_size = size
        self.local_rank = dist.get_rank(group) % size
        """This rank's place in its owner group: what the plan's owners are numbered by."""
        self.owner_group, self.peer_group = owner_groups(group, world_size, size)
        self._overlap: OverlappedReduce | None = None
        groups = [g for g in optimizer.param_groups if per_matrix(g)]  # Muon, its variants, SOAP: per-matrix work
        params = [p for g in groups for p in g["params"]]
        # Expert stacks split by experts over the group's ranks: param index -> rows per local rank.
        layouts = [layout_of(g) for g in groups for _ in g["params"]]
        self._split: dict[int, list[tuple[int, int]]] = {}  # per local rank: (first expert, experts)
        if mode == "reduce_scatter" and size > 1:
            stacks = [
                i
                for i, (p, lay) in enumerate(zip(params, layouts))
                if lay.row_blocks_hold_whole_matrices and p.ndim == 3
            ]
            self._split = dict(zip(stacks, expert_blocks([params[i].shape[0] for i in stacks], size)))
        plan = plan_ownership(
            [p.shape for p in params],
            size,  # every group holds the same plan over its S ranks
            layouts=layouts,
            spread=[i in self._split for i in range(len(params))],
            spread_blocks=list(self._split.values()),
        )
        self._parts: dict[int, Tensor] = {}  # param index -> the view of this rank's rows it steps
        self._warned_observer = False
        super().__init__(
            optimizer, params, plan, group=group, rank=dist.get_rank(group), world_size=world_size, stats=stats
        )
        for i, blocks in self._split.items():
            start, rows = blocks[self.local_rank]
            self._parts[i] = self.params[i].detach()[start : start + rows]

    def owns(self, p: Tensor) -> bool:
        """True when this rank steps ``p`` whole: its group's owner of the matrix, or ``p`` is not a Muon parameter.

        An expert stack split by experts is owned by no rank whole (``stepped`` gives each its rows).
        """
        i = self._index.get(id(p))
        return i is None or self.plan.owners[i] == self.local_rank

    def stepped(self, p: Tensor) -> Tensor | None:
        """What this rank steps of ``p``: ``p``, the view of its rows of an expert stack, or None."""
        i = self._index.get(id(p))
        if i is not None and i in self._split:
            part = self._parts[i]
            return part if part.numel() else None
        return p if self.owns(p) else None

    @contextlib.contextmanager
    def lent_state(self) -> Iterator[None]:
        """For the step: each expert-stack part's state moves from the stack to the view this rank steps, and back
        under the stack after (where checkpoints look for it)."""
        state = self.optimizer.state
        for i, part in self._parts.items():
            p = self.params[i]
            if p in state:
                state[part] = state.pop(p)
        if self._parts and self.optimizer.has_update_hooks and not self._warned_observer:
            self._warned_observer = True
            warnings.warn(
                "MuonDDPSharding: expert stacks are stepped by their experts' ranks, in parts; the update hooks "
                "(UpdateSpectrumMonitor) are not run for them",
                RuntimeWarning,
                stacklevel=4,
            )
        try:
            yield
        finally:
            for i, part in self._parts.items():
                if part in state:
                    state[self.params[i]] = state.pop(part)

    def part_grads(self) -> list[Tensor]:
        """The gradients of the expert-stack parts this rank steps (besides the owned whole matrices')."""
        return [part.grad for part in self._parts.values() if part.grad is not None and part.numel()]

    def _by_owner(self) -> list[list[tuple[Tensor, int, int]]]:
        """Per local rank 0 to S - 1 of this rank's group, its units: (parameter, first row, rows).

        A whole matrix is ``(p, 0, dim 0)``; an expert stack gives every rank its block of experts.
        """
        out = []
        for r in range(self.group_size):
            units = [(self.params[i], 0, self.params[i].shape[0]) for i in self.plan.owned(r)]
            for i, blocks in self._split.items():
                start, rows = blocks[r]
                if rows:
                    units.append((self.params[i], start, rows))
            out.append(units)
        return out

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average Muon gradients onto their owners; drop them elsewhere (``reduce_scatter`` mode).

        A parameter with no gradient on some rank counts as zeros there; with no gradient on
        any rank it stays without one on its owner, so the step skips it as a single process
        would. Then the ranks agree whether every gradient any of them reads is finite
        (``FiniteChecks.agree``), so that ``Muon``'s check skips or raises on all ranks alike
        instead of leaving one rank waiting in a collective; under AMP, ``MuonDDPStrategy``
        gives the GradScaler a ``ShardedGradScaler``, which agrees on overflows likewise.
        """
        if self.mode != "reduce_scatter" or not self.params:
            self.optimizer.finite_checks.agree()
            return
        if self._overlap is not None:
            self._assign(self._overlap.finish())  # the buckets sent from backward's hooks
            return
        S = self.group_size
        dtype = self.params[0].dtype
        device = self.params[0].device
        summed = []
        # In rounds that fit the step's memory cap (``step_memory_mb``): round k sends each owner
        # its k-th chunk of units; every rank cuts the same chunks from the same plan.
        for chunks in self._exchange_rounds():
            pieces, send_counts = [], []
            for owned in chunks:
                # One extra element per unit: 1 where this rank has a gradient.
                for p, start, rows in owned:
                    grad = p.grad if p.grad is not None else torch.zeros_like(p)
                    pieces.append(unit_rows(grad, start, rows).to(dtype))
                pieces.append(torch.tensor([p.grad is not None for p, _, _ in owned], dtype=dtype, device=device))
                send_counts.append(sum(_unit_numel(u) for u in owned) + len(owned))
            mine = chunks[self.local_rank]
            size = sum(_unit_numel(u) for u in mine) + len(mine)
            send = torch.cat(pieces)
            del pieces
            recv = all_to_all_v(send, send_counts, [size] * S, self.owner_group, self.stats, "reduce_scatter")
            del send
            view = recv.view(S, size)  # (S, size): what each rank of the group sent this one
            total = view[0]
            for row in view[1:]:
                total.add_(row)  # summed in place, in rank order
            if self.peer_group is not None and total.numel():
                all_reduce_(total, group=self.peer_group, stats=self.stats, name="reduce_across")
            # The owned gradients become views of this round's sum: a copy of its first row, so
            # that the other rows' memory goes now.
            summed.append((mine, total.clone() if S > 1 else total))
            del recv, view, total
        self._assign(summed)

    def _exchange_rounds(self) -> list[list[list[tuple[Tensor, int, int]]]]:
        """The owners' units in rounds: round k holds, per local rank of the group, its k-th chunk of units.

        A chunk holds at most ``cap / (2 S)`` bytes of units (a larger unit alone): a round's
        send and receive buffers then fit the cap (``step_memory_mb``; None: one round). Every
        rank of the group cuts the same chunks from the same plan.
        """
        by_owner = self._by_owner()
        itemsize = self.params[0].element_size()
        cap = step_memory_bytes(self.optimizer.state_settings.step_memory_mb, self.params[0].device)
        if cap is None:
            return [by_owner]
        budget = max(1, cap // (2 * self.group_size * itemsize))  # elements per owner per round
        per_owner = []
        for owned in by_owner:
            chunks: list[list[tuple[Tensor, int, int]]] = [[]]
            load = 0
            for unit in owned:
                n = _unit_numel(unit)
                if chunks[-1] and load + n > budget:
                    chunks.append([])
                    load = 0
                chunks[-1].append(unit)
                load += n
            per_owner.append(chunks)
        rounds = max(len(c) for c in per_owner)
        return [[c[k] if k < len(c) else [] for c in per_owner] for k in range(rounds)]

    def _assign(self, summed: list[tuple[list[tuple[Tensor, int, int]], Tensor]]) -> None:
        """Owned gradients become views of each summed buffer (grads, then flags); other Muon gradients are dropped.

        An expert stack's rows go to the view this rank steps (``stepped``), not to the stack.
        Under overlap a gradient left from backward's hook before anything after backward (a
        user's hook, an injected fault) could change it. A local gradient that has since
        become non-finite is kept, not dropped, and joins the finiteness agreement: AMP's
        scaler and ``Muon``'s check then skip or raise on every rank alike.
        """
        owned_grads = []
        for mine, total in summed:
            grads, flags = total[: total.numel() - len(mine)], total[total.numel() - len(mine) :]
            grads.div_(self.world_size)
            owned_grads.append(grads)
            offset = 0
            for (p, _, rows), flag in zip(mine, flags.tolist()):
                n = _unit_numel((p, 0, rows))
                grad = grads[offset : offset + n].view(rows, *p.shape[1:]).to(p.dtype) if flag > 0 else None
                i = self._index[id(p)]
                if i in self._split:
                    self._parts[i].grad = grad
                else:
                    p.grad = grad
                offset += n
        kept = []
        for p in self.params:
            if self.owns(p) or p.grad is None:
                continue
            if self._overlap is not None and self.optimizer.nonfinite != "ignore" and not all_finite([p.grad]):
                kept.append(p.grad)
            else:
                p.grad = None
        # The owned Muon gradients in one pass per buffer (absent ones are zeros there), with
        # every other gradient this rank's step reads.
        self.optimizer.finite_checks.agree([*owned_grads, *kept, *self._replicated_grads()])

    def overlap_with_backward(self, should_sync, bucket_cap_mb: float = 25.0) -> None:
        """Send Muon gradients to their owners from backward's hooks, in buckets (``OverlappedReduce``).

        ``should_sync()`` says whether the running backward is the one to reduce (a DDP
        module's ``require_backward_grad_sync``: False under ``no_sync``). Every rank must call
        it (it creates a process group). ``reduce_gradients`` then waits for the buckets.
        """
        if self.mode != "reduce_scatter":
            raise ValueError(f"overlap needs mode='reduce_scatter' (DDP reduces everything in {self.mode!r} mode)")
        if self._overlap is None and self.params:
            self._overlap = OverlappedReduce(self, should_sync, bucket_cap_mb)

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
        """Send every owner's Muon units to the other ranks of its group (after the owners stepped)."""
        if self.group_size == 1 or not self.params:
            return
        for chunks in self._exchange_rounds():  # rounds that fit the step's memory cap, as the reduce's
            mine = chunks[self.local_rank]
            sizes = [sum(_unit_numel(u) for u in owned) for owned in chunks]
            ref = self.params[0].detach()
            blob = ref.new_empty(sizes[self.local_rank])
            if mine:
                torch.cat([unit_rows(p.detach(), start, rows) for p, start, rows in mine], out=blob)
            send_counts = [0 if r == self.local_rank else blob.numel() for r in range(self.group_size)]
            recv_counts = [0 if r == self.local_rank else sizes[r] for r in range(self.group_size)]
            send = blob if self.group_size == 2 else torch.cat([blob] * (self.group_size - 1))
            del blob
            recv = all_to_all_v(send, send_counts, recv_counts, self.owner_group, self.stats, name="all_gather")
            del send
            offset = 0
            for r, owned in enumerate(chunks):
                if r == self.local_rank:
                    continue
                for p, start, rows in owned:
                    n = _unit_numel((p, start, rows))
                    unit_rows(p.detach(), start, rows).copy_(recv[offset : offset + n])
                    offset += n

    def gather_states(self) -> list[dict[str, object]]:
        """Every Muon parameter's optimizer state, fetched from its owner; one dict per ``self.params``.

        Every rank must call it (checkpoint saving does, on all ranks); ``owner_state.gather_owner_states``.
        """
        split = {id(self.params[i]) for i in self._split}
        return gather_owner_states(
            self.optimizer, self.params, self._by_owner(), split, self.local_rank, self.owner_group, self.stats
        )

    def drop_foreign_state(self) -> None:
        """Forget the optimizer state of matrices another rank owns (after loading a full state).

        An expert stack keeps its rows of every per-expert entry (``owner_state.drop_foreign_states``).
        """
        rows = {id(self.params[i]): blocks[self.local_rank] for i, blocks in self._split.items()}
        drop_foreign_states(self.optimizer.state, self.params, rows, self.owns)


def _unit_numel(unit: tuple[Tensor, int, int]) -> int:
    """Elements of a unit ``(p, first row, rows)``."""
    p, _, rows = unit
    return p.numel() // p.shape[0] * rows if p.shape[0] else 0
