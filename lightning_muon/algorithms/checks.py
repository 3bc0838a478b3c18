"""Checks shared by the algorithms' hyperparameters: numbers in a range, choices, bools, beta pairs.

Every error is an ``HparamError`` (a ``ValueError``) whose message starts with where the
value came from (``"Muon()"``, ``"param group 2 ('muon')"``) and names the key as the user
wrote it: ``prefix`` turns a group key into ``Muon``'s keyword (``eps`` -> ``adamw_eps``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

__all__ = [
    "HparamError",
    "check_betas",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "normalize",
    "with_placeholders",
]


class HparamError(ValueError):
    """A bad hyperparameter; ``field`` is the ``Muon`` keyword it came from, ``detail`` the message after ``where``."""

    def __init__(self, message: str, field: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.detail = message if detail is None else detail


def _error(where: str, detail: str, field: str) -> HparamError:
    return HparamError(f"{where}: {detail}", field, detail)


def check_number(
    value: Any,
    name: str,
    where: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    field: str | None = None,
) -> None:
    """``value`` is a finite real in the interval (``low_open``/``high_open``: the end excluded)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise _error(where, f"{name} must be a finite number in {lo}{low}, {high}{hi}, got {value!r}", field or name)


def check_int(value: Any, name: str, where: str, low: int) -> None:
    """``value`` is an int (not a bool) of at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive int" if low == 1 else f"an int >= {low}"
        raise _error(where, f"{name} must be {what}, got {value!r}", name)


def check_choice(group: dict[str, Any], name: str, where: str, choices: tuple) -> None:
    """``group[name]`` is one of ``choices`` (None matched by identity, strings by value)."""
    value = group[name]
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        raise _error(where, f"{name} must be one of {choices}, got {value!r}", name)


def check_bool(group: dict[str, Any], name: str, where: str) -> None:
    if not isinstance(group[name], bool):
        raise _error(where, f"{name} must be a bool, got {group[name]!r}", name)


def check_betas(betas: Any, where: str, prefix: str, beta1_open: bool = False) -> tuple[float, float]:
    """A pair (beta1, beta2), each in [0, 1) (``beta1_open``: beta1 in (0, 1)); returned as a tuple."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise _error(where, f"{prefix}betas must be a pair (beta1, beta2), got {betas!r}", f"{prefix}betas")
    for k, beta in enumerate(betas):
        low_open = k == 0 and beta1_open
        check_number(beta, f"{prefix}betas[{k}]", where, 0.0, 1.0, low_open, True, field=f"{prefix}betas")
    return tuple(betas)


def with_placeholders(part: Any) -> dict[str, Any]:
    """``part``'s fields, with an lr and weight decay of None (take AdamW's, checked there) as 0."""
    values = dataclasses.asdict(part)
    for name in ("lr", "weight_decay"):
        values[name] = 0.0 if values[name] is None else values[name]
    return values


def normalize(part: Any, values: dict[str, Any]) -> None:
    """Store the checked, normalized ``values`` on the frozen dataclass ``part`` (once, at construction)."""
    for name, value in values.items():
        object.__setattr__(part, name, value)
