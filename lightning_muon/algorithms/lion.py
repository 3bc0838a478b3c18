"""``"lion"`` groups: Lion (sign of an interpolated momentum) with decoupled weight decay.

Per parameter with gradient ``g`` and momentum ``m``::

    W <- W (1 - lr wd) - lr sign(b1 m + (1 - b1) g)
    m <- b2 m + (1 - b2) g

State per parameter: ``exp_avg`` (stored in ``exp_avg_dtype``). Lion usually wants 3-10x less lr
than AdamW; its settings default to the scalar family's (lr 3e-4, no weight decay).

References:
    Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675, 2023.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_muon.algorithms.adamw import momentum_readout, sync_beta1
from lightning_muon.algorithms.base import Algorithm, StepContext, group_lr, register_algorithm
from lightning_muon.algorithms.families import Betas, ScalarSettings, checked_betas
from lightning_muon.algorithms.state_dtypes import STATE_SETTINGS, state_dtype
from lightning_muon.functional import foreach_pays, is_narrower, store_widened, widened, widening_chunks

__all__ = ["LION", "Lion", "LionSettings", "lion_"]


def lion_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion (Chen et al. 2023, arXiv 2302.06675) with decoupled weight decay.

    ``W <- W (1 - lr wd) - lr sign(b1 m + (1 - b1) g)``, then ``m <- b2 m + (1 - b2) g``.
    A momentum stored narrower than its parameter (``exp_avg_dtype``) is read into its dtype,
    used and updated there, and rounded once on its way back.
    """
    if is_narrower(exp_avgs, params):
        for part in widening_chunks(params):
            work = widened(exp_avgs[part], params[part])
            lion_(params[part], grads[part], work, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
            store_widened(exp_avgs[part], work)
        return
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    if exp_avgs and foreach_pays(exp_avgs[0]):
        direction = list(torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1))
    else:
        direction = [m.lerp(g, 1.0 - beta1) for m, g in zip(exp_avgs, grads)]
    torch._foreach_sign_(direction)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)


@dataclass(frozen=True, kw_only=True)
class LionSettings(ScalarSettings, algorithm="lion"):
    """Lion groups: Chen et al. with decoupled weight decay (its lr usually 3-10x below AdamW's)."""

    betas: Betas = (0.9, 0.99)
    """(beta1, beta2): the update's interpolation and the momentum's decay, each in [0, 1)."""

    def normalize(self) -> None:
        self._set("betas", checked_betas(self, self.betas))


class Lion(Algorithm):
    """``"lion"``: Lion with decoupled weight decay."""

    name = "lion"
    settings = LionSettings
    state_dtype_settings = frozenset(STATE_SETTINGS)  # no second moment: exp_avg_sq_dtype has nothing to store

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        momentum_readout(group)

    def init_state(self, ctx: StepContext, group: dict[str, Any], params: list[Tensor]) -> None:
        state = ctx.state
        for p in params:
            if "exp_avg" not in state[p]:
                dtype = state_dtype(ctx, "exp_avg_dtype", p)
                state[p]["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        state = ctx.state
        self.init_state(ctx, group, params)
        sync_beta1(ctx, group)  # a scheduler or a user may have moved beta1 since
        beta1, beta2 = group["betas"]
        lion_(
            params,
            grads,
            [state[p]["exp_avg"] for p in params],
            lr=group_lr(group),
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
        )


LION = register_algorithm(Lion())
