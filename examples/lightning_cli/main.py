"""Your own model and data under LightningCLI, with Muon configured from YAML.

Run: python examples/lightning_cli/main.py fit --config examples/lightning_cli/config.yaml

Any setting is overridable from the command line, e.g.
``--model.muon_config.matrix.init_args.lr=0.03 --model.muon_config.schedule.falloff=linear
--trainer.max_epochs=3 --trainer.strategy=muon_ddp``.
Importing lightning_muon registers its strategies (muon_ddp, muon_fsdp) by name.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from torch import nn

from lightning_muon import MuonConfig, MuonModuleMixin
from lightning_muon.callbacks import MuonSaveConfigCallback
from lightning_muon_demo.digits import DigitsDataModule


class DigitsMLP(MuonModuleMixin, pl.LightningModule):
    """A small MLP classifier; ``muon_config`` (MuonConfig's sections) comes from the YAML file."""

    def __init__(self, hidden: int = 256, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)


def main(args: list[str] | None = None) -> LightningCLI:
    # MuonSaveConfigCallback saves the run's config in its log dir and never over an input file.
    return LightningCLI(DigitsMLP, DigitsDataModule, save_config_callback=MuonSaveConfigCallback, args=args)


if __name__ == "__main__":
    main()
