"""A user's own update rule, in one file outside the package: Signum (sign descent with momentum).

For a parameter ``W`` with gradient ``g``::

    m <- beta m + (1 - beta) g
    W <- W (1 - lr wd) - lr sign(m)

Importing this module registers it as ``"signum"``; a YAML config may also name it by its
import path, ``user_algorithm.Signum``, which imports and registers it.

References:
    Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", arXiv 1802.04434.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_muon import Algorithm, register_algorithm


@dataclass(frozen=True, kw_only=True)
class SignumHparams:
    lr: float = 1e-3
    """Step size: every entry moves by lr per step."""
    beta: float = 0.9
    """Momentum, in [0, 1)."""
    weight_decay: float = 0.0
    """Decoupled weight decay, times the lr."""

    def __post_init__(self) -> None:
        for name, value in (("lr", self.lr), ("weight_decay", self.weight_decay)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.beta, (int, float)) and 0 <= self.beta < 1):
            raise ValueError(f"beta must be in [0, 1), got {self.beta!r}")


@register_algorithm
class Signum(Algorithm):
    """``"signum"``: the sign of an EMA of the gradients, with decoupled weight decay."""

    name = "signum"
    hparams = SignumHparams

    def init_group(self, group, params, where):
        group["momentum"] = group["beta"]  # what LearningRateMonitor logs as this group's momentum

    def step_group(self, optimizer, group, params, grads):
        bufs = []
        for p in params:
            state = optimizer.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(state["momentum_buffer"])
        torch._foreach_lerp_(bufs, grads, 1.0 - group["beta"])
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(params, torch._foreach_sign(bufs), alpha=-group["lr"])
