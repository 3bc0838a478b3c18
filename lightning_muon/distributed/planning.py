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

__all__ = ["OwnershipPlan", "matrix_shapes", "plan_ownership"]


def matrix_shapes(shape: Sequence[int], layout: MatrixLayout | None = None) -> list[tuple[int, int]]:
    """The (rows, cols) of every matrix Muon orthogonalizes for a parameter of ``shape`` (``layout.matrix_shapes``).

    A batch of ``B`` matrices counts as ``B`` matrices; a grouped fused QKV (split sizes
    summing to a proper divisor of the output axis) gives ``(groups * size_i, cols)`` per
    piece, the matrices Newton-Schulz really sees.
    """
    return (layout or MatrixLayout()).matrix_shapes(shape)


@dataclass(frozen=True)
class OwnershipPlan:
    """``owners[i]`` is the rank that orthogonalizes parameter ``i``."""

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
) -> OwnershipPlan:
    """Assign each parameter (by shape) to an owner rank, balancing Newton-Schulz FLOPs.

    Args:
        shapes: the parameters' shapes, in a fixed order shared by every rank.
        world_size: number of ranks.
        ns_steps: Newton-Schulz steps (scales every cost alike; kept for reporting).
        layouts: per parameter, the matrices it holds (``MatrixLayout``); one plain matrix each by default.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    n = len(shapes)
    layouts = list(layouts) if layouts is not None else [MatrixLayout()] * n
    if len(layouts) != n:
        raise ValueError(f"layouts need one entry per shape ({n}), got {len(layouts)}")
    flops = tuple(sum(ns_flops(r, c, ns_steps) for r, c in matrix_shapes(s, lay)) for s, lay in zip(shapes, layouts))
    numels = tuple(int(torch.Size(s).numel()) for s in shapes)
    load = [0] * world_size
    elements = [0] * world_size
    owners = [0] * n
    for i in sorted(range(n), key=lambda i: (-flops[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], elements[r], r))
        owners[i] = rank
        load[rank] += flops[i]
        elements[rank] += numels[i]
    return OwnershipPlan(tuple(owners), flops, numels, world_size)
