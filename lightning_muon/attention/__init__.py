"""Attention logits for QK-clip: per-head maxima, the module protocol, the scaling math, transformers."""

from lightning_muon.attention.clip import apply_qk_clip, clip_factors, global_head_maxima, output_factors
from lightning_muon.attention.hf import hf_qk_heads, register_attention
from lightning_muon.attention.maxima import (
    QKClipAttention,
    QKHeads,
    capped_query,
    flex_attention,
    head_max_logits,
    record_head_max_logits,
    record_max_logits,
    scaled_dot_product_attention,
)

__all__ = [
    "QKClipAttention",
    "QKHeads",
    "apply_qk_clip",
    "capped_query",
    "clip_factors",
    "flex_attention",
    "global_head_maxima",
    "head_max_logits",
    "hf_qk_heads",
    "output_factors",
    "record_head_max_logits",
    "record_max_logits",
    "register_attention",
    "scaled_dot_product_attention",
]
