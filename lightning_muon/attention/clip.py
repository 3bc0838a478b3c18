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

Tensor parallelism: a rank whose Q projection is split by heads (``ColwiseParallel``)
runs attention for its own heads only and records ``H_local < H`` maxima.
:func:`global_head_maxima` places them at the rank's first head (``-inf`` elsewhere), so a
MAX all-reduce over every rank yields the ``(H,)`` maxima of the whole model; the factors
above are then computed for all heads, and each rank scales the rows of its own shards.

References:
    Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, 2025 (MuonClip,
    per-head QK-clip).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_muon.attention.maxima import QKHeads

__all__ = ["apply_qk_clip", "clip_factors", "global_head_maxima", "output_factors"]


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


def global_head_maxima(max_logits: Tensor, heads: QKHeads, name: str = "attention") -> Tensor:
    """The ``(H,)`` maxima of all query heads, from the ``(H_local,)`` a tensor-parallel rank recorded.

    ``max_logits`` itself when it has ``heads.num_heads`` entries. Shorter, it holds this
    rank's heads only: ``heads.q_weight`` must be a DTensor split along its output axis on
    one mesh dim (plain ``Shard``, as ``ColwiseParallel`` does; FSDP2's ``_StridedShard``
    on the data dim is gathered for the forward and does not count). ``Shard`` cuts like
    ``torch.chunk``: with ``R`` output rows in ``n`` parts, coordinate ``c`` holds rows
    ``c * ceil(R / n) ...``, which must be ``H_local`` whole heads of the Q block::

        first = (c * ceil(R / n) - q_offset) / head_dim
        out[first : first + H_local] = max_logits,   out[other heads] = -inf

    ``-inf`` is the MAX all-reduce's identity (and a head at ``-inf`` is never clipped), so
    reducing over every rank fills each head from the ranks that ran it.

    Raises:
        ValueError: naming ``name``, when the length or the layout does not tell which
            heads these are: more maxima than heads, a fused Q/K weight (its column shards
            mix Q, K and V rows), a Q weight that is not split on exactly one mesh dim, or a
            shard that is not ``H_local`` whole heads.
    """
    H, local = heads.num_heads, max_logits.numel()
    if local == H:
        return max_logits
    weight = heads.q_weight
    where = f"QKClip: attention {name!r} recorded {local} maxima for its {H} query heads"
    if local > H or local == 0:
        raise ValueError(f"{where}; record one per query head (shape (num_heads,))")
    if weight is heads.k_weight:
        raise ValueError(
            f"{where}: a fused Q/K weight under tensor parallelism is not supported (its column shards mix Q, K "
            "and V rows); split it into separate q and k projections"
        )
    axis = 1 if heads.transposed else 0
    placements = tuple(weight.placements) if isinstance(weight, DTensor) else ()
    split = [
        i
        for i, p in enumerate(placements)
        if isinstance(p, Shard)
        and not isinstance(p, _StridedShard)
        and p.dim == axis
        and weight.device_mesh.size(i) > 1
    ]
    if len(split) != 1:
        raise ValueError(
            f"{where}, so they must be this rank's heads of a q_weight split along its output axis (dim {axis}) on "
            f"one mesh dim (ColwiseParallel); q_weight is {f'placed {placements}' if placements else 'not a DTensor'}"
        )
    # Shard cuts like torch.chunk: parts of ceil(rows / parts) rows, the last ones shorter or empty.
    rows, parts = weight.shape[axis], weight.device_mesh.size(split[0])
    chunk = math.ceil(rows / parts)
    start = min(rows, weight.device_mesh.get_local_rank(split[0]) * chunk)
    held = min(rows, start + chunk) - start
    first, off_head = divmod(start - heads.q_offset, heads.head_dim)
    if held != local * heads.head_dim or off_head or not 0 <= first <= H - local:
        raise ValueError(
            f"{where}, but this rank's shard of q_weight is its rows {start}..{start + held - 1} of {rows}: not "
            f"{local} whole heads of head_dim {heads.head_dim} from q_offset {heads.q_offset}"
        )
    out = torch.full((H,), float("-inf"), dtype=max_logits.dtype, device=max_logits.device)
    out[first : first + local] = max_logits
    return out


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
