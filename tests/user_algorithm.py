"""A user's own update rule, in one file outside the package: Signum (sign descent with momentum).

For a parameter ``W`` with gradient ``g``::

    m <- beta m + (1 - beta) g
    W <- W (1 - lr wd) - lr sign(m)

Importing this module registers it as ``"signum"``; a YAML config may also name it by its
import path, ``user_algorithm.Signum`` (a rule's algorithm) or ``user_algorithm.SignumSettings``
(a config section's class_path), which imports and registers it. Its settings derive from the
scalar family's (``ScalarSettings``: lr, weight_decay) and declare only ``beta``; the checks
come from the fields.

References:
    Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", arXiv 1802.04434.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_muon import Algorithm, register_algorithm
from lightning_muon.algorithms import ScalarSettings
from lightning_muon.algorithms.settings import setting


@dataclass(frozen=True, kw_only=True)
class SignumSettings(ScalarSettings, algorithm="signum", defaults={"lr": 1e-3}):
    """Signum groups: the scalar family's lr and decoupled weight decay, and a momentum of their own."""

    beta: float = setting(0.9, low=0.0, high=1.0, high_open=True)
    """Momentum, in [0, 1)."""


@register_algorithm
class Signum(Algorithm):
    """``"signum"``: the sign of an EMA of the gradients, with decoupled weight decay."""

    name = "signum"
    settings = SignumSettings

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
