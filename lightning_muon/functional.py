"""Pure update rules behind ``Muon``: Muon momentum and apply, AdamW, Lion.

The optimizer class collects tensors and state; these functions do the math on
lists of tensors with ``torch._foreach_*`` kernels. The distributed strategies
reuse the same pieces on whatever matrices their rank owns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_muon.newton_schulz import orthogonalize_many

__all__ = [
    "ADJUST_LR_ALIASES",
    "ADJUST_LR_MODES",
    "adamw_",
    "adjust_lr_ratio",
    "lion_",
    "matrix_views",
    "muon_apply_",
    "muon_momentum_",
    "muon_orthogonalize",
]

# Update scale per matrix shape (rows, cols), times ``extra_scale_factor``.
ADJUST_LR_MODES = {
    # Keller Jordan / torch.optim.Muon: keep the RMS-to-RMS operator norm per unit lr.
    "original": lambda r, c: math.sqrt(max(1.0, r / c)),
    # Moonlight (Liu et al. 2025, arXiv 2502.16982): match AdamW's update RMS of ~0.2.
    "match_rms_adamw": lambda r, c: 0.2 * math.sqrt(max(r, c)),
    # Megatron's "spectral": sqrt(max(r, c)); with extra_scale_factor 0.2 it is Moonlight's.
    "spectral": lambda r, c: math.sqrt(max(r, c)),
    # Unit RMS-to-RMS spectral norm (Bernstein & Newhouse 2024): sqrt(fan_out / fan_in).
    "spectral_norm": lambda r, c: math.sqrt(r / c),
    "none": lambda r, c: 1.0,
}
# Megatron-Core scale_mode names.
ADJUST_LR_ALIASES = {"shape_scaling": "original", "unit_rms_norm": "spectral_norm"}


def adjust_lr_ratio(mode: str, rows: int, cols: int, extra_scale_factor: float = 1.0) -> float:
    """The factor multiplying the Muon lr for a rows x cols matrix."""
    mode = ADJUST_LR_ALIASES.get(mode, mode)
    return ADJUST_LR_MODES[mode](rows, cols) * extra_scale_factor


def matrix_views(t: Tensor, split_sizes: Sequence[int] | None = None, batched: bool = False) -> list[Tensor]:
    """Views of a contiguous tensor as the matrices Muon orthogonalizes.

    - ``batched``: a (..., rows, cols) tensor is one batch of matrices (MoE experts).
    - otherwise the tensor is flattened to (dim 0, rest) (convs: (out, in * kh * kw)),
      then split along dim 0 by ``split_sizes`` when given (fused QKV).
    """
    if batched:
        return [t.view(-1, *t.shape[-2:])]
    flat = t.view(t.shape[0], -1)
    if split_sizes:
        return list(flat.split(list(split_sizes), dim=0))
    return [flat]


def muon_momentum_(grads: list[Tensor], bufs: list[Tensor], momentum: float, nesterov: bool) -> list[Tensor]:
    """EMA momentum ``B <- mu B + (1 - mu) G``; returns the tensors to orthogonalize.

    With Nesterov the update is ``(1 - mu) G + mu B`` (``G.lerp(B, mu)``), else ``B``.
    """
    torch._foreach_lerp_(bufs, grads, 1.0 - momentum)
    if nesterov:
        return list(torch._foreach_lerp(grads, bufs, momentum))
    return list(bufs)


def muon_orthogonalize(
    updates: list[Tensor],
    *,
    ns_steps: int,
    ns_coefficients,
    ns_dtype,
    split_sizes: Sequence[int] | None,
    batched: bool,
) -> list[list[Tensor]]:
    """Orthogonalize every update's matrices; returns, per update, its list of pieces."""
    pieces = [matrix_views(u.contiguous(), split_sizes, batched) for u in updates]
    flat = [m for ms in pieces for m in ms]
    ortho = iter(orthogonalize_many(flat, ns_steps, ns_coefficients, ns_dtype))
    return [[next(ortho) for _ in ms] for ms in pieces]


def muon_apply_(
    params: list[Tensor],
    ortho: list[list[Tensor]],
    *,
    lr: float,
    weight_decay: float,
    adjust_lr: str,
    extra_scale_factor: float,
    split_sizes: Sequence[int] | None,
    batched: bool,
) -> None:
    """``W <- W (1 - lr wd) - lr * adjust(shape) * O`` for every matrix piece."""
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    targets, deltas, scales = [], [], []
    for p, pieces in zip(params, ortho):
        views = matrix_views(p, split_sizes, batched) if p.is_contiguous() else None
        if views is None:  # a non-contiguous param: apply through a contiguous delta
            delta = torch.empty_like(p, memory_format=torch.contiguous_format)
            for v, o in zip(matrix_views(delta, split_sizes, batched), pieces):
                v.copy_(o).mul_(-lr * adjust_lr_ratio(adjust_lr, *o.shape[-2:], extra_scale_factor))
            p.add_(delta)
            continue
        for v, o in zip(views, pieces):
            targets.append(v)
            deltas.append(o)
            scales.append(-lr * adjust_lr_ratio(adjust_lr, *o.shape[-2:], extra_scale_factor))
    if targets:
        torch._foreach_mul_(deltas, scales)
        torch._foreach_add_(targets, deltas)


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
    """AdamW (Loshchilov & Hutter, arXiv 1711.05101), op for op as torch.optim.AdamW's foreach path."""
    torch._foreach_add_(steps, 1.0)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    counts = [s.item() for s in steps]
    step_size = [(lr / (1.0 - beta1**n)) * -1.0 for n in counts]
    bias_correction2_sqrt = [(1.0 - beta2**n) ** 0.5 for n in counts]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


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
    """
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(direction)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
