"""Manual optimization with the list API: one optimizer per algorithm, stepped by hand.

Run: python examples/manual_optimization/train.py [--config examples/manual_optimization/config.yaml]

``build_optimizers(module, config)`` routes the parameters as the mixin does and returns
one optimizer per algorithm (here Muon for the hidden matrices, then AdamW for the rest);
``build_schedulers`` gives each the same lr schedule and Muon momentum warmup. With
``automatic_optimization = False`` the module steps them itself (Lightning's
``gradient_clip_val`` and ``accumulate_grad_batches`` do not apply to manual
optimization, so clipping is done here with ``clip_gradients``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import yaml
from torch import nn

from lightning_muon import MuonConfig, build_optimizers, build_schedulers
from lightning_muon_demo.digits import DigitsDataModule


class ManualDigitsClassifier(pl.LightningModule):
    def __init__(self, muon_config: dict | None = None, clip: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        optimizers = self.optimizers()
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            self.clip_gradients(opt, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
            opt.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train_loss", loss, prog_bar=True)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        config = MuonConfig.from_any(self.hparams.muon_config)
        optimizers = build_optimizers(self, config)
        # Each optimizer.step() counts as a global step in manual optimization; the schedule
        # is stepped once per batch, so it spans the batches (estimated_stepping_batches).
        batches = int(self.trainer.estimated_stepping_batches)
        schedulers = build_schedulers(optimizers, config, total_steps=batches)
        return optimizers, schedulers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument("--max-epochs", type=int, default=None, help="overrides trainer.max_epochs")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    trainer_kwargs = config["trainer"] | ({"max_epochs": args.max_epochs} if args.max_epochs else {})
    pl.seed_everything(0, verbose=False)
    model = ManualDigitsClassifier(muon_config=config["muon_config"])
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(model, datamodule=DigitsDataModule(**config["data"]))
    names = [type(o.optimizer).__name__ + "/" + o.optimizer.param_groups[0]["algorithm"] for o in model.optimizers()]
    metrics = trainer.callback_metrics
    print(f"optimizers: {', '.join(names)}")
    print(f"validation loss {float(metrics['val_loss']):.4f}, accuracy {float(metrics['val_acc']):.2%}")


if __name__ == "__main__":
    main()
