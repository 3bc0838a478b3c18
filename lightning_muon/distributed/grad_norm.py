"""The global gradient norm when no rank holds every gradient whole, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` takes the norm of the tensors it is given. Under
``muon_ddp`` a Muon gradient lives on its owner only (each owner group holds it once), under
FSDP2 every rank holds a row block, and under tensor parallelism a block of a block, while
AdamW gradients are whole on every rank. One rule covers them all: each rank sums
``|g|^p`` over its local pieces, each divided by the number of ranks of the reducing group
that hold the very same values (``copies``), and one all-reduce gives the global sum::

    total^p = sum over ranks r, pieces g on r of |g|^p / copies(g)         (one all-reduce, SUM)
    total   = max over ranks r, pieces g on r of max |g|                    (p = inf: MAX)

so each value counts once, whatever the layout, for the price of one small all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.distributed.comm import CommStats, all_reduce_

__all__ = ["clip_by_total_norm_", "global_grad_norm"]


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return norm_type


@torch.no_grad()
def global_grad_norm(
    pieces: Sequence[tuple[Tensor, int]],
    norm_type: float = 2.0,
    *,
    device: torch.device,
    group=None,
    stats: CommStats | None = None,
    replicated: bool = False,
) -> Tensor:
    """The ``norm_type``-norm of every gradient of every rank of ``group``, on every rank alike.

    Args:
        pieces: ``(local values, copies)``: a plain tensor (a gradient or the local part of a
            sharded one) and how many ranks of ``group`` hold these same values (the group's
            size for a replicated gradient).
        norm_type: p of the p-norm; ``math.inf`` for the largest absolute value.
        device: where the (float32) sum lives: the rank's device (NCCL needs a CUDA tensor).
        group: the ranks to reduce over (None: the world); with one rank nothing is sent.
        stats: counts the all-reduce as ``"clip_norm"``.
        replicated: every rank holds every gradient whole (say so on every rank alike): the
            norm is taken locally, with nothing sent.
    """
    p = _check_norm_type(norm_type)
    distributed = dist.is_available() and dist.is_initialized() and not replicated
    world = dist.get_world_size(group) if distributed else 1
    # (sent, kept): values some ranks lack are reduced; values every rank holds are added
    # afterwards, exactly as one process would (no division by the world and back).
    sums = torch.zeros(2, dtype=torch.float32, device=device)
    for local, copies in pieces:
        if not local.numel():
            continue
        values = local.detach().float()
        k = 1 if copies >= world else 0
        if p == math.inf:
            sums[k] = torch.maximum(sums[k], values.abs().max().to(device))
        else:
            sums[k] += values.abs().pow(p).sum().to(device) / (1 if k else copies)
    sent = sums[:1].clone()
    if world > 1:
        all_reduce_(sent, dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM, group, stats, name="clip_norm")
    if p == math.inf:
        return torch.maximum(sent[0], sums[1])
    return (sent[0] + sums[1]).pow(1.0 / p)


@torch.no_grad()
def clip_by_total_norm_(
    grads: Sequence[Tensor], total_norm: Tensor, max_norm: float, norm_type: float = 2.0, error_if_nonfinite=False
) -> Tensor:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``, as ``clip_grad_norm_``; returns the norm.

    ``total_norm`` is the same on every rank (``global_grad_norm``), so every rank scales
    alike, and with ``error_if_nonfinite`` every rank raises alike. A DTensor gradient is
    scaled through its local tensor (no communication).
    """
    if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, pass "
            "error_if_nonfinite=False"
        )
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        local.mul_(coef.to(local.device))
    return total_norm
