"""Lightning's own tools on a ``MuonModuleMixin`` model, each driven in a real ``Trainer`` (CPU, tiny models).

- ``BackboneFinetuning``: the unfrozen backbone is split into a Muon and an AdamW group
  with lrs by ``added_groups``' rule, both train, and a checkpoint after the unfreeze
  resumes bit for bit.
- ``Tuner.lr_find`` and ``LearningRateFinder``: the sweep moves every group by one factor,
  the suggestion is the Muon lr, and the run that follows trains at it (``one_lr``).
- ``StochasticWeightAveraging``: the averaged weights are the module's at the end, and one
  ``swa_lrs`` value is each group's share of it.
- The progress bar's epoch counter under ``max_steps``; ``bf16-true``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    RichProgressBar,
    StochasticWeightAveraging,
)
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import AdamWSettings, MuonConfig, MuonModuleMixin, MuonSettings, RoutingSettings, Rule
from lightning_muon.callbacks import MaxStepsProgressBar

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
)

# float32 Newton-Schulz: exact comparisons must not depend on this host's bf16 policy.
CONFIG = {"matrix": MuonSettings(lr=0.02, ns_dtype="float32"), "scalar": AdamWSettings(lr=3e-4)}
ADAMW_SHARE = 3e-4 / 0.02  # AdamW's lr over Muon's


class Net(MuonModuleMixin, pl.LightningModule):
    """``backbone`` (two hidden Linears) and ``head`` (a hidden Linear and the output Linear)."""

    def __init__(self, muon_config: MuonConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.steps: list[dict[str, float]] = []  # per optimizer step: group name -> the lr it stepped with

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> dict:
        out = super().configure_optimizers()
        # After the step: the lrs each group was stepped with (a pre-hook would run before the
        # closure, so before Lightning's on_before_optimizer_step).
        out["optimizer"].register_step_post_hook(self._record_lrs)
        return out

    def _record_lrs(self, optimizer, args, kwargs) -> None:
        self.steps.append({g.get("name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)})


def _loader(n: int = 16, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)), batch_size)


def _trainer(tmp_path: Path, **kwargs) -> pl.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("enable_progress_bar", False)
    return pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, enable_model_summary=False, **kwargs)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# --- BackboneFinetuning -----------------------------------------------------------------------


class AfterEpochZero(pl.Callback):
    """The backbone's weights when the frozen epoch 0 ends."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Net) -> None:
        if trainer.current_epoch == 0:
            self.frozen = _params(pl_module.backbone)


def test_backbone_finetuning_splits_the_backbone_into_a_muon_and_an_adamw_group(tmp_path):
    model = Net(MuonConfig(**CONFIG))
    start = _params(model.backbone)
    monitor = LearningRateMonitor(logging_interval="step")
    frozen = AfterEpochZero()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
    trainer = _trainer(
        tmp_path, max_epochs=3, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[finetuning, monitor, frozen]
    )
    trainer.fit(model, _loader())

    groups = trainer.optimizers[0].param_groups
    # The head's groups (routed with the backbone frozen), then the backbone's: its biases
    # (AdamW, no weight decay, as the vectors rule routes them) and its matrices (Muon, last:
    # the first group's algorithm, the group BackboneFinetuning moves in later epochs).
    assert [(g["name"], g["algorithm"]) for g in groups] == [
        ("muon", "muon"),
        ("adamw_no_decay", "adamw"),
        ("adamw", "adamw"),
        ("pg3.adamw_no_decay", "adamw"),
        ("pg3.muon", "muon"),
    ]
    assert groups[3]["param_names"] == ["backbone.0.bias", "backbone.2.bias"] and groups[3]["weight_decay"] == 0.0
    assert groups[4]["param_names"] == ["backbone.0.weight", "backbone.2.weight"]
    state = trainer.optimizers[0].state
    assert set(state[model.backbone[0].weight]) == {"momentum_buffer"}  # stepped by Muon
    assert {"exp_avg", "exp_avg_sq"} <= set(state[model.backbone[0].bias])  # stepped by AdamW
    # Frozen through epoch 0, then every backbone tensor trains, matrices and biases.
    assert all(torch.equal(frozen.frozen[n], start[n]) for n in start)
    assert all(not torch.equal(p, start[n]) for n, p in _params(model.backbone).items())

    # The lrs LearningRateMonitor logged, 4 steps per epoch. Epoch 1: BackboneFinetuning gives
    # 0.1 x param_groups[0]["lr"] = 0.002, read on the first group's (Muon's) scale: the Muon
    # part takes 0.002, the AdamW part 0.002 x 3e-4 / 0.02. Epoch 2: its ramp (x2 by default) moves the
    # last group, the Muon part; the AdamW part keeps its lr.
    lrs = monitor.lrs
    assert lrs["muon/muon"] == [0.02] * 12 and lrs["muon/adamw"] == [3e-4] * 12
    assert lrs["muon/pg3.muon"] == pytest.approx([0.002] * 4 + [0.004] * 4, rel=1e-12)
    assert lrs["muon/pg3.adamw_no_decay"] == pytest.approx([0.002 * ADAMW_SHARE] * 8, rel=1e-12)


