"""``CheckpointChecks``: what ``MuonModuleMixin`` checks about checkpoints across strategies.

- A distributed checkpoint folder (``muon_fsdp``'s format) given to a strategy that reads one
  file (``"auto"``, ``"ddp"``, ...) raises ``DistributedCheckpointError``, which names
  ``strategy="muon_fsdp"`` and ``python -m lightning_muon convert-checkpoint``, instead of
  fsspec's bare ``IsADirectoryError``. The check sits in the strategy's checkpoint IO, from
  ``setup`` on (the path is known only when the strategy reads it).
- Every checkpoint records the strategy that saved it, its world size and whether
  Lightning's ``DistributedSampler`` fed it (``checkpoint["lightning_muon"]["saved_by"]``).
- Resuming a fit under a strategy that changes the sampler (a ``muon_ddp`` checkpoint on
  one device with ``"auto"``, or the reverse) warns: the data order from there on differs
  from the run that saved it (``docs/distributed.md``, "Resuming: which batches come next").

The mixin adds it in ``configure_callbacks``; ``Trainer(callbacks=[CheckpointChecks()])``
gives it to any module.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from typing_extensions import override

from lightning_muon._warn import warn_user
from lightning_muon.checkpoints import distributed_checkpoint_error, is_distributed_checkpoint

__all__ = ["CheckpointChecks", "saved_by", "strategy_name"]

RECORD_KEY = "lightning_muon"


def strategy_name(strategy: Any) -> str:
    """The registered name of a strategy where it has one (``muon_ddp``, ``single_device``), else its class name."""
    return getattr(type(strategy), "strategy_name", None) or type(strategy).__name__


def saved_by(trainer: pl.Trainer) -> dict[str, Any]:
    """What a checkpoint of ``trainer`` records about its run: strategy, world size, distributed sampler."""
    connector = getattr(trainer, "_accelerator_connector", None)
    sampler = bool(
        connector is not None
        and getattr(connector, "use_distributed_sampler", False)
        and getattr(connector, "is_distributed", False)
    )
    name = strategy_name(trainer.strategy)
    return {"strategy": name, "world_size": trainer.world_size, "distributed_sampler": sampler}


class _RefuseDistributedFolders(_WrappingCheckpointIO):
    """The strategy's own checkpoint IO, but a distributed checkpoint folder raises ``DistributedCheckpointError``."""

    def __init__(self, checkpoint_io: CheckpointIO, reader: str) -> None:
        super().__init__(checkpoint_io)
        self.reader = reader

    @override
    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if is_distributed_checkpoint(path):
            raise distributed_checkpoint_error(path, self.reader)
        return super().load_checkpoint(path, *args, **kwargs)

    @override
    def teardown(self) -> None:
        assert self.checkpoint_io is not None
        self.checkpoint_io.teardown()


def _sampler_words(record: dict[str, Any]) -> str:
    if record["distributed_sampler"]:
        return f"Lightning's DistributedSampler (seeded by epoch, split over {record['world_size']} process(es))"
    return "the loader's own sampler"


class CheckpointChecks(pl.Callback):
    """Refuses ``muon_fsdp``'s folders where a file is read; records the saving run; warns on a sampler change.

    See the module docstring. It holds no state of its own.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Only Lightning's default IO is wrapped (a user's own is left as it is); strategies that
        # read folders themselves (muon_fsdp, FSDP) never ask it to load.
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = _RefuseDistributedFolders(strategy.checkpoint_io, type(strategy).__name__)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint.setdefault(RECORD_KEY, {})["saved_by"] = saved_by(trainer)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        saved = (checkpoint.get(RECORD_KEY) or {}).get("saved_by")
        if saved is None or trainer.state.fn != "fit":  # an older checkpoint; weights for validate/test
            return
        now = saved_by(trainer)
        if saved["distributed_sampler"] == now["distributed_sampler"]:
            return
        keep = f"strategy={saved['strategy']!r}" + (" (devices=1 included)" if saved["distributed_sampler"] else "")
        warn_user(
            f"Resuming a checkpoint saved under strategy {saved['strategy']!r} ({saved['world_size']} process(es)), "
            f"which drew its batches with {_sampler_words(saved)}, under {now['strategy']!r}, which draws them "
            f"with {_sampler_words(now)}: the batches from here on differ from the ones the saving run would have "
            f"seen. Resume with {keep} to keep its data order"
        )
