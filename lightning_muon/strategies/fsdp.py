"""``MuonFSDPStrategy``: FSDP2 (``fully_shard``) with exact Muon, registered as ``muon_fsdp``."""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_muon.distributed.fsdp import FSDP_MODES, MuonFSDPSharding
from lightning_muon.muon import Muon
from lightning_muon.routing import TRANSPOSED_MODULES
from lightning_muon.strategies._checkpoint import explained_reads

__all__ = ["MuonFSDPStrategy", "default_fully_shard"]

# Modules without a forward of their own: their elements are what runs.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


# Layers whose matrix weights make a block worth its own FSDP unit: nn.Linear, convolutions,
# and module types known by class name (transformers' Conv1D, GPT-2's projections).
_MATRIX_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _holds_matrix_layer(module: nn.Module) -> bool:
    return any(isinstance(m, _MATRIX_LAYERS) or type(m).__name__ in TRANSPOSED_MODULES for m in module.modules())


def default_fully_shard(module: nn.Module, mesh: Any) -> list[str]:
    """Apply ``fully_shard`` the way ``MuonFSDPStrategy`` does for a module that did not; returns the units.

    1. Blocks: each element of an ``nn.ModuleList`` / ``nn.Sequential`` (at any depth) that
       holds a matrix layer (``nn.Linear``, a convolution, or a module type of
       ``TRANSPOSED_MODULES`` such as GPT-2's ``Conv1D``) becomes its own FSDP unit
       (transformer blocks; the layers of a Sequential MLP). Sharded blocks are not
       searched further. A plan of one unit (the whole model gathered at once) warns.
    2. Roots: each direct child of ``module`` that holds parameters becomes an FSDP unit
       over what the blocks left (embeddings, norms, heads); a ``ModuleList`` child has
       no forward, so its elements are taken instead.

    ``module`` itself (the LightningModule) is not sharded: Lightning calls
    ``training_step``, not its ``forward``, so FSDP2's hooks on it would never run.

    Raises:
        ValueError: ``module`` holds parameters directly, or in a ``ParameterList`` /
            ``ParameterDict`` child (no forward of theirs would gather them).
    """
    from torch.distributed.fsdp import fully_shard

    # Parameters that only the LightningModule's own code uses: no FSDP unit's forward would gather them.
    direct = [name for name, _ in module.named_parameters(recurse=False)]
    direct += [
        name
        for name, child in module.named_children()
        if isinstance(child, (nn.ParameterList, nn.ParameterDict)) and len(child)
    ]
    if direct:
        raise ValueError(
            f"MuonFSDPStrategy: {type(module).__name__} holds parameters directly ({direct}); the default sharding "
            "shards child modules only. Move them into a submodule, or apply fully_shard in configure_model()"
        )
    units: list[str] = []

    def shard_blocks(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if isinstance(parent, (nn.ModuleList, nn.Sequential)) and _holds_matrix_layer(child):
                fully_shard(child, mesh=mesh)
                units.append(path)
            else:
                shard_blocks(child, f"{path}.")

    def shard_roots(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if not any(True for _ in child.parameters()):
                continue
            if isinstance(child, _CONTAINERS):
                shard_roots(child, f"{path}.")
            elif not _is_fsdp(child):
                fully_shard(child, mesh=mesh)
                units.append(path)

    shard_blocks(module, "")
    shard_roots(module, "")
    if len(units) == 1:
        warnings.warn(
            f"MuonFSDPStrategy: the default sharding made a single FSDP unit ({units[0]!r}), so the whole model is "
            "gathered at once; no nn.ModuleList / nn.Sequential of blocks holding matrix layers was found. Apply "
            "fully_shard per block in the LightningModule's configure_model() to shard it finer",
            UserWarning,
            stacklevel=2,
        )
    return units


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _inner(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class MuonFSDPStrategy(ModelParallelStrategy):
    """FSDP2 over every rank, with each Muon matrix orthogonalized whole by one owner rank.

    Built on Lightning's ``ModelParallelStrategy`` with the whole world as the data-parallel
    mesh dimension (no tensor parallelism). A LightningModule whose ``configure_model``
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
        muon_mode: ``"owner"`` or ``"blockwise"``.
        save_distributed_checkpoint: save a folder of shards (True) or one full file from
            rank 0 (False).
        process_group_backend: ``"nccl"``, ``"gloo"``, ... (default: by device).
        timeout: for the process group's collectives.
    """

    strategy_name = "muon_fsdp"

    def __init__(
        self,
        muon_mode: str = "owner",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if muon_mode not in FSDP_MODES:
            raise ValueError(f"muon_mode must be one of {FSDP_MODES}, got {muon_mode!r}")
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.muon_mode = muon_mode
        self.default_units: list[str] = []
        """The FSDP units the default sharding made (empty when the module sharded itself)."""

    @property
    def shardings(self) -> list[MuonFSDPSharding]:
        return [s for s in (getattr(_inner(o), "_sharding", None) for o in self.optimizers) if s is not None]

    @override
    def _configure_launcher(self) -> None:
        # ModelParallelStrategy rejects 16-mixed only when passed as an instance, not by name.
        if getattr(self.precision_plugin, "precision", None) == "16-mixed":
            raise ValueError(f"{type(self).__name__} does not support precision='16-mixed'; use 'bf16-mixed'")
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # All ranks form the data-parallel dimension ("auto" would make it the node count).
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, with the default sharding where configure_model did none
        # (it requires configure_model instead).
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(f"{type(self).__name__} takes FSDP2 (fully_shard), not FullyShardedDataParallel modules")
        self.accelerator.setup(trainer)
        if not _is_sharded(self.model):
            self.default_units = default_fully_shard(self.model, self.device_mesh["data_parallel"])
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)  # after sharding: Muon sees the DTensor parameters
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for optimizer in map(_inner, self.optimizers):
            if isinstance(optimizer, Muon) and any(g["algorithm"] == "muon" for g in optimizer.param_groups):
                MuonFSDPSharding(optimizer, mode=self.muon_mode)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's loading (a DCP folder or a file); a damaged one raises ``CheckpointReadError`` naming it."""
        with explained_reads(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 (fully_shard) with exact Muon: whole matrices orthogonalized by owner ranks",
        )
