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
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.module import CharGPTModule


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
    """Draw the last ``spectra/heatmap`` image of the event file, with its row names, as a PNG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(log_dir), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    image = events.Images("spectra/heatmap")[-1]
    rows_text = make_ndarray(events.Tensors("spectra/heatmap_rows/text_summary")[-1].tensor_proto)
    names = [line.split("`")[1] for line in rows_text.item().decode().splitlines()]  # "0. `name`"
    pixels = plt.imread(io.BytesIO(image.encoded_image_string), format="png")
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.4), dpi=120)
    ax.imshow(pixels, aspect="auto", extent=(0, 1, len(names) - 0.5, -0.5), interpolation="nearest")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("singular value index / short side (largest first); colour: value / largest value")
    ax.set_title(f"Muon update spectra at step {image.step} (UpdateSpectrumMonitor)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
