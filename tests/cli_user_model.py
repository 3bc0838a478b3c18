"""A user's model for tests/test_cli.py: its own float data and loaders, no datamodule.

Byte text (the demo's ``CharTextDataModule``) fed to it fails in the first matmul with
"mat1 and mat2 must have the same dtype", so a run that ends cleanly trained on these loaders.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import MuonConfig, MuonModuleMixin


class UserModel(MuonModuleMixin, pl.LightningModule):
    """Regression of 8 features on one hidden layer; ``train_dataloader`` and ``val_dataloader`` of its own."""

    def __init__(self, features: int = 8, hidden: int = 16, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)
        )

    def _dataset(self, seed: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(64, self.hparams.features, generator=generator)
        return TensorDataset(x, x.sum(dim=1, keepdim=True))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(0), batch_size=16, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(1), batch_size=16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))
