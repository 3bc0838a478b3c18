"""Non-finite gradients: ``Muon``'s check before a step, agreed by every rank, and the parameter it names.

``FiniteChecks`` is composed into ``Muon`` (one per optimizer, ``Muon.finite_checks``): the
step asks ``passes(work)``; ``precheck()`` checks this rank's gradients earlier (before
clipping) and the step reuses that answer; a strategy that reduces the gradients itself agrees
right after (``agree``); ``label(i, j)`` names a parameter.

With ``nonfinite="raise"`` (the default) a NaN or inf in a gradient raises, naming the
group and parameter; ``"skip"`` skips the whole step with a warning; ``"ignore"`` checks
nothing (no host-device synchronization). The check is one foreach reduction over every
gradient and one host sync (``functional.all_finite``).

Under a sharding the ranks agree by one all-reduce (MAX) of an integer vector ``[bad, *extra]``:
``bad`` is 1 on a rank whose gradients hold a NaN or an inf; ``extra`` is, where the sharding
``agrees_on_grads`` (FSDP2: a gradient on all ranks or on none), a signature of which Muon
matrices have gradients, sent as ``[h, -h]`` so that the ranks agree exactly when the maxima are
opposite. Only when some rank is bad, a second all-reduce (MIN) finds the first bad parameter in
optimizer order, so every rank's error names it. Then every rank skips or raises alike and none
waits alone in a collective of the step.

Under ``torch.compile`` a step whose parameters all have state is decided on the device
(``snapshot`` and ``restore``): the step runs, and a parameter or state tensor it wrote keeps its old value
where a gradient was not finite, so such a step applies nothing, with no host sync and no
graph break. The verdict is kept on the device; the next eager ``step()`` or
``raise_pending()`` reads it and raises (or, for ``"skip"``, warns) as an eager step would,
naming the parameter. A first step (which makes the state) checks on the host.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.distributed.comm import all_reduce_
from lightning_muon.functional import all_finite

__all__ = ["FiniteChecks", "FiniteVerdict"]


class FiniteVerdict(NamedTuple):
    """What the ranks agreed on the gradients of one step."""

    finite: bool
    """True when every gradient on every rank is finite."""
    local_finite: bool
    """True when this rank's gradients are finite."""
    culprit: str | None = None
    """``FiniteChecks.label`` of the first non-finite gradient over all ranks, in optimizer order."""


