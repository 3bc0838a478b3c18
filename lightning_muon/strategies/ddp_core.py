"""What ``muon_ddp`` does, once, for the Trainer's strategy and Fabric's alike.

``MuonDDPCore`` holds the strategy's options and every step of the distributed logic; the
two strategies (``lightning_muon.strategies.ddp`` for the Trainer, ``fabric_ddp`` for
Fabric) only call it at the points where their framework lets them in:

    attach(optimizers, module)   a MuonDDPSharding per Muon (owners planned), checks   before DDP wraps
    leave_to_owners(module)      DDP told to ignore the Muon matrices, rank 0's     before DDP wraps
                                 values broadcast (DDP broadcasts all others)
    share_overflows(precision)   a GradScaler becomes torch's ShardedGradScaler
    after_wrap(ddp)              overlap: Muon gradients leave from backward's hooks
    reduce(optimizer)            Muon gradients averaged onto their owners           after backward,
                                                                                     before unscale/clip
    clip_grad_norm_(...)         clipping by the global norm over sharded gradients
    full_state(optimizer, sd)    every matrix's optimizer state, fetched from owners  checkpoint save
    drop_foreign_state()         owners keep only their own state                     checkpoint load
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from lightning_muon.algorithms import per_matrix
from lightning_muon.distributed.ddp import MODES, MuonDDPSharding
from lightning_muon.distributed.grad_norm import clip_by_total_norm_, global_grad_norm
from lightning_muon.muon import Muon
from lightning_muon.strategies.checks import check_optimizers

__all__ = ["MuonDDPCore", "unwrap"]


def unwrap(optimizer: Any) -> Any:
    """The optimizer inside Lightning's or Fabric's wrapper (``LightningOptimizer``, ``_FabricOptimizer``)."""
    inner = getattr(optimizer, "_optimizer", None)
    return optimizer if inner is None else inner


def sharding_of(optimizer: Any) -> MuonDDPSharding | None:
    """The ``MuonDDPSharding`` attached to ``optimizer`` (wrapped or not), or None."""
    optimizer = unwrap(optimizer)
    return optimizer.sharding if isinstance(optimizer, Muon) else None


class MuonDDPCore:
    """The options and the distributed logic of ``muon_ddp`` (see the module docstring for the call order).

    Args:
        muon_mode: ``"reduce_scatter"`` (DDP ignores the Muon matrices; their gradients go
            straight to owners: the bytes of DDP's all-reduce) or ``"all_gather"`` (DDP
            all-reduces everything; owners split the Newton-Schulz work; +50% traffic).
        owner_group_size: S, ranks per owner group (None: the devices per node).
        overlap: send Muon gradients to owners from backward's hooks (``reduce_scatter``).
        bucket_cap_mb: bucket size for ``overlap``.
        who: the strategy's name, for error messages.
    """

    def __init__(
        self,
        muon_mode: str = "reduce_scatter",
        owner_group_size: int | None = None,
        overlap: bool = True,
        bucket_cap_mb: float = 25.0,
        who: str = "MuonDDPStrategy",
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
        self.muon_mode = muon_mode
        self.owner_group_size = owner_group_size
        self.overlap = overlap
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.who = who
        self.shardings: list[MuonDDPSharding] = []
        """The sharding of every ``Muon`` optimizer that has Muon groups, in the order attached."""

    # ------------------------------------------------------------------ before DDP wraps

    def attach(
        self, optimizers: list[Any], module: nn.Module, world_size: int, num_processes: int
    ) -> list[MuonDDPSharding]:
        """Check the optimizers against ``module`` and give each Muon with Muon groups a ``MuonDDPSharding``.

        Every rank must call it (it may create process groups). Raises for an optimizer that is
        not a ``Muon`` and for parameters ``module`` does not hold (``checks.check_optimizers``).
        """
        check_optimizers([unwrap(o) for o in optimizers], module, self.who, "muon_ddp")
        size = self.owner_group_size or num_processes  # default: one group per node
        if world_size % size:
            raise ValueError(
                f"{self.who}: owner_group_size={size} must divide the world size {world_size} "
                f"({world_size // max(num_processes, 1)} node(s) x {num_processes} device(s))"
            )
        new = []
        for optimizer in map(unwrap, optimizers):
            if optimizer.sharding is None and any(per_matrix(g) for g in optimizer.param_groups):
                new.append(MuonDDPSharding(optimizer, mode=self.muon_mode, owner_group_size=size))
        self.shardings += new
        return new

    def leave_to_owners(self, module: nn.Module, shardings: list[MuonDDPSharding]) -> None:
        """``reduce_scatter`` mode: DDP leaves ``shardings``' matrices alone; rank 0's values are broadcast.

        Call before DDP wraps ``module``: DDP reads the names to ignore when it is built, and
        it broadcasts rank 0's parameters then, except the ignored ones.
        """
        if self.muon_mode != "reduce_scatter" or not shardings:
            return
        ids = {id(p) for s in shardings for p in s.params}
        names = [n for n, p in module.named_parameters() if id(p) in ids]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
        for s in shardings:
            for p in s.params:
                dist.broadcast(p.data, src=0)

    def share_overflows(self, precision: Any) -> None:
        """Give a GradScaler torch's ``ShardedGradScaler``: every rank then skips an overflowing step alike.

        Owners alone hold the reduced Muon gradients, so an overflow in one shows on one rank;
        ``ShardedGradScaler`` all-reduces what each rank's unscaling found, so every rank skips
        the step and lowers the scale together. Its settings and state come from the scaler given.
        ``precision`` is the Trainer's or Fabric's precision plugin (both keep ``scaler``, ``device``).
        """
        scaler = getattr(precision, "scaler", None)
        if not self.shardings or scaler is None or isinstance(scaler, ShardedGradScaler) or not scaler.is_enabled():
            return
        group = self.shardings[0].group
        sharded = ShardedGradScaler(precision.device, process_group=group or dist.group.WORLD)
        sharded.load_state_dict(scaler.state_dict())
        precision.scaler = sharded

    # ------------------------------------------------------------------ after DDP wraps

    def after_wrap(self, ddp: DistributedDataParallel, shardings: list[MuonDDPSharding]) -> None:
        """With ``overlap``: Muon gradients leave from backward's hooks on a backward that synchronizes."""
        if self.overlap and self.muon_mode == "reduce_scatter":
            for s in shardings:
                # False inside DDP's no_sync (micro-batches that only accumulate).
                s.overlap_with_backward(lambda: ddp.require_backward_grad_sync, self.bucket_cap_mb)

    # ------------------------------------------------------------------ the step

    @staticmethod
    def reduce(optimizer: Any) -> None:
        """Average ``optimizer``'s Muon gradients onto their owners (every rank, after backward, before unscaling)."""
        sharding = sharding_of(optimizer)
        if sharding is not None:
            sharding.reduce_gradients()

    @staticmethod
    def clip_grad_norm_(
        optimizer: Any, params: list[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite=False
    ) -> Tensor | None:
        """``clip_grad_norm_`` semantics with the norm over the sharded (owner-only) Muon gradients.

        Each owner group holds every owned gradient once; the AdamW (replicated) gradients
        are on every rank. Returns the total norm, or None when there is no gradient.
        """
        sharding = sharding_of(optimizer)
        parts = sharding.part_grads() if sharding is not None else []  # this rank's rows of expert stacks
        grads = [p.grad for p in params if p.grad is not None] + parts
        if not grads:
            return None
        # In all_gather mode DDP reduced every gradient, Muon ones too: all are replicated.
        owned_only = sharding is not None and sharding.mode == "reduce_scatter"
        sharded = {id(p) for p in sharding.params} if owned_only else set()
        world = dist.get_world_size() if dist.is_initialized() else 1
        groups = world // sharding.group_size if sharding is not None else world
        pieces = [(p.grad, groups if id(p) in sharded else world) for p in params if p.grad is not None]
        pieces += [(g, groups) for g in parts]
        stats = sharding.stats if sharding is not None else None
        total = global_grad_norm(pieces, norm_type, device=grads[0].device, stats=stats, replicated=not owned_only)
        return clip_by_total_norm_(grads, total, max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ checkpoints

    @staticmethod
    def full_state(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (``optimizer.state_dict()``) with every Muon matrix's state, gathered from its owner.

        Every rank must call it (one all-to-all inside each owner group).
        """
        sharding = sharding_of(optimizer)
        if sharding is None:
            return state
        inner = unwrap(optimizer)
        index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
        for p, entries in zip(sharding.params, sharding.gather_states()):
            if entries:
                state["state"][index[id(p)]] = entries
        return state

    def drop_foreign_state(self) -> None:
        """After loading a full state: each rank forgets the state of matrices another rank owns."""
        for sharding in self.shardings:
            sharding.drop_foreign_state()
