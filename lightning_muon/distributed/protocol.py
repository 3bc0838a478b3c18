"""The sharding protocol: how a ``Muon`` optimizer splits its Newton-Schulz work across ranks.

A sharding holds the Muon parameters of one optimizer, an ``OwnershipPlan`` (the rank
that orthogonalizes each whole matrix) and a process group. ``Muon`` reaches it through
``Muon.attach_sharding`` and calls only the methods of ``Sharding`` below, in this
order within one ``step``::

    sharding.step_finite()         # the agreed "every gradient is finite" (one collective)
    sharding.owns(p)               # which parameters this rank steps
    sharding.local_shard(grad)     # the part of a gradient this rank holds
    sharding.orthogonalize(...)    # per Muon group: Newton-Schulz on whole matrices
    sharding.reduce_matrix_sums()  # a variant that needs whole-matrix norms (MuonHyperball)
    sharding.gather_parameters()   # after the update: results to every rank

``MuonSharding`` (DDP: whole tensors on every rank, gradients reduced onto owners) and
``MuonFSDPSharding`` (FSDP2: ``Shard(0)`` DTensors, rows sent to owners and back) are
its two subclasses; a new layout (owner groups, tensor parallelism) is a third.

Finiteness is agreed by one all-reduce (MAX) of an integer vector ``[bad, *extra]``:
``bad`` is 1 on a rank whose gradients hold a NaN or an inf, ``extra`` what a subclass
must also agree on (FSDP2: which matrices have gradients). Only when some rank is bad,
a second all-reduce (MIN) finds the first bad parameter in optimizer order, so every
rank's error names it. Then every rank skips or raises alike and none waits alone in
a collective of the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.distributed.comm import CommStats, all_reduce_
from lightning_muon.distributed.planning import OwnershipPlan
from lightning_muon.functional import all_finite, muon_orthogonalize

__all__ = ["FiniteVerdict", "Sharding"]


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

    # ------------------------------------------------------------------ ownership

    @property
    def owners(self) -> tuple[int, ...]:
        """``owners[i]``: the rank that orthogonalizes ``params[i]``."""
        return self.plan.owners

    def owner(self, p: Tensor) -> int | None:
        """The rank that orthogonalizes ``p``, or None for a parameter outside ``params``."""
        i = self._index.get(id(p))
        return None if i is None else self.plan.owners[i]

    def owns(self, p: Tensor) -> bool:
        """True when this rank steps ``p``: it owns the matrix, or ``p`` is not a Muon parameter."""
        owner = self.owner(p)
        return owner is None or owner == self.rank

    def local_shard(self, t: Tensor) -> Tensor:
        """The part of ``t`` (a parameter, gradient or state tensor) this rank holds."""
        return t

    def stepped(self, p: Tensor) -> Tensor | None:
        """What this rank steps of ``p``: ``p`` itself when it owns it, else None (a subclass may give a part)."""
        return p if self.owns(p) else None

    def lend_state(self) -> None:
        """Before the step's groups: move state to the parts ``stepped`` gives (none by default)."""

    def return_state(self) -> None:
        """After the step's groups: the lent state back under its parameters (none by default)."""

    def part_grads(self) -> list[Tensor]:
        """Gradients of the parts ``stepped`` gives besides whole parameters (none by default)."""
        return []

    def round_owners(self, group: dict, params: list[Tensor]) -> list[int | None] | None:
        """Who orthogonalizes each of ``params`` (of ``group``) in a step's rounds (``step_memory.plan_rounds``).

        None (the default): this rank orthogonalizes everything it steps, and plans its rounds
        alone (no collective runs per round). A sharding that sends matrices to owners inside
        ``orthogonalize`` returns each one's owner rank (None where every rank does its own
        part), so that every rank plans the same rounds and each owner's share fits the cap.
        """
        return None

    # ------------------------------------------------------------------ the step

    def orthogonalize(self, params: list[Tensor], updates: list[Tensor], **ns_kwargs: Any) -> list[list[Tensor]]:
        """Per update of ``params``, its orthogonalized pieces, shaped like ``MatrixLayout.views``.

        ``ns_kwargs`` are ``functional.muon_orthogonalize``'s keywords. Every rank calls it
        with the same groups in the same order. The default orthogonalizes here what this
        rank holds whole; pieces stay in Newton-Schulz's dtype (``muon_apply_`` adds them
        into the parameters in one pass).
        """
        return muon_orthogonalize(updates, **ns_kwargs, keep_work_dtype=True)

    def map_whole(
        self,
        params: list[Tensor],
        tensors: list[list[Tensor]],
        fn: Callable[[int, list[Tensor]], list[Tensor]],
    ) -> list[list[Tensor]]:
        """Per parameter ``i``, ``fn(i, wholes)`` on its ``tensors[i]`` whole; returns this rank's part of each result.

        The primitive of per-matrix work that is not an orthogonalization (SOAP's step: the
        gradient and the state's factors in, the update and the new state out). ``tensors[i]``
        are shaped as the results ``fn`` returns for them, one each, and each is split across
        ranks as ``params[i]`` is (a DTensor's placements; whole here). This default holds
        every tensor whole (one process, DDP owners): ``fn`` runs here. Every rank calls it
        with the same parameters.
        """
        return [fn(i, ts) for i, ts in enumerate(tensors)]

    @property
    def observing(self) -> bool:
        """Whether ``orthogonalize`` runs the update hooks on what it orthogonalizes (see ``unobserved``)."""
        return self.__dict__.get("_observing", True)

    @contextlib.contextmanager
    def unobserved(self) -> Iterator[None]:
        """Within it, ``orthogonalize`` runs no update hooks: a stage orthogonalizes something not an update.

        (Spel projects its weights back onto the orthogonal matrices with the same exchange.)
        """
        previous = self.observing
        self.__dict__["_observing"] = False
        try:
            yield
        finally:
            self.__dict__["_observing"] = previous

    def reduce_matrix_sums(self, params: list[Tensor], partial: Tensor) -> Tensor:
        """Whole-matrix sums from this rank's part of them: ``partial[i]`` sums over its piece of ``params[i]``.

        ``partial`` is ``(len(params), k)``: k sums per parameter (squares, dot products) over the
        elements of it this rank holds (``local_shard``). Returns the sums over whole parameters.
        Every rank that steps ``params`` calls it with the same parameters. The default, for
        whole tensors on the rank that steps them (DDP owners), returns ``partial``: no traffic.
        """
        return partial

    def gather_parameters(self) -> None:
        """After the owners stepped: bring every rank's copy of the parameters up to date (every rank calls it)."""

    # ------------------------------------------------------------------ finiteness

    def local_gradients(self) -> list[Tensor]:
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

        ``grads`` are this rank's (default: ``local_gradients()``). Every rank must call it,
        once per step and before the step's other collectives. The verdict is kept for
        ``step_finite``; with ``nonfinite="ignore"`` nothing is checked and nothing is sent.
        """
        if self.optimizer.nonfinite == "ignore":
            self._verdict = FiniteVerdict(True, True)
            return self._verdict
        grads = self.local_gradients() if grads is None else grads
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