class FiniteChecks:
    """The non-finite gradient checks of one optimizer: reads its ``param_groups``, ``nonfinite`` and ``sharding``."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._precheck: tuple[tuple, bool, str | None] | None = None  # (gradients' key, finite here, culprit)
        self._agreed: FiniteVerdict | None = None  # the ranks' verdict on the current gradients (``agree``)
        self.pending: list[tuple[Tensor, list[tuple[int, int]]]] = []
        """Compiled steps' verdicts not read yet: per step, a flag per gradient and its (group, index)."""

    # ------------------------------------------------------------------ the eager check

    def passes(self, work: list, sharding: Any = None) -> bool:
        """True when the step over ``work`` (``(group, params, grads)``) may go on; False to skip it (``"skip"``,
        with a warning); raises ``FloatingPointError`` for ``"raise"``, naming the parameter. ``sharding``: the
        optimizer's.

        Takes the verdict the ranks agreed on since the last step (``agree``), or agrees now:
        on the answer of a ``precheck`` of these same gradients, or on a check made here.
        """
        nonfinite = self.optimizer.nonfinite
        if nonfinite == "ignore":
            return True
        verdict, self._agreed = self._agreed, None
        if verdict is None:
            precheck, self._precheck = self._precheck, None
            if precheck is not None and precheck[0] == self._key():
                local_ok, culprit = precheck[1:]
            else:  # none, or made for other gradients since
                grads = [g for _, _, gs in work for g in gs]
                if sharding is not None:
                    grads = [sharding.local_shard(g) for g in grads]  # a DTensor's norm would be a collective
                local_ok, culprit = all_finite(grads), None
            if local_ok and sharding is None:
                return True  # one process, every gradient finite: the common case
            verdict = self._agreement(local_ok, culprit, sharding)
        if verdict.finite:
            return True
        if nonfinite == "skip":
            warnings.warn(
                "Muon: a gradient holds NaN or inf; the step was skipped for all groups", RuntimeWarning, stacklevel=3
            )
            return False
        if not verdict.local_finite:
            raise FloatingPointError(
                f"Muon: non-finite gradient in {verdict.culprit}; pass nonfinite='skip' to skip such steps"
            )
        raise FloatingPointError(
            "Muon: non-finite gradient on another rank"
            + (f", in {verdict.culprit}" if verdict.culprit else " (its error names the parameter)")
            + "; pass nonfinite='skip' to skip such steps"
        )

    def precheck(self) -> bool:
        """Check this rank's gradients now, before something (clipping) rewrites them; the step reuses the answer.

        Clipping by norm spreads one NaN to every gradient; called before it, the step's error
        names the parameter whose gradient went bad. Costs the one pass the step would make (the
        step then skips its own), and keeps its answer only for these same gradients. No
        collective: the ranks still agree in the step. Returns True when this rank's gradients
        are finite.
        """
        if self.optimizer.nonfinite == "ignore":
            return True
        ok = all_finite([g for _, _, g in self._local_grads()])
        # Scaling by a finite factor (what clipping does) keeps finite values finite and
        # non-finite ones non-finite, so the answer holds until these gradients are replaced.
        self._precheck = (self._key(), ok, None if ok else self.culprit())
        return ok

    def agree(self, grads: list[Tensor] | None = None) -> FiniteVerdict:
        """Agree with every rank now whether all gradients are finite; the next step takes this verdict.

        For a strategy that reduces the gradients itself (``muon_ddp``): right after its reduce,
        before AMP unscaling, so that every rank decides alike. ``grads`` are this rank's, the ones
        its step reads (default: every local gradient of a parameter it steps). Every rank of the
        sharding must call it. With ``nonfinite="ignore"`` nothing is checked and nothing is sent.
        """
        if self.optimizer.nonfinite == "ignore":
            self._agreed = FiniteVerdict(True, True)
        else:
            ok = all_finite(grads if grads is not None else [g for _, _, g in self._local_grads()])
            self._agreed = self._agreement(ok, None, self.optimizer.sharding)
        return self._agreed

    def _agreement(self, local_ok: bool, culprit: str | None, sharding: Any) -> FiniteVerdict:
        """The verdict over every rank from this rank's ``local_ok``: one all-reduce under a sharding of several."""
        if sharding is None or sharding.world_size == 1:
            if sharding is not None and sharding.agrees_on_grads:
                self._with_grads(sharding)
            return FiniteVerdict(local_ok, local_ok, None if local_ok else culprit or self.culprit())
        flags = [0 if local_ok else 1]
        if sharding.agrees_on_grads:
            signature = hash(self._with_grads(sharding)) % (1 << 62)  # ints hash alike in every process
            flags += [signature, -signature]
        dtype = torch.int64 if sharding.agrees_on_grads else torch.int32  # a flag alone fits in 4 bytes
        device = sharding.params[0].device if sharding.params else torch.device("cpu")  # NCCL: no CPU tensors
        vector = torch.tensor(flags, dtype=dtype, device=device)
        name = "step_check" if sharding.agrees_on_grads else "nonfinite_flag"
        all_reduce_(vector, dist.ReduceOp.MAX, sharding.group, sharding.stats, name=name)
        bad, *extra = vector.tolist()
        if extra and extra[0] != -extra[1]:
            raise RuntimeError(
                f"{type(sharding).__name__}: ranks disagree on which Muon matrices have gradients (this rank: "
                f"{len(self._with_grads(sharding))} of {len(sharding.params)}); every rank must run the same modules"
            )
        if not bad:
            return FiniteVerdict(True, True)
        return FiniteVerdict(False, local_ok, self._first_culprit(sharding, local_ok))

    @staticmethod
    def _with_grads(sharding: Any) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(sharding.params) if p.grad is not None)

    def _first_culprit(self, sharding: Any, local_ok: bool) -> str | None:
        """The first non-finite gradient over all ranks, in optimizer order (a second all-reduce, MIN)."""
        groups = self.optimizer.param_groups
        flat = [(i, j) for i, g in enumerate(groups) for j in range(len(g["params"]))]
        culprit = None if local_ok else self.culprit_index()
        first = flat.index(culprit) if culprit is not None else len(flat)
        device = sharding.params[0].device if sharding.params else torch.device("cpu")
        where = torch.tensor([first], dtype=torch.int64, device=device)
        all_reduce_(where, dist.ReduceOp.MIN, sharding.group, sharding.stats, name="nonfinite_where")
        first = int(where.item())
        return self.label(*flat[first]) if first < len(flat) else None

    def _local_grads(self) -> list[tuple[int, int, Tensor]]:
        """(group index, index in group, this rank's gradient) for every gradient a step here reads."""
        sharding = self.optimizer.sharding
        out = []
        for i, group in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if sharding is not None:
                    p = sharding.stepped(p)  # p, the part of it this rank steps, or None
                    if p is None:
                        continue
                if p.grad is None or p.numel() == 0:
                    continue
                g = p.grad if sharding is None else sharding.local_shard(p.grad)
                if g.numel():
                    out.append((i, j, g))
        return out

    def _key(self) -> tuple:
        """Which gradients a verdict is about: each local gradient's identity and storage."""
        return tuple((id(g), g.data_ptr()) for _, _, g in self._local_grads())

    # ------------------------------------------------------------------ naming the parameter

    def label(self, i: int, j: int) -> str:
        """``param group i ('name'), parameter j 'param name' of shape (...)``, for messages."""
        group = self.optimizer.param_groups[i]
        names = group.get("param_names") or ()
        name = names[j] if j < len(names) else None
        label = f" {name!r}" if name else ""
        shape = tuple(group["params"][j].shape)
        return f"param group {i} ({group.get('name', group['algorithm'])!r}), parameter {j}{label} of shape {shape}"

    def culprit_index(self) -> tuple[int, int] | None:
        """(group, index) of the first parameter whose gradient on this rank holds NaN or inf, or None."""
        for i, j, g in self._local_grads():
            if not bool(g.isfinite().all()):
                return i, j
        return None

    def culprit(self) -> str | None:
        """``label`` of ``culprit_index()``, or None."""
        index = self.culprit_index()
        return None if index is None else self.label(*index)

    # ------------------------------------------------------------------ compiled steps

    def can_mask(self, work: list) -> bool:
        """Whether a compiled step can be decided on the device: checks on, one process, every parameter with state.

        A parameter's first step makes its state, which a masked step could not put back.
        """
        if self.optimizer.nonfinite == "ignore" or self.optimizer.sharding is not None:
            return False
        if not any(grads for _, _, grads in work):
            return False
        state = self.optimizer.state
        return all(p in state and state[p] for _, params, _ in work for p in params)

    def snapshot(self, work: list) -> tuple:
        """Before a step decided on the device: each gradient's flag (finite or not) and a copy of every tensor the
        step writes (its parameters and their state). ``restore(snapshot)`` after the step finishes it.

        The flags come from one foreach reduction (each gradient's inf-norm, exact for every
        finite value); no host sync.
        """
        grads = [g for _, _, gs in work for g in gs]
        where = [
            (i, next(j for j, q in enumerate(group["params"]) if q is p))
            for i, (group, params, _) in enumerate(work)
            for p in params
        ]
        flags = torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))]).isfinite()
        state = self.optimizer.state
        written = [p for _, params, _ in work for p in params]
        written += [t for p in list(written) for t in state[p].values() if isinstance(t, Tensor)]
        return flags, where, written, [t.clone() for t in written]

    def restore(self, snapshot: tuple) -> None:
        """After the step: every tensor it wrote keeps its copy unless every gradient was finite; the flags wait
        for ``raise_pending``."""
        flags, where, written, before = snapshot
        ok = flags.all()
        for t, old in zip(written, before):
            t.copy_(torch.where(ok, t, old))
        self.pending.append((flags, where))

    def raise_pending(self) -> None:
        """Read the verdicts of compiled steps (one sync): raise for a non-finite gradient, or warn for "skip"."""
        pending, self.pending = self.pending, []
        for flags, where in pending:
            if bool(flags.all()):
                continue
            i, j = where[int((~flags).nonzero()[0, 0])]
            if self.optimizer.nonfinite == "skip":
                warnings.warn(
                    f"Muon: a compiled step met a non-finite gradient in {self.label(i, j)} and applied nothing",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            raise FloatingPointError(
                f"Muon: non-finite gradient in {self.label(i, j)} in a compiled step, which applied nothing; "
                "pass nonfinite='skip' to skip such steps"
            )
