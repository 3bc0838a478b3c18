"""What ``muon_fsdp`` does, once, for the Trainer's strategy and Fabric's alike.

``MuonFSDPCore`` holds the strategy's options (``muon_mode``, the (data, tensor) mesh sizes,
``tp_mode``) and the distributed logic: the mesh sizes for a world, the default FSDP2
sharding of a module that applied none (``default_fully_shard``), a ``MuonFSDPSharding``
or ``MuonTPSharding`` for every ``Muon`` (``attach``), and clipping by the global norm over
parameters on 1-D and 2-D meshes alike (``clip_grad_norm_``). The Trainer's
``lightning_muon.strategies.fsdp.MuonFSDPStrategy`` and Fabric's
``lightning_muon.fabric.MuonFSDPStrategy`` only call it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_muon.algorithms import per_matrix
from lightning_muon.distributed.fsdp import FSDP_MODES, MuonFSDPSharding
from lightning_muon.distributed.grad_norm import clip_by_total_norm_, global_grad_norm
from lightning_muon.distributed.tensor_parallel import MuonTPSharding
from lightning_muon.distributed.tp_math import TP_MODES
from lightning_muon.muon import Muon
from lightning_muon.routing import TRANSPOSED_MODULES
from lightning_muon.strategies.checks import check_optimizers
from lightning_muon.strategies.ddp_core import unwrap

__all__ = ["MuonFSDPCore", "default_fully_shard", "is_sharded"]

# Modules without a forward of their own: their elements are what runs.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


# Layers whose matrix weights make a block worth its own FSDP unit: nn.Linear, convolutions,
# and module types known by class name (transformers' Conv1D, GPT-2's projections).
_MATRIX_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _holds_matrix_layer(module: nn.Module) -> bool:
    return any(isinstance(m, _MATRIX_LAYERS) or type(m).__name__ in TRANSPOSED_MODULES for m in module.modules())


def default_fully_shard(module: nn.Module, mesh: Any, root: bool = False) -> list[str]:
    """Apply ``fully_shard`` the way ``MuonFSDPStrategy`` does for a module that did not; returns the units.

    1. Blocks: each element of an ``nn.ModuleList`` / ``nn.Sequential`` (at any depth) that
       holds a matrix layer (``nn.Linear``, a convolution, or a module type of
       ``TRANSPOSED_MODULES`` such as GPT-2's ``Conv1D``) becomes its own FSDP unit
       (transformer blocks; the layers of a Sequential MLP). Sharded blocks are not
       searched further. A plan of one unit (the whole model gathered at once) warns.
    2. Roots: each direct child of ``module`` that holds parameters becomes an FSDP unit
       over what the blocks left (embeddings, norms, heads); a ``ModuleList`` child has
       no forward, so its elements are taken instead.

    With ``root=False`` (the Trainer) ``module`` itself (the LightningModule) is not
    sharded: Lightning calls ``training_step``, not its ``forward``, so FSDP2's hooks on it
    would never run. With ``root=True`` (Fabric, which calls the model's ``forward``) step 2
    is ``fully_shard(module)``: the root unit takes every parameter the blocks left, its own
    included, as FSDP2 recommends.

    Raises:
        ValueError: with ``root=False``, ``module`` holds parameters directly, or in a
            ``ParameterList`` / ``ParameterDict`` child (no forward of theirs would gather them).
    """
    from torch.distributed.fsdp import fully_shard

    # Parameters that only the LightningModule's own code uses: no FSDP unit's forward would gather them.
    direct = [] if root else [name for name, _ in module.named_parameters(recurse=False)]
    direct += [
        name
        for name, child in module.named_children()
        if not root and isinstance(child, (nn.ParameterList, nn.ParameterDict)) and len(child)
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
    if root:
        fully_shard(module, mesh=mesh)
        units.append("")
    else:
        shard_roots(module, "")
    if len(units) == 1:
        warnings.warn(
            f"MuonFSDPStrategy: the default sharding made a single FSDP unit ({units[0] or 'the model'!r}), so the "
            "whole model is gathered at once; no nn.ModuleList / nn.Sequential of blocks holding matrix layers was "
            "found. Apply fully_shard per block yourself (in the LightningModule's configure_model(), or in the "
            "parallelize_fn given to Fabric's strategy) to shard it finer",
            UserWarning,
            stacklevel=2,
        )
    return units


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def on_2d_mesh(p: Any) -> bool:
    return isinstance(p, DTensor) and p.device_mesh.ndim > 1


class MuonFSDPCore:
    """The options and the distributed logic of ``muon_fsdp``.

    Args:
        muon_mode: ``"owner"`` (exact: whole matrices on owner ranks) or ``"blockwise"``
            (each rank's row block alone; an approximation), FSDP2 alone only.
        data_parallel_size: ranks per data-parallel group, or ``"auto"`` (world / tensor size).
        tensor_parallel_size: ranks per tensor-parallel group (1: FSDP2 alone).
        tp_mode: ``"duplicated"``, ``"distributed"`` or ``"blockwise"`` for every Muon group;
            None takes each group's own.
        who: the strategy's name, for error messages.
    """

    def __init__(
        self,
        muon_mode: str = "owner",
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        tp_mode: str | None = None,
        who: str = "MuonFSDPStrategy",
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
        self.muon_mode = muon_mode
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.tp_mode = tp_mode
        self.who = who
        self.shardings: list[MuonFSDPSharding | MuonTPSharding] = []
        """The sharding of every ``Muon`` optimizer attached, in order."""
        self.global_clipping = False
        """True once a parameter lives on a 2-D mesh: then only ``clip_grad_norm_`` can take the global norm."""

    def mesh_sizes(self, world_size: int) -> tuple[int, int]:
        """(data, tensor) sizes for ``world_size`` ranks: the ranks not in tensor groups form the data dim.

        (``ModelParallelStrategy``'s ``"auto"`` would make the data dim the node count.)
        """
        tp = self.tensor_parallel_size
        dp = world_size // tp if self.data_parallel_size == "auto" else self.data_parallel_size
        if dp * tp != world_size:
            raise ValueError(
                f"{self.who}: data_parallel_size={self.data_parallel_size} x tensor_parallel_size={tp} "
                f"must equal the number of processes ({world_size})"
            )
        return dp, tp

    def check_precision(self, precision: Any) -> None:
        """FSDP2 here has no GradScaler support: ``16-mixed`` is refused (``bf16-mixed`` works)."""
        if getattr(precision, "precision", None) == "16-mixed":
            raise ValueError(f"{self.who} does not support precision='16-mixed'; use 'bf16-mixed'")

    def attach(self, optimizers: list[Any], module: nn.Module) -> list[MuonFSDPSharding | MuonTPSharding]:
        """Check the optimizers against the sharded ``module``; give each Muon with Muon groups its sharding.

        A ``MuonTPSharding`` where tensor parallelism is on or a Muon matrix lives on a 2-D
        mesh, a ``MuonFSDPSharding`` otherwise. Every rank must call it.
        """
        optimizers = [unwrap(o) for o in optimizers]
        check_optimizers(optimizers, module, self.who, "muon_fsdp")
        shardings = []
        for optimizer in optimizers:
            on_2d = {g["algorithm"] for g in optimizer.param_groups for p in g["params"] if on_2d_mesh(p)}
            self.global_clipping |= bool(on_2d)
            if optimizer.sharding is not None or not any(per_matrix(g) for g in optimizer.param_groups):
                continue
            if self.tensor_parallel_size > 1 or any(per_matrix(a) for a in on_2d):
                sharding = MuonTPSharding(optimizer, tp_mode=self._resolve_tp_mode(optimizer))
                rank_zero_info(
                    f"{self.who}: Muon on a {sharding.dp_size} x {sharding.tp_size} (data x tensor) mesh, "
                    f"tp_mode={sharding.tp_mode!r}"
                )
            else:
                sharding = MuonFSDPSharding(optimizer, mode=self.muon_mode)
            shardings.append(sharding)
        self.shardings += shardings
        return shardings

    def _resolve_tp_mode(self, optimizer: Muon) -> str:
        """The strategy's ``tp_mode`` if set (written into every Muon group), else the groups' own (all alike)."""
        # Muon's groups carry a tp_mode; the other per-matrix algorithms' (Emerging-Optimizers'
        # names, SOAP) gather their matrices whole: "duplicated".
        groups = [g for g in optimizer.param_groups if per_matrix(g) and "tp_mode" in g]
        modes = {g["tp_mode"] for g in groups} or {TP_MODES[0]}
        if self.tp_mode is None:
            if len(modes) > 1:
                raise ValueError(f"{self.who}: the Muon groups ask for different tp_modes {sorted(modes)}")
            return modes.pop()
        clash = modes - {self.tp_mode, TP_MODES[0]}  # a group left at the default takes the strategy's
        if clash:
            raise ValueError(
                f"{self.who}(tp_mode={self.tp_mode!r}) and the optimizer's tp_mode {sorted(clash)} (MuonConfig."
                "tp_mode) disagree; set one of them"
            )
        for g in groups:
            g["tp_mode"] = self.tp_mode
        return self.tp_mode

    @staticmethod
    def clip_grad_norm_(
        optimizer: Any, params: list[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite=False
    ) -> Tensor | None:
        """``clip_grad_norm_`` over every gradient, whatever mesh its DTensor lives on; returns the total norm.

        A local piece counts once over the world: it is held by the world size over the sizes
        of the mesh dims it is sharded across (``global_grad_norm``). Lightning's and torch's
        own clipping stack per-parameter norms, which fails across a 1-D and a 2-D mesh.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        pieces = []
        for g in grads:
            local, copies = g, world
            if isinstance(g, DTensor):
                local = g.to_local()
                sharded = [
                    g.device_mesh.size(i) for i, pl in enumerate(g.placements) if isinstance(pl, (Shard, _StridedShard))
                ]
                copies = world // math.prod(sharded)
            pieces.append((local, copies))
        sharding = getattr(unwrap(optimizer), "sharding", None)
        stats = sharding.stats_by_dim["world"] if isinstance(sharding, MuonTPSharding) else None
        device = pieces[0][0].device
        total = global_grad_norm(pieces, norm_type, device=device, stats=stats)
        return clip_by_total_norm_(grads, total, max_norm, norm_type, error_if_nonfinite)
