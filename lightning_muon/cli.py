"""LightningCLI entry point: ``python -m lightning_muon fit --config configs/muon.yaml``.

The bundled ``CharGPTModule`` and ``CharTextDataModule`` are the defaults; any
LightningModule or LightningDataModule is taken by ``class_path``. Importing the
package registers the Muon strategies, so ``--trainer.strategy=muon_ddp`` works.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

__all__ = ["MuonCLI", "main"]


class MuonCLI(LightningCLI):
    """LightningCLI with the demo model and data as defaults."""

    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.set_defaults(
            {
                "model": {"class_path": "lightning_muon.demo.CharGPTModule"},
                "data": {"class_path": "lightning_muon.data.CharTextDataModule"},
            }
        )


def main(args: list[str] | None = None) -> MuonCLI:
    """Run the CLI; ``args`` defaults to ``sys.argv[1:]``."""
    return MuonCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
