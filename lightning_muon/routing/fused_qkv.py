"""Fused QKV weights: Q, K and V orthogonalized apart (``MuonConfig.split_qkv``, Megatron-Core's name).

A fused projection holds the query, key and value matrices side by side along its output
axis; Muon should orthogonalize each on its own (as it would three ``nn.Linear``). The rules
here set the layout (``split_sizes`` or ``split_parts``, ``MatrixLayout``) on the weights they
find: ``nn.MultiheadAttention``'s ``in_proj_weight``, GPT-2's ``Conv1D`` ``c_attn`` (split along
its columns), and fused weights named or marked as such (split as Megatron lays out query
groups).
"""

from __future__ import annotations

from lightning_muon.routing.conv1d import TRANSPOSED_MODULES
from lightning_muon.routing.rules import Rule

__all__ = ["QKV_NAMES", "split_rules"]

# Parameter names treated as fused QKV weights by ``split_qkv`` (besides Megatron's
# ``is_qkv`` attribute): Megatron-Core, timm/ViT, GPT-2/nanoGPT, GPT-NeoX, nn.MultiheadAttention.
QKV_NAMES = r"(^|\.)(linear_qkv|qkv|qkv_proj|c_attn|query_key_value)\.weight$|(^|\.)in_proj_weight$"


def split_rules(split_qkv: bool, qkv_split_shapes: tuple[int, ...] | None, matrix_algorithm: str) -> list[Rule]:
    """The routing rules ``split_qkv`` adds, in the order they are tried (none without ``split_qkv``).

    1. ``nn.MultiheadAttention``'s ``in_proj_weight``: Q | K | V of equal size along dim 0,
       three parts.
    2. GPT-2's ``c_attn``, a ``Conv1D`` stored (fan_in, fan_out): the same names and sizes,
       split along the output axis, dim 1.
    3. Fused QKV weights by Megatron's ``is_qkv`` attribute or by name (``QKV_NAMES``), split
       as Megatron does: the rows are query groups of ``sum(qkv_split_shapes)`` rows each,
       and Q (K, V) gathers its rows from every group.

    Rules 2 and 3 need ``qkv_split_shapes``; without it only rule 1 applies. The matched
    weights go to ``matrix_algorithm`` (Muon, or the variant the config trains hidden matrices with).
    """
    if not split_qkv:
        return []
    rules = [
        Rule(
            name="mha_in_proj",
            algorithm=matrix_algorithm,
            group="muon_mha_in_proj",
            names="*in_proj_weight",
            module_types="MultiheadAttention",
            options={"split_parts": 3},
        )
    ]
    if qkv_split_shapes is None:
        return rules
    options = {"split_sizes": list(qkv_split_shapes)}
    return [
        *rules,
        Rule(
            name="qkv_names_transposed",
            algorithm=matrix_algorithm,
            group="muon_qkv_transposed",
            regex=QKV_NAMES,
            module_types=TRANSPOSED_MODULES,
            min_ndim=2,
            options={**options, "transposed": True},
        ),
        Rule(
            name="split_qkv",
            algorithm=matrix_algorithm,
            group="muon_qkv",
            attributes="is_qkv",
            min_ndim=2,
            options=options,
        ),
        Rule(
            name="qkv_names",
            algorithm=matrix_algorithm,
            group="muon_qkv",
            regex=QKV_NAMES,
            min_ndim=2,
            options=options,
        ),
    ]
