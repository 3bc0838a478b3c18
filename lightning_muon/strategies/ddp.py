"""``MuonDDPStrategy``: DDP with Newton-Schulz sharded across ranks (``muon_ddp``, ``muon_ddp_spawn``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.checkpoints import distributed_checkpoint_error, is_distributed_checkpoint
from lightning_muon.distributed.ddp import MuonDDPSharding
from lightning_muon.strategies._checkpoint import explained_reads
from lightning_muon.strategies._exit import destroy_process_group_at_exit
from lightning_muon.strategies.ddp_core import MuonDDPCore, sharding_of

__all__ = ["MuonDDPStrategy"]


class MuonDDPStrategy(DDPStrategy):
    """Data parallel training where each Muon matrix is orthogonalized once, by its owner rank.

    ``muon_mode="reduce_scatter"`` (default): DDP ignores the Muon matrices; their gradients
    are averaged straight onto owner ranks, owners step them, and the new values are sent
    to every rank: the same bytes as DDP's all-reduce of those matrices, and 1/W of the
    Newton-Schulz work per rank. ``muon_mode="all_gather"``: DDP all-reduces everything and
    owners share their results (+50% traffic for the Muon matrices; a fallback).

    Gradient clipping by norm uses the global norm over the sharded gradients. The
    optimizer state in checkpoints holds every matrix's momentum, whichever rank owns it,
    so a checkpoint resumes at any world size. Every optimizer must be a ``Muon`` over the
    module's parameters. The distributed logic is ``MuonDDPCore``'s, shared with Fabric's
    ``lightning_muon.fabric.MuonDDPStrategy``.

    Args:
        muon_mode: ``"reduce_scatter"`` or ``"all_gather"``.
        owner_group_size: S, ranks per owner group (HSDP's pattern): the Muon gradients are
            reduced onto owners inside each group of S consecutive ranks, each owner's sum is
            all-reduced with its peers in the other groups, and the results are gathered
            inside the group. Default: the devices per node (one group per node); the world
            size gives one group over every rank. Must divide the world size.
        overlap: send Muon gradients to their owners from backward's hooks, in buckets, on
            the micro-batch that ends an accumulation (``reduce_scatter`` mode); the step
            waits for them. False: one all-to-all after backward.
        bucket_cap_mb: bucket size for ``overlap``.
    """

    strategy_name = "muon_ddp"

    def __init__(
        self,
        *args: Any,
        muon_mode: str = "reduce_scatter",
        owner_group_size: int | None = None,
        overlap: bool = True,
        bucket_cap_mb: float = 25.0,
        **kwargs: Any,
    ) -> None:
        self.muon = MuonDDPCore(muon_mode, owner_group_size, overlap, bucket_cap_mb, who=type(self).__name__)
        super().__init__(*args, **kwargs)
        self._optimizers_ready = False

    @property
    def muon_mode(self) -> str:
        return self.muon.muon_mode

    @property
    def owner_group_size(self) -> int | None:
        return self.muon.owner_group_size

    @property
    def overlap(self) -> bool:
        return self.muon.overlap

    @property
    def bucket_cap_mb(self) -> float:
        return self.muon.bucket_cap_mb

    @property
    def shardings(self) -> list[MuonDDPSharding]:
        return [s for s in (sharding_of(opt) for opt in self.optimizers) if s is not None]

    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()  # gloo too, not only NCCL as Lightning does

    def configure_ddp(self) -> None:
        # Optimizers first, on the unwrapped module: DDP must learn which parameters to
        # ignore before it wraps the model.
        super().setup_optimizers(self.lightning_module.trainer)
        self._optimizers_ready = True
        shardings = self.muon.attach(self.optimizers, self.model, self.world_size, self.num_processes)
        self.muon.leave_to_owners(self.model, shardings)
        if self.muon.muon_mode == "reduce_scatter" and shardings:
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        self.muon.share_overflows(self.precision_plugin)
        super().configure_ddp()
        self.muon.after_wrap(self.model, shardings)

    def setup_optimizers(self, trainer: Any) -> None:
        if not self._optimizers_ready:  # configure_ddp built them already
            super().setup_optimizers(trainer)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if sharding_of(optimizer) is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def reduced_closure() -> Any:
            # After backward, before AMP unscaling and clipping: the ranks agree on finiteness
            # before anything reads the gradients.
            output = closure()
            self.muon.reduce(optimizer)
            return output

        return super().optimizer_step(optimizer, reduced_closure, model, **kwargs)

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's ``clip_grad_by_norm`` with the norm over sharded (owner-only) gradients."""
        self.muon.clip_grad_norm_(optimizer, list(self.precision_plugin.main_params(optimizer)), clip_val)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full state on every rank: every Muon matrix's state (momentum and more), gathered from owners."""
        return self.muon.full_state(optimizer, super().optimizer_state(optimizer))

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's loading; a damaged or truncated file raises ``CheckpointReadError`` naming it.

        A distributed checkpoint folder (``muon_fsdp``'s) raises ``DistributedCheckpointError``
        naming ``strategy="muon_fsdp"`` and the converter.
        """
        if is_distributed_checkpoint(checkpoint_path):
            raise distributed_checkpoint_error(checkpoint_path, type(self).__name__)
        with explained_reads(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.muon.drop_foreign_state()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("muon_ddp", "popen"), ("muon_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"DDP with Muon's Newton-Schulz sharded across ranks, start_method '{start_method}'",
                start_method=start_method,
            )
