"""Checkpoint loading: which file failed and why (not torch's bare read error), and one file into FSDP2.

``explained_reads`` turns a read failure into a ``CheckpointReadError`` naming the file or
folder. ``load_full_checkpoint`` is Lightning's ``ModelParallelStrategy`` loading of one
checkpoint file, with the optimizer state matched to parameters as the optimizer numbers them
(``load_optimizer_state``, which Fabric's ``muon_fsdp`` uses for its files too).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_muon.checkpoints import by_position
from lightning_muon.muon import Muon
from lightning_muon.routing.checkpoint import check_checkpoint_routing
from lightning_muon.strategies.ddp_core import unwrap

__all__ = ["CheckpointReadError", "explained_reads", "load_full_checkpoint", "load_optimizer_state"]


class CheckpointReadError(RuntimeError):
    """A checkpoint file or folder that cannot be read: damaged, truncated, or missing a shard."""


def _is_read_error(err: BaseException) -> bool:
    if isinstance(err, (OSError, EOFError, pickle.UnpicklingError, CheckpointException)):
        return True
    # torch.load on a truncated zip archive
    return isinstance(err, RuntimeError) and "PytorchStreamReader" in str(err)


def _describe(path: Path) -> str:
    if path.is_dir():
        files = sorted(p.name for p in path.iterdir())
        shown = ", ".join(files[:12]) + (f", ... ({len(files)} in all)" if len(files) > 12 else "")
        return f"the distributed checkpoint folder {str(path)!r} (holding: {shown or 'nothing'})"
    if path.is_file():
        return f"the checkpoint file {str(path)!r} ({path.stat().st_size:,} bytes)"
    return f"{str(path)!r}, which does not exist"


@contextlib.contextmanager
def explained_reads(path: Any) -> Iterator[None]:
    """Re-raise a read failure inside the block as ``CheckpointReadError`` naming ``path`` and what it holds."""
    try:
        yield
    except (Exception, CheckpointException) as err:  # DCP's exception derives from BaseException
        if isinstance(err, CheckpointReadError) or not _is_read_error(err):
            raise
        raise CheckpointReadError(
            f"cannot read {_describe(Path(path))}: it is damaged or incomplete (a truncated file, or a "
            f"shard missing from a distributed checkpoint folder); {type(err).__name__}: {str(err)[:500]}"
        ) from err


def load_full_checkpoint(
    path: Path, module: nn.Module, optimizers: list[Any], strict: bool = True, weights_only: bool | None = None
) -> dict[str, Any]:
    """One Lightning checkpoint file into the FSDP2 ``module`` and its ``optimizers``; returns the rest of it.

    Lightning's ``ModelParallelStrategy`` path for a file, but for the optimizer state's keys:
    each of ``optimizer_states`` loads by ``load_optimizer_state``. The weights load by
    Lightning's ``_load_raw_module_state``.
    """
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    _load_raw_module_state(checkpoint.pop("state_dict"), module, strict=strict)
    for optimizer, saved in zip(optimizers, checkpoint["optimizer_states"]):
        load_optimizer_state(module, optimizer, saved, strict)
    return checkpoint


def load_optimizer_state(module: nn.Module, optimizer: Any, saved: dict[str, Any], strict: bool = True) -> None:
    """One optimizer's state, as one checkpoint file holds it, into ``optimizer`` of the FSDP2 ``module``.

    A file saved by ``muon_ddp``, ``"auto"`` or ``convert-checkpoint`` (under the Trainer or
    Fabric) keys the state by position, as ``Optimizer.state_dict()`` does, and Lightning would
    read the positions in the module's parameter order; ``Muon`` numbers its parameters group
    by group, so one parameter's state would meet another's shape ("The size of tensor a (12)
    must match the size of tensor b (9)"). Here the ids the saved groups list are, in order,
    the optimizer's parameters in its groups' order, as ``Optimizer.load_state_dict`` reads them
    under every other strategy (``checkpoints.by_position``), after ``Muon``'s routing check;
    torch's ``FSDP.rekey_optim_state_dict`` names them, and ``set_optimizer_state_dict`` loads
    them from rank 0 as Lightning does. A state keyed by name (``muon_fsdp``'s own one file)
    loads the same way.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    optimizer = unwrap(optimizer)
    if isinstance(optimizer, Muon):  # a routing change named here, before its ids are read
        check_checkpoint_routing(optimizer.param_groups, saved)
    named = FullyShardedDataParallel.rekey_optim_state_dict(
        by_position(saved), OptimStateKeyType.PARAM_NAME, module, optim=optimizer
    )
    # torch's broadcast from rank 0 sends a tensor's memory as it lies, and the other ranks
    # read it row-major: a column-major one (SOAP's eigenbases, saved in their layout)
    # would reach them transposed. The shards keep the layout of the state they load into.
    named["state"] = {
        name: {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for name, entry in named["state"].items()
    }
    options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=strict)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=named, options=options)
