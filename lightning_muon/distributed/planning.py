"""Who orthogonalizes what: owner ranks for Muon matrices, balanced by Newton-Schulz FLOPs.

Every rank builds the same plan from the same list of parameter shapes, so no
communication is needed to agree on it. Longest-processing-time-first: matrices
sorted by FLOPs (largest first, ties by index) each go to the least-loaded rank
(ties by fewer elements, then lower rank). For a set of identical matrices this is
round-robin; in general the most loaded rank carries at most 4/3 of the optimum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_muon.layout import MatrixLayout
from lightning_muon.newton_schulz import ns_flops

__all__ = ["OwnershipPlan", "expert_blocks", "matrix_shapes", "plan_ownership"]


def expert_blocks(experts: Sequence[int], world_size: int) -> list[list[tuple[int, int]]]:
    """Per expert stack (its number of experts), per rank: ``(first expert, experts)`` of the block it steps.

    ``torch.chunk`` blocks of each stack's experts, rotated: stack ``k``'s first block goes to
    rank ``(experts of the stacks before k) mod W``. Where a stack has fewer experts than there
    are ranks, the ranks its blocks miss take the next stack's, so the busiest rank does its
    fair share rather than one expert of every stack (DeepSeek-V3, 256 experts, at W = 1024:
    one stack in four per rank).
    """
    out, base = [], 0
    for count in experts:
        size = -(-count // world_size) if count else 0  # torch.chunk's block size
        blocks = [(b * size, max(0, min(size, count - b * size))) for b in range(world_size)]
        per_rank: list[tuple[int, int]] = [(0, 0)] * world_size
        for b, block in enumerate(blocks):
            per_rank[(b + base) % world_size] = block
        out.append(per_rank)
        base += count
    return out


def matrix_shapes(shape: Sequence[int], layout: MatrixLayout | None = None) -> list[tuple[int, int]]:
    """The (rows, cols) of every matrix Muon orthogonalizes for a parameter of ``shape`` (``layout.matrix_shapes``).

    A batch of ``B`` matrices counts as ``B`` matrices; a grouped fused QKV (split sizes
    summing to a proper divisor of the output axis) gives ``(groups * size_i, cols)`` per
    piece, the matrices Newton-Schulz really sees.
    """
    return (layout or MatrixLayout()).matrix_shapes(shape)


@dataclass(frozen=True)
class OwnershipPlan:
    """``owners[i]`` is the rank that orthogonalizes parameter ``i`` (-1: spread over every rank by rows)."""

    owners: tuple[int, ...]
    flops: tuple[int, ...]
    """Newton-Schulz FLOPs per parameter."""
    numels: tuple[int, ...]
    """Elements per parameter."""
    world_size: int

    def owned(self, rank: int) -> list[int]:
        """Indices of the parameters ``rank`` owns, in index order."""
        return [i for i, r in enumerate(self.owners) if r == rank]

    def load(self, rank: int) -> int:
        """Newton-Schulz FLOPs of ``rank``."""
        return sum(f for f, r in zip(self.flops, self.owners) if r == rank)

    def elements(self, rank: int) -> int:
        """Elements of the parameters ``rank`` owns."""
        return sum(n for n, r in zip(self.numels, self.owners) if r == rank)


def plan_ownership(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    ns_steps: int = 5,
    layouts: Sequence[MatrixLayout] | None = None,
    spread: Sequence[bool] | None = None,
    spread_blocks: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> OwnershipPlan:
    """Assign each parameter (by shape) to an owner rank, balancing Newton-Schulz FLOPs.

    Args:
        shapes: the parameters' shapes, in a fixed order shared by every rank.
        world_size: number of ranks.
        ns_steps: Newton-Schulz steps (scales every cost alike; kept for reporting).
        layouts: per parameter, the matrices it holds (``MatrixLayout``); one plain matrix each by default.
        spread: per parameter, whether every rank takes a block of its rows instead (an expert stack
            split by experts): it gets no owner (-1), and the others are balanced among themselves.
        spread_blocks: for the spread parameters, in order, per rank ``(first expert, experts)``
            (``expert_blocks``): each rank starts with its experts' FLOPs, so the owned matrices fill
            around them. Without it the spread ones weigh nothing.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    n = len(shapes)
    layouts = list(layouts) if layouts is not None else [MatrixLayout()] * n
    if len(layouts) != n:
        raise ValueError(f"layouts need one entry per shape ({n}), got {len(layouts)}")
    flops = tuple(sum(ns_flops(r, c, ns_steps) for r, c in matrix_shapes(s, lay)) for s, lay in zip(shapes, layouts))
    numels = tuple(int(torch.Size(s).numel()) for s in shapes)
    spread = list(spread) if spread is not None else [False] * n
    if len(spread) != n:
        raise ValueError(f"spread needs one entry per shape ({n}), got {len(spread)}")
    load = [0] * world_size
    elements = [0] * world_size
    for i, blocks in zip((i for i in range(n) if spread[i]), spread_blocks or ()):
        per_expert = flops[i] // shapes[i][0] if shapes[i][0] else 0
        for r, (_, rows) in enumerate(blocks):
            load[r] += per_expert * rows
            elements[r] += numels[i] // shapes[i][0] * rows if shapes[i][0] else 0
    owners = [-1] * n
    for i in sorted((i for i in range(n) if not spread[i]), key=lambda i: (-flops[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], elements[r], r))
        owners[i] = rank
        load[rank] += flops[i]
        elements[rank] += numels[i]
    return OwnershipPlan(tuple(owners), flops, numels, world_size)
