"""``MuonDDPStrategy``: DDP with Newton-Schulz sharded across ranks (``muon_ddp``, ``muon_ddp_spawn``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_muon.algorithms import orthogonalizes
from lightning_muon.distributed.comm import all_reduce_
from lightning_muon.distributed.sharded import MODES, MuonSharding
from lightning_muon.muon import Muon
from lightning_muon.strategies._checkpoint import explained_reads
from lightning_muon.strategies._exit import destroy_process_group_at_exit

__all__ = ["MuonDDPStrategy"]


def _sharding_of(optimizer: Optimizer) -> MuonSharding | None:
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    return optimizer.sharding if isinstance(optimizer, Muon) else None


class MuonDDPStrategy(DDPStrategy):
    """Data parallel training where each Muon matrix is orthogonalized once, by its owner rank.

    ``muon_mode="reduce_scatter"`` (default): DDP ignores the Muon matrices; their gradients
    are averaged straight onto owner ranks, owners step them, and the new values are sent
    to every rank: the same bytes as DDP's all-reduce of those matrices, and 1/W of the
    Newton-Schulz work per rank. ``muon_mode="all_gather"``: DDP all-reduces everything and
    owners share their results (+50% traffic for the Muon matrices; a fallback).

    Gradient clipping by norm uses the global norm over the sharded gradients. The
    optimizer state in checkpoints holds every matrix's momentum, whichever rank owns it,
    so a checkpoint resumes at any world size.

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
        if muon_mode not in MODES:
            raise ValueError(f"muon_mode must be one of {MODES}, got {muon_mode!r}")
        if owner_group_size is not None and (
            isinstance(owner_group_size, bool) or not isinstance(owner_group_size, int) or owner_group_size < 1
        ):
            raise ValueError(f"owner_group_size must be a positive int or None, got {owner_group_size!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        super().__init__(*args, **kwargs)
        self.muon_mode = muon_mode
        self.owner_group_size = owner_group_size
        self.overlap = overlap
        self.bucket_cap_mb = float(bucket_cap_mb)
        self._optimizers_ready = False

    @property
    def shardings(self) -> list[MuonSharding]:
        return [s for s in (_sharding_of(opt) for opt in self.optimizers) if s is not None]

    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()  # gloo too, not only NCCL as Lightning does

    def configure_ddp(self) -> None:
        # Optimizers first, on the unwrapped module: DDP must learn which parameters to
        # ignore before it wraps the model.
        super().setup_optimizers(self.lightning_module.trainer)
        self._optimizers_ready = True
        size = self.owner_group_size or self.num_processes  # default: one group per node
        if self.world_size % size:
            raise ValueError(
                f"owner_group_size={size} must divide the world size {self.world_size} "
                f"({self.num_nodes} node(s) x {self.num_processes} device(s))"
            )
        for optimizer in self.optimizers:
            if isinstance(optimizer, Muon) and any(orthogonalizes(g) for g in optimizer.param_groups):
                MuonSharding(optimizer, mode=self.muon_mode, owner_group_size=size)
        if self.muon_mode == "reduce_scatter" and self.shardings:
            ids = {id(p) for s in self.shardings for p in s.params}
            names = [n for n, p in self.model.named_parameters() if id(p) in ids]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.model, names)
            # DDP broadcasts rank 0's parameters at wrap time, except ignored ones.
            for s in self.shardings:
                for p in s.params:
                    dist.broadcast(p.data, src=0)
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
            self._share_overflows()
        super().configure_ddp()
        if self.overlap and self.muon_mode == "reduce_scatter":
            ddp = self.model
            for s in self.shardings:
                # False inside DDP's no_sync (micro-batches that only accumulate).
                s.overlap_with_backward(lambda: ddp.require_backward_grad_sync, self.bucket_cap_mb)

    def _share_overflows(self) -> None:
        """Give a GradScaler torch's ``ShardedGradScaler``: every rank then skips an overflowing step alike.

        Owners alone hold the reduced Muon gradients, so an overflow in one shows on one rank;
        ``ShardedGradScaler`` all-reduces what each rank's unscaling found, so every rank skips
        the step and lowers the scale together. Its settings and state come from the scaler given.
        """
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or isinstance(scaler, ShardedGradScaler) or not scaler.is_enabled():
            return
        group = self.shardings[0].group
        sharded = ShardedGradScaler(self.precision_plugin.device, process_group=group or dist.group.WORLD)
        sharded.load_state_dict(scaler.state_dict())
        self.precision_plugin.scaler = sharded

    def setup_optimizers(self, trainer: Any) -> None:
        if not self._optimizers_ready:  # configure_ddp built them already
            super().setup_optimizers(trainer)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        sharding = _sharding_of(optimizer)
        if sharding is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def reduced_closure() -> Any:
            # After backward, before AMP unscaling and clipping: the ranks agree on finiteness
            # before anything reads the gradients.
            output = closure()
            sharding.reduce_gradients()
            return output

        return super().optimizer_step(optimizer, reduced_closure, model, **kwargs)

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` semantics with the norm over sharded (owner-only) gradients."""
        sharding = _sharding_of(optimizer)
        params = [p for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        if sharding is None or not params:
            torch.nn.utils.clip_grad_norm_(params, clip_val)
            return
        sharded = {id(p) for p in sharding.params}
        device = params[0].grad.device
        squares = torch.zeros(2, device=device, dtype=torch.float32)  # (sharded, replicated)
        for p in params:
            squares[0 if id(p) in sharded else 1] += p.grad.detach().float().pow(2).sum()
        own = squares[:1].clone()
        # Each group holds every owned gradient once: the sum over one group is the whole norm.
        all_reduce_(own, group=sharding.owner_group, stats=sharding.stats, name="clip_norm")
        total_norm = (own[0] + squares[1]).sqrt()
        coef = torch.clamp(clip_val / (total_norm + 1e-6), max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef.to(device))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full state on every rank: every Muon matrix's state (momentum and more), gathered from owners."""
        state = super().optimizer_state(optimizer)
        sharding = _sharding_of(optimizer)
        if sharding is None:
            return state
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
        for p, entries in zip(sharding.params, sharding.gather_states()):
            if entries:
                state["state"][index[id(p)]] = entries
        return state

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's loading; a damaged or truncated file raises ``CheckpointReadError`` naming it."""
        with explained_reads(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        for sharding in self.shardings:
            sharding.drop_foreign_state()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("muon_ddp", "popen"), ("muon_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"DDP with Muon's Newton-Schulz sharded across ranks, start_method '{start_method}'",
                start_method=start_method,
            )
