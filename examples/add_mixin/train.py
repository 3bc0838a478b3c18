"""Give an existing LightningModule Muon by adding one base class; nothing else changes.

Run: python examples/add_mixin/train.py [--config examples/add_mixin/config.yaml] [--max-epochs 10]

``MuonModuleMixin`` goes first in the bases, so its ``configure_optimizers`` (Muon on the
hidden matrices, AdamW on the head and biases, the schedule from the config) replaces the
module's own AdamW one. The Muon settings come from ``muon_config`` in the YAML file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import yaml
from existing_model import DigitsClassifier

from lightning_muon import MuonModuleMixin
from lightning_muon_demo.digits import DigitsDataModule


class MuonDigitsClassifier(MuonModuleMixin, DigitsClassifier):
    """The existing model, trained with Muon."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument("--max-epochs", type=int, default=None, help="overrides trainer.max_epochs")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    trainer_kwargs = config["trainer"] | ({"max_epochs": args.max_epochs} if args.max_epochs else {})

    results = {}
    for name, cls in (("AdamW (the module's own)", DigitsClassifier), ("Muon (mixin added)", MuonDigitsClassifier)):
        pl.seed_everything(0, verbose=False)
        model = cls()
        if cls is MuonDigitsClassifier:
            model.muon_config = config["muon_config"]
        trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_model_summary=False, **trainer_kwargs)
        trainer.fit(model, datamodule=DigitsDataModule(**config["data"]))
        results[name] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    for name, metrics in results.items():
        print(f"{name:>26}: validation loss {metrics['val_loss']:.4f}, accuracy {metrics['val_acc']:.2%}")


if __name__ == "__main__":
    main()