class StopAfterEpoch(pl.Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_a_checkpoint_taken_after_the_unfreeze_resumes_exactly(tmp_path):
    def finetuning() -> BackboneFinetuning:
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)

    full = Net(MuonConfig(**CONFIG))
    _trainer(tmp_path / "full", max_epochs=4, callbacks=[finetuning()]).fit(full, _loader())

    first = Net(MuonConfig(**CONFIG))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    callbacks = [finetuning(), checkpoint, StopAfterEpoch(2)]  # epoch 1 unfreezes, epoch 2 ramps
    trainer = _trainer(tmp_path / "first", max_epochs=4, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(first, _loader())
    path = tmp_path / "ckpt" / "epoch=2.ckpt"
    saved = torch.load(path, weights_only=True)
    assert [g["name"] for g in saved["optimizer_states"][0]["param_groups"]][3:] == ["pg3.adamw_no_decay", "pg3.muon"]

    resumed = Net(MuonConfig(**CONFIG), seed=123)  # other weights: they must come from the checkpoint
    trainer = _trainer(tmp_path / "resumed", max_epochs=4, callbacks=[finetuning()])
    trainer.fit(resumed, _loader(), ckpt_path=path)
    # One process, the same float32 ops in the same order: bitwise the same run.
    after = _params(resumed)
    assert all(torch.equal(after[n], p) for n, p in _params(full).items())
    assert resumed.steps == full.steps[12:]  # epoch 3, every group at the lr of the run that never stopped
    # And the check has teeth: the same weights with a fresh optimizer do not continue alike.
    restarted = Net(MuonConfig(**CONFIG), seed=123)
    restarted.load_state_dict(saved["state_dict"])
    restarted.backbone.requires_grad_(True)
    _trainer(tmp_path / "restarted", max_epochs=1).fit(restarted, _loader())
    assert any(not torch.equal(p, after[n]) for n, p in _params(restarted).items())


# --- the lr finder ----------------------------------------------------------------------------

# A rule with an lr of its own: the finder must keep that ratio too.
FINDER_CONFIG = dict(
    CONFIG,
    routing=RoutingSettings(
        rules=[Rule(name="first", algorithm="muon", names="backbone.0.weight", options={"lr": 0.01})]
    ),
)
SHARES = {"first": 0.5, "muon": 1.0, "adamw_no_decay": ADAMW_SHARE, "adamw": ADAMW_SHARE}


def _assert_shares(step: dict[str, float], muon_lr: float) -> None:
    assert step == pytest.approx({name: muon_lr * share for name, share in SHARES.items()}, rel=1e-12)


def test_tuner_lr_find_sweeps_one_factor_and_the_next_fit_trains_at_the_suggestion(tmp_path):
    model = Net(MuonConfig(**FINDER_CONFIG))
    trainer = _trainer(tmp_path, max_steps=3)
    finder = Tuner(trainer).lr_find(model, _loader(128), min_lr=1e-4, max_lr=1.0, num_training=20)
    # Every step of the sweep: the Muon groups at the swept lr (the one the finder records),
    # every other group at its configured share of it.
    swept = finder.results["lr"]
    assert len(model.steps) == len(swept) == 20 and swept[0] == 1e-4
    for step, lr in zip(model.steps, swept):
        _assert_shares(step, lr)
    suggestion = finder.suggestion()
    assert suggestion is not None and 1e-4 < suggestion < 1.0
    # update_attr=True: the config takes it, every other lr by the same factor, in the hparams
    # (where checkpoints keep them).
    config = model.resolve_muon_config()
    assert model.lr == config.matrix.lr == suggestion and model.hparams["muon_config"] is config
    assert config.scalar.lr == pytest.approx(3e-4 * suggestion / 0.02, rel=1e-12)
    assert config.routing.rules[0].options["lr"] == pytest.approx(0.01 * suggestion / 0.02, rel=1e-12)
    # The fit that follows: its first step at the suggestion, in the configured ratios.
    model.steps.clear()
    trainer.fit(model, _loader(128))
    assert len(model.steps) == 3
    _assert_shares(model.steps[0], suggestion)


def test_learning_rate_finder_callback_goes_on_at_the_suggestion(tmp_path):
    model = Net(MuonConfig(**FINDER_CONFIG))
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=20)
    _trainer(tmp_path, max_steps=3, callbacks=[finder]).fit(model, _loader(128))
    suggestion = finder.optimal_lr.suggestion()
    assert model.lr == suggestion
    sweep, fit = model.steps[:20], model.steps[20:]
    for step, lr in zip(sweep, finder.optimal_lr.results["lr"]):
        _assert_shares(step, lr)
    # The same fit goes on, with its own scheduler: at the suggestion from its first step on
    # (Lightning writes the suggestion into every group before it; the mixin undoes that).
    assert len(fit) == 3
    for step in fit:
        _assert_shares(step, suggestion)


