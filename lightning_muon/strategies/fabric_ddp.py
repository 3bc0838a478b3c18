"""``muon_ddp`` for Lightning Fabric: the Trainer strategy's distributed logic behind Fabric's hooks.

Fabric calls its strategy at fixed points; ``MuonDDPCore`` does the work at each:

    fabric.setup(model, optimizer)       attach shardings, DDP told to ignore the Muon matrices, DDP wraps
    fabric.setup_module(model)           DDP wraps (nothing is known of the optimizer yet) ...
    fabric.setup_optimizers(optimizer)   ... attach shardings, and the DDP wrapper is rebuilt in place
                                         with the Muon matrices ignored (before any forward)
    fabric.backward(loss)                plain backward; with overlap, Muon gradients of a backward
                                         outside fabric.no_backward_sync leave from its hooks
    fabric.clip_gradients(...)           reduce onto owners (once per step), unscale, global norm
    optimizer.step()                     reduce onto owners (if not yet), step, results to every rank
    fabric.save / fabric.load            every matrix's state gathered from owners / dropped by non-owners

Fabric has no hook at the end of backward, so the Muon gradients are reduced at the first
of ``fabric.clip_gradients`` and ``optimizer.step()``, after every micro-batch of an
accumulation, as DDP's own reduction ends with the last synchronizing backward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_muon.checkpoints import distributed_checkpoint_error, is_distributed_checkpoint
from lightning_muon.distributed.ddp import MuonDDPSharding
from lightning_muon.strategies._checkpoint import explained_reads
from lightning_muon.strategies._exit import destroy_process_group_at_exit
from lightning_muon.strategies.checks import holds_parameters
from lightning_muon.strategies.ddp_core import MuonDDPCore, sharding_of, unwrap

__all__ = ["MuonDDPStrategy"]


class MuonDDPStrategy(DDPStrategy):
    """Fabric's DDP with each Muon matrix orthogonalized once, by its owner rank (``muon_ddp``, ``muon_ddp_spawn``).

    The Fabric counterpart of ``lightning_muon.MuonDDPStrategy``, with the same options and
    the same distributed logic (``MuonDDPCore``): DDP leaves the Muon matrices alone, their
    gradients are averaged straight onto owners (the bytes of DDP's all-reduce), owners step
    them and send the new values to every rank. ``fabric.clip_gradients`` takes the global
    norm over the sharded gradients; ``fabric.save`` writes every matrix's optimizer state,
    so a checkpoint resumes at any world size.

    Every optimizer must be a ``lightning_muon.Muon`` over the parameters of the model set
    up with it. Fabric's documented flow works unchanged; the one thing to know is that
    the Muon gradients are reduced at the first of ``fabric.clip_gradients`` and
    ``optimizer.step()``: with ``overlap`` (the default), accumulate micro-batches inside
    ``fabric.no_backward_sync(model)``, as with plain DDP, so that only the last backward
    of a step sends them.

    Args:
        muon_mode, owner_group_size, overlap, bucket_cap_mb: as ``lightning_muon.MuonDDPStrategy``.
        *args, **kwargs: Fabric's ``DDPStrategy`` arguments (``start_method``, ``timeout``,
            ``process_group_backend``, DDP's own keywords).
    """

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
        self._wrapped: dict[int, tuple[nn.Module, DistributedDataParallel]] = {}
        self._reduced: set[int] = set()  # ids of the shardings whose gradients are on their owners this step

    @property
    def shardings(self) -> list[MuonDDPSharding]:
        """The sharding of every ``Muon`` optimizer set up so far."""
        return list(self.muon.shardings)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()  # gloo too, not only NCCL as Lightning does

    # ------------------------------------------------------------------ setup

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        # Optimizers first, on the bare module: DDP must learn which parameters to ignore
        # before it wraps the model.
        shardings = self.muon.attach(optimizers, module, self.world_size, self.num_processes)
        self.muon.leave_to_owners(module, shardings)
        self.muon.share_overflows(self.precision)
        ddp = self._wrap(module)
        self.muon.after_wrap(ddp, shardings)
        return ddp, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        return self._wrap(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """A Muon set up after its model (``fabric.setup_module``, then ``fabric.setup_optimizers``).

        DDP reads the parameters to ignore only when it is built, so the wrapper made for the
        model is rebuilt in place, with the Muon matrices ignored: the module Fabric returned
        stays the one to call. Do it before the first forward (Fabric's documented order).
        """
        if not self._wrapped:
            raise ValueError(
                f"{type(self).__name__} ('muon_ddp'): set up the model before its optimizer: "
                "fabric.setup(model, optimizer), or fabric.setup_module(model) then fabric.setup_optimizers(optimizer)"
            )
        # The model that holds the optimizer's parameters (else the last one: attach names the stranger).
        module, ddp = next(
            ((m, ddp) for m, ddp in self._wrapped.values() if holds_parameters(m, unwrap(optimizer))),
            list(self._wrapped.values())[-1],
        )
        shardings = self.muon.attach([optimizer], module, self.world_size, self.num_processes)
        if shardings and self.muon.muon_mode == "reduce_scatter":
            self.muon.leave_to_owners(module, shardings)
            self._wrap(module, into=ddp)
        self.muon.share_overflows(self.precision)
        self.muon.after_wrap(ddp, shardings)
        return optimizer

    def _wrap(self, module: nn.Module, into: DistributedDataParallel | None = None) -> DistributedDataParallel:
        """Fabric's DDP wrapper of ``module``; with ``into``, that wrapper is rebuilt in place instead.

        DDP's constructor reads the parameters to ignore, broadcasts rank 0's values of the
        others and registers its gradient hooks; running it again on the same wrapper drops
        the old reducer (and its hooks) and builds a new one.
        """
        if into is None:
            ddp = super().setup_module(module)
        else:
            ddp = into
            device_ids = self._determine_ddp_device_ids()
            ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
            with ctx:
                DistributedDataParallel.__init__(ddp, module, device_ids=device_ids, **self._ddp_kwargs)
        self._wrapped[id(module)] = (module, ddp)
        return ddp

    # ------------------------------------------------------------------ the step

    def _reduce(self, optimizer: Any) -> None:
        """The Muon gradients onto their owners, once per step (every rank, after the last backward)."""
        sharding = sharding_of(optimizer)
        if sharding is not None and id(sharding) not in self._reduced:
            self.muon.reduce(optimizer)
            self._reduced.add(id(sharding))

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        closure: Callable[[], Any] | None = kwargs.pop("closure", None)
        if closure is None:
            self._reduce(optimizer)
        else:

            def reduced_closure() -> Any:
                output = closure()  # backward runs here: reduce after it, before unscaling
                self._reduce(optimizer)
                return output

            kwargs["closure"] = reduced_closure
        try:
            return super().optimizer_step(optimizer, **kwargs)
        finally:
            sharding = sharding_of(optimizer)
            self._reduced.discard(id(sharding))

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global norm over every rank's gradients (Muon ones live on owners), and clipping by it."""
        self._reduce(optimizer)
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        total = self.muon.clip_grad_norm_(optimizer, params, max_norm, norm_type, error_if_nonfinite)
        return total if total is not None else torch.zeros((), device=self.root_device)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        self._reduce(optimizer)  # clamping owned values equals clamping the averaged ones everywhere
        super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------------ checkpoints

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full state on every rank: every Muon matrix's state, gathered from owners (every rank calls it)."""
        optimizer = unwrap(optimizer)  # a _FabricOptimizer's state_dict() would come back here
        return self.muon.full_state(optimizer, super().get_optimizer_state(optimizer))

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Fabric's loading; then each rank drops the state of matrices others own. A damaged file names itself.

        A distributed checkpoint folder (``muon_fsdp``'s) raises ``DistributedCheckpointError``.
        """
        if is_distributed_checkpoint(path):
            raise distributed_checkpoint_error(path, type(self).__name__)
        with explained_reads(path):
            remainder = super().load_checkpoint(path, state, strict=strict, **kwargs)
        self.muon.drop_foreign_state()
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("muon_ddp", "popen"), ("muon_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"DDP with Muon's Newton-Schulz sharded across ranks, start_method '{start_method}'",
                start_method=start_method,
            )
