"""Checkpoints across strategies, on one process: what ``MuonModuleMixin``'s ``CheckpointChecks`` catches.

- A distributed checkpoint folder (``muon_fsdp``'s format) under a strategy that reads one
  file raises ``DistributedCheckpointError`` naming ``strategy="muon_fsdp"`` and the
  converter, not fsspec's ``IsADirectoryError`` (the real 2-rank folder, and the converter,
  in ``test_fsdp_strategy.py``).
- A checkpoint records the strategy that saved it; resuming a ``muon_ddp`` checkpoint under
  a single-device strategy (another sampler) warns; under ``muon_ddp`` it does not.
- ``MuonScheduler``'s resume warning points at the user's ``trainer.fit``, not into Lightning.
- Under a distributed strategy Lightning shuffles a training loader that does not shuffle, as
  docs/distributed.md says.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_muon import AdamWSettings, MuonConfig, MuonDDPStrategy, MuonModuleMixin, MuonSettings
from lightning_muon.checkpoints import DistributedCheckpointError

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
)

CONFIG = MuonConfig(matrix=MuonSettings(lr=0.02, ns_dtype="float32"), scalar=AdamWSettings(lr=3e-3))
ROOT = Path(__file__).resolve().parents[1]


class Net(MuonModuleMixin, pl.LightningModule):
    def __init__(self, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)), 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def _trainer(root: Path, max_steps: int, strategy="auto", save_every: int | None = None) -> pl.Trainer:
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=save_every)]
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks if save_every else None,
        enable_checkpointing=bool(save_every),
    )


def _folder(tmp_path: Path) -> Path:
    """A folder marked as a distributed checkpoint (torch's ``.metadata``), as ``muon_fsdp`` names one."""
    folder = tmp_path / "epoch=0-step=2.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    (folder / "meta.pt").write_bytes(b"")
    return folder


def test_a_distributed_checkpoint_folder_under_auto_names_muon_fsdp_and_the_converter(tmp_path):
    folder = _folder(tmp_path)
    with pytest.raises(DistributedCheckpointError) as raised:
        _trainer(tmp_path, 4).fit(Net(CONFIG), ckpt_path=folder)
    message = str(raised.value)
    assert message.startswith(f"{str(folder)!r} is a distributed checkpoint"), message
    assert 'SingleDeviceStrategy reads one checkpoint file. Resume it with strategy="muon_fsdp"' in message
    assert "python -m lightning_muon convert-checkpoint" in message and message.endswith("OUT.ckpt")
    # A file still loads as ever: the check sits in the strategy's IO, which it keeps.
    _trainer(tmp_path / "run", 2, save_every=2).fit(Net(CONFIG))
    saved = next((tmp_path / "run" / "ckpt").glob("*.ckpt"))
    _trainer(tmp_path / "again", 3).fit(Net(CONFIG), ckpt_path=saved)


def test_muon_ddp_refuses_a_distributed_checkpoint_folder_by_name(tmp_path):
    folder = _folder(tmp_path)
    with pytest.raises(DistributedCheckpointError, match=r'MuonDDPStrategy reads one checkpoint file.*"muon_fsdp"'):
        MuonDDPStrategy().load_checkpoint(folder)


def _resume(root: Path, saved: Path, strategy) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(root, 4, strategy=strategy).fit(Net(CONFIG), ckpt_path=saved)
    return [str(w.message) for w in caught if "Resuming a checkpoint saved under" in str(w.message)]


def test_a_muon_ddp_checkpoint_resumed_on_one_device_warns_that_the_sampler_changes(tmp_path):
    # muon_ddp on one process: Lightning's DistributedSampler all the same (a distributed strategy).
    _trainer(tmp_path / "ddp", 2, strategy="muon_ddp", save_every=2).fit(Net(CONFIG))
    saved = next((tmp_path / "ddp" / "ckpt").glob("*.ckpt"))
    record = torch.load(saved, weights_only=True)["lightning_muon"]["saved_by"]
    assert record == {"strategy": "muon_ddp", "world_size": 1, "distributed_sampler": True}
    (message,) = _resume(tmp_path / "auto", saved, "auto")
    assert message.startswith(
        "Resuming a checkpoint saved under strategy 'muon_ddp' (1 process(es)), which drew its batches with "
        "Lightning's DistributedSampler"
    ), message
    assert "under 'single_device', which draws them with the loader's own sampler" in message
    assert message.endswith("Resume with strategy='muon_ddp' (devices=1 included) to keep its data order")
    # The same strategy keeps the sampler: no warning.
    assert _resume(tmp_path / "same", saved, "muon_ddp") == []


def test_a_distributed_strategy_shuffles_a_training_loader_that_does_not_as_the_docs_say(tmp_path):
    """Lightning 2.6 under muon_ddp, one process: the training loader's DistributedSampler shuffles though the
    loader does not (other batches than "auto" takes); a validation loader keeps its order."""

    class WithValidation(Net):
        def val_dataloader(self) -> DataLoader:
            return self.train_dataloader()

        def validation_step(self, batch, batch_idx) -> None:
            pass

    trainer = _trainer(tmp_path, 1, strategy="muon_ddp")
    model = WithValidation(CONFIG)
    assert not isinstance(model.train_dataloader().sampler, torch.utils.data.RandomSampler)  # in order
    trainer.fit(model)
    train, val = trainer.train_dataloader.sampler, trainer.val_dataloaders.sampler
    assert isinstance(train, DistributedSampler) and isinstance(val, DistributedSampler)
    assert train.shuffle and list(train) != list(range(32))
    assert not val.shuffle and list(val) == list(range(32))
    docs = " ".join((ROOT / "docs" / "distributed.md").read_text().split())
    assert "gives the training loader a `DistributedSampler` that shuffles, whether or not the loader does" in docs
    assert "Validation and test loaders are shuffled only when they shuffle" in docs


def test_the_schedulers_resume_warning_points_at_the_users_fit_not_into_lightning(tmp_path):
    _trainer(tmp_path / "run", 2, save_every=2).fit(Net(CONFIG))
    saved = next((tmp_path / "run" / "ckpt").glob("*.ckpt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path / "resumed", 3).fit(
            Net(MuonConfig(matrix=MuonSettings(lr=0.04, ns_dtype="float32"), scalar=AdamWSettings(lr=3e-3))),
            ckpt_path=saved,
        )
    (warning,) = [w for w in caught if "MuonScheduler: resuming at step 2" in str(w.message)]
    lightning_dir = os.path.dirname(os.path.dirname(os.path.abspath(pl.__file__))) + os.sep  # .../lightning/
    assert not os.path.abspath(warning.filename).startswith(lightning_dir), warning.filename
    assert os.path.abspath(warning.filename) == os.path.abspath(__file__), warning.filename
