"""Loading optimizer state only where it belongs: the routing check ``Muon.load_state_dict`` runs first.

torch matches saved state to parameters by position alone; after a change of routing
rules, Muon momentum would land on an AdamW parameter, or a shape would change and the
first step fail far from the cause. Groups carry ``param_names`` and ``algorithm``, so a
checkpoint can be checked against this run's groups before it is loaded.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor

__all__ = ["check_checkpoint_routing"]

# State entries shaped like their parameter (second moments may be reduced: not checked).
_PARAM_SHAPED = ("momentum_buffer", "exp_avg", "exp_avg_sq", "main_param")
_warned_unnamed = False


def check_checkpoint_routing(param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """Raise unless ``state_dict`` was saved with the routing of ``param_groups`` (this optimizer's groups).

    Every name must sit in the same group, at the same place, with the same algorithm, and
    every saved tensor must have its parameter's shape. Without names (an older or
    hand-made checkpoint) positions are trusted, with a warning, once per process.
    """
    saved_groups = state_dict.get("param_groups", [])
    named_then = all("param_names" in g for g in saved_groups)
    named_now = all("param_names" in g for g in param_groups)
    if len(saved_groups) == len(param_groups) and named_then and named_now:
        _check_routing(param_groups, saved_groups, state_dict.get("state", {}))
        return
    if named_now != named_then:
        unnamed = "the checkpoint's param groups carry" if named_now else "this optimizer's parameters have"
        _warn_once(
            f"Muon.load_state_dict: {unnamed} no param_names, so the routing could not be checked by name and "
            "the state is matched to parameters by position only (as torch.optim does); shapes are still checked"
        )
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint has {len(saved_groups)} param groups "
            f"({[g.get('name', g.get('algorithm')) for g in saved_groups]}), this optimizer "
            f"{len(param_groups)} ({[g.get('name', g['algorithm']) for g in param_groups]}): "
            "the routing changed since it was saved; resume with the rules it was saved with"
        )
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        _check_shapes(i, group, saved, state_dict.get("state", {}))


def _warn_once(message: str) -> None:
    global _warned_unnamed
    if not _warned_unnamed:
        _warned_unnamed = True  # every resume of such a run says the same
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _check_routing(param_groups: list[dict], saved_groups: list[dict], saved_state: dict) -> None:
    def where(groups: list[dict]) -> dict[str, tuple[int, int, str, str]]:
        return {
            name: (i, j, g.get("name", g.get("algorithm")), g.get("algorithm"))
            for i, g in enumerate(groups)
            for j, name in enumerate(g["param_names"])
        }

    then, now = where(saved_groups), where(param_groups)
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        for name in group["param_names"]:
            if then.get(name) != now[name]:
                before = then.get(name)
                was = "absent" if before is None else f"param group {before[0]} {before[2]!r} ({before[3]})"
                raise ValueError(
                    f"Muon.load_state_dict: {name!r} was routed to {was} when the checkpoint was saved, and "
                    f"to param group {i} {now[name][2]!r} ({now[name][3]}) now; its optimizer state would "
                    "land on another parameter. Resume with the routing rules the checkpoint was saved with "
                    "(or load only the model weights)"
                )
        _check_shapes(i, group, saved, saved_state)


def _check_shapes(i: int, group: dict, saved: dict, saved_state: dict) -> None:
    """Every saved tensor shaped like its parameter has the shape of the parameter at its place now."""
    names = group.get("param_names") or [None] * len(group["params"])
    for j, (name, p) in enumerate(zip(names, group["params"])):
        if j >= len(saved["params"]):
            break
        here = f"{name!r}" if name else f"parameter {j} of param group {i}"
        for key, value in saved_state.get(saved["params"][j], {}).items():
            if key in _PARAM_SHAPED and isinstance(value, Tensor) and tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"Muon.load_state_dict: {here} has shape {tuple(p.shape)}, but the checkpoint's "
                    f"{key!r} for it has shape {tuple(value.shape)}: the model or its routing changed "
                    "since the checkpoint was saved"
                )
