"""The memory one Muon step holds at once: its cap (``step_memory_mb``) and the rounds that keep to it.

A Muon group's step makes a temporary per matrix (the Nesterov update), stacks same-shape
matrices for Newton-Schulz (the stack, its iterate and two Gram-sized buffers per matrix)
and keeps each result until the weights are updated. Done for the whole group at once,
that is about twice the group's matrices again, on top of the parameters, gradients and
momentum, and it grows with the model. With a cap, ``plan_rounds`` cuts the group into
rounds whose estimated working set fits it, and the step runs momentum, Newton-Schulz,
the second moment, the update hooks and the weight update once per round. A matrix whose
own working set is larger than the cap runs in a round of its own: the step's transient
stays under max(the cap, the largest single matrix's working set).

Every matrix's result is the same bits in any round: Newton-Schulz gives a matrix of a kind
that stacks the same batched iteration in a stack of any size (``orthogonalize_many``), and
the momentum and the update are elementwise. Under a sharding that sends matrices to owners
(``muon_fsdp``), every rank plans the same rounds from the parameters' global shapes and the
ownership plan, so that each round's exchange is one agreed collective and each owner's
share of a round fits the cap.

``step_memory_mb`` is an optimizer-wide setting: ``"auto"`` (the default: 32 MiB on a CPU,
1 GiB on a GPU, where stacks of many matrices keep the tensor cores busy), a number of MiB,
or None (no cap: the whole group in one round).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from lightning_muon.algorithms.checks import HparamError

__all__ = [
    "AUTO_STEP_MEMORY_MB",
    "StepMemory",
    "check_step_memory_mb",
    "plan_rounds",
    "step_memory_bytes",
]

StepMemory = float | Literal["auto"] | None
# The automatic cap per device type, in MiB: on a CPU about torch.optim.Muon's own transient
# for a GPT-2-sized model (one 768 x 3072 matrix at a time); on a GPU room for stacks of a
# model's same-shape matrices (stacking is what beats a per-matrix loop there).
AUTO_STEP_MEMORY_MB = {"cpu": 32.0, "cuda": 1024.0}
_OTHER_DEVICES_MB = 1024.0


def check_step_memory_mb(value: object) -> StepMemory:
    """``value`` if it is "auto", None or a positive number of MiB; else an ``HparamError`` naming the field."""
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise HparamError(
            f"step_memory_mb must be 'auto', None (no cap) or a positive number of MiB, got {value!r}", "step_memory_mb"
        )
    return float(value)


def step_memory_bytes(setting: StepMemory, device: torch.device | str) -> int | None:
    """The cap in bytes for a step on ``device`` (None: no cap)."""
    if setting is None:
        return None
    if setting == "auto":
        setting = AUTO_STEP_MEMORY_MB.get(torch.device(device).type, _OTHER_DEVICES_MB)
    return int(float(setting) * 2**20)


def plan_rounds(
    costs: Sequence[int],
    kinds: Sequence[tuple],
    cap: int | None,
    owners: Sequence[int | None] | None = None,
    world_size: int = 1,
) -> list[list[int]]:
    """Indices of the group's parameters, cut into rounds that each fit ``cap`` bytes.

    ``costs[i]``: parameter i's working bytes where it is orthogonalized; ``kinds[i]``: what
    makes two parameters stack together (their piece shapes and dtype). ``owners[i]``: the
    rank that orthogonalizes parameter i (a sharding's plan), or None where every rank
    orthogonalizes its own part of it (an expert stack under FSDP2: ``costs[i] /
    world_size`` each); without owners, this rank does it all.

    Each owner's parameters of one kind are cut into units of as many as fit ``cap``, but
    never one alone where the kind has more (the last one joins the unit before it): a
    matrix then meets Newton-Schulz in a stack of two or more in every round, as in one
    round of the whole group, and gets the same bits. Units are packed into rounds, the
    owners' in turn, a round closing when the next unit would take any rank past ``cap``; a unit larger than
    ``cap`` gets a round of its own. ``cap`` None: one round, in the given order.
    Deterministic: every rank that plans the same inputs gets the same rounds.
    """
    if cap is None:
        return [list(range(len(costs)))] if costs else []
    runs: dict[tuple, list[int]] = {}
    for i in range(len(costs)):
        owner = None if owners is None else owners[i]
        runs.setdefault((owner is None, owner if owner is not None else -1, kinds[i]), []).append(i)
    per_owner: dict[tuple, list[list[int]]] = {}
    for key in sorted(runs):  # by owner, then kind: each kind's units side by side
        run = runs[key]
        size = max(2, cap // max(1, costs[run[0]]))
        parts = [run[start : start + size] for start in range(0, len(run), size)]
        if len(parts) > 1 and len(parts[-1]) == 1:
            last = parts.pop()
            parts[-1] += last
        per_owner.setdefault(key[:2], []).extend(parts)
    # The owners' units in turn, so that a round holds a unit of every owner.
    queues = list(per_owner.values())
    longest = max(map(len, queues)) if queues else 0  # (no default=: torch.compile traces this)
    units = [q[k] for k in range(longest) for q in queues if k < len(q)]

    def loads(unit: list[int]) -> dict[int, float]:
        out: dict[int, float] = {}
        for i in unit:
            owner = None if owners is None else owners[i]
            if owners is not None and owner is None:  # spread over every rank
                for r in range(world_size):
                    out[r] = out.get(r, 0.0) + costs[i] / world_size
            else:
                r = 0 if owner is None else owner
                out[r] = out.get(r, 0.0) + costs[i]
        return out

    rounds: list[list[int]] = []
    current: list[int] = []
    load: dict[int, float] = {}
    for unit in units:
        add = loads(unit)
        if current and any(load.get(r, 0.0) + b > cap for r, b in add.items()):
            rounds.append(current)
            current, load = [], {}
        current += unit
        for r, b in add.items():
            load[r] = load.get(r, 0.0) + b
    if current:
        rounds.append(current)
    return rounds
