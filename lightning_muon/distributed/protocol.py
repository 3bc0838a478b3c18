"""The sharding protocol: how a ``Muon`` optimizer splits its per-matrix work across ranks.

A sharding holds the Muon parameters of one optimizer, an ``OwnershipPlan`` (the rank
that works on each whole matrix) and a process group. ``Muon`` reaches it through
``Muon.attach_sharding`` and calls only the methods of ``Sharding`` below, in this
order within one ``step``::

    sharding.step_finite()         # the agreed "every gradient is finite" (one collective)
    sharding.stepped(p)            # what of each parameter this rank steps
    sharding.local_shard(grad)     # the part of a gradient this rank holds
    sharding.map_whole(...)        # per-matrix work where each matrix is whole: Newton-Schulz
                                   #   (``orthogonalize``), MOP's SVD, Sinkhorn, Spel, SOAP
    sharding.reduce_matrix_sums()  # whole-matrix sums from every rank's part (MuonHyperball, PolarGrad, NAMO)
    sharding.gather_parameters()   # after the update: results to every rank

``map_whole`` is the one way to run work on a matrix's owner; ``orthogonalize`` is a call of
it (Newton-Schulz). Whether a rank's part of a tensor already holds whole matrices is a
fact of the group's ``MatrixLayout`` and of the placement (``holds_whole``): an expert
stack sharded over its experts does, and then nothing moves.

``MuonDDPSharding`` (DDP: whole tensors on every rank, gradients reduced onto owners) and
``MuonFSDPSharding`` (FSDP2: ``Shard(0)`` DTensors, rows sent to owners and back) are
subclasses; ``MuonTPSharding`` (a data x tensor mesh) is a third.

Finiteness is agreed by one all-reduce (MAX) of an integer vector ``[bad, *extra]``:
``bad`` is 1 on a rank whose gradients hold a NaN or an inf, ``extra`` what a subclass
must also agree on (FSDP2: which matrices have gradients). Only when some rank is bad,
a second all-reduce (MIN) finds the first bad parameter in optimizer order, so every
rank's error names it. Then every rank skips or raises alike and none waits alone in
a collective of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.distributed.comm import CommStats, all_reduce_
from lightning_muon.distributed.planning import OwnershipPlan
from lightning_muon.functional import all_finite, muon_orthogonalize
from lightning_muon.layout import MatrixLayout, layout_of
from lightning_muon.newton_schulz import resolve_ns_dtype

__all__ = ["FiniteVerdict", "NewtonSchulzWork", "Observer", "Sharding", "WholeWork", "ns_wire_dtype"]

WholeWork = Callable[[list[int], list[list[Tensor]]], list[list[Tensor]]]
"""``fn(indices, wholes) -> results`` of ``Sharding.map_whole``: work on the parameters a rank holds whole."""
Observer = Callable[[list[int], list[list[Tensor]], list[list[Tensor]]], None]
"""``observe(indices, wholes, results)`` of ``Sharding.map_whole``: sees an owner's whole inputs and results."""


class NewtonSchulzWork:
    """Newton-Schulz as ``map_whole`` work: ``muon_orthogonalize`` on the whole updates, pieces in its dtype.

    A sharding may recognize it to iterate on blocks instead of whole matrices
    (``MuonTPSharding``'s ``tp_mode="distributed"``); any other sharding just calls it.
    """

    def __init__(self, ns_kwargs: dict[str, Any]) -> None:
        self.ns_kwargs = ns_kwargs
        """``functional.muon_orthogonalize``'s keywords, ``layout`` among them."""

    def __call__(self, indices: list[int], wholes: list[list[Tensor]]) -> list[list[Tensor]]:
        return muon_orthogonalize([w[0] for w in wholes], **self.ns_kwargs, keep_work_dtype=True)


def ns_wire_dtype(updates: list[Tensor], ns_dtype: Any) -> torch.dtype | None:
    """The dtype updates may travel in to Newton-Schulz without loss: its work dtype where narrower, else None.

    Newton-Schulz casts its input to the work dtype first and returns values of that dtype,
    so sending either in it rounds nothing more.
    """
    if not updates:
        return None
    base = updates[0].dtype
    for u in updates[1:]:
        base = torch.promote_types(base, u.dtype)
    work = resolve_ns_dtype(ns_dtype, updates[0].device, base)
    return work if work.itemsize < base.itemsize else None


