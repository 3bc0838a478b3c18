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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_muon.algorithms.base import Algorithm, StepContext, register_algorithm
from lightning_muon.algorithms.checks import check_betas, check_number, normalize
from lightning_muon.algorithms.state_dtypes import STATE_SETTINGS, state_dtype
from lightning_muon.functional import adamw_

__all__ = ["ADAMW", "AdamW", "AdamWHparams", "Betas", "check_adamw"]

Betas = tuple[float, float]


@dataclass(frozen=True, kw_only=True)
class AdamWHparams:
    """AdamW groups (``Muon``'s ``adamw_*`` keywords), as ``torch.optim.AdamW``."""

    lr: float = 3e-4
    """AdamW learning rate (peak); follows the same schedule as Muon's."""
    betas: Betas = (0.9, 0.95)
    """(beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """Added to the root of the second moment; > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""

    prefix = "adamw_"  # not a field: the prefix of these knobs among Muon's keywords

    def __post_init__(self) -> None:
        normalize(self, check_adamw(dataclasses.asdict(self), "Muon()", self.prefix))


def check_adamw(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check AdamW's hyperparameters in ``group``; returns the normalized values (``betas`` a tuple)."""
    check_number(group["lr"], prefix + "lr", where, 0.0)
    check_number(group["weight_decay"], prefix + "weight_decay", where, 0.0)
    betas = check_betas(group["betas"], where, prefix)
    check_number(group["eps"], prefix + "eps", where, 0.0, low_open=True)
    return {"betas": betas}


def momentum_readout(group: dict[str, Any]) -> None:
    """A copy of beta1 in ``group["momentum"]``: loggers (LearningRateMonitor) read that key from every group."""
    group["momentum"] = group["betas"][0]


class AdamW(Algorithm):
    """``"adamw"``: AdamW, bit for bit ``torch.optim.AdamW``."""

    name = "adamw"
    hparams = AdamWHparams
    state_dtype_settings = frozenset(STATE_SETTINGS)

    def check(self, values: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
        return check_adamw(values, where, prefix)

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        momentum_readout(group)

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        state = ctx.state
        for p in params:
            entry = state[p]
            if "exp_avg" not in entry:
                entry["step"] = torch.tensor(0.0)
                entry["exp_avg"] = torch.zeros_like(
                    p, dtype=state_dtype(ctx, "exp_avg_dtype", p), memory_format=torch.preserve_format
                )
                entry["exp_avg_sq"] = torch.zeros_like(
                    p, dtype=state_dtype(ctx, "exp_avg_sq_dtype", p), memory_format=torch.preserve_format
                )
        entries = [state[p] for p in params]
        beta1, beta2 = group["betas"]
        momentum_readout(group)  # betas may have been changed since (a scheduler, a user)
        adamw_(
            params,
            grads,
            [s["exp_avg"] for s in entries],
            [s["exp_avg_sq"] for s in entries],
            [s["step"] for s in entries],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )


ADAMW = register_algorithm(AdamW())
