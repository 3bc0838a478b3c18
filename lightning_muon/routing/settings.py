"""``RoutingSettings``: where parameters go, each knob declared once; ``route_parameters``, the routing entry.

The routing section of ``MuonConfig`` in YAML, and ``route_parameters``' keywords in Python, are
these fields. With the two algorithms of the default rules (the config's ``matrix`` and
``scalar`` sections, or ``route_parameters``' ``matrix_algorithm`` and ``scalar_algorithm``),
``RoutingSettings.route`` splits a module's parameters into named groups: the user's rules, then
``split_qkv``'s, then the default rules (``rules``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_muon.algorithms import get_algorithm
from lightning_muon.routing.fused_qkv import QKV_NAMES, split_rules
from lightning_muon.routing.rules import DEFAULT_HEAD_NAMES, ParamGroups, Rule, route

__all__ = ["RoutingSettings", "route_parameters"]


@dataclass(kw_only=True)
class RoutingSettings:
    """Where each parameter goes: user rules first, then the default rules these settings tune."""

    rules: list[Rule] = field(default_factory=list)
    """Rules tried in order before the default rules (each a Rule or a dict of its fields)."""
    default_rules: bool = True
    """Append the default rules (embedding, head, vectors to the scalar algorithm; matrices to the matrix one)."""
    max_aspect_ratio: float | None = None
    """Send matrices whose long side exceeds this many times the short side to the scalar algorithm."""
    head_names: tuple[str, ...] = DEFAULT_HEAD_NAMES
    """Attribute names that mark a Linear as the output head."""
    head_by_position: bool = True
    """Without a named head, treat the last nn.Linear as the head."""
    input_layer: bool = False
    """Send the first convolution or Linear weight (a convnet's stem) to the scalar algorithm."""
    split_qkv: bool = False
    """Orthogonalize Q, K and V of fused QKV weights apart (Megatron's muon_split_qkv): nn.MultiheadAttention's
    in_proj_weight always, other fused weights (by name or is_qkv) given qkv_split_shapes."""
    qkv_split_shapes: tuple[int, ...] | None = None
    """Rows of Q, K, V per query group, e.g. (heads_per_group * head_dim, head_dim, head_dim)."""
    split_gate_up: bool = True
    """Mixture-of-experts fused gate/up stacks: orthogonalize gate and up apart, per expert (False: fused)."""
    router_algorithm: str | None = None
    """Mixture-of-experts router weights: None keeps them on the scalar algorithm; "muon" sends them to Muon."""
    probe_experts: bool = True
    """Read mixture-of-experts layouts and routers transformers' metadata does not give from the model's forward."""

    def __post_init__(self) -> None:
        self.rules = [_rule(i, r) for i, r in enumerate(self.rules)]
        self.head_names = tuple(self.head_names)
        if self.router_algorithm is not None:
            try:
                get_algorithm(self.router_algorithm)
            except ValueError as err:
                raise ValueError(f"RoutingSettings.router_algorithm: {err}") from None
        if self.max_aspect_ratio is not None and not self.max_aspect_ratio >= 1:
            raise ValueError(f"RoutingSettings.max_aspect_ratio must be >= 1 or None, got {self.max_aspect_ratio!r}")
        for name in ("default_rules", "head_by_position", "input_layer", "split_qkv", "split_gate_up", "probe_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RoutingSettings.{name} must be a bool, got {getattr(self, name)!r}")
        if self.qkv_split_shapes is not None:
            shapes = tuple(self.qkv_split_shapes)
            if not shapes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shapes):
                raise ValueError(
                    "RoutingSettings.qkv_split_shapes must be a non-empty list of positive ints, "
                    f"got {self.qkv_split_shapes!r}"
                )
            self.qkv_split_shapes = shapes

    def route(self, module: nn.Module, matrix_algorithm: str = "muon", scalar_algorithm: str = "adamw") -> ParamGroups:
        """``module``'s trainable parameters in named param groups (``rules.route``), with ``matrix_algorithm`` and
        ``scalar_algorithm`` for the default rules' hidden matrices and everything else."""
        optional = split_rules(self.split_qkv, self.qkv_split_shapes, matrix_algorithm)
        groups = route(module, self, matrix_algorithm, scalar_algorithm, optional)
        if self.split_qkv and self.qkv_split_shapes is None:
            split = {id(p) for g in groups if g.get("split_sizes") or g.get("split_parts") for p in g["params"]}
            whole = [
                n
                for n, p in module.named_parameters()
                if re.search(QKV_NAMES, n) and id(p) not in split and p.ndim >= 2
            ]
            if whole:
                warnings.warn(
                    f"split_qkv: {whole[:3]}{' ...' if len(whole) > 3 else ''} look like fused QKV weights, but "
                    "routing.qkv_split_shapes is not set, so they are orthogonalized whole; set it to the rows of Q, "
                    "K and V per query group to split them",
                    UserWarning,
                    stacklevel=3,
                )
        return groups

    def to_dict(self) -> dict[str, Any]:
        """Plain values (rules as dicts of the fields they set), for YAML and ``save_hyperparameters``."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["rules"] = [r.to_dict() for r in self.rules]
        return out


def route_parameters(
    module: nn.Module,
    rules: Iterable[Rule | dict[str, Any]] | None = None,
    *,
    matrix_algorithm: str = "muon",
    scalar_algorithm: str = "adamw",
    **settings: Any,
) -> ParamGroups:
    """Split ``module``'s trainable parameters into named param groups by ordered rules; the first match wins.

    Args:
        module: the model; a wrapper around it (Fabric's ``_FabricModule``, DDP, ``torch.compile``)
            is looked through, so names and layer types are the model's own.
        rules: user rules (``Rule`` or dicts of its fields), tried before the default rules.
        matrix_algorithm: ``"muon"`` or a registered variant of it (``"muon_hyperball"``) for the
            default rules' hidden matrices (group ``muon`` becomes the algorithm's name).
        scalar_algorithm: ``"adamw"``, ``"lion"``, ``"adamw_schedulefree"`` or another registered
            algorithm that does not orthogonalize, for the default rules' other groups (their
            names take the algorithm's; options it does not know are dropped).
        **settings: the other fields of ``RoutingSettings`` (``max_aspect_ratio``, ``head_names``,
            ``input_layer``, ``split_qkv``, ``router_algorithm``, ``probe_experts``, ...), each
            documented there.

    Returns:
        ``ParamGroups`` (``rules.route``), with ``report()``.
    """
    return RoutingSettings(rules=list(rules or []), **settings).route(module, matrix_algorithm, scalar_algorithm)


def _rule(index: int, value: Rule | dict[str, Any]) -> Rule:
    if isinstance(value, Rule):
        return value
    try:
        plain = dict(vars(value)) if hasattr(value, "__dict__") and not isinstance(value, dict) else dict(value)
        return Rule(**plain)  # jsonargparse may hand a Namespace
    except (TypeError, ValueError) as err:  # TypeError: an unknown or missing field
        raise ValueError(f"RoutingSettings.rules[{index}]: {err}") from None
