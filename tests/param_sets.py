"""GPT-like parameter sets with fixed random gradients, for tests that step ``Muon`` without a model.

Per layer the hidden matrices qkv (3d, d), attention projection (d, d), fc1 (4d, d) and fc2
(d, 4d); everything else is an embedding and a head (``VOCAB`` x d) and LayerNorm weights
and biases: the shapes of ``benchmarks/bench_optimizer.py``'s step table, so what a test
says of memory or state sizes holds for the model that table times.
"""

from __future__ import annotations

import torch
from torch import Tensor

VOCAB = 256


def gpt_shapes(d: int, layers: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(hidden matrices, everything else), in registration order."""
    hidden: list[tuple[int, ...]] = []
    other: list[tuple[int, ...]] = [(VOCAB, d)]
    for _ in range(layers):
        other += [(d,), (d,)]
        hidden += [(3 * d, d), (d, d)]
        other += [(d,), (d,)]
        hidden += [(4 * d, d), (d, 4 * d)]
    other += [(d,), (d,), (VOCAB, d)]
    return hidden, other


def gpt_parameters(d: int, layers: int, device: torch.device, seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """Leaf tensors of ``gpt_shapes`` (scaled by 0.02) with a random ``.grad`` each, drawn from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(shape: tuple[int, ...]) -> Tensor:
        p = (0.02 * torch.randn(shape, generator=gen, device=device)).requires_grad_()
        p.grad = torch.randn(shape, generator=gen, device=device)
        return p

    hidden, other = gpt_shapes(d, layers)
    return [make(s) for s in hidden], [make(s) for s in other]
