"""AdamW and Lion param groups of ``Muon``: elementwise rules over this optimizer's state."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_muon.functional import adamw_, lion_

__all__ = ["ElementwiseGroups"]


class ElementwiseGroups:
    """The step of ``"adamw"`` groups (as ``torch.optim.AdamW``) and ``"lion"`` groups (Chen et al.), a mixin.

    Each also writes ``beta1`` to the group's ``"momentum"``: loggers (LearningRateMonitor)
    read that entry from every group.
    """

    state: Any

    def _adamw_step(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        group["momentum"] = beta1
        adamw_(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    def _lion_step(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in params:
            if "exp_avg" not in self.state[p]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        group["momentum"] = beta1
        lion_(
            params,
            grads,
            [self.state[p]["exp_avg"] for p in params],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
        )
