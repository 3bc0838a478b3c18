"""``MuonFSDPStrategy``: FSDP2 (``fully_shard``) with exact Muon, registered as ``muon_fsdp``."""

from __future__ import annotations

import math
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from typing_extensions import override

from lightning_muon.algorithms import orthogonalizes
from lightning_muon.distributed.comm import all_reduce_
from lightning_muon.distributed.fsdp import FSDP_MODES, MuonFSDPSharding
from lightning_muon.distributed.tensor_parallel import MuonTPSharding
from lightning_muon.distributed.tp_math import TP_MODES
from lightning_muon.muon import Muon
from lightning_muon.routing import TRANSPOSED_MODULES
from lightning_muon.strategies._checkpoint import explained_reads
from lightning_muon.strategies._exit import destroy_process_group_at_exit

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


def _on_2d_mesh(p: Any) -> bool:
    return isinstance(p, DTensor) and p.device_mesh.ndim > 1


def _no_configure_model() -> None:
    """Stands in for a missing ``configure_model`` during ``MuonFSDPStrategy.setup`` (the default sharding applies)."""


def _inner(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


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
        if muon_mode not in FSDP_MODES:
            raise ValueError(f"muon_mode must be one of {FSDP_MODES}, got {muon_mode!r}")
        if tp_mode is not None and tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {TP_MODES} or None, got {tp_mode!r}")
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size == "auto" and name == "data_parallel_size":
                continue
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int{' or auto' if name[0] == 'd' else ''}, got {size!r}")
        if muon_mode != "owner" and tensor_parallel_size > 1:
            raise ValueError(
                f"muon_mode={muon_mode!r} is for FSDP2 alone; with tensor_parallel_size > 1 choose tp_mode instead"
            )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.muon_mode = muon_mode
        self.tp_mode = tp_mode
        self.default_units: list[str] = []
        """The FSDP units the default sharding made (empty when the module sharded itself)."""

    @property
    def shardings(self) -> list[MuonFSDPSharding | MuonTPSharding]:
        """The sharding of every ``Muon`` optimizer that has one."""
        optimizers = [_inner(o) for o in self.optimizers]
        return [o.sharding for o in optimizers if isinstance(o, Muon) and o.sharding is not None]

    @override
    def _configure_launcher(self) -> None:
        # ModelParallelStrategy rejects 16-mixed only when passed as an instance, not by name.
        if getattr(self.precision_plugin, "precision", None) == "16-mixed":
            raise ValueError(f"{type(self).__name__} does not support precision='16-mixed'; use 'bf16-mixed'")
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # The ranks not in tensor-parallel groups form the data-parallel dimension ("auto" in
        # ModelParallelStrategy would make it the node count).
        world, tp = self.num_nodes * self.num_processes, self._tensor_parallel_size
        dp = world // tp if self._data_parallel_size == "auto" else self._data_parallel_size
        if dp * tp != world:
            raise ValueError(
                f"{type(self).__name__}: data_parallel_size={self._data_parallel_size} x tensor_parallel_size={tp} "
                f"must equal the number of processes ({world})"
            )
        self._data_parallel_size = dp
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
        if not _is_sharded(self.model):
            self.default_units = default_fully_shard(self.model, self.device_mesh["data_parallel"])
        super().model_to_device()

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        two_d = False
        for optimizer in map(_inner, self.optimizers):
            on_2d = {g["algorithm"] for g in optimizer.param_groups for p in g["params"] if _on_2d_mesh(p)}
            two_d |= bool(on_2d)
            if not (isinstance(optimizer, Muon) and any(orthogonalizes(g) for g in optimizer.param_groups)):
                continue
            if self._tensor_parallel_size > 1 or any(orthogonalizes(a) for a in on_2d):
                sharding = MuonTPSharding(optimizer, tp_mode=self._resolve_tp_mode(optimizer))
                rank_zero_info(
                    f"{type(self).__name__}: Muon on a {sharding.dp_size} x {sharding.tp_size} (data x tensor) mesh, "
                    f"tp_mode={sharding.tp_mode!r}"
                )
            else:
                MuonFSDPSharding(optimizer, mode=self.muon_mode)
        if two_d:
            # Lightning's clipping stacks per-parameter norms, which fails across a 1-D and a 2-D mesh.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _resolve_tp_mode(self, optimizer: Muon) -> str:
        """The strategy's ``tp_mode`` if set (written into every Muon group), else the groups' own (all alike)."""
        groups = [g for g in optimizer.param_groups if orthogonalizes(g)]
        modes = {g["tp_mode"] for g in groups}
        if self.tp_mode is None:
            if len(modes) > 1:
                raise ValueError(f"MuonFSDPStrategy: the Muon groups ask for different tp_modes {sorted(modes)}")
            return modes.pop()
        clash = modes - {self.tp_mode, TP_MODES[0]}  # a group left at the default takes the strategy's
        if clash:
            raise ValueError(
                f"MuonFSDPStrategy(tp_mode={self.tp_mode!r}) and the optimizer's tp_mode {sorted(clash)} (MuonConfig."
                "tp_mode) disagree; set one of them"
            )
        for g in groups:
            g["tp_mode"] = self.tp_mode
        return self.tp_mode

    @torch.no_grad()
    def _clip_grad_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        """``clip_grad_norm_`` over every gradient, whatever mesh its DTensor lives on.

        Each rank sums the squares of its local pieces, each divided by the number of ranks
        holding a copy of it (the world size over the mesh sizes it is sharded across), and one
        all-reduce over the world gives the global sum of squares.
        """
        grads = [p.grad for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        if not grads:
            return
        world = dist.get_world_size()
        device = self.root_device
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            local, copies = g, world
            if isinstance(g, DTensor):
                local = g.to_local()
                sharded = [
                    g.device_mesh.size(i) for i, pl in enumerate(g.placements) if isinstance(pl, (Shard, _StridedShard))
                ]
                copies = world // math.prod(sharded)
            if local.numel():
                total += local.detach().float().square().sum().to(device) / copies
        sharding = getattr(_inner(optimizer), "sharding", None)
        stats = sharding.stats_by_dim["world"] if isinstance(sharding, MuonTPSharding) else None
        all_reduce_(total, stats=stats, name="clip_norm")
        coef = torch.clamp(clip_val / (total.sqrt() + 1e-6), max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))

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
