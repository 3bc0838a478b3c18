r"""QK-clip's math: per-head factors from the maxima, and their application to Q and K weights.

For query head ``h`` with largest logit ``S_h`` and threshold ``tau``::

    eta_h = tau / S_h  if S_h > tau  else 1
    W_q[h] <- eta_h^alpha W_q[h]          W_k[h] <- eta_h^(1 - alpha) W_k[h]

so that head's logits ``q . k`` scale by exactly ``eta_h`` and its maximum lands on
``tau``; heads under ``tau`` get factors of exactly 1 (their weights are multiplied by
1.0, which leaves every bit in place). Biases of Q and K are scaled with their head's
rows, so ``q = W x + b`` scales exactly too.

Grouped-query attention: key head ``g`` serves the query heads ``g r ... g r + r - 1``
(``r = H / G``). It takes the *smallest* eta of its group::

    W_k[g] <- (min_{h in g} eta_h)^(1 - alpha) W_k[g]

Why the smallest: a shared key scales every logit of its group, and head ``h``'s logits
end up scaled by ``eta_h^alpha * eta_k^(1 - alpha)``; that is at most ``eta_h`` (so the
head lands at or under ``tau``) for every clipped head of the group exactly when
``eta_k <= eta_h`` for all of them, i.e. ``eta_k <= min eta_h``. Taking the minimum
itself shrinks nothing more than that bound requires. The price: the group's other
query heads (their own Q untouched) see their logits shrink by
``(min eta)^(1 - alpha)`` too, which can only move them further under ``tau``.

References:
    Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, 2025 (MuonClip,
    per-head QK-clip).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_muon.attention.maxima import QKHeads

__all__ = ["apply_qk_clip", "clip_factors", "output_factors"]


def clip_factors(max_logits: Tensor, threshold: float, alpha: float, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """Per-head factors ``(eta^alpha (H,), (min eta of each key head's group)^(1 - alpha) (G,))``.

    ``max_logits`` is ``(H,)``; a head at or under ``threshold`` (or NaN, or ``-inf`` for a
    head that saw no position) gets ``eta = 1``, hence factors of exactly 1.
    """
    H = max_logits.numel()
    if H % num_kv_heads:
        raise ValueError(f"clip_factors: {H} query heads is not a multiple of num_kv_heads={num_kv_heads}")
    eta = torch.where(max_logits > threshold, threshold / max_logits, torch.ones_like(max_logits))  # (H,)
    q = eta.pow(alpha)  # (H,)
    k = eta.view(num_kv_heads, H // num_kv_heads).amin(dim=1).pow(1.0 - alpha)  # (G,)
    return q, k


def output_factors(heads: QKHeads, q: Tensor, k: Tensor) -> list[tuple[Tensor, Tensor | None, Tensor]]:
    """``(weight, bias, factors along its output axis)`` for the one or two parameters of ``heads``.

    ``q`` ``(H,)`` and ``k`` ``(G,)`` are per-head factors; every output row (column when
    transposed) outside the Q and K blocks (V, other heads) gets exactly 1.
    """
    axis = 1 if heads.transposed else 0
    d = heads.head_dim

    def fill(vector: Tensor, offset: int, per_head: Tensor) -> None:
        vector[offset : offset + per_head.numel() * d] = per_head.repeat_interleave(d)

    if heads.q_weight is heads.k_weight:
        if heads.q_bias is not heads.k_bias:
            raise ValueError("QKHeads: a fused Q/K weight must name one bias for both (or None for both)")
        vector = torch.ones(heads.q_weight.shape[axis], device=q.device)
        fill(vector, heads.q_offset, q)
        fill(vector, heads.k_offset, k)
        return [(heads.q_weight, heads.q_bias, vector)]
    out = []
    for weight, bias, offset, per_head in (
        (heads.q_weight, heads.q_bias, heads.q_offset, q),
        (heads.k_weight, heads.k_bias, heads.k_offset, k),
    ):
        vector = torch.ones(weight.shape[axis], device=q.device)
        fill(vector, offset, per_head)
        out.append((weight, bias, vector))
    return out


def _mul_(param: Tensor, factor: Tensor) -> None:
    """``param *= factor`` (broadcast), on a plain tensor or on this rank's shards of a DTensor.

    For a DTensor the factor is laid out like the parameter: sharded along the dims the
    parameter is sharded on (each rank keeps the rows or columns of its own shard; under
    tensor parallelism, its own heads) and replicated along a broadcast dim. Every rank
    holds the same full factor, so ``src_data_rank=None`` cuts it locally: no communication.
    """
    factor = factor.to(dtype=param.dtype, device=param.device)
    if isinstance(param, DTensor):
        placements = [
            Replicate() if p.is_shard() and factor.shape[p.dim] == 1 else p  # type: ignore[attr-defined]
            for p in param.placements
        ]
        factor = distribute_tensor(factor, param.device_mesh, placements, src_data_rank=None)
    param.mul_(factor)


@torch.no_grad()
def apply_qk_clip(heads: QKHeads, q: Tensor, k: Tensor) -> None:
    """Scale the Q heads of ``heads`` by ``q`` ``(H,)`` and its K heads by ``k`` ``(G,)``, in place.

    Plain tensors (one process, ``muon_ddp`` replicas: every rank applies the same factors)
    and DTensors (``muon_fsdp``: each rank scales its own shard) alike.
    """
    for weight, bias, vector in output_factors(heads, q, k):
        _mul_(weight, vector.view(1, -1) if heads.transposed else vector.view(-1, 1))
        if bias is not None:
            _mul_(bias, vector)
