"""``MuonSaveConfigCallback``: LightningCLI's config saving, never over a file the user wrote.

With ``logger: false`` the log directory is ``default_root_dir`` (the working directory by default), where
``config.yaml`` may be the very file the run was started with. Lightning's ``SaveConfigCallback`` then refuses to
run, or (``overwrite=True``) replaces the user's file with its own dump. This one saves to ``config.yaml`` unless that
is a ``--config`` input or a file it did not save itself (known by ``DUMP_HEADER``, which ``python -m lightning_muon``
writes first), and then to the first free ``config_1.yaml``, ``config_2.yaml``, .... It prints the path. Any
LightningCLI takes it: ``LightningCLI(..., save_config_callback=MuonSaveConfigCallback)``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["DUMP_HEADER", "MuonSaveConfigCallback"]

# First line of every config python -m lightning_muon saves: how the callback knows its own files, the only ones it
# may write over.
DUMP_HEADER = "lightning_muon: the config of a run, saved by the CLI"


class MuonSaveConfigCallback(SaveConfigCallback):
    """Saves the run's config to the log directory without writing over the user's files (module docstring).

    Args:
        input_configs: The ``--config`` files of the run (``python -m lightning_muon`` passes them).
    """

    def __init__(self, *args: Any, input_configs: Sequence[str] = (), **kwargs: Any) -> None:
        kwargs["overwrite"] = True  # over its own earlier saves only; _choose_name avoids the rest
        super().__init__(*args, **kwargs)
        self.input_configs = {os.path.realpath(path) for path in input_configs}

    def _choose_name(self, log_dir: str) -> str:
        fs, (stem, ext) = get_filesystem(log_dir), os.path.splitext(self.config_filename)
        for name in (self.config_filename if n == 0 else f"{stem}_{n}{ext}" for n in range(10_000)):
            path = os.path.join(log_dir, name)
            if os.path.realpath(path) in self.input_configs:
                continue
            if not fs.isfile(path):
                return name
            with fs.open(path, "r") as f:
                if f.readline().strip() == f"# {DUMP_HEADER}":
                    return name
        raise RuntimeError(f"no free name for the run's config in {log_dir}")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir:
            log_dir = trainer.log_dir  # on every rank: it broadcasts
            # Only rank zero writes; with overwrite on, the other ranks never look at the name.
            if trainer.is_global_zero and log_dir is not None:
                self.config_filename = self._choose_name(log_dir)
                rank_zero_info(f"The run's config: {os.path.join(log_dir, self.config_filename)}")
        super().setup(trainer, pl_module, stage)
