"""``"lion"`` groups: Lion (sign of an interpolated momentum) with decoupled weight decay.

Per parameter with gradient ``g`` and momentum ``m``::

    W <- W (1 - lr wd) - lr sign(b1 m + (1 - b1) g)
    m <- b2 m + (1 - b2) g

State per parameter: ``exp_avg`` (stored in ``exp_avg_dtype``). Lion's lr and weight decay default to AdamW's (Lion
usually wants 3-10x less lr).

References:
    Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675, 2023.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_muon.algorithms.adamw import Betas, momentum_readout
from lightning_muon.algorithms.base import Algorithm, HparamsSource, StepContext, register_algorithm
from lightning_muon.algorithms.checks import check_betas, check_number, normalize, with_placeholders
from lightning_muon.algorithms.state_dtypes import STATE_SETTINGS, state_dtype
from lightning_muon.functional import lion_

__all__ = ["LION", "Lion", "LionHparams", "check_lion", "with_adamw_fallbacks"]


@dataclass(frozen=True, kw_only=True)
class LionHparams:
    """Lion groups (``Muon``'s ``lion_*`` keywords); Chen et al. with decoupled weight decay."""

    lr: float | None = None
    """Lion learning rate; None takes AdamW's (Lion usually wants 3-10x less)."""
    betas: Betas = (0.9, 0.99)
    """(beta1, beta2), each in [0, 1)."""
    weight_decay: float | None = None
    """Decoupled weight decay; None takes AdamW's."""

    prefix = "lion_"  # not a field: the prefix of these knobs among Muon's keywords

    def __post_init__(self) -> None:
        normalize(self, check_lion(with_placeholders(self), "Muon()", self.prefix))


def check_lion(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check Lion's hyperparameters in ``group``; returns the normalized values (``betas`` a tuple)."""
    check_number(group["lr"], prefix + "lr", where, 0.0)
    check_number(group["weight_decay"], prefix + "weight_decay", where, 0.0)
    return {"betas": check_betas(group["betas"], where, prefix)}


def with_adamw_fallbacks(values: dict[str, Any], config: HparamsSource) -> dict[str, Any]:
    """``values`` with an lr or weight decay of None replaced by AdamW's (Lion, Schedule-Free AdamW)."""
    adamw = config.hparams_of("adamw")
    values["lr"] = adamw.lr if values["lr"] is None else values["lr"]
    values["weight_decay"] = adamw.weight_decay if values["weight_decay"] is None else values["weight_decay"]
    return values


class Lion(Algorithm):
    """``"lion"``: Lion with decoupled weight decay."""

    name = "lion"
    hparams = LionHparams
    state_dtype_settings = frozenset(STATE_SETTINGS)  # no second moment: exp_avg_sq_dtype has nothing to store

    def check(self, values: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
        return check_lion(values, where, prefix)

    def group_defaults(self, config: HparamsSource) -> dict[str, Any]:
        return with_adamw_fallbacks(dataclasses.asdict(config.hparams_of("lion")), config)

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        momentum_readout(group)

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        state = ctx.state
        for p in params:
            if "exp_avg" not in state[p]:
                dtype = state_dtype(ctx, "exp_avg_dtype", p)
                state[p]["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        momentum_readout(group)
        lion_(
            params,
            grads,
            [state[p]["exp_avg"] for p in params],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
        )


LION = register_algorithm(Lion())
