"""Watch what Muon does to every layer: UpdateSpectrumMonitor logging to TensorBoard.

Run: python examples/spectra_tensorboard/train.py [--max-steps 300]
Then: tensorboard --logdir runs/spectra_tensorboard

Every ``every_n_steps`` optimizer steps the monitor logs, per Muon matrix, the singular
values of the update actually applied (``spectra/<name>/sigma_max``, ``stable_rank``,
``effective_rank``, ``orthogonality_error``, ``update_to_weight_rms``, ...), a histogram of
them, and one heatmap image of all layers (SCALARS, HISTOGRAMS and IMAGES tabs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import yaml
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_muon import UpdateSpectrumMonitor
from lightning_muon.data import CharTextDataModule
from lightning_muon.demo import CharGPTModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument("--max-steps", type=int, default=None, help="overrides trainer.max_steps")
    parser.add_argument("--logdir", type=Path, default=Path("runs/spectra_tensorboard"))
    parser.add_argument("--save-heatmap", type=Path, default=None, help="also write the last heatmap image here (PNG)")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    trainer_kwargs = config["trainer"] | ({"max_steps": args.max_steps} if args.max_steps else {})

    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(args.logdir, name="", version="")
    trainer = pl.Trainer(
        logger=logger,
        callbacks=[UpdateSpectrumMonitor(**config["spectra"])],
        enable_checkpointing=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(CharGPTModule(**config["model"]), datamodule=CharTextDataModule(**config["data"]))
    print(f"TensorBoard logs: {logger.log_dir}\nview them with: tensorboard --logdir {args.logdir}")
    if args.save_heatmap is not None:
        save_last_heatmap(Path(logger.log_dir), args.save_heatmap)
        print(f"last heatmap: {args.save_heatmap}")


def save_last_heatmap(log_dir: Path, path: Path) -> None:
    """Copy the last ``spectra/heatmap`` image of the event file (stored as PNG bytes) to ``path``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    events.Reload()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(events.Images("spectra/heatmap")[-1].encoded_image_string)


if __name__ == "__main__":
    main()
