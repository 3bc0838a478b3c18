"""``muon_fsdp``'s checkpoint folders elsewhere: recognized, refused with the ways out, converted to one file.

``muon_fsdp`` saves a checkpoint as a folder, torch's distributed checkpoint (DCP): one
shard file per rank, ``.metadata``, and Lightning's ``meta.pt`` with everything but the
model and the optimizer (loops, ``lr_schedulers``, callbacks, hyperparameters). Inside the
shards the model's state is keyed by parameter name under ``state_dict``, and each
optimizer's under ``optimizer_{i}``, keyed by parameter name as well
(``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``). A Fabric folder
(``fabric.save`` under ``muon_fsdp``) holds the model and each optimizer under the key
``fabric.save`` was given, and ``meta.pt`` the rest of its state.

Any world size of ``muon_fsdp`` resumes such a folder (``devices=1`` included). Another
strategy reads one file, and would fail on the folder with a bare ``IsADirectoryError``:
``DistributedCheckpointError`` says what the folder is and the two ways out, and
``convert_checkpoint`` (``python -m lightning_muon convert-checkpoint DIR OUT.ckpt``) makes the
one file: the checkpoint a single-device run would have saved, with the optimizer state
keyed by position as ``Muon.state_dict()`` keys it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["DistributedCheckpointError", "by_position", "convert_checkpoint", "is_distributed_checkpoint"]

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a folder's shards
LIGHTNING_METADATA = "meta.pt"  # Lightning's: the checkpoint less the model and the optimizers
CONVERT_COMMAND = "python -m lightning_muon convert-checkpoint"


class DistributedCheckpointError(ValueError):
    """A distributed checkpoint folder given to a strategy that reads one checkpoint file."""


def is_distributed_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a folder holding a torch distributed checkpoint (``muon_fsdp``'s format)."""
    try:
        path = Path(path)
    except TypeError:
        return False
    return path.is_dir() and (path / DCP_METADATA).is_file()


def distributed_checkpoint_error(path: Any, reader: str) -> DistributedCheckpointError:
    """The error for ``reader`` (a strategy's name) given the distributed checkpoint folder ``path``."""
    return DistributedCheckpointError(
        f'{str(path)!r} is a distributed checkpoint (a folder of shards, as strategy="muon_fsdp" saves it), '
        f'and {reader} reads one checkpoint file. Resume it with strategy="muon_fsdp" (any number of devices, '
        f"devices=1 included), or convert it to one file first: {CONVERT_COMMAND} {shlex.quote(str(path))} OUT.ckpt"
    )


def by_position(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by position, as ``Optimizer.state_dict()`` keys it, from one keyed otherwise.

    The keys are parameter names (DCP's layout) or ids in any numbering (``muon_fsdp``'s one
    file numbers them in the module's order); positions run over the groups' ``params`` in
    order, as torch numbers them, and as ``Optimizer.load_state_dict`` reads any numbering.
    """
    groups = optimizer_state.get("param_groups", [])
    index: dict[Any, int] = {}
    new_groups = []
    for group in groups:
        params = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            params.append(index[name])
        new_groups.append({**group, "params": params})
    state = optimizer_state.get("state", {})
    unknown = sorted(str(name) for name in state if name not in index)
    if unknown:
        raise ValueError(f"the optimizer state names parameters no param group holds: {unknown[:5]}")
    return {"state": {index[name]: value for name, value in state.items()}, "param_groups": new_groups}


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, dict) and "param_groups" in value and set(value) <= {"state", "param_groups"}


def convert_checkpoint(folder: str | os.PathLike, output: str | os.PathLike) -> dict[str, Any]:
    """Write the distributed checkpoint ``folder`` as the one file ``output``; returns what was written.

    The file is a Lightning checkpoint as a single-device run saves it (``state_dict``,
    ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``, ``global_step``,
    ``epoch``, the hyperparameters): ``Trainer(strategy="auto").fit(model, ckpt_path=output)``
    resumes it, ``torch.load(output)`` reads it, and ``muon_fsdp`` takes it too. The tensors
    are whole (no DTensors); the optimizer state is keyed by position, as ``Muon`` keeps it
    on one device. A Fabric folder becomes the file ``fabric.save`` writes on one device: the
    model and each optimizer under the key it was saved under (each optimizer's state keyed
    by position), beside the rest of the saved state, which ``fabric.load`` reads under
    ``muon_fsdp``, ``muon_ddp`` or one device. Built on
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``; the whole checkpoint
    passes through this process's memory.

    Raises:
        ValueError: ``folder`` is not a distributed checkpoint (no ``.metadata``) or holds no
            ``meta.pt`` (one not saved by Lightning).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, output = Path(folder), Path(output)
    if not is_distributed_checkpoint(folder):
        what = "a file" if folder.is_file() else ("a folder without .metadata" if folder.is_dir() else "missing")
        raise ValueError(f"{str(folder)!r} is no distributed checkpoint folder ({what})")
    if not (folder / LIGHTNING_METADATA).is_file():
        raise ValueError(f"{str(folder)!r} holds no {LIGHTNING_METADATA}: not a checkpoint Lightning saved")
    if output.resolve() == folder.resolve() or output.is_dir():
        raise ValueError(f"the output {str(output)!r} must be a file path, not a folder")
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        raw_path = Path(tmp) / "dcp.pt"
        dcp_to_torch_save(folder, raw_path)
        raw = torch.load(raw_path, map_location="cpu", weights_only=False)  # written just now, from the folder
    checkpoint = torch.load(folder / LIGHTNING_METADATA, map_location="cpu", weights_only=False)
    if "state_dict" in raw:  # the Trainer's: the optimizers as a list
        checkpoint["state_dict"] = raw.pop("state_dict")
        optimizers = sorted((k for k in raw if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
        checkpoint["optimizer_states"] = [by_position(raw.pop(key)) for key in optimizers]
    # anything else saved beside them; a Fabric folder's model and optimizers, under their keys
    checkpoint.update({key: by_position(value) if _is_optimizer_state(value) else value for key, value in raw.items()})
    torch.save(checkpoint, output)
    return checkpoint


def main(args: list[str] | None = None, prog: str = CONVERT_COMMAND) -> int:
    """``python -m lightning_muon convert-checkpoint DIR OUT.ckpt``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert a distributed checkpoint folder (strategy=muon_fsdp) into one checkpoint file that "
        'any strategy resumes (strategy="auto" on one device included) and torch.load reads.',
    )
    parser.add_argument("folder", help="the distributed checkpoint folder, e.g. checkpoints/epoch=0-step=100.ckpt")
    parser.add_argument("output", help="the checkpoint file to write, e.g. step100.ckpt")
    options = parser.parse_args(args)
    try:
        checkpoint = convert_checkpoint(options.folder, options.output)
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    if "state_dict" not in checkpoint:  # a Fabric folder's
        print(f"{options.output}: {', '.join(map(str, checkpoint))}; load it with fabric.load(path, state)")
        return 0
    print(
        f"{options.output}: global_step {checkpoint.get('global_step')}, {len(checkpoint['state_dict'])} tensors, "
        f"{len(checkpoint['optimizer_states'])} optimizer(s); resume it with trainer.fit(model, ckpt_path=...)"
    )
    return 0
