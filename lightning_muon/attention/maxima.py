"""Per-head maximum attention logits: the measurement QK-clip acts on, and the protocol behind it.

QK-clip (MuonClip) needs, for every attention head ``h``, the largest pre-softmax logit
of the step's forward pass::

    S_max[h] = max over batch b, query i, allowed key j of  scale * <q[b, h, i], k[b, g(h), j]>

(``g(h)`` the key head of query head ``h``: ``h // (H / G)`` with ``H`` query and ``G``
key heads, ``g(h) = h`` without GQA). Masked positions (causal future, padding) do not
count; additive biases (ALiBi, soft-capping) are not part of ``q . k`` and are left out,
since clipping scales ``q . k`` alone.

The protocol, for any attention module:

- ``qk_clip_heads()`` returns a :class:`QKHeads`: which parameters are Q and K, where
  their blocks sit, how many query and key heads there are, and the weight layout;
- its forward calls :func:`record_max_logits` with the ``(H,)`` maxima while
  ``module.qk_clip_recording`` is true (the callback sets it), or calls this module's
  :func:`scaled_dot_product_attention` / :func:`flex_attention` with ``module=self``,
  which do that for it. The maxima accumulate (a running MAX over micro-batches) in
  ``module.qk_clip_max_logits`` until the callback reads and clears them.
  :func:`record_head_max_logits` (what the SDPA drop-in calls) also honours
  ``module.qk_clip_exact_above``: on the steps whose values are not logged the callback
  sets it to its threshold, and a layer whose every head is bounded under it by the norms
  of q and k records those bounds instead of running ``Q K^T`` (none can be clipped).
- ``QKClip(cap_forward=True)`` also sets ``module.qk_clip_cap`` (its threshold): the
  forward then passes its queries through :func:`capped_query` with the maxima it just
  recorded, so that no head's logit above the threshold reaches the softmax. The SDPA
  drop-in and the transformers function do; a module that records through
  :func:`record_max_logits` itself must too (the callback checks that it did).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "QKClipAttention",
    "QKHeads",
    "capped_query",
    "flex_attention",
    "head_max_logits",
    "is_recording",
    "record_head_max_logits",
    "record_max_logits",
    "scaled_dot_product_attention",
]

# Scores materialized at once by head_max_logits: 2^24 floats (64 MiB in fp32). Longer
# sequences are measured in query blocks so the extra memory stays bounded.
_MAX_SCORE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class QKHeads:
    """Where one attention module's query and key heads live in its parameters.

    Head ``h`` of Q is the ``head_dim`` output rows ``q_offset + h * head_dim ...`` of
    ``q_weight`` (output columns when ``transposed``), and the same entries of ``q_bias``;
    likewise for K with ``k_offset``. A fused QKV projection names one parameter for both,
    with the K block's offset (the demo GPT's ``qkv``: ``k_offset = d``; GPT-2's ``c_attn``:
    the same, ``transposed=True``).
    """

    q_weight: Tensor
    """Parameter holding the query projection (output rows, or columns when transposed)."""
    k_weight: Tensor
    """Parameter holding the key projection; may be ``q_weight`` itself (fused QKV)."""
    num_heads: int
    """Query heads ``H``: the length of the recorded maxima."""
    num_kv_heads: int
    """Key heads ``G``; ``H`` must be a multiple (GQA: each key head serves ``H / G`` query heads)."""
    head_dim: int
    """Rows (columns when transposed) per head in both projections."""
    q_bias: Tensor | None = None
    """Bias of the query projection (scaled with its head's rows so ``q`` scales exactly), or None."""
    k_bias: Tensor | None = None
    """Bias of the key projection, or None."""
    q_offset: int = 0
    """First output row of the Q block in ``q_weight``."""
    k_offset: int = 0
    """First output row of the K block in ``k_weight``."""
    transposed: bool = False
    """True for weights stored ``(fan_in, fan_out)`` (transformers' ``Conv1D``): heads are columns."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "q_offset", "k_offset"):
            value = getattr(self, name)
            minimum = 0 if name.endswith("offset") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"QKHeads.{name} must be an int >= {minimum}, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"QKHeads.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        axis = 1 if self.transposed else 0
        for which, weight, bias, offset, heads in (
            ("q", self.q_weight, self.q_bias, self.q_offset, self.num_heads),
            ("k", self.k_weight, self.k_bias, self.k_offset, self.num_kv_heads),
        ):
            if weight.ndim != 2:
                raise ValueError(f"QKHeads.{which}_weight must be a matrix, got shape {tuple(weight.shape)}")
            end = offset + heads * self.head_dim
            if end > weight.shape[axis]:
                raise ValueError(
                    f"QKHeads: {heads} {which} heads of {self.head_dim} from {which}_offset {offset} need {end} "
                    f"outputs, but {which}_weight {tuple(weight.shape)} has {weight.shape[axis]} along dim {axis}"
                    f" ({'(fan_in, fan_out)' if self.transposed else '(fan_out, fan_in)'} layout)"
                )
            if bias is not None and bias.shape != (weight.shape[axis],):
                raise ValueError(
                    f"QKHeads.{which}_bias has shape {tuple(bias.shape)}; expected ({weight.shape[axis]},)"
                )


@runtime_checkable
class QKClipAttention(Protocol):
    """An attention module QK-clip can act on (see the module docstring for the contract)."""

    def qk_clip_heads(self) -> QKHeads:
        """Its Q and K parameters and head layout, read at every clip (FSDP may replace parameters)."""
        ...


def is_recording(module: nn.Module | None) -> bool:
    """Whether ``module``'s forward should measure maxima now: the callback asked, and it is training."""
    return module is not None and module.training and bool(getattr(module, "qk_clip_recording", False))


@torch.no_grad()
def record_max_logits(module: nn.Module, max_logits: Tensor) -> None:
    """Fold ``max_logits`` ``(H,)`` into ``module.qk_clip_max_logits`` by a running maximum.

    Micro-batches of one optimizer step (gradient accumulation) and re-run forwards
    (activation checkpointing) fold into the same maximum; the callback clears it after
    each step.
    """
    max_logits = max_logits.detach().float()
    previous = getattr(module, "qk_clip_max_logits", None)
    module.qk_clip_max_logits = max_logits if previous is None else torch.maximum(previous, max_logits)


def record_head_max_logits(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    *,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    """:func:`head_max_logits` of one attention call, folded into ``module``'s maxima (:func:`record_max_logits`).

    Passes ``module.qk_clip_exact_above`` (set by the callback: its threshold on the steps
    whose values are not logged, None on the others) as ``exact_above``. Returns this
    call's ``(H,)`` maxima (for :func:`capped_query`).
    """
    exact_above = getattr(module, "qk_clip_exact_above", None)
    maxima = head_max_logits(query, key, scale=scale, attn_mask=attn_mask, is_causal=is_causal, exact_above=exact_above)
    record_max_logits(module, maxima)
    return maxima


def capped_query(module: nn.Module, query: Tensor, max_logits: Tensor) -> Tensor:
    """``query`` ``(..., H, T, d)`` with each head whose max logit exceeds ``module.qk_clip_cap`` scaled under it.

    Head ``h`` with ``max_logits[h] = S_h > cap`` has its queries multiplied by
    ``cap / S_h``, so its logits in this call scale by exactly that factor and their
    maximum lands on the cap (to the rounding of ``query``'s dtype); other heads are
    multiplied by exactly 1 (bitwise unchanged). The factor is a constant to autograd.
    ``query`` itself when the module has no cap (``QKClip(cap_forward=True)`` sets it).
    """
    cap = getattr(module, "qk_clip_cap", None)
    if cap is None:
        return query
    module.qk_clip_capped = True
    max_logits = max_logits.detach()
    eta = torch.where(max_logits > cap, cap / max_logits, torch.ones_like(max_logits))  # (H,); NaN: 1
    return query * eta.to(device=query.device, dtype=query.dtype).view(-1, 1, 1)


@torch.no_grad()
def head_max_logits(
    query: Tensor,
    key: Tensor,
    *,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    exact_above: float | None = None,
) -> Tensor:
    """Largest ``scale * q . k`` per query head over batch, queries and allowed keys; shape ``(H,)``.

    Args:
        query: ``(..., H, Tq, d)``.
        key: ``(..., G, Tk, d)`` with ``G`` dividing ``H`` (GQA keys are not repeated:
            query heads are viewed as ``(G, H / G)`` instead).
        scale: the softmax scale; default ``1 / sqrt(d)``, as SDPA's.
        attn_mask: broadcastable to ``(..., H, Tq, Tk)``: boolean (True = may attend) or
            additive float (positions at ``-inf`` or at most half the dtype's minimum are
            masked; other values are biases, left out of the maximum).
        is_causal: key ``j`` allowed for query ``i`` iff ``j <= i`` (SDPA's top-left
            alignment).
        exact_above: on a CPU, first bound every head's logits by Cauchy-Schwarz,
            ``scale * max_i |q_i| * max_j |k_j|`` (norms only); when no head's bound exceeds
            ``exact_above``, return the bounds instead of the maxima. QK-clip passes its
            threshold on the steps it does not log: a head whose bound is under it cannot be
            clipped, so only that decision is needed. Elsewhere (None, or a CUDA tensor, where
            reading the verdict would synchronize the host) the maxima are always computed.

    Returns:
        float32 ``(H,)``; ``-inf`` for a head whose every position is masked (or the
        bounds, each at most ``exact_above``: see there).

    Cost: the ``Q K^T`` product once more (``2 * B * H * Tq * Tk * d`` FLOPs, no backward)
    and one pass over the scores, in query blocks of at most 2^24 scores.
    """
    H, d, G = query.shape[-3], query.shape[-1], key.shape[-3]
    if H % G:
        raise ValueError(f"head_max_logits: query heads ({H}) must be a multiple of key heads ({G})")
    scale = d**-0.5 if scale is None else scale
    if exact_above is not None and query.device.type == "cpu":
        bound = _norm_bound(query, key, scale)
        if bool((bound <= exact_above).all()):  # NaN compares False: measured below
            return bound
    return _measured_maxima(query, key, scale, attn_mask, is_causal)


def _norm_bound(query: Tensor, key: Tensor, scale: float) -> Tensor:
    """``(H,)`` Cauchy-Schwarz bounds ``scale * max_i |q_i| * max_j |k_j|`` of every head's logits.

    Over every batch entry and position, masked or not (a larger set, so still a bound); a
    key head's longest key serves each query head of its group.
    """
    *_, H, Tq, d = query.shape
    G, Tk = key.shape[-3], key.shape[-2]
    q_longest = torch.linalg.vector_norm(query.reshape(-1, H, Tq, d), dim=-1).amax(dim=(0, 2))  # (H,)
    k_longest = torch.linalg.vector_norm(key.reshape(-1, G, Tk, d), dim=-1).amax(dim=(0, 2))  # (G,)
    return scale * q_longest.float() * k_longest.float().repeat_interleave(H // G)


def _measured_maxima(query: Tensor, key: Tensor, scale: float, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """:func:`head_max_logits` itself: ``Q K^T`` in query blocks, masked, reduced per head."""
    *batch, H, Tq, d = query.shape
    G, Tk = key.shape[-3], key.shape[-2]
    r = H // G
    q = query.reshape(-1, G, r, Tq, d)  # (B, G, r, Tq, d): the r query heads of each key head
    B = q.shape[0]
    kt = key.expand(*batch, G, Tk, d).reshape(B * G, Tk, d).transpose(1, 2)  # (B*G, d, Tk)
    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(*batch, H, Tq, Tk).reshape(B, G, r, Tq, Tk)
        if mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
    # Query blocks of t rows: one (B*G, r*t, k) batched product each, masked in place (no
    # second score-sized tensor), reduced at once: 4x faster than a broadcast 5-D matmul with
    # an out-of-place masked_fill (demo shapes, 1 CPU thread: 4.7 ms against 18.4 ms).
    # Causal: block b only needs keys 0 .. stop-1, so four blocks skip ~3/8 of Q K^T.
    block = max(1, _MAX_SCORE_ELEMENTS // max(1, B * H * Tk))
    if is_causal and attn_mask is None:
        block = min(block, max(16, -(-Tq // 4)))
    best = torch.full((G, r), float("-inf"), device=query.device)
    for start in range(0, Tq, block):
        stop = min(Tq, start + block)
        keys = min(Tk, stop) if is_causal else Tk  # causal: key j <= query i < stop
        qb = q[:, :, :, start:stop].reshape(B * G, r * (stop - start), d)  # (B*G, r*t, d)
        scores = torch.bmm(qb, kt[:, :, :keys]).view(B, G, r, stop - start, keys)  # (B, G, r, t, k)
        if is_causal and keys > start:
            # Keys before `start` are visible to every query of the block: mask only the
            # (t, keys - start) corner that reaches past the diagonal (a strided in-place fill).
            rows = torch.arange(start, stop, device=query.device)[:, None]
            cols = torch.arange(start, keys, device=query.device)[None, :]
            scores[..., start:].masked_fill_(cols > rows, float("-inf"))  # (t, keys - start)
        if mask is not None:
            scores.masked_fill_(~mask[..., start:stop, :keys], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).float())
    # The scale is positive, so it commutes with the max; applied once on (G, r) numbers.
    return (best * scale).reshape(H)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    module: nn.Module | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention``, which also records each head's max logit on ``module``.

    Same arguments and result as torch's function. When ``module`` is recording (a
    ``QKClip`` callback is attached and the module is in training mode), the per-head
    maxima of ``scale * q . k`` over the allowed positions (:func:`head_max_logits`) are
    folded into ``module.qk_clip_max_logits`` first, and with ``QKClip(cap_forward=True)``
    the heads over its threshold are capped for this call (:func:`capped_query`);
    otherwise this is torch's function alone, at no extra cost. Use it in your attention's
    forward with ``module=self``.
    """
    if is_recording(module):
        maxima = record_head_max_logits(module, query, key, scale=scale, attn_mask=attn_mask, is_causal=is_causal)
        query = capped_query(module, query, maxima)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: object | None = None,
    block_mask: object | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    module: nn.Module | None = None,
    **kwargs: object,
) -> Tensor:
    """``torch.nn.attention.flex_attention.flex_attention``, recording each head's max score on ``module``.

    While ``module`` is recording, the kernel is asked for its row maxima
    (``return_aux=AuxRequest(max_scores=True)``, torch >= 2.9): the maximum comes out of
    the attention kernel itself, with no second ``Q K^T``. They are the scores after
    ``score_mod`` (a bias it adds is included; masked positions are not). torch 2.13
    computes them on CUDA only (on CPU it raises ``NotImplementedError``); use
    :func:`scaled_dot_product_attention` there. Returns the attention output only.
    """
    from torch.nn.attention.flex_attention import AuxRequest
    from torch.nn.attention.flex_attention import flex_attention as _flex

    if not is_recording(module):
        return _flex(query, key, value, score_mod, block_mask, scale, enable_gqa, **kwargs)
    if getattr(module, "qk_clip_cap", None) is not None:
        raise ValueError(
            "flex_attention: QKClip(cap_forward=True) needs the maxima before the attention, and flex attention "
            "returns them after it; use lightning_muon.attention.scaled_dot_product_attention, or cap_forward=False"
        )
    if query.device.type != "cuda":
        raise ValueError(
            f"flex_attention: recording max scores needs CUDA under torch {torch.__version__} (query is on "
            f"{query.device}); use lightning_muon.attention.scaled_dot_product_attention instead"
        )
    out, aux = _flex(
        query, key, value, score_mod, block_mask, scale, enable_gqa, return_aux=AuxRequest(max_scores=True), **kwargs
    )
    record_max_logits(module, aux.max_scores.detach().float().amax(dim=(0, 2)))  # (B, H, Tq) -> (H,)
    return out
