"""Megatron-Core's names for Muon's settings, in one place: ``MuonConfig`` accepts them beside its own.

``coefficient_type`` -> ``ns_coefficients``, ``num_ns_steps`` -> ``ns_steps``, ``scale_mode``
-> ``adjust_lr``, ``moment2_method`` -> ``second_moment``, and ``split_qkv`` with
``qkv_split_shapes``: routing rules that orthogonalize Q, K and V of fused QKV weights
separately (by Megatron's ``is_qkv`` attribute or by name, ``QKV_NAMES``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

from lightning_muon.functional import ADJUST_LR_ALIASES, SECOND_MOMENTS
from lightning_muon.newton_schulz import COEFFICIENTS
from lightning_muon.routing.conv1d import TRANSPOSED_MODULES
from lightning_muon.routing.rules import Rule

__all__ = ["MEGATRON_COEFFICIENTS", "MEGATRON_SCALE_MODES", "QKV_NAMES", "map_megatron_names", "split_rules"]

# Megatron-Core's ``coefficient_type`` names (emerging_optimizers ``muon_utils``) and their
# schedules here. Megatron cycles a list when ``num_ns_steps`` is a multiple of its length
# (and raises otherwise): those become explicit lists below.
MEGATRON_COEFFICIENTS: dict[str, str | list[tuple[float, float, float]]] = {
    "simple": "keller",  # (3.4445, -4.7750, 2.0315) at every step
    "quintic": "you",  # Megatron's default, You Jiacheng's 5-step tuning
    # The paper's 8 tuples with the 1.01 safety folded in (Megatron rounds them to 4 digits),
    # last repeated; Megatron requires num_ns_steps >= 8, shorter runs take the first tuples.
    # Megatron pre-scales by ||X||_F, ours by 1.01 ||X||_F (NORMALIZATION["polar_express_paper"]).
    "polar_express": "polar_express_paper",
    # Emerging-Optimizers 0.3.0 repeats the last tuple of these two, as ours do.
    "cans": "cans",  # Grishina et al., arXiv 2506.10935
    "deepseekv4": "deepseekv4",  # 10 steps: Keller's quintic 8 times, then (2, -1.5, 0.5) twice
    # Megatron's "aol" list, from thib-s/flash-newton-schulz (Boissin et al.), 4 tuples.
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
MEGATRON_SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")
# Parameter names treated as fused QKV weights by ``split_qkv`` (besides Megatron's
# ``is_qkv`` attribute): Megatron-Core, timm/ViT, GPT-2/nanoGPT, GPT-NeoX, nn.MultiheadAttention.
QKV_NAMES = r"(^|\.)(linear_qkv|qkv|qkv_proj|c_attn|query_key_value)\.weight$|(^|\.)in_proj_weight$"


def map_megatron_names(config: Any) -> None:
    """Carry Megatron-Core's names over to ours; a clash with a field set to another value raises.

    A field of ours left at its default takes the Megatron value; one set to the same
    value is fine; one set to a different value raises naming both.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(config)}

    def take(megatron: str, ours: str, value: Any, same: Callable[[Any, Any], bool] = operator.eq) -> None:
        current = getattr(config, ours)
        if current != defaults[ours] and not same(current, value):
            raise ValueError(
                f"MuonConfig: {megatron}={getattr(config, megatron)!r} and {ours}={current!r} disagree; "
                f"set one of them ({megatron} maps to {ours}={value!r})"
            )
        setattr(config, ours, value)

    if config.num_ns_steps is not None:
        if isinstance(config.num_ns_steps, bool) or not isinstance(config.num_ns_steps, int) or config.num_ns_steps < 1:
            raise ValueError(f"MuonConfig.num_ns_steps must be a positive int, got {config.num_ns_steps!r}")
        take("num_ns_steps", "ns_steps", config.num_ns_steps)
    if config.coefficient_type is not None:
        take("coefficient_type", "ns_coefficients", _megatron_schedule(config), _same_schedule)
    if config.scale_mode is not None:
        if config.scale_mode not in MEGATRON_SCALE_MODES:
            raise ValueError(f"MuonConfig.scale_mode must be one of {MEGATRON_SCALE_MODES}, got {config.scale_mode!r}")
        take("scale_mode", "adjust_lr", config.scale_mode, _same_adjust_lr)
    if config.moment2_method is not None:
        if config.moment2_method not in SECOND_MOMENTS:
            raise ValueError(
                f"MuonConfig.moment2_method must be one of {SECOND_MOMENTS}, got {config.moment2_method!r}"
            )
        take("moment2_method", "second_moment", config.moment2_method)
    if not isinstance(config.split_qkv, bool):
        raise ValueError(f"MuonConfig.split_qkv must be a bool, got {config.split_qkv!r}")
    if config.qkv_split_shapes is not None:
        shapes = tuple(config.qkv_split_shapes)
        if not shapes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shapes):
            raise ValueError(
                "MuonConfig.qkv_split_shapes must be a non-empty list of positive ints, "
                f"got {config.qkv_split_shapes!r}"
            )
        config.qkv_split_shapes = shapes
    if config.split_qkv and config.qkv_split_shapes is None:
        raise ValueError(
            "MuonConfig.split_qkv needs qkv_split_shapes, the rows of Q, K and V per query group "
            "(Megatron derives them from the model: heads / groups * kv_channels, kv_channels, kv_channels)"
        )


