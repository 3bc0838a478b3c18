"""``muon_fsdp`` for Lightning Fabric: FSDP2 (and 2-D meshes) with exact Muon, on Fabric's ``ModelParallelStrategy``.

Fabric's flow under FSDP2, and what happens at each call (``MuonFSDPCore`` does the work):

    fabric.setup_module(model)        parallelize_fn(model, mesh), or the default FSDP2 sharding:
                                      one unit per block holding matrix layers, then the root
    Muon(model.parameters(), ...)     made from the sharded (DTensor) parameters
    fabric.setup_optimizers(opt)      checked against the model; a MuonFSDPSharding (1-D mesh)
                                      or MuonTPSharding (2-D mesh) attached
    optimizer.step()                  each Muon matrix's rows to its owner, orthogonalized whole, back
    fabric.clip_gradients(...)        the global norm over every mesh
    fabric.save / fabric.load         distributed checkpoints (a folder, one file per rank),
                                      loadable at any world size; one file (muon_ddp's, one
                                      device's, convert-checkpoint's) loads too
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _Stateful
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_muon.distributed.fsdp import MuonFSDPSharding
from lightning_muon.distributed.tensor_parallel import MuonTPSharding
from lightning_muon.muon import Muon
from lightning_muon.strategies._checkpoint import explained_reads, load_optimizer_state
from lightning_muon.strategies._exit import destroy_process_group_at_exit
from lightning_muon.strategies.checks import holds_parameters
from lightning_muon.strategies.ddp_core import unwrap
from lightning_muon.strategies.fsdp_core import MuonFSDPCore, default_fully_shard, is_sharded

__all__ = ["MuonFSDPStrategy"]


class MuonFSDPStrategy(ModelParallelStrategy):
    """Fabric's FSDP2 (``fully_shard``) and 2-D meshes with each Muon matrix orthogonalized whole by one owner.

    The Fabric counterpart of ``lightning_muon.MuonFSDPStrategy``, with the same options and
    the same distributed logic (``MuonFSDPCore``). Set the model up first, then make the
    optimizer from its (now sharded) parameters::

        fabric = L.Fabric(strategy="muon_fsdp", devices=2)
        fabric.launch()
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(Muon(model.parameters(), lr=0.02))

    Args:
        parallelize_fn: ``fn(model, device_mesh) -> model`` applying the parallelism, as for
            Fabric's ``ModelParallelStrategy`` (with ``tensor_parallel_size > 1``:
            ``parallelize_module`` on ``device_mesh["tensor_parallel"]``, then ``fully_shard`` on
            ``device_mesh["data_parallel"]``). None: ``default_fully_shard(model, mesh, root=True)``
            (each block of an ``nn.ModuleList`` / ``nn.Sequential`` holding a matrix layer, then
            the whole model); needs ``tensor_parallel_size=1``.
        muon_mode, data_parallel_size, tensor_parallel_size, tp_mode: as ``lightning_muon.MuonFSDPStrategy``.
        save_distributed_checkpoint, process_group_backend, timeout: as Fabric's ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None,
        muon_mode: str = "owner",
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        tp_mode: str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self.muon = MuonFSDPCore(muon_mode, data_parallel_size, tensor_parallel_size, tp_mode, who=type(self).__name__)
        if parallelize_fn is None and tensor_parallel_size > 1:
            raise ValueError(
                f"{type(self).__name__}: tensor_parallel_size={tensor_parallel_size} needs a parallelize_fn(model, "
                "mesh) that applies parallelize_module on mesh['tensor_parallel'], then fully_shard on "
                "mesh['data_parallel']"
            )
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ValueError(f"parallelize_fn must be a callable (model, device_mesh) -> model, got {parallelize_fn!r}")
        self._user_parallelize = parallelize_fn
        super().__init__(
            parallelize_fn=self._parallelize,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._modules: list[nn.Module] = []
        self.default_units: list[str] = []
        """The FSDP units the default sharding made (empty with a ``parallelize_fn``)."""

    @property
    def shardings(self) -> list[MuonFSDPSharding | MuonTPSharding]:
        """The sharding of every ``Muon`` optimizer set up so far."""
        return list(self.muon.shardings)

    def _parallelize(self, module: nn.Module, mesh: Any) -> nn.Module:
        if self._user_parallelize is not None:
            return self._user_parallelize(module, mesh)
        self.default_units = default_fully_shard(module, mesh["data_parallel"], root=True)
        return module

    @override
    def _configure_launcher(self) -> None:
        self.muon.check_precision(self.precision)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size, _ = self.muon.mesh_sizes(self.num_nodes * self.num_processes)
        super().setup_environment()
        destroy_process_group_at_exit()  # gloo too, not only NCCL as Lightning does

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if not is_sharded(module):
            raise ValueError(
                f"{type(self).__name__} ('muon_fsdp'): parallelize_fn returned a model without FSDP2-sharded "
                f"parameters ({type(module).__name__}); apply torch.distributed.fsdp.fully_shard to its blocks "
                "and to the model (on mesh['data_parallel']), or pass no parallelize_fn for the default sharding"
            )
        self._modules.append(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check ``optimizer`` against the model set up before it and attach its sharding."""
        if not self._modules:
            raise ValueError(
                f"{type(self).__name__} ('muon_fsdp'): set up the model before making its optimizer: "
                "model = fabric.setup_module(model), then fabric.setup_optimizers(Muon(model.parameters(), ...))"
            )
        held = [m for m in self._modules if holds_parameters(m, unwrap(optimizer))]
        self.muon.attach([optimizer], (held or self._modules)[-1])
        return optimizer

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global norm over every gradient on every mesh, and clipping by it."""
        self.precision.unscale_gradients(optimizer)
        inner = unwrap(optimizer)
        if isinstance(inner, Muon):
            inner.finite_checks.precheck()  # clipping spreads one NaN: name the parameter it came from first
        params = list(self.precision.main_params(optimizer))
        total = self.muon.clip_grad_norm_(optimizer, params, max_norm, norm_type, error_if_nonfinite)
        return total if total is not None else torch.zeros((), device=self.root_device)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Fabric's loading (a DCP folder or a file); a damaged one raises ``CheckpointReadError`` naming it.

        From one file (``fabric.save`` under ``muon_ddp`` or one device, ``convert-checkpoint``'s
        output) the model and the rest load as Fabric loads them, and each optimizer's state by
        ``load_optimizer_state``: such a file keys it by position, and Fabric would read the
        positions in the module's parameter order, not the optimizer's.

        From a distributed checkpoint folder Fabric's ``ModelParallelStrategy`` puts the saved
        ``state_dict()`` of a stateful object other than the model and optimizers (an lr
        scheduler) in its place in ``state`` instead of loading it into the object; here the
        object loads it and stays in ``state``, as every other Fabric strategy does.
        """
        from lightning.fabric.strategies.fsdp import _is_full_checkpoint
        from lightning.fabric.strategies.model_parallel import _has_dtensor_modules

        stateful, optimizers = {}, {}
        if isinstance(state, dict):
            stateful = {k: v for k, v in state.items() if isinstance(v, _Stateful) and not isinstance(v, nn.Module)}
            stateful = {k: v for k, v in stateful.items() if not isinstance(v, Optimizer)}
        with explained_reads(path):
            path = Path(self.broadcast(path))  # rank 0's, as Fabric takes it
            if isinstance(state, dict) and _is_full_checkpoint(path):
                optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
                rest = {k: v for k, v in state.items() if k not in optimizers}
                remainder = super().load_checkpoint(path, rest, strict=strict, **kwargs)
                state.update(rest)  # what Fabric moved into it from the file
                module = next(v for v in rest.values() if _has_dtensor_modules(v))
                for key, optimizer in optimizers.items():
                    load_optimizer_state(module, optimizer, remainder.pop(key), strict)
            else:
                remainder = super().load_checkpoint(path, state, strict=strict, **kwargs)
        for key, obj in stateful.items():
            if state[key] is not obj:
                obj.load_state_dict(state[key])
                state[key] = obj
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "muon_fsdp",
            cls,
            description="FSDP2 (fully_shard) with exact Muon: whole matrices orthogonalized by owner ranks",
        )
