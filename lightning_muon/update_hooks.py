"""Update hooks: callables that observe the orthogonalized updates ``Muon`` applies (``UpdateHooks``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils.hooks import RemovableHandle

__all__ = ["UpdateHook", "UpdateHooks"]

# ``hook(group, params, updates, ortho)``: see ``Muon.register_update_hook``.
UpdateHook = Callable[[dict, list, list, list], None]


class UpdateHooks:
    """The update hooks of one optimizer, in registration order; true when there is one.

    ``Muon`` holds one and exposes it as ``register_update_hook``, ``has_update_hooks`` and
    ``run_update_hooks``; the update rule (or a sharding that holds the whole matrices only
    on owner ranks) runs them.
    """

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, UpdateHook] = OrderedDict()

    def register(self, hook: UpdateHook) -> RemovableHandle:
        """Add ``hook``; ``handle.remove()`` takes it out again, as for torch's hooks."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def run(
        self, group: dict[str, Any], params: list[Tensor], updates: list[Tensor], ortho: list[list[Tensor]]
    ) -> None:
        """Call every hook, in registration order (a copy of the list: a hook may remove itself)."""
        for hook in list(self._hooks.values()):
            hook(group, params, updates, ortho)
