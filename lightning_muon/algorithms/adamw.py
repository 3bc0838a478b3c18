"""``"adamw"`` groups: AdamW on the parameters Muon should not orthogonalize (embeddings, head, vectors).

As ``torch.optim.AdamW`` (its foreach path, op for op), per parameter with gradient ``g``::

    W <- W (1 - lr wd)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    W <- W - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

State per parameter: ``step`` (a 0-D tensor), ``exp_avg``, ``exp_avg_sq`` (stored in
``exp_avg_dtype`` and ``exp_avg_sq_dtype``, computed in the parameter's dtype: ``state_dtypes``).

References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", arXiv 1711.05101.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_muon.algorithms.base import Algorithm, StepContext, group_lr, register_algorithm
from lightning_muon.algorithms.families import AdamLikeSettings
from lightning_muon.algorithms.state_dtypes import STATE_SETTINGS, state_dtype
from lightning_muon.functional import adamw_

__all__ = ["ADAMW", "AdamW", "AdamWSettings", "momentum_readout"]


@dataclass(frozen=True, kw_only=True)
class AdamWSettings(AdamLikeSettings, algorithm="adamw"):
    """AdamW groups, as ``torch.optim.AdamW`` (``Muon``'s ``adamw_*`` keywords)."""


def momentum_readout(group: dict[str, Any]) -> None:
    """A copy of beta1 in ``group["momentum"]``: loggers (LearningRateMonitor) read that key from every group."""
    group["momentum"] = group["betas"][0]


def adam_moments(ctx: StepContext, params: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Adam's state of ``params``: ``(exp_avg, exp_avg_sq, step)`` lists, made zero on a parameter's first step
    (the moments in ``exp_avg_dtype`` and ``exp_avg_sq_dtype``, ``state_dtypes``)."""
    for p in params:
        entry = ctx.state[p]
        if "exp_avg" not in entry:
            entry["step"] = torch.tensor(0.0)
            for key, setting in (("exp_avg", "exp_avg_dtype"), ("exp_avg_sq", "exp_avg_sq_dtype")):
                dtype = state_dtype(ctx, setting, p)
                entry[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    entries = [ctx.state[p] for p in params]
    return [s["exp_avg"] for s in entries], [s["exp_avg_sq"] for s in entries], [s["step"] for s in entries]


class AdamW(Algorithm):
    """``"adamw"``: AdamW, bit for bit ``torch.optim.AdamW``."""

    name = "adamw"
    settings = AdamWSettings
    state_dtype_settings = frozenset(STATE_SETTINGS)

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        momentum_readout(group)

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        momentum_readout(group)  # betas may have been changed since (a scheduler, a user)
        adamw_(
            params,
            grads,
            *adam_moments(ctx, params),
            lr=group_lr(group),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )


ADAMW = register_algorithm(AdamW())
