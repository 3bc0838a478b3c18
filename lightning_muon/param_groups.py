"""Param groups for ``Muon``: from what a user passes, to checked groups of one algorithm each.

A flat list of tensors (or ``(name, tensor)`` pairs) is split by rule: tensors with two or
more dims to a ``"muon"`` group, the rest to an ``"adamw"`` group. A dict without
``"algorithm"`` gets ``"muon"`` if all its tensors are matrices, ``"adamw"`` if none is,
and an error otherwise. A Muon group may also set the layout of its tensors:
``split_sizes`` / ``split_parts`` (fused QKV), ``batched`` (experts), ``transposed``
(``(fan_in, fan_out)`` storage); ``check_muon_params`` checks them against the shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from lightning_muon.hparams import ALGORITHMS, HPARAMS

__all__ = ["algorithm_of", "as_groups", "check_muon_params", "option_names", "resolve_split_parts"]

# Options of a Muon group besides its hyperparameters: the layout of its tensors.
MUON_LAYOUT = frozenset({"split_sizes", "split_parts", "batched", "transposed"})


def option_names(algorithm: str) -> frozenset[str]:
    """The keys a param group of ``algorithm`` may set: its hyperparameters, ``name`` and ``param_names``.

    The hyperparameters are the fields of the algorithm's config (``MuonHparams``,
    ``AdamWHparams``, ...); a Muon group also takes ``split_sizes``, ``split_parts``,
    ``batched`` and ``transposed``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    own = {"name", "param_names", *(f.name for f in dataclasses.fields(HPARAMS[algorithm]))}
    return frozenset(own | MUON_LAYOUT if algorithm == "muon" else own)


def algorithm_of(group: dict[str, Any], params: list[Tensor], where: str) -> str:
    """The group's ``"algorithm"``, or the one its tensors imply; raises on a bad or ambiguous one."""
    algorithm = group.get("algorithm")
    if algorithm is None:
        is_matrix = [p.ndim >= 2 for p in params]
        if all(is_matrix) and params:
            algorithm = "muon"
        elif not any(is_matrix):
            algorithm = "adamw"
        else:
            raise ValueError(
                f"{where}: mixes matrices and 1-D tensors without an 'algorithm'; "
                "set 'algorithm' or pass a flat parameter list to split them by rule"
            )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{where}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return algorithm


def as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Param-group dicts from tensors, (name, tensor) pairs or dicts."""
    if isinstance(params, Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a single Tensor")
    items = list(params)
    if not items:
        raise ValueError("params is empty: Muon got no parameters to optimize")
    if all(isinstance(item, dict) for item in items):
        return items
    if any(isinstance(item, dict) for item in items):
        raise ValueError("params mixes dicts with tensors; pass one kind")
    named = [item if isinstance(item, tuple) else (None, item) for item in items]
    for name, p in named:
        if not isinstance(p, Tensor):
            raise TypeError(f"params must hold tensors, got {type(p).__name__} for {name or 'an item'}")
    groups = []
    for algorithm, keep in (("muon", lambda p: p.ndim >= 2), ("adamw", lambda p: p.ndim < 2)):
        chosen = [(n, p) for n, p in named if keep(p)]
        if chosen:
            group: dict[str, Any] = {"params": [p for _, p in chosen], "algorithm": algorithm, "name": algorithm}
            if all(n is not None for n, _ in chosen):
                group["param_names"] = [n for n, _ in chosen]
            groups.append(group)
    return groups


def resolve_split_parts(group: dict[str, Any], params: list[Tensor], where: str) -> None:
    """``split_parts=k``: ``k`` equal blocks along the output axis, turned into ``split_sizes``.

    Per-head orthogonalization (a fused QKV of ``H`` heads: ``3 H`` parts; a ``q_proj``:
    ``H`` parts) and ``nn.MultiheadAttention``'s ``in_proj_weight`` (Q, K, V: 3 parts)
    without spelling the sizes. Every tensor of the group must have the same output size.
    """
    parts = group.pop("split_parts", None)
    if parts is None:
        return
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"{where}: split_parts must be a positive int, got {parts!r}")
    if group.get("split_sizes") is not None:
        raise ValueError(f"{where}: set split_parts or split_sizes, not both")
    axis = 1 if group.get("transposed") else 0
    sizes = {p.shape[axis] for p in params if p.ndim >= 2}
    if len(sizes) > 1:
        raise ValueError(f"{where}: split_parts={parts} needs one output size in the group, got {sorted(sizes)}")
    (size,) = sizes or {parts}
    if size % parts:
        names = group.get("param_names", [])
        raise ValueError(
            f"{where}{f' ({names[0]!r})' if names else ''}: split_parts={parts} does not divide the output axis "
            f"(dim {axis}, size {size})"
        )
    group["split_sizes"] = (size // parts,) * parts


def check_muon_params(group: dict[str, Any], params: list[Tensor], where: str) -> None:
    split_sizes, batched, transposed = group["split_sizes"], group["batched"], group["transposed"]
    if not isinstance(transposed, bool):
        raise ValueError(f"{where}: transposed must be a bool, got {transposed!r}")
    if transposed and (batched or group["second_moment"] == "normuon"):
        what = "batched=True" if batched else "second_moment='normuon' (per-row statistics)"
        raise ValueError(f"{where}: transposed=True cannot be combined with {what} yet")
    out_dim = 1 if transposed else 0
    if split_sizes is not None:
        if batched:
            raise ValueError(f"{where}: split_sizes and batched=True cannot be combined")
        if not split_sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in split_sizes):
            raise ValueError(f"{where}: split_sizes must be a non-empty list of positive ints, got {split_sizes!r}")
        group["split_sizes"] = tuple(split_sizes)
    for j, p in enumerate(params):
        label = f"{where}, parameter {j}" + (f" ({group['param_names'][j]!r})" if "param_names" in group else "")
        if p.is_complex():
            raise ValueError(f"{label}: complex parameters are not supported by Muon")
        if p.ndim < 2:
            raise ValueError(
                f"{label}: Muon needs a matrix, got a {p.ndim}-D tensor of shape {tuple(p.shape)}; "
                "route it to 'adamw', 'lion' or 'adamw_schedulefree'"
            )
        if batched and p.ndim < 3:
            raise ValueError(f"{label}: batched=True needs a tensor with 3+ dims, got shape {tuple(p.shape)}")
        if transposed and p.ndim != 2:
            raise ValueError(f"{label}: transposed=True needs a 2-D (fan_in, fan_out) weight, got {tuple(p.shape)}")
        if split_sizes is not None and p.shape[out_dim] % sum(split_sizes) != 0:
            layout = "a (fan_in, fan_out) weight, transposed=True" if transposed else "a (fan_out, ...) weight"
            raise ValueError(
                f"{label}: split_sizes {tuple(split_sizes)} sum to {sum(split_sizes)}, but dim {out_dim} has size "
                f"{p.shape[out_dim]}, not a multiple of it (dim {out_dim} is the output axis of {layout}, "
                f"shape {tuple(p.shape)})"
            )
