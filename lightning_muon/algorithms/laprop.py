"""``"laprop"`` groups: LaProp (momentum of the RMS-normalized gradient) for the parameters Muon does not orthogonalize.

The hyperparameters and the step are NVIDIA Emerging-Optimizers' ``LaProp`` (0.3.0): its
defaults, its bias correction, its four weight decay methods and
its optional Frobenius-norm preservation. The rule is on ``LaProp``; ``laprop_`` is the
math over lists of tensors, ``LaProp.step_group`` collects them and the state.

State per parameter: ``step`` (a 0-D tensor), ``exp_avg``, ``exp_avg_sq`` (stored in
``exp_avg_dtype`` and ``exp_avg_sq_dtype``, computed in float32 at least: ``state_dtypes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_muon.algorithms.adamw import AdamW
from lightning_muon.algorithms.base import register_algorithm
from lightning_muon.algorithms.families import UNSIGNED_DECAY_METHODS, AdamLikeSettings, WeightDecayMethod
from lightning_muon.algorithms.settings import setting
from lightning_muon.functional import decay_weights_, widening_chunks

__all__ = [
    "LAPROP",
    "LaProp",
    "LaPropSettings",
    "laprop_",
]


@dataclass(frozen=True, kw_only=True)
class LaPropSettings(AdamLikeSettings, algorithm="laprop", defaults={"lr": 1e-3, "betas": (0.9, 0.999)}):
    """LaProp groups, Emerging-Optimizers' defaults."""

    eps: float = setting(1e-8, low=0.0)
    """Added to the root of the second moment; >= 0 (Emerging-Optimizers allows 0, unlike Adam's)."""
    correct_bias: bool = True
    """Divide both EMAs by 1 - beta ** step (Adam's bias correction); False uses them as they are."""
    frob_normalize: bool = False
    """After each step, scale each parameter back to the Frobenius norm it had before; meant for weight_decay=0."""
    weight_decay_method: WeightDecayMethod = "decoupled"
    """"decoupled" W (1 - lr wd), "independent" W (1 - wd), "l2" g + wd W, "palm" W (1 - lr^2 wd)."""

    choices: ClassVar[dict[str, tuple]] = {"weight_decay_method": UNSIGNED_DECAY_METHODS}


def laprop_(
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
    weight_decay_method: str,
    correct_bias: bool,
    frob_normalize: bool,
) -> None:
    """One LaProp step over every parameter (``LaProp``'s rule), the moments and ``steps`` updated in place.

    The math runs in float32 at least: a bf16 parameter, gradient or moment (``exp_avg_dtype``,
    ``exp_avg_sq_dtype``) is read into float32, updated there and rounded once on its way back,
    a part at a time (``functional.widening_chunks``). ``grads`` are not modified ("l2" adds the decay to a copy).
    """
    work = [torch.promote_types(p.dtype, torch.float32) for p in params]
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if any(t.dtype != w for ts in lists for t, w in zip(ts, work)):
        for part in widening_chunks(params):
            # ``Tensor.to`` returns the tensor itself where it already is in the work dtype.
            wide = [[t.to(w) for t, w in zip(ts[part], work[part])] for ts in lists]
            laprop_(
                *wide, steps[part], lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                weight_decay_method=weight_decay_method, correct_bias=correct_bias, frob_normalize=frob_normalize,
            )  # fmt: skip
            for stored, updated in ((params, wide[0]), (exp_avgs, wide[2]), (exp_avg_sqs, wide[3])):
                for t, w in zip(stored[part], updated):
                    if w is not t:
                        t.copy_(w)  # rounded once, to nearest even
        return
    torch._foreach_add_(steps, 1.0)
    counts = [s.item() for s in steps]  # a parameter that skipped steps has its own count
    pre_norms = [torch.linalg.vector_norm(p) for p in params] if frob_normalize else []
    if weight_decay != 0.0 and weight_decay_method == "l2":
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    decay_weights_(params, lr, weight_decay, weight_decay_method, multiply_decoupled=False)
    bias1 = [1.0 - beta1**n if correct_bias else 1.0 for n in counts]
    bias2_sqrt = [math.sqrt(1.0 - beta2**n) if correct_bias else 1.0 for n in counts]
    # v <- beta2 v + (1 - beta2) g^2
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    # d = sqrt(v / (1 - beta2^t)) + eps;  m <- beta1 m + (1 - beta1) g / d
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_addcdiv_(exp_avgs, grads, denom, 1.0 - beta1)
    del denom  # the update below is the step's one other temporary
    # W <- W - lr m / (1 - beta1^t)
    update = torch._foreach_mul(exp_avgs, [-lr / b for b in bias1])
    torch._foreach_add_(params, update)
    del update
    for p, before in zip(params, pre_norms):
        # eps floors the divisor: a parameter stepped to zero stays zero rather than NaN (for eps > 0).
        p.mul_(before / torch.linalg.vector_norm(p).clamp_min(eps))


class LaProp(AdamW):
    """``"laprop"``: LaProp, Adam's two moments with the momentum taken of the normalized gradient.

    Per parameter ``W`` with gradient ``g``, at step ``t`` (counted from 1), with
    ``c1 = 1 - beta1^t`` and ``c2 = 1 - beta2^t`` (both 1 when ``correct_bias=False``)::

        r = ||W||_F                                   # frob_normalize only
        W <- W (1 - lr wd)                            # "decoupled"; "independent": W (1 - wd),
                                                      # "palm": W (1 - lr^2 wd), "l2": g <- g + wd W
        v <- beta2 v + (1 - beta2) g^2
        m <- beta1 m + (1 - beta1) g / (sqrt(v / c2) + eps)
        W <- W - lr m / c1
        W <- W r / max(||W||_F, eps)                  # frob_normalize only

    Unlike Adam, the gradient is divided by its RMS before it enters the momentum, not after:
    the paper's point is that this frees beta1 from beta2 (any pair in [0, 1) is stable).

    References:
        Ziyin, Wang, Ueda, "LaProp: Separating Momentum and Adaptivity in Adam",
        arXiv 2002.04839, 2020.
    """

    name = "laprop"
    settings = LaPropSettings

    rule = staticmethod(laprop_)

    def rule_options(self, group: dict[str, Any]) -> dict[str, Any]:
        return {key: group[key] for key in ("weight_decay_method", "correct_bias", "frob_normalize")}


LAPROP = register_algorithm(LaProp())
