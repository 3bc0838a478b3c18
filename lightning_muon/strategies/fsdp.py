"""``MuonFSDPStrategy``: FSDP2 (``fully_shard``) with exact Muon, registered as ``muon_fsdp``."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_muon.distributed.fsdp import MuonFSDPSharding
from lightning_muon.distributed.tensor_parallel import MuonTPSharding
from lightning_muon.muon import Muon
from lightning_muon.strategies._checkpoint import explained_reads, load_full_checkpoint
from lightning_muon.strategies._exit import destroy_process_group_at_exit
from lightning_muon.strategies.ddp_core import unwrap
from lightning_muon.strategies.fsdp_core import MuonFSDPCore, default_fully_shard, is_sharded

__all__ = ["MuonFSDPStrategy", "default_fully_shard"]


def _no_configure_model() -> None:
    """Stands in for a missing ``configure_model`` during ``MuonFSDPStrategy.setup`` (the default sharding applies)."""


class MuonFSDPStrategy(ModelParallelStrategy):
    """FSDP2 over every rank, with each Muon matrix orthogonalized whole by one owner rank.

    Built on Lightning's ``ModelParallelStrategy``. By default the whole world is the
    data-parallel mesh dimension (no tensor parallelism). With ``tensor_parallel_size=T``
    the mesh is (data, tensor) as in ``ModelParallelStrategy``: the module's
    ``configure_model`` applies ``parallelize_module`` on ``device_mesh["tensor_parallel"]``
    and ``fully_shard`` on ``device_mesh["data_parallel"]``, and every ``Muon`` gets a
    ``MuonTPSharding``: owners among the data-parallel ranks as below, and ``tp_mode`` on
    the tensor dim (``"duplicated"`` and ``"distributed"`` exact, ``"blockwise"`` an
    approximation; see ``lightning_muon.distributed.tensor_parallel``). Gradient clipping
    then takes the global norm over parameters on the 2-D and the 1-D mesh alike (Lightning's
    own clipping cannot stack their norms). A LightningModule whose ``configure_model``
    applies ``fully_shard`` is left as it is; otherwise ``default_fully_shard`` makes each
    block holding Linear layers an FSDP unit, then each top-level child. Every ``Muon``
    optimizer then gets a ``MuonFSDPSharding``:

    - ``muon_mode="owner"`` (default): exact Muon. Shards of each momentum update go to the
      matrix's owner by all-to-all (bf16 when Newton-Schulz runs in bf16), the owner
      orthogonalizes whole matrices, and the rows go back; owners are balanced by
      Newton-Schulz FLOPs. Momentum and all other state stay DTensors sharded like their
      parameter.
    - ``muon_mode="blockwise"``: each rank orthogonalizes its own row block. No extra
      traffic, but an approximation, not Muon: for comparison.

    Gradient clipping by norm takes the global norm (``clip_grad_norm_`` on DTensors).
    Checkpoints are distributed checkpoints (a folder, one file per rank) by default and
    resume at any world size, ``muon_fsdp`` with ``devices=1`` included. Precision:
    ``32-true`` and ``bf16-mixed`` are tested; ``16-mixed`` is rejected (FSDP2 has no
    GradScaler support here). Processes are started as for ``ModelParallelStrategy``:
    Lightning re-runs the script (popen), or takes those torchrun/SLURM started.

    Args:
        muon_mode: ``"owner"`` or ``"blockwise"`` (no tensor parallelism).
        data_parallel_size: ranks per data-parallel group; ``"auto"``: world size / ``tensor_parallel_size``.
        tensor_parallel_size: ranks per tensor-parallel group (1: FSDP2 alone).
        tp_mode: ``"duplicated"``, ``"distributed"`` or ``"blockwise"`` for every Muon group; None
            takes each group's own (``MuonConfig.tp_mode``, default ``"duplicated"``).
        save_distributed_checkpoint: save a folder of shards (True) or one full file from
            rank 0 (False).
        process_group_backend: ``"nccl"``, ``"gloo"``, ... (default: by device).
        timeout: for the process group's collectives.
    """

    strategy_name = "muon_fsdp"

    def __init__(
        self,
        muon_mode: str = "owner",
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        tp_mode: str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self.muon = MuonFSDPCore(muon_mode, data_parallel_size, tensor_parallel_size, tp_mode, who=type(self).__name__)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.default_units: list[str] = []
        """The FSDP units the default sharding made (empty when the module sharded itself)."""

    @property
    def muon_mode(self) -> str:
        return self.muon.muon_mode

    @property
    def tp_mode(self) -> str | None:
        return self.muon.tp_mode

    @property
    def shardings(self) -> list[MuonFSDPSharding | MuonTPSharding]:
        """The sharding of every ``Muon`` optimizer that has one."""
        optimizers = [unwrap(o) for o in self.optimizers]
        return [o.sharding for o in optimizers if isinstance(o, Muon) and o.sharding is not None]

    @override
    def _configure_launcher(self) -> None:
        # ModelParallelStrategy rejects 16-mixed only when passed as an instance, not by name.
        self.muon.check_precision(self.precision_plugin)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size, _ = self.muon.mesh_sizes(self.num_nodes * self.num_processes)
        super().setup_environment()
        destroy_process_group_at_exit()  # gloo too, not only NCCL as Lightning does

    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup as it is. It refuses a module without a configure_model
        # hook; here the default sharding (model_to_device) stands in for one, so a module
        # without the hook is let through, for this call only.
        module = self.lightning_module
        if module is None or is_overridden("configure_model", module):
            super().setup(trainer)
            return
        module.configure_model = _no_configure_model  # type: ignore[method-assign]
        try:
            super().setup(trainer)
        finally:
            del module.configure_model

    @override
    def model_to_device(self) -> None:
        # ModelParallelStrategy.setup's first hook after configure_model: where that applied no
        # fully_shard, the default sharding does, before the optimizers see the parameters.
        assert self.model is not None
        if not is_sharded(self.model):
            self.default_units = default_fully_shard(self.model, self.device_mesh["data_parallel"])
        super().model_to_device()

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        self.muon.attach(self.optimizers, self.model)
        if self.muon.global_clipping:
            # Lightning's clipping stacks per-parameter norms, which fails across a 1-D and a 2-D mesh.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    @torch.no_grad()
    def _clip_grad_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        """Lightning's ``clip_grad_by_norm`` with the global norm over every mesh (``MuonFSDPCore.clip_grad_norm_``)."""
        self.muon.clip_grad_norm_(optimizer, list(self.precision_plugin.main_params(optimizer)), clip_val)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's loading of a DCP folder; a file by ``load_full_checkpoint`` (its optimizer state keyed by
        position, as every strategy but this one saves it). A damaged one raises ``CheckpointReadError`` naming it."""
        from lightning.fabric.strategies.fsdp import _is_full_checkpoint

        with explained_reads(checkpoint_path):
            path = Path(self.broadcast(checkpoint_path))  # rank 0's, as Lightning takes it
            if not _is_full_checkpoint(path):
                return super().load_checkpoint(path, weights_only=weights_only)
            assert self.model is not None and self.lightning_module is not None
            strict = self.lightning_module.strict_loading
            return load_full_checkpoint(path, self.model, self.optimizers, strict, weights_only)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 (fully_shard) with exact Muon: whole matrices orthogonalized by owner ranks",
        )
