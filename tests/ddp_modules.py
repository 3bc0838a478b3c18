"""Module-level LightningModules for ``muon_ddp_spawn`` tests (spawned processes import them)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_muon import MuonConfig, MuonModuleMixin


class TinyRegressor(MuonModuleMixin, pl.LightningModule):
    def __init__(self, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)
        )

    def train_dataloader(self):
        # Rank r takes samples r, r + W, ...: per step the ranks together see the same samples
        # as one process with a W-times larger batch (use_distributed_sampler=False).
        world, rank = self.trainer.world_size, self.trainer.global_rank
        data = torch.utils.data.Subset(dataset(), range(rank, 48, world))
        return torch.utils.data.DataLoader(data, batch_size=8 // world, shuffle=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def dataset(n: int = 48) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
