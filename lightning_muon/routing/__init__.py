"""Routing parameters to algorithms: ordered, named rules, and one module per layout family.

- ``rules``: ``Rule``, the rules engine (``route``) and ``ParamGroups`` (the report);
- ``settings``: ``RoutingSettings`` (the routing section of ``MuonConfig``, each knob declared once) and
  ``route_parameters``;
- ``conv1d``: weights stored ``(fan_in, fan_out)`` (transformers' ``Conv1D``);
- ``experts``: mixture-of-experts stacks and their routers; ``probe``: their layouts read from the
  model's own forward;
- ``fused_qkv``: fused QKV weights split into Q, K and V (``split_qkv``);
- ``added_groups``, ``param_groups``, ``checkpoint``: groups added after construction, groups
  from what a user passes, and the check that a checkpoint was saved with this routing.
"""

from lightning_muon.routing.conv1d import TRANSPOSED_MODULES
from lightning_muon.routing.experts import ExpertStack, find_experts
from lightning_muon.routing.rules import (
    DEFAULT_HEAD_NAMES,
    TOKEN_TABLE_NAMES,
    ParamGroups,
    Rule,
    unwrap_module,
)
from lightning_muon.routing.settings import RoutingSettings, route_parameters

__all__ = [
    "DEFAULT_HEAD_NAMES",
    "TOKEN_TABLE_NAMES",
    "TRANSPOSED_MODULES",
    "ExpertStack",
    "ParamGroups",
    "RoutingSettings",
    "Rule",
    "find_experts",
    "route_parameters",
    "unwrap_module",
]
