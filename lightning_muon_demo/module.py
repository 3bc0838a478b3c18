"""``CharGPTModule``: the bundled demo LightningModule, a ``CharGPT`` trained with Muon."""

from __future__ import annotations

import lightning.pytorch as pl
from torch import Tensor

from lightning_muon import MuonConfig, MuonModuleMixin
from lightning_muon_demo.models import CharGPT

__all__ = ["CharGPTModule"]


class CharGPTModule(MuonModuleMixin, pl.LightningModule):
    """A character-level GPT whose ``configure_optimizers`` comes from ``MuonModuleMixin``.

    Logs ``train_loss`` every step and ``val_loss`` (mean nats per byte) every validation.
    ``muon_config`` holds every optimizer, routing and schedule setting: a ``MuonConfig``, or a
    dict of its sections (``matrix``, ``scalar``, ``state``, ``routing``, ``schedule``, ...), e.g.
    from YAML.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = False,
        muon_config: MuonConfig | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = CharGPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, tie_weights)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.model.loss(self.model(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.model.loss(self.model(inputs), targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss
