"""The demo GPT on several processes with ``muon_ddp`` or ``muon_fsdp``; the same command runs on GPUs.

Run (2 CPU processes, gloo):
    python examples/distributed/train.py --strategy muon_ddp
    python examples/distributed/train.py --strategy muon_fsdp
On one node of GPUs (nccl), only the accelerator and device count change:
    python examples/distributed/train.py --strategy muon_fsdp --accelerator gpu --devices 8
On several nodes: add ``--num-nodes N`` and start the same command on every node under
torchrun or SLURM's srun (Lightning reads the ranks from the environment).

Both strategies start one process per device by re-running this script, so it must be a
script (or ``python -m``), not a notebook. Settings come from ``config.yaml``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import yaml

from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.module import CharGPTModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument("--strategy", choices=("muon_ddp", "muon_fsdp"), default="muon_ddp")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="overrides trainer.max_steps")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    trainer_kwargs = config["trainer"] | ({"max_steps": args.max_steps} if args.max_steps else {})

    pl.seed_everything(0, verbose=False)
    model = CharGPTModule(**config["model"])
    data = CharTextDataModule(**config["data"])
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule=data)
    loss = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]  # every rank takes part
    if trainer.is_global_zero:
        print(f"{args.strategy} on {trainer.world_size} processes: validation loss {loss:.4f}")


if __name__ == "__main__":
    main()