def _megatron_schedule(config) -> str | list[tuple[float, float, float]]:
    name = config.coefficient_type
    if name == "custom":
        if isinstance(config.ns_coefficients, str):
            raise ValueError("MuonConfig: coefficient_type='custom' needs ns_coefficients as a list of (a, b, c)")
        return config.ns_coefficients
    if name not in MEGATRON_COEFFICIENTS:
        raise ValueError(
            f"MuonConfig.coefficient_type must be one of {[*MEGATRON_COEFFICIENTS, 'custom']}, got {name!r}"
        )
    schedule = MEGATRON_COEFFICIENTS[name]
    if name in ("quintic", "aol"):
        cycle = list(schedule) if isinstance(schedule, list) else list(COEFFICIENTS[schedule])
        if isinstance(config.ns_steps, int) and config.ns_steps > len(cycle):  # Megatron repeats the whole list
            return [cycle[i % len(cycle)] for i in range(config.ns_steps)]
    return schedule


def split_rules(config: Any) -> list[Rule]:
    """The routing rules ``split_qkv`` adds, in the order they are tried (none without ``split_qkv``).

    1. ``nn.MultiheadAttention``'s ``in_proj_weight``: Q | K | V of equal size along dim 0,
       three parts.
    2. GPT-2's ``c_attn``, a ``Conv1D`` stored (fan_in, fan_out): the same names and sizes,
       split along the output axis, dim 1.
    3. Fused QKV weights by Megatron's ``is_qkv`` attribute or by name (``QKV_NAMES``), split
       as Megatron does: the rows are query groups of ``sum(qkv_split_shapes)`` rows each,
       and Q (K, V) gathers its rows from every group.
    """
    if not config.split_qkv:
        return []
    sizes = list(config.qkv_split_shapes)
    options = {"split_sizes": sizes}
    matrices = config.matrix_optimizer  # Muon, or the variant the config trains hidden matrices with
    return [
        Rule(
            name="mha_in_proj",
            algorithm=matrices,
            group="muon_mha_in_proj",
            names="*in_proj_weight",
            module_types="MultiheadAttention",
            options={"split_parts": 3},
        ),
        Rule(
            name="qkv_names_transposed",
            algorithm=matrices,
            group="muon_qkv_transposed",
            regex=QKV_NAMES,
            module_types=TRANSPOSED_MODULES,
            min_ndim=2,
            options={**options, "transposed": True},
        ),
        Rule(name="split_qkv", algorithm=matrices, group="muon_qkv", attributes="is_qkv", min_ndim=2, options=options),
        Rule(name="qkv_names", algorithm=matrices, group="muon_qkv", regex=QKV_NAMES, min_ndim=2, options=options),
    ]


def _same_schedule(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return [tuple(float(v) for v in abc) for abc in a] == [tuple(float(v) for v in abc) for abc in b]


def _same_adjust_lr(a: str, b: str) -> bool:
    return ADJUST_LR_ALIASES.get(a, a) == ADJUST_LR_ALIASES.get(b, b)
