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
from lightning_muon.functional import is_narrower, store_widened, widened, widening_chunks

__all__ = ["ADAMW", "AdamW", "AdamWSettings", "adamw_", "momentum_readout", "sync_beta1"]


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW (Loshchilov & Hutter, arXiv 1711.05101), op for op as torch.optim.AdamW's foreach path.

    Moments stored narrower than their parameter (``exp_avg_dtype``, ``exp_avg_sq_dtype``)
    are read into its dtype, updated and used there, and rounded once on their way back.
    """
    if is_narrower(exp_avgs, params) or is_narrower(exp_avg_sqs, params):
        for part in widening_chunks(params):
            avgs, sqs = widened(exp_avgs[part], params[part]), widened(exp_avg_sqs[part], params[part])
            adamw_(
                params[part], grads[part], avgs, sqs, steps[part],
                lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            )  # fmt: skip
            store_widened(exp_avgs[part], avgs)
            store_widened(exp_avg_sqs[part], sqs)
        return
    torch._foreach_add_(steps, 1.0)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    if torch.compiler.is_compiling():  # the bias corrections on the device: no sync, no graph break
        _adamw_update_on_device(params, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps)
        return
    counts = [s.item() for s in steps]
    step_size = [(lr / (1.0 - beta1**n)) * -1.0 for n in counts]
    bias_correction2_sqrt = [(1.0 - beta2**n) ** 0.5 for n in counts]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def _adamw_update_on_device(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """``adamw_``'s update from its moments, with the step counts read on the device (the compiled step's form)."""
    step_size = torch._foreach_pow(beta1, steps)  # beta1^n
    torch._foreach_sub_(step_size, 1.0)  # -(1 - beta1^n)
    torch._foreach_div_(step_size, lr)
    torch._foreach_reciprocal_(step_size)  # -lr / (1 - beta1^n)
    bias_correction2_sqrt = torch._foreach_pow(beta2, steps)
    torch._foreach_neg_(bias_correction2_sqrt)
    torch._foreach_add_(bias_correction2_sqrt, 1.0)
    torch._foreach_sqrt_(bias_correction2_sqrt)  # sqrt(1 - beta2^n)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(denom, step_size)  # p + m / (denom / step_size) = p + step_size m / denom
    torch._foreach_addcdiv_(params, exp_avgs, denom)


@dataclass(frozen=True, kw_only=True)
class AdamWSettings(AdamLikeSettings, algorithm="adamw"):
    """AdamW groups, as ``torch.optim.AdamW`` (``Muon``'s ``adamw_*`` keywords)."""


def momentum_readout(group: dict[str, Any]) -> None:
    """A copy of beta1 in ``group["momentum"]``: loggers (LearningRateMonitor) read that key from every group."""
    group["momentum"] = group["betas"][0]


def sync_beta1(ctx: StepContext, group: dict[str, Any]) -> None:
    """``group["betas"][0]`` and its copy ``group["momentum"]`` made one value again before a step.

    The one changed since the group's last step wins: ``momentum`` where a scheduler that
    cycles momentum wrote it (OneCycleLR, CyclicLR: the optimizer's defaults name
    ``momentum``, so they write that key in every group, where torch.optim.AdamW's get
    ``betas``), ``betas`` where a user or a tool set them. With no step recorded (the first,
    or the first after ``load_state_dict``), a ``momentum`` unlike beta1 was written since
    the group was made (``momentum_readout`` made them equal).
    """
    beta1, beta2 = group["betas"]
    momentum = group.get("momentum", beta1)
    if momentum != beta1 and momentum != ctx.beta1s.get(id(group)):
        group["betas"] = (momentum, beta2)
    else:
        group["momentum"] = beta1
    ctx.beta1s[id(group)] = group["momentum"]


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

    rule = staticmethod(adamw_)
    """The update over lists of tensors, with the moments: ``rule(params, grads, exp_avgs, exp_avg_sqs, steps, *,
    lr, beta1, beta2, eps, weight_decay, **rule_options(group))``."""

    def rule_options(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group's keywords ``rule`` takes beyond Adam's (none for AdamW; LaProp's flags)."""
        return {}

    def init_state(self, ctx: StepContext, group: dict[str, Any], params: list[Tensor]) -> None:
        adam_moments(ctx, params)

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        """Step ``params`` with ``grads``; of ``ctx`` only ``state`` and ``config`` (the state dtypes) are used."""
        sync_beta1(ctx, group)  # a scheduler or a user may have moved beta1 since
        beta1, beta2 = group["betas"]
        self.rule(
            params,
            grads,
            *adam_moments(ctx, params),
            lr=group_lr(group),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            **self.rule_options(group),
        )


ADAMW = register_algorithm(AdamW())
