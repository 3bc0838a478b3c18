"""The sharding protocol: how a ``Muon`` optimizer splits its per-matrix work across ranks, moving tensors only.

A sharding holds the Muon parameters of one optimizer, an ``OwnershipPlan`` (the rank
that works on each whole matrix) and a process group. ``Muon`` reaches it through
``Muon.attach_sharding`` and calls only the methods of ``Sharding`` below, in this
order within one ``step``::

    sharding.stepped(p)            # what of each parameter this rank steps
    sharding.local_shard(grad)     # the part of a tensor this rank holds
    with sharding.lent_state():    # state under the parts this rank steps, for the step
        sharding.round_owners(...)     # who works on each matrix: every rank plans the same rounds
        sharding.map_whole(...)        # per-matrix work where each matrix is whole: Newton-Schulz,
                                       #   MOP's SVD, Sinkhorn, Spel, SOAP
        sharding.reduce_matrix_sums()  # whole-matrix sums from every rank's part (MuonHyperball, PolarGrad, NAMO)
    sharding.gather_parameters()   # after the update: results to every rank

``map_whole`` is the one way to run work on a matrix's owner. Whether a rank's part of a tensor
already holds whole matrices is a fact of the group's ``MatrixLayout`` and of the placement
(``holds_whole``): an expert stack sharded over its experts does, and then nothing moves. The
non-finite check agrees across ranks on its own (``nonfinite.FiniteChecks``), through the
sharding's process group.

``MuonDDPSharding`` (DDP: whole tensors on every rank, gradients reduced onto owners) and
``MuonFSDPSharding`` (FSDP2: ``Shard(0)`` DTensors, rows sent to owners and back) are
subclasses; ``MuonTPSharding`` (a data x tensor mesh) is a third.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_muon.distributed.comm import CommStats
from lightning_muon.distributed.planning import OwnershipPlan
from lightning_muon.layout import MatrixLayout, layout_of

__all__ = ["Observer", "Sharding", "WholeWork"]

WholeWork = Callable[[list[int], list[list[Tensor]]], list[list[Tensor]]]
"""``fn(indices, wholes) -> results`` of ``Sharding.map_whole``: work on the parameters a rank holds whole."""
Observer = Callable[[list[int], list[list[Tensor]], list[list[Tensor]]], None]
"""``observe(indices, wholes, results)`` of ``Sharding.map_whole``: sees an owner's whole inputs and results."""


class Sharding:
    """Base of the ways ``Muon`` splits Newton-Schulz across ranks: params, plan, owners, and moving tensors.

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
    """True when only owners hold whole matrices, so ``map_whole``'s ``observe`` runs ``Muon``'s update hooks there."""
    agrees_on_grads: ClassVar[bool] = False
    """True when every rank has a gradient for a Muon parameter or none does (FSDP2): the non-finite check's
    agreement then also checks that the ranks agree on which have one (``nonfinite.FiniteChecks``)."""

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

    @contextlib.contextmanager
    def lent_state(self) -> Iterator[None]:
        """For the step's groups: state under the parts ``stepped`` gives, and back under the parameters after
        (nothing moves by default)."""
        yield

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
        newton_schulz: dict[str, Any] | None = None,
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
        ``newton_schulz``: given when ``fn`` is Newton-Schulz with these settings
        (``functional.muon_orthogonalize``'s keywords but ``layout``), for a sharding that can
        iterate on blocks of a matrix instead of gathering it (``MuonTPSharding``'s
        ``tp_mode="distributed"``); every other sharding runs ``fn``.

        This default holds every tensor whole (one process, DDP owners): ``fn`` runs here.
        """
        indices = list(range(len(tensors)))
        results = fn(indices, tensors)
        if observe is not None:
            observe(indices, tensors, results)
        return results

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
