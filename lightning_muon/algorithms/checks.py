"""``HparamError``: a bad setting, naming the field as the user wrote it; and the check of a group's bool keys.

The settings' own checks are generated from their fields (``algorithms.settings``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HparamError", "check_bool"]


class HparamError(ValueError):
    """A bad setting; ``field`` is the name the user wrote (a keyword, a field, an alias), ``detail`` the message
    after where the value came from."""

    def __init__(self, message: str, field: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.detail = message if detail is None else detail


def check_bool(group: dict[str, Any], name: str, where: str) -> None:
    """``group[name]`` is a bool, or an ``HparamError`` naming it."""
    if not isinstance(group[name], bool):
        detail = f"{name} must be a bool, got {group[name]!r}"
        raise HparamError(f"{where}: {detail}", name, detail)