# --- SWA --------------------------------------------------------------------------------------


class EpochStartWeights(pl.Callback):
    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights.append(_params(pl_module))


# SWA swaps the per-step MuonScheduler for its per-epoch SWALR, and warns about the one it replaces.
@pytest.mark.filterwarnings("ignore:SWA is currently only supported every epoch")
def test_swa_ends_on_the_averaged_weights_and_spreads_one_swa_lr_by_the_configured_ratios(tmp_path):
    model = Net(MuonConfig(**CONFIG))
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=1)
    recorder = EpochStartWeights()
    trainer = _trainer(tmp_path, max_epochs=5, callbacks=[recorder, swa])
    trainer.fit(model, _loader())
    # Lightning's SWA averages the weights each epoch from swa_start to swa_end begins with
    # (0-based epochs), and hands the average to the module when training ends.
    assert (swa.swa_start, swa.swa_end) == (1, 4)
    averaged = {n: torch.stack([w[n] for w in recorder.weights[1:5]]).mean(0) for n in recorder.weights[0]}
    final = _params(model)
    for name in final:
        torch.testing.assert_close(final[name], averaged[name])  # a running mean against a mean: float32 rounding
    assert any(not torch.equal(final[n], recorder.weights[-1][n]) for n in final)  # not the last weights
    # The lrs: the configured ones until SWA begins, then (after one annealing epoch) Muon at
    # swa_lrs and AdamW at its configured share of it.
    by_epoch = [model.steps[4 * e] for e in range(5)]
    assert by_epoch[0] == {"muon": 0.02, "adamw_no_decay": 3e-4, "adamw": 3e-4}
    for step in by_epoch[2:]:
        assert step == pytest.approx({"muon": 0.01, "adamw_no_decay": 0.01 * ADAMW_SHARE, "adamw": 0.01 * ADAMW_SHARE})


# --- the progress bar, precision ---------------------------------------------------------------


class TrainDescriptions(pl.Callback):
    """What the Rich bar shows for the training task at the end of each epoch."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bar = trainer.progress_bar_callback
        self.seen.append(bar.progress.tasks[bar.train_progress_bar_id].description.strip())


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"max_steps": 10}, ["Epoch 0/2", "Epoch 1/2", "Epoch 2/2"]),  # 4 steps per epoch: step 10 is in epoch 2
        ({"max_steps": 10, "accumulate_grad_batches": 3}, [f"Epoch {e}/4" for e in range(5)]),  # 2 steps per epoch
        ({"max_steps": 10, "max_epochs": 2}, ["Epoch 0/1", "Epoch 1/1"]),  # max_epochs ends it first
    ],
)
def test_the_progress_bar_counts_the_epochs_max_steps_allows(tmp_path, limits, expected):
    theme = RichProgressBarTheme(description="green")
    descriptions = TrainDescriptions()
    bar = RichProgressBar(leave=True, theme=theme)  # Lightning's default bar where rich is installed
    trainer = _trainer(tmp_path, callbacks=[bar, descriptions], enable_progress_bar=True, **limits)
    trainer.fit(Net(MuonConfig(**CONFIG)), _loader())
    # Lightning's own bar reads "Epoch 0/-2" here; the markup is the theme's, kept from the bar given.
    assert descriptions.seen == [f"[green]{text}" for text in expected]
    used = trainer.progress_bar_callback
    assert isinstance(used, MaxStepsProgressBar) and used.theme is theme and used._leave


def test_the_default_bar_is_replaced_without_lightnings_override_notice(tmp_path, monkeypatch):
    # No bar passed: Lightning adds its default RichProgressBar. The mixin's MaxStepsProgressBar
    # takes its place without Lightning logging that the model's callbacks "will override existing
    # callbacks passed to Trainer: RichProgressBar" (the user passed none).
    from lightning.pytorch.trainer.connectors import callback_connector

    notices: list[str] = []
    monkeypatch.setattr(callback_connector, "rank_zero_info", lambda message, *a, **k: notices.append(message))
    trainer = _trainer(tmp_path, enable_progress_bar=True, max_steps=2)
    assert type(trainer.progress_bar_callback) is RichProgressBar
    trainer.fit(Net(MuonConfig(**CONFIG)), _loader())
    assert isinstance(trainer.progress_bar_callback, MaxStepsProgressBar)
    assert [c for c in trainer.callbacks if isinstance(c, RichProgressBar)] == [trainer.progress_bar_callback]
    assert not [m for m in notices if "will override" in m], notices


def test_bf16_true_fits(tmp_path):
    model = Net(MuonConfig(**CONFIG))
    start = _params(model)
    _trainer(tmp_path, max_steps=3, precision="bf16-true").fit(model, _loader())
    after = _params(model)
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in after.values())
    assert all(not torch.equal(after[n].float(), start[n]) for n in start if n.startswith("head"))
