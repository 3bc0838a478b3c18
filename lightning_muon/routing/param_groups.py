"""Param groups for ``Muon``: from what a user passes, to groups of one algorithm each.

``(name, tensor)`` pairs (``model.named_parameters()``) are routed by the default rules from
what the names show (``rules.route_names``): biases and other vectors to ``"adamw_no_decay"``,
embeddings and the output head to ``"adamw"``, every other matrix to ``"muon"``, as the
module's own routing does. A flat list of tensors without names takes the flat rule: tensors
with two or more dims to a ``"muon"`` group, the rest to an ``"adamw"`` group; a whole
model's (matrices and vectors) gets a warning that its embeddings and head go to Muon, and
the lines that route them. A dict without
``"algorithm"`` gets ``"muon"`` if all its tensors are matrices, ``"adamw"`` if none is,
and an error otherwise. An ``"algorithm"`` must be registered (``algorithms``); what a
group of it may set is its algorithm's ``option_names``, and the algorithm checks the rest
(``Algorithm.check``, ``Algorithm.init_group``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_muon._warn import warn_user
from lightning_muon.algorithms import Algorithm, get_algorithm
from lightning_muon.routing.rules import route_names

__all__ = [
    "algorithm_of",
    "as_groups",
    "flat_groups",
    "group_label",
    "option_names",
    "params_of_pairs",
    "split_named_params",
]


# torch.optim's rule: a name for every parameter or for none (the names check a checkpoint's routing).
_MIXED_NAMES = (
    "params mixes (name, tensor) pairs with bare tensors: name every parameter (model.named_parameters()) or none"
)


def params_of_pairs(params: list[Any]) -> list[tuple[str, Any]]:
    """``params`` given as (name, tensor) pairs, checked: a name for every parameter or for none, as torch.optim
    requires (the names are what a checkpoint's routing is checked by)."""
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params):
        raise ValueError(_MIXED_NAMES)
    return params


def option_names(algorithm: str) -> frozenset[str]:
    """The keys a param group of ``algorithm`` may set: its settings, ``name`` and ``param_names``.

    The settings are the fields of the algorithm's ``settings`` (``MuonSettings``,
    ``AdamWSettings``, ...) and their other projects' names (``aliases``); a Muon group also
    takes ``split_sizes``, ``split_parts``, ``batched``, ``transposed`` and ``blocks``.
    """
    return get_algorithm(algorithm).option_names()


def split_named_params(param_group: dict[str, Any]) -> tuple[dict[str, Any], list[Tensor]]:
    """A copy of ``param_group`` whose ``params`` is a list of tensors; (name, tensor) pairs give ``param_names``."""
    group = dict(param_group)
    params = group["params"]
    params = [params] if isinstance(params, Tensor) else list(params)
    if any(isinstance(p, tuple) for p in params):
        group.setdefault("param_names", [n for n, _ in params_of_pairs(params)])
        params = [p for _, p in params]
    group["params"] = params
    return group, params


def group_label(index: int, group: dict[str, Any]) -> str:
    """``param group 2 ('name')``: how messages name a group."""
    return f"param group {index}" + (f" ({group['name']!r})" if "name" in group else "")


def algorithm_of(group: dict[str, Any], where: str) -> Algorithm:
    """The registered algorithm the group names (a group without one was split by route already)."""
    try:
        return get_algorithm(group["algorithm"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Param-group dicts from tensors, (name, tensor) pairs or dicts (the module docstring)."""
    if isinstance(params, Tensor):  # torch.optim's words
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
            + torch.typename(params)
        )
    items = list(params)
    if not items:
        raise ValueError("params is empty: Muon got no parameters to optimize")
    if all(isinstance(item, dict) for item in items):
        return items
    if any(isinstance(item, dict) for item in items):
        raise ValueError("params mixes dicts with tensors; pass one kind")
    named = params_of_pairs(items) if any(isinstance(item, tuple) for item in items) else [(None, p) for p in items]
    for name, p in named:
        if not isinstance(p, Tensor):
            raise TypeError(f"params must hold tensors, got {type(p).__name__} for {name or 'an item'}")
    if named[0][0] is not None:
        return route_names(named)
    matrices = sum(p.ndim >= 2 for _, p in named)
    if 0 < matrices < len(named):  # a whole model's, as model.parameters() gives them
        warn_user(
            f"Muon: {matrices} matrices given without names all go to Muon, embeddings and output heads included "
            "(Muon is for hidden layers). Muon(model.named_parameters()) routes those to AdamW by name, "
            "Muon(route_parameters(model)) by the model's layers too; with LightningCLI's --optimizer, "
            "which passes model.parameters(), give the model MuonModuleMixin and set its muon_config instead"
        )
    return flat_groups(named)


def flat_groups(named: list[tuple[str | None, Tensor]]) -> list[dict[str, Any]]:
    """The flat rule: two or more dims to a ``"muon"`` group, the rest to ``"adamw"`` (names kept where all are)."""
    groups = []
    for algorithm, keep in (("muon", lambda p: p.ndim >= 2), ("adamw", lambda p: p.ndim < 2)):
        chosen = [(n, p) for n, p in named if keep(p)]
        if chosen:
            group: dict[str, Any] = {"params": [p for _, p in chosen], "algorithm": algorithm, "name": algorithm}
            if all(n is not None for n, _ in chosen):
                group["param_names"] = [n for n, _ in chosen]
            groups.append(group)
    return groups