@dataclass(frozen=True)
class FiniteVerdict:
    """What the ranks agreed on the gradients of one step."""

    finite: bool
    """True when every gradient on every rank is finite."""
    local_finite: bool
    """True when this rank's gradients are finite."""
    culprit: str | None = None
    """``FiniteChecks.label`` of the first non-finite gradient over all ranks, in optimizer order."""


class Sharding:
    """Base of the ways ``Muon`` splits Newton-Schulz across ranks: params, plan, owners, one finiteness check.

    A subclass builds the plan from its own view of the shapes, then calls this
    ``__init__``, which attaches the sharding to the optimizer. The methods below are
    the whole interface ``Muon`` uses; their defaults are those of whole (unsharded)
    tensors on every rank.

    Args:
        optimizer: the ``Muon`` optimizer to attach to.
        params: its Muon parameters, in the order of ``plan``.
        plan: the owner of each of ``params``.
        group: the process group (None: the default group).
        rank: this rank in ``group``.
        world_size: ranks in ``group``.
        stats: where bytes and calls are counted; a new ``CommStats`` by default.
    """

    observes_updates: ClassVar[bool] = False
    """True when the sharding runs ``Muon``'s update hooks itself (only owners hold whole matrices)."""
    check_name: ClassVar[str] = "nonfinite_flag"
    """The ``CommStats`` name of the finiteness all-reduce."""
    check_dtype: ClassVar[torch.dtype] = torch.int32
    """The dtype of its vector: a flag fits in 4 bytes; a subclass whose ``agreement_extra`` needs more widens it."""

    def __init__(
        self,
        optimizer: Any,
        params: list[Tensor],
        plan: OwnershipPlan,
        *,
        group: Any = None,
        rank: int,
        world_size: int,
        stats: CommStats | None = None,
    ) -> None:
        if len(plan.owners) != len(params):
            raise ValueError(f"plan has {len(plan.owners)} owners for {len(params)} parameters")
        self.optimizer = optimizer
        self.params = params
        self.plan = plan
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.stats = stats if stats is not None else CommStats()
        self._index = {id(p): i for i, p in enumerate(params)}
        self._verdict: FiniteVerdict | None = None
        self.nonfinite_culprit: str | None = None
        """The first bad parameter of the last agreement that found one, as the step's error names it."""
        optimizer.attach_sharding(self)

    # ------------------------------------------------------------------ what this rank holds and steps

    def stepped(self, p: Tensor) -> Tensor | None:
        """What this rank steps of ``p``: ``p`` when it owns the matrix or ``p`` is no Muon parameter, else None.

        A subclass may give a part (DDP: a block of an expert stack's experts; FSDP2: every DTensor).
        """
        i = self._index.get(id(p))
        return p if i is None or self.plan.owners[i] == self.rank else None

    def local_shard(self, t: Tensor) -> Tensor:
        """The part of ``t`` (a parameter, gradient or state tensor) this rank holds."""
        return t

    def holds_whole(self, layout: MatrixLayout) -> bool:
        """Whether this rank's part of a tensor of ``layout`` holds whole matrices: per-matrix work runs there.

        The placement's half of the fact; the layout says which dims index matrices
        (``MatrixLayout.row_blocks_hold_whole_matrices``). True here: every tensor is whole.
        """
        return True

    def lend_state(self) -> None:
        """Before the step's groups: move state to the parts ``stepped`` gives (none by default)."""

    def return_state(self) -> None:
        """After the step's groups: the lent state back under its parameters (none by default)."""

    def round_owners(self, group: dict, params: list[Tensor]) -> list[int | None] | None:
        """Who works on each of ``params`` (of ``group``) in a step's rounds (``step_memory.plan_rounds``).

        None where this rank holds the group's matrices whole (``holds_whole``): it works on
        everything it steps, and plans its rounds alone (no collective runs per round).
        Otherwise each one's owner rank, so that every rank plans the same rounds and each
        owner's share fits the cap.
        """
        if self.holds_whole(layout_of(group)):
            return None
        return [self.plan.owners[self._index[id(p)]] for p in params]

    # ------------------------------------------------------------------ the step

    def map_whole(
        self,
        params: list[Tensor],
        tensors: list[list[Tensor]],
        fn: WholeWork,
        *,
        layout: MatrixLayout | None = None,
        wire_dtype: torch.dtype | None = None,
        observe: Observer | None = None,
    ) -> list[list[Tensor]]:
        """Run ``fn`` where each parameter's tensors are whole; return this rank's part of every result.

        The one primitive of per-matrix work. ``tensors[i]`` belong to ``params[i]``; every rank
        calls it with the same parameters in the same order. ``fn(indices, wholes)`` runs on
        each rank over the parameters it holds whole (``wholes[k]`` is ``tensors[indices[k]]``,
        whole), all at once, so that same-shape matrices share a batch, and returns per
        parameter its results:

        - ``layout=None``: one result per tensor, shaped like it (SOAP's step: the gradient and
          the state's factors in, the update and the new state out). This rank's part of
          each comes back as a plain tensor, cut as the tensor is.
        - ``layout`` given: per-matrix work on the layout's matrices (Newton-Schulz, MOP's SVD,
          Sinkhorn, Spel's projection). Each parameter has one tensor, and ``fn`` returns its
          pieces (``layout.views``); they come back placed as the tensor is (a DTensor's
          pieces as DTensors). Where this rank's part holds whole matrices already
          (``holds_whole``), ``fn`` runs on that part and nothing moves.

        ``wire_dtype``: a dtype narrower than the tensors' that ``fn`` reads them in anyway
        (Newton-Schulz's bf16), so they travel in it without loss. ``observe(indices, wholes,
        results)`` is called where ``fn`` ran on an owner's whole matrices, each matrix once
        over all ranks (the update hooks, for a sharding that ``observes_updates``).

        This default holds every tensor whole (one process, DDP owners): ``fn`` runs here.
        """
        indices = list(range(len(tensors)))
        results = fn(indices, tensors)
        if observe is not None:
            observe(indices, tensors, results)
        return results

    def orthogonalize(
        self, params: list[Tensor], updates: list[Tensor], *, observe: bool = True, **ns_kwargs: Any
    ) -> list[list[Tensor]]:
        """Per update of ``params``, its orthogonalized pieces (``MatrixLayout.views``): Newton-Schulz by ``map_whole``.

        ``ns_kwargs`` are ``functional.muon_orthogonalize``'s keywords, ``layout`` among them.
        Where the pieces are computed here they stay in Newton-Schulz's dtype (``muon_apply_``
        adds them into the parameters in one pass). ``observe``: whether the update hooks see
        them (False: a stage orthogonalizes something other than an update, Spel's weight);
        only a sharding that ``observes_updates`` runs them here.
        """
        return self.map_whole(
            params,
            [[u] for u in updates],
            NewtonSchulzWork(ns_kwargs),
            layout=ns_kwargs["layout"],
            wire_dtype=ns_wire_dtype(updates, ns_kwargs.get("ns_dtype")),
            observe=self.update_observer(params, updates) if observe else None,
        )

    def update_observer(self, params: list[Tensor], updates: list[Tensor]) -> Observer | None:
        """The update hooks as ``map_whole``'s ``observe`` for ``updates`` of ``params``; None where they run elsewhere.

        ``Muon`` runs the hooks itself unless the sharding ``observes_updates`` (only owners
        hold whole matrices), and none run without hooks registered.
        """
        if not self.observes_updates or not self.optimizer.has_update_hooks:
            return None

        def observe(indices: list[int], wholes: list[list[Tensor]], results: list[list[Tensor]]) -> None:
            if not indices:
                return
            # Looked up now: loading a state dict replaces the group dicts (not the parameters).
            first = params[indices[0]]
            group = next(g for g in self.optimizer.param_groups if any(q is first for q in g["params"]))
            dtypes = [updates[i].dtype for i in indices]
            self.optimizer.run_update_hooks(
                group,
                [params[i] for i in indices],
                [w[0].reshape(params[i].shape).to(d) for i, w, d in zip(indices, wholes, dtypes)],
                [[o.to(d) for o in pieces] for pieces, d in zip(results, dtypes)],
            )

        return observe

    def reduce_matrix_sums(self, params: list[Tensor], partial: Tensor, layout: MatrixLayout) -> Tensor:
        """Whole-matrix sums from this rank's part of them: ``partial[i]`` sums over its piece of ``params[i]``.

        ``partial`` is ``(len(params), k)``: k sums per parameter (squares, dot products) over the
        elements of it this rank holds (``local_shard``); where the rank holds ``layout``'s
        matrices whole (``holds_whole``) its rows may be per matrix of a batch instead.
        Returns the sums over whole matrices. Every rank that steps ``params`` calls it with
        the same parameters. The default, for whole tensors on the rank that steps them (DDP
        owners), returns ``partial``: no traffic.
        """
        return partial

    def gather_parameters(self) -> None:
        """After the owners stepped: bring every rank's copy of the parameters up to date (every rank calls it)."""

    # ------------------------------------------------------------------ finiteness

    def _local_gradients(self) -> list[Tensor]:
        """Every gradient this rank's step reads: the local part of each gradient of a parameter it steps."""
        grads = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                q = self.stepped(p)
                if q is not None and q.grad is not None:
                    g = self.local_shard(q.grad)
                    if g.numel():
                        grads.append(g)
        return grads

    def agreement_extra(self) -> list[int]:
        """Integers every rank must agree on besides finiteness; checked by ``check_agreement``."""
        return []

    def check_agreement(self, extra: list[int]) -> None:
        """Raise when the all-reduced (MAX) ``extra`` shows the ranks disagree (same answer on every rank)."""

    def agree_finite(self, grads: list[Tensor] | None = None) -> FiniteVerdict:
        """Agree with every rank whether all gradients are finite: the one collective of the check.

        ``grads`` are this rank's (default: every local gradient its step reads). Every rank must call it,
        once per step and before the step's other collectives. The verdict is kept for
        ``step_finite``; with ``nonfinite="ignore"`` nothing is checked and nothing is sent.
        """
        if self.optimizer.nonfinite == "ignore":
            self._verdict = FiniteVerdict(True, True)
            return self._verdict
        grads = self._local_gradients() if grads is None else grads
        local_ok = not grads or all_finite(grads)
        extra = self.agreement_extra()
        self.nonfinite_culprit = None
        bad = 0 if local_ok else 1
        if self.world_size > 1:
            device = self.params[0].device if self.params else torch.device("cpu")  # NCCL: no CPU tensors
            flags = torch.tensor([bad, *extra], dtype=self.check_dtype, device=device)
            all_reduce_(flags, dist.ReduceOp.MAX, self.group, self.stats, name=self.check_name)
            values = flags.tolist()
            bad, extra = values[0], values[1:]
            self.check_agreement(extra)
        if not bad:
            self._verdict = FiniteVerdict(True, True)
            return self._verdict
        self.nonfinite_culprit = self._first_culprit(local_ok)
        self._verdict = FiniteVerdict(False, local_ok, self.nonfinite_culprit)
        return self._verdict

    def _first_culprit(self, local_ok: bool) -> str | None:
        """The first non-finite gradient over all ranks, in optimizer order (a second all-reduce, MIN)."""
        groups = self.optimizer.param_groups
        flat = [(i, j) for i, g in enumerate(groups) for j in range(len(g["params"]))]
        culprit = None if local_ok else self.optimizer.finite_checks.culprit_index()
        first = flat.index(culprit) if culprit is not None else len(flat)
        if self.world_size > 1:
            device = self.params[0].device if self.params else torch.device("cpu")
            where = torch.tensor([first], dtype=torch.int64, device=device)
            all_reduce_(where, dist.ReduceOp.MIN, self.group, self.stats, name="nonfinite_where")
            first = int(where.item())
        return self.optimizer.finite_checks.label(*flat[first]) if first < len(flat) else None

    def step_finite(self) -> FiniteVerdict:
        """The verdict on this step's gradients: the agreement made since the last step, or a new one.

        A strategy that agrees early (DDP, right after reducing the gradients, before AMP
        unscaling and clipping) leaves its verdict here; otherwise the step agrees now.
        """
        verdict, self._verdict = self._verdict, None
        return verdict if verdict is not None else self._consume(self.agree_finite())

    def _consume(self, verdict: FiniteVerdict) -> FiniteVerdict:
        self._verdict = None
        return verdict
