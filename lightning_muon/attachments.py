"""What attaches to a ``Muon`` optimizer from outside: a sharding across ranks, update hooks, a router."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from lightning_muon.added_groups import Router
    from lightning_muon.distributed.protocol import Sharding

__all__ = ["Attachments", "UpdateHook"]

# ``hook(group, params, updates, ortho)``: see ``Muon.register_update_hook``.
UpdateHook = Callable[[dict, list, list, list], None]


class Attachments:
    """``Muon``'s sharding (``attach_sharding``), update hooks (``register_update_hook``) and router, as a mixin."""

    def _init_attachments(self) -> None:
        self._sharding: Sharding | None = None
        self._update_hooks: OrderedDict[int, UpdateHook] = OrderedDict()
        self._router: Router | None = None

    @property
    def router(self) -> Router | None:
        """Where ``add_param_group`` sends the tensors of a group given without an algorithm; None: the flat rule."""
        return self._router

    def attach_router(self, router: Router | None) -> None:
        """Route groups added without an ``"algorithm"`` by ``router`` (``added_groups``); None: the flat rule.

        ``configure_muon_optimizers`` attaches an ``added_groups.ModuleRouter``, so that a
        backbone unfrozen later (``BackboneFinetuning``) is routed by the config's rules.
        """
        self._router = router

    @property
    def sharding(self) -> Sharding | None:
        """The ``distributed.Sharding`` that splits Newton-Schulz across ranks, or None (one process)."""
        return self._sharding

    def attach_sharding(self, sharding: Sharding | None) -> None:
        """Let ``sharding`` split this optimizer's Muon work across ranks (None: detach).

        A ``Sharding`` calls this from its constructor; ``step`` then asks it which
        parameters this rank steps (``owns``), what part of a gradient it holds
        (``local_shard``), whether every rank's gradients are finite (``step_finite``), to
        orthogonalize (``orthogonalize``) and to share the results (``gather_parameters``).
        """
        if sharding is not None and sharding.optimizer is not self:
            raise ValueError("Muon.attach_sharding: the sharding was built for another optimizer")
        self._sharding = sharding

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(group, params, updates, ortho)`` on every Muon update; returns a handle to remove it.

        Called after orthogonalization (and any second moment), before the update is
        applied, on the rank that steps the matrices: ``updates`` are the momentum tensors
        fed to Newton-Schulz, ``ortho`` per parameter its list of pieces (shaped like
        ``functional.matrix_views``), as they are applied before the lr scale. Under a
        sharding that holds whole matrices only on owners (FSDP2) the sharding runs the
        hooks there, with the whole matrices, before any second moment. Hooks must not
        modify their arguments. ``handle.remove()`` unregisters it, as for torch's hooks.
        """
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    @property
    def has_update_hooks(self) -> bool:
        """True when an update hook is registered."""
        return bool(self._update_hooks)

    def run_update_hooks(
        self, group: dict[str, Any], params: list[Tensor], updates: list[Tensor], ortho: list[list[Tensor]]
    ) -> None:
        """Call every registered update hook, in registration order (a sharding that observes updates calls it)."""
        for hook in list(self._update_hooks.values()):
            hook(group, params, updates, ortho)
