"""Checkpoint loading that says which file failed and why, instead of torch's bare read error."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["CheckpointReadError", "explained_reads"]


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
