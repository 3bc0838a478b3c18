"""Megatron-Core's names for Muon's settings, in one place: ``MuonConfig`` accepts them beside its own.

``coefficient_type`` -> ``ns_coefficients``, ``num_ns_steps`` -> ``ns_steps``, ``scale_mode``
-> ``adjust_lr``, ``moment2_method`` -> ``second_moment``; ``split_qkv`` with
``qkv_split_shapes`` turns on the routing rules of ``fused_qkv``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

from lightning_muon.algorithms.emerging import MEGATRON_COEFFICIENTS, eo_schedule
from lightning_muon.functional import ADJUST_LR_ALIASES

__all__ = ["MEGATRON_COEFFICIENTS", "MEGATRON_SCALE_MODES", "map_megatron_names"]  # the last two from fused_qkv

# Megatron-Core's ``moment2_method`` names: Emerging-Optimizers' forms (``functional.muon_second_moment_``).
MEGATRON_MOMENT2_METHODS = ("adamuon", "normuon", "namo")
MEGATRON_SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")


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
        if config.moment2_method not in MEGATRON_MOMENT2_METHODS:
            raise ValueError(
                f"MuonConfig.moment2_method must be one of {MEGATRON_MOMENT2_METHODS}, got {config.moment2_method!r}"
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
    steps = config.ns_steps if isinstance(config.ns_steps, int) else 1  # a bad ns_steps is refused later
    return eo_schedule(name, steps)


def _same_schedule(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return [tuple(float(v) for v in abc) for abc in a] == [tuple(float(v) for v in abc) for abc in b]


def _same_adjust_lr(a: str, b: str) -> bool:
    return ADJUST_LR_ALIASES.get(a, a) == ADJUST_LR_ALIASES.get(b, b)
