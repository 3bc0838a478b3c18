"""Module-level worker for tests/test_grad_norm.py (spawned gloo ranks import it by name)."""

from __future__ import annotations

import math

import torch

from lightning_muon.distributed.grad_norm import global_grad_norm

NORM_TYPES = (1.0, 2.0, 3.0, math.inf)


def gradients() -> dict[str, torch.Tensor]:
    """Every gradient of the model, whole: two sharded matrices, one owned matrix, replicated vectors."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (5, 4), "b": (3, 6), "o": (4, 4), "bias": (7,)}
    return {name: torch.randn(shape, generator=gen) * (3 if name == "bias" else 1) for name, shape in shapes.items()}


def norm_worker(rank: int, world_size: int) -> dict[float, float]:
    """Rank r holds rows r::W of ``a`` and ``b`` (one copy each), ``o`` if it is rank 0, ``bias`` whole."""
    grads = gradients()
    pieces = [(grads["a"][rank::world_size], 1), (grads["b"][rank::world_size], 1), (grads["bias"], world_size)]
    if rank == 0:
        pieces.append((grads["o"], 1))
    return {p: float(global_grad_norm(pieces, p, device=torch.device("cpu"))) for p in NORM_TYPES}
