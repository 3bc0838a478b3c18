"""A non-transformer model: a small conv net on scikit-learn's bundled digits, Muon vs AdamW.

Run: python examples/digits_convnet/train.py [--config examples/digits_convnet/config.yaml] [--max-epochs 15]

Muon works on conv kernels too: a ``(out, in, kh, kw)`` weight is orthogonalized as the
``(out, in * kh * kw)`` matrix it acts as. The routing sends both conv kernels and the
hidden linear layer to Muon and the classifier head, biases and norms to AdamW; the
baseline sends everything to AdamW. Both runs share the model initialisation, batches and
schedule.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from torch import nn

from lightning_muon import MuonConfig, MuonModuleMixin
from lightning_muon_demo.digits import DigitsDataModule


class DigitsConvNet(MuonModuleMixin, pl.LightningModule):
    def __init__(self, channels: int = 32, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.GELU(),  # (B, c, 8, 8)
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.GELU(),
            nn.MaxPool2d(2),  # (B, 2c, 4, 4)
        )  # fmt: skip
        self.hidden = nn.Linear(2 * c * 16, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.gelu(self.hidden(self.features(x).flatten(1))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument("--max-epochs", type=int, default=None, help="overrides trainer.max_epochs")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    trainer_kwargs = config["trainer"] | ({"max_epochs": args.max_epochs} if args.max_epochs else {})
    results = {}
    for name in ("muon", "adamw"):
        pl.seed_everything(0, verbose=False)
        model = DigitsConvNet(muon_config=config[f"{name}_config"], **config["model"])
        trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_model_summary=False, **trainer_kwargs)
        trainer.fit(model, datamodule=DigitsDataModule(as_images=True, **config["data"]))
        results[name] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    for name, metrics in results.items():
        print(f"{name:>6}: validation loss {metrics['val_loss']:.4f}, accuracy {metrics['val_acc']:.2%}")


if __name__ == "__main__":
    main()
