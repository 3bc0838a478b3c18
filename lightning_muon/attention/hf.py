"""Hugging Face transformers models: maxima through ``AttentionInterface``, heads from the module.

transformers routes every attention call of its models through ``AttentionInterface``
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``) with the post-RoPE query
``(B, H, T, d)``, the key ``(B, G, T, d)`` (before GQA's ``repeat_kv``), the mask and the
scale. :func:`register_attention` registers ``"qk_clip_sdpa"``: it measures the per-head
maxima on the calling module (when recording; with ``QKClip(cap_forward=True)`` it also
caps the heads over the threshold, :func:`~lightning_muon.attention.maxima.capped_query`),
then runs transformers' own SDPA attention. :func:`hf_qk_heads` reads where Q and K live:

- Llama-style ``q_proj`` / ``k_proj`` (Llama, Mistral, Qwen2, ...), or BERT-style ``query`` /
  ``key`` (BERT, RoBERTa, ViT): ``H`` query and ``G = num_key_value_heads`` key heads (``H``
  without it) of ``head_dim`` rows each; biases when present;
- GPT-2's fused ``c_attn`` (``Conv1D``, weight ``(d, 3d)`` stored ``(fan_in, fan_out)``):
  Q is output columns ``0 .. d-1``, K columns ``d .. 2d-1``, the bias alike.

Models that normalize q and k after the projection (``q_norm`` / ``k_norm``: Qwen3,
Gemma 3, OLMo 2) are refused: scaling ``W_q`` does not change a normalized ``q``; so are
projections that peft wraps in LoRA layers, whose ``W_q`` and ``W_k`` stay frozen.
transformers is imported only when a Hugging Face model is found.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_muon.attention.maxima import QKHeads, capped_query, is_recording, record_head_max_logits

__all__ = ["ATTENTION_NAME", "enable_hf_recording", "hf_qk_heads", "is_hf_module", "register_attention"]

ATTENTION_NAME = "qk_clip_sdpa"
"""The name ``register_attention`` gives its function in transformers' ``AttentionInterface``."""

# Implementations whose masks and numerics the wrapped SDPA reproduces (eager and SDPA
# compute the same softmax(q k^T * scale + mask) v).
_WRAPPABLE = (None, "eager", "sdpa", ATTENTION_NAME)


def is_hf_module(module: nn.Module) -> bool:
    """Whether ``module`` is defined by transformers (by the module path of its class)."""
    return type(module).__module__.startswith("transformers.")


def _qk_clip_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if is_recording(module):
        # Which keys a query sees, decided as transformers' SDPA path decides it: causal
        # only without an explicit mask and for more than one query, keys cut to the queries.
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal) and attention_mask is None and query.shape[2] > 1
        keys = key[:, :, : query.shape[2]] if causal and key.shape[2] > query.shape[2] else key
        maxima = record_head_max_logits(module, query, keys, scale=scaling, attn_mask=attention_mask, is_causal=causal)
        query = capped_query(module, query, maxima)  # QKClip(cap_forward=True); else query itself
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def register_attention() -> str:
    """Register ``"qk_clip_sdpa"`` with transformers' ``AttentionInterface`` (and its mask); returns the name.

    Idempotent. Select it with ``model.set_attn_implementation("qk_clip_sdpa")`` (the
    ``QKClip`` callback does this for every Hugging Face model it finds).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _qk_clip_sdpa)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTENTION_NAME


def enable_hf_recording(model: nn.Module) -> list[str]:
    """Switch every Hugging Face ``PreTrainedModel`` inside ``model`` to ``"qk_clip_sdpa"``; returns their names.

    Raises:
        ValueError: for a model on an implementation the wrapper does not reproduce
            (flash or flex attention), naming the model and the implementation.
    """
    found = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not (is_hf_module(module) and hasattr(module, "set_attn_implementation") and config is not None):
            continue
        if any(name.startswith(f"{done}.") or not done for done in found):
            continue  # inside a model already switched (the setting is on the shared config)
        current = getattr(config, "_attn_implementation", None)
        if current not in _WRAPPABLE:
            raise ValueError(
                f"QKClip: Hugging Face model {name or type(module).__name__!r} uses attn_implementation="
                f"{current!r}; QK-clip measures maxima through SDPA: load it with attn_implementation='sdpa' or 'eager'"
            )
        module.set_attn_implementation(register_attention())
        found.append(name)
    return found


def hf_qk_heads(module: nn.Module) -> QKHeads | None:
    """The :class:`QKHeads` of a transformers attention module, or None when it is not one we read.

    Raises:
        ValueError: for an attention with QK-norm (``q_norm``/``k_norm``), where scaling
            the projections does not change the logits.
    """
    if not is_hf_module(module):
        return None
    q_proj, k_proj, c_attn = (getattr(module, n, None) for n in ("q_proj", "k_proj", "c_attn"))
    if q_proj is None and not getattr(module, "is_cross_attention", False):  # BERT, RoBERTa, ViT
        q_proj, k_proj = getattr(module, "query", None), getattr(module, "key", None)
    if any(isinstance(getattr(proj, "base_layer", None), nn.Linear) for proj in (q_proj, k_proj)):
        raise ValueError(
            f"QKClip: the q and k projections of {type(module).__name__} are peft LoRA layers: QK-clip rescales W_q "
            "and W_k, which LoRA keeps frozen (an adapter checkpoint would not keep the change either); train them "
            "fully with QKClip, or merge the adapters first (model.merge_and_unload())"
        )
    if isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear):
        if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None) is not None:
            raise ValueError(
                f"QKClip: {type(module).__name__} normalizes q and k after the projection (q_norm/k_norm): "
                "scaling W_q and W_k does not bound its logits; leave it out with QKClip(names=...)"
            )
        config = module.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(module, "head_dim", None) or q_proj.out_features // heads
        return QKHeads(q_proj.weight, k_proj.weight, heads, kv_heads, head_dim, q_bias=q_proj.bias, k_bias=k_proj.bias)
    if c_attn is not None and type(c_attn).__name__ == "Conv1D" and not getattr(module, "is_cross_attention", False):
        d = module.split_size
        return QKHeads(
            c_attn.weight, c_attn.weight, module.num_heads, module.num_heads, module.head_dim,
            q_bias=c_attn.bias, k_bias=c_attn.bias, q_offset=0, k_offset=d, transposed=True,
        )  # fmt: skip
    return None
