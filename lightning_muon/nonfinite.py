"""Non-finite gradients: ``Muon``'s check before a step, the parameter it names, and the pre-clipping check.

``FiniteChecks`` is composed into ``Muon`` (one per optimizer, ``Muon.finite_checks``):
``precheck()`` before clipping, ``label(i, j)`` naming a parameter, ``culprit()``.

With ``nonfinite="raise"`` (the default) a NaN or inf in a gradient raises, naming the
group and parameter; ``"skip"`` skips the whole step with a warning; ``"ignore"`` checks
nothing (no host-device synchronization). Under a sharding the ranks agree first
(``Sharding.step_finite``), so every rank skips or raises alike.

Under ``torch.compile`` a step whose parameters all have state is decided on the device
(``snapshot`` and ``restore``): the step runs, and a parameter or state tensor it wrote keeps its old value
where a gradient was not finite, so such a step applies nothing, with no host sync and no
graph break. The verdict is kept on the device; the next eager ``step()`` or
``raise_pending()`` reads it and raises (or, for ``"skip"``, warns) as an eager step would,
naming the parameter. A first step (which makes the state) checks on the host.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_muon.functional import all_finite

__all__ = ["FiniteChecks"]


class FiniteChecks:
    """The non-finite gradient checks of one optimizer: reads its ``param_groups``, ``nonfinite`` and ``sharding``.

    The check reads every gradient once and syncs the host with the device once per step.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._precheck: tuple | None = None
        # Compiled steps' verdicts not read yet: per step, a flag per gradient and its (group, index).
        self._pending: list[tuple[Tensor, list[tuple[int, int]]]] = []

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

        The flags come from one foreach reduction (each gradient's inf-norm); no host sync.
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
        self._pending.append((flags, where))

    def raise_pending(self) -> None:
        """Read the verdicts of compiled steps (one sync): raise for a non-finite gradient, or warn for "skip"."""
        pending, self._pending = self._pending, []
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

    def grads_finite(self, work: list) -> bool:
        """True when the step may go on; False to skip it; raises for ``nonfinite="raise"``.

        Under a sharding every rank reaches the same answer: the verdict is the one the
        ranks agreed on (``Sharding.step_finite``), over every gradient any rank's step reads.
        """
        nonfinite = self.optimizer.nonfinite
        if nonfinite == "ignore":
            return True
        precheck = self._take_precheck()
        sharding = self.optimizer.sharding
        if sharding is not None:
            verdict = sharding.step_finite()
            ok, local_ok, where = verdict.finite, verdict.local_finite, verdict.culprit
            culprit = precheck[1] if precheck is not None and not precheck[0] else None
        else:
            if precheck is not None:
                local_ok, culprit = precheck
            else:
                grads = [g for _, _, gs in work for g in gs]
                local_ok, culprit = (not grads or all_finite(grads)), None
            ok, where = local_ok, None
        if ok:
            return True
        if nonfinite == "skip":
            warnings.warn(
                "Muon: a gradient holds NaN or inf; the step was skipped for all groups", RuntimeWarning, stacklevel=3
            )
            return False
        if not local_ok:
            culprit = culprit or self.culprit()
            raise FloatingPointError(
                f"Muon: non-finite gradient in {culprit}; pass nonfinite='skip' to skip such steps"
            )
        raise FloatingPointError(
            "Muon: non-finite gradient on another rank"
            + (f", in {where}" if where else " (its error names the parameter)")
            + "; pass nonfinite='skip' to skip such steps"
        )

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

    def precheck(self) -> bool:
        """Check the gradients now, before something (clipping) rewrites them; the next step reuses the answer.

        Clipping by norm spreads one NaN to every gradient; called before it, the step's error
        names the parameter whose gradient went bad. Costs the one pass the step would make
        (the step then skips its own), and keeps its answer only for these same gradients.
        Returns True when every gradient is finite.
        """
        if self.optimizer.nonfinite == "ignore":
            return True
        entries = self._local_grads()
        ok = not entries or all_finite([g for _, _, g in entries])
        self.record(ok, None if ok else self.culprit())
        return ok

    def record(self, ok: bool, culprit: str | None = None) -> None:
        """Remember that the current gradients are (not) all finite; a sharding that checked them calls it."""
        # Scaling by a finite factor (what clipping does) keeps finite values finite and
        # non-finite ones non-finite, so the answer holds until these gradients are replaced.
        self._precheck = (tuple((id(g), g.data_ptr()) for _, _, g in self._local_grads()), ok, culprit)

    def _take_precheck(self) -> tuple[bool, str | None] | None:
        precheck, self._precheck = self._precheck, None
        if precheck is None:
            return None
        key, ok, culprit = precheck
        if key != tuple((id(g), g.data_ptr()) for _, _, g in self._local_grads()):
            return None  # other gradients since: check again
        return ok, culprit
