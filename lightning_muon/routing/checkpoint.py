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
    global _warned_unnamed
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) == len(param_groups) and all("param_names" in g for g in saved_groups):
        _check_routing(param_groups, saved_groups, state_dict.get("state", {}))
        return
    named_now = all("param_names" in g for g in param_groups)
    if named_now and not all("param_names" in g for g in saved_groups) and not _warned_unnamed:
        _warned_unnamed = True  # every resume of such a run says the same
        warnings.warn(
            "Muon.load_state_dict: the checkpoint's param groups carry no param_names, so its state is "
            "matched to parameters by position only (as torch.optim does)",
            RuntimeWarning,
            stacklevel=3,
        )
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"Muon.load_state_dict: the checkpoint has {len(saved_groups)} param groups "
            f"({[g.get('name', g.get('algorithm')) for g in saved_groups]}), this optimizer "
            f"{len(param_groups)} ({[g.get('name', g['algorithm']) for g in param_groups]}): "
            "the routing changed since it was saved; resume with the rules it was saved with"
        )


def _check_routing(param_groups: list[dict], saved_groups: list[dict], saved_state: dict) -> None:
    def where(groups: list[dict]) -> dict[str, tuple[int, int, str, str]]:
        return {
            name: (i, j, g.get("name", g.get("algorithm")), g.get("algorithm"))
            for i, g in enumerate(groups)
            for j, name in enumerate(g["param_names"])
        }

    then, now = where(saved_groups), where(param_groups)
    for i, group in enumerate(param_groups):
        saved = saved_groups[i]
        names = group.get("param_names") or [None] * len(group["params"])
        for j, (name, p) in enumerate(zip(names, group["params"])):
            here = f"{name!r}" if name else f"parameter {j} of param group {i}"
            if name is not None and then.get(name) != now[name]:
                before = then.get(name)
                was = "absent" if before is None else f"param group {before[0]} {before[2]!r} ({before[3]})"
                raise ValueError(
                    f"Muon.load_state_dict: {here} was routed to {was} when the checkpoint was saved, and "
                    f"to param group {i} {now[name][2]!r} ({now[name][3]}) now; its optimizer state would "
                    "land on another parameter. Resume with the routing rules the checkpoint was saved with "
                    "(or load only the model weights)"
                )
            if j >= len(saved["params"]):
                continue
            for key, value in saved_state.get(saved["params"][j], {}).items():
                if key in _PARAM_SHAPED and isinstance(value, Tensor) and tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"Muon.load_state_dict: {here} has shape {tuple(p.shape)}, but the checkpoint's "
                        f"{key!r} for it has shape {tuple(value.shape)}: the model or its routing changed "
                        "since the checkpoint was saved"
                    )
