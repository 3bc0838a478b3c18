"""Real ``Trainer.fit`` runs with the Muon optimizer on tiny models (CPU, a few steps each).

Covers the mixin and ``configure_muon_optimizers``, LearningRateMonitor names, gradient
clipping, gradient accumulation, mixed precision, exact checkpoint resumption,
``load_from_checkpoint``, and the list API under manual optimization and plain loops.
"""

from __future__ import annotations

import copy
import csv
import math
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import (
    AdamWSettings,
    LRSchedule,
    MomentumWarmup,
    Muon,
    MuonConfig,
    MuonModuleMixin,
    MuonScheduler,
    MuonSettings,
    RoutingSettings,
    Rule,
    ScheduleSettings,
    build_optimizers,
    build_schedulers,
    configure_muon_optimizers,
    route_parameters,
)
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.module import CharGPTModule

ROOT = Path(__file__).resolve().parents[1]

# Noise from Lightning itself on tiny CPU runs.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
)

# Newton-Schulz in float32 everywhere below: the automatic policy may pick bf16 on this
# CPU, and bf16 turns one-ulp input differences (another reduction order) into percent-level ones.
FP32 = MuonSettings(ns_dtype="float32")


class TinyNet(MuonModuleMixin, pl.LightningModule):
    """An MLP regressor: two hidden matrices (Muon), a head and biases (AdamW)."""

    def __init__(self, muon_config: MuonConfig | dict | None = None, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)  # a mean over the batch
        self.losses.append(loss.detach().clone())
        return loss


def _data(n: int = 16, identical_batches_of: int | None = None, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    rows = identical_batches_of or n
    x, y = torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)
    if identical_batches_of:
        x, y = x.repeat(n // rows, 1), y.repeat(n // rows, 1)
    return TensorDataset(x, y)


def _loader(dataset: TensorDataset, batch_size: int = 4) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _trainer(tmp_path: Path, **kwargs) -> pl.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _differ(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a)


def _assert_params_equal(a: dict, b: dict, **tolerance) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, n=name: f"{n}: {m}", **tolerance)


# --- the mixin ------------------------------------------------------------------------------


def test_mixin_gives_configure_optimizers_and_must_come_first():
    out = TinyNet().configure_optimizers()
    assert isinstance(out["optimizer"], Muon)
    with pytest.raises(TypeError, match=r"Wrong: list MuonModuleMixin before LightningModule"):

        class Wrong(pl.LightningModule, MuonModuleMixin):
            pass

    # Defining configure_optimizers yourself is fine whatever the order.
    class OwnOptimizers(pl.LightningModule, MuonModuleMixin):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    assert isinstance(OwnOptimizers().configure_optimizers(), torch.optim.SGD)


def _lrs(module: pl.LightningModule) -> dict[str, float]:
    return {g["name"]: g["lr"] for g in module.configure_optimizers()["optimizer"].param_groups}


def test_mixin_reads_the_config_from_attribute_hparams_or_defaults():
    # Defaults: no hyperparameters at all, or muon_config=None.
    class Bare(MuonModuleMixin, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    assert _lrs(Bare()) == {"muon": 0.02, "adamw_no_decay": 3e-4, "adamw": 3e-4}
    assert _lrs(TinyNet()) == {"muon": 0.02, "adamw_no_decay": 3e-4, "adamw": 3e-4}
    # hparams["muon_config"], from save_hyperparameters, as a MuonConfig or a dict.
    assert _lrs(TinyNet(MuonConfig(matrix=MuonSettings(lr=0.05))))["muon"] == 0.05
    assert _lrs(TinyNet({"scalar": {"init_args": {"lr": 1e-3}}}))["adamw"] == 1e-3  # YAML's form, AdamW by default
    # The muon_config attribute wins over hparams.
    module = TinyNet(MuonConfig(matrix=MuonSettings(lr=0.05)))
    module.muon_config = {"matrix": {"init_args": {"lr": 0.07}}}
    assert _lrs(module)["muon"] == 0.07

    # hparams["muon"] is read too.
    class UsesMuonKey(MuonModuleMixin, pl.LightningModule):
        def __init__(self, muon: dict | None = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

    muon = {"matrix": {"init_args": {"lr": 0.01}}, "scalar": {"class_path": "LionSettings", "init_args": {"lr": 1e-5}}}
    assert _lrs(UsesMuonKey(muon)) == {
        "muon": 0.01,
        "lion_no_decay": 1e-5,
        "lion": 1e-5,
    }
    assert _lrs(UsesMuonKey())["muon"] == 0.02


def test_configure_muon_optimizers_structure():
    module = TinyNet()
    out = configure_muon_optimizers(
        module, MuonConfig(schedule=ScheduleSettings(momentum_warmup=MomentumWarmup(steps=3)))
    )
    assert set(out) == {"optimizer", "lr_scheduler"}
    assert isinstance(out["optimizer"], Muon)
    scheduler_config = out["lr_scheduler"]
    assert {k: v for k, v in scheduler_config.items() if k != "scheduler"} == {
        "interval": "step",
        "frequency": 1,
        "name": "muon",
    }
    scheduler = scheduler_config["scheduler"]
    assert isinstance(scheduler, MuonScheduler) and scheduler.optimizer is out["optimizer"]
    assert scheduler.schedule == LRSchedule(falloff="constant")
    assert [g["name"] for g in out["optimizer"].param_groups] == ["muon", "adamw_no_decay", "adamw"]
    # Outside a Trainer, a schedule that needs the run's length says so.
    with pytest.raises(ValueError, match=r"total_steps is needed by falloff='cosine'.*set total_steps or max_steps"):
        configure_muon_optimizers(module, {"schedule": {"falloff": "cosine"}})


@pytest.mark.parametrize(
    ("trainer_kwargs", "expected_total"),
    [
        (dict(max_steps=5), 5),
        # 3 batches per epoch, accumulating 2: a step after batch 2 and one for the odd batch
        # at the epoch's end, so 2 epochs are ceil(3 / 2) * 2 = 4 steps.
        (dict(max_epochs=2, accumulate_grad_batches=2), 4),
    ],
    ids=["max_steps", "max_epochs-accumulate"],
)
def test_total_steps_come_from_the_trainer(tmp_path, trainer_kwargs, expected_total):
    config = MuonConfig(
        matrix=FP32,
        schedule=ScheduleSettings(falloff="cosine", warmup=0.2, min_lr_ratio=0.1),
    )
    module = TinyNet(config)
    trainer = _trainer(tmp_path, **trainer_kwargs)
    trainer.fit(module, _loader(_data(12)))
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.schedule.total_steps == expected_total
    assert scheduler.schedule.warmup_steps == round(0.2 * expected_total)
    assert trainer.global_step == expected_total
    # After the last step the cosine has reached min_lr_ratio of every base lr.
    lrs = {g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups}
    assert lrs == pytest.approx({"muon": 0.002, "adamw_no_decay": 3e-5, "adamw": 3e-5}, rel=1e-9)


# --- logging --------------------------------------------------------------------------------


def test_learning_rate_monitor_logs_every_group_lr_and_momentum(tmp_path):
    config = MuonConfig(
        matrix=MuonSettings(lr=0.02, ns_dtype="float32"),
        scalar=AdamWSettings(lr=3e-4, betas=(0.8, 0.99)),
        schedule=ScheduleSettings(warmup=2, momentum_warmup=MomentumWarmup(steps=4)),
    )
    logger = CSVLogger(tmp_path, name="logs")
    trainer = _trainer(
        tmp_path,
        max_steps=6,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor(logging_interval="step", log_momentum=True)],
    )
    trainer.fit(TinyNet(config), _loader(_data(24)))
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    # Lightning names each group "<scheduler name>/<group name>"; our scheduler is named "muon".
    groups = ("muon", "adamw", "adamw_no_decay")
    expected_columns = {f"muon/{g}" for g in groups} | {f"muon/{g}-momentum" for g in groups} | {"step"}
    assert set(rows[0]) == expected_columns
    assert [int(r["step"]) for r in rows] == list(range(6))
    warmup = [0.5, 1, 1, 1, 1, 1]  # lr multiplier: (s + 1) / 2, then constant
    muon_momentum = [0.85, 0.875, 0.9, 0.925, 0.95, 0.95]  # 0.85 -> 0.95 over 4 steps
    for s, row in enumerate(rows):
        assert float(row["muon/muon"]) == pytest.approx(0.02 * warmup[s], rel=1e-9)
        assert float(row["muon/adamw"]) == float(row["muon/adamw_no_decay"]) == pytest.approx(3e-4 * warmup[s])
        assert float(row["muon/muon-momentum"]) == pytest.approx(muon_momentum[s], abs=1e-12)
        # AdamW groups report beta1 as their momentum; the warmup leaves them alone.
        assert float(row["muon/adamw-momentum"]) == float(row["muon/adamw_no_decay-momentum"]) == 0.8
    # Every LR-monitor key the docs and examples name is one that was logged.
    documented = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]:
        text = page.read_text()
        if "LearningRateMonitor" in text:
            documented |= set(re.findall(r"`(lr-\w+/\w+|muon/\w+(?:-momentum)?)`", text))  # group curves
    assert {"muon/muon", "muon/adamw"} <= documented  # the pages that name them were read
    assert documented <= expected_columns, documented - expected_columns


# --- clipping, accumulation, precision ------------------------------------------------------


class GradRecorder(pl.Callback):
    """Records every grad before clipping (on_before_optimizer_step) and as the step sees them.

    Lightning clips after ``on_before_optimizer_step``, inside ``optimizer.step`` (the closure
    runs first), so a step *pre*-hook would run before the grads exist; the *post*-hook sees
    the grads the update used (they are zeroed only at the next closure).
    """

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.used: list[list[torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
        trainer.optimizers[0].register_step_post_hook(
            lambda *_: self.used.append([p.grad.detach().clone() for p in params])
        )
        self.params = params

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before.append([p.grad.detach().clone() for p in self.params])


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_reaches_the_optimizer(tmp_path, algorithm):
    clip = 0.05  # well below this model's gradient norm (~1) and max |grad| (~0.3)
    recorder = GradRecorder()
    trainer = _trainer(
        tmp_path, max_steps=3, gradient_clip_val=clip, gradient_clip_algorithm=algorithm, callbacks=[recorder]
    )
    trainer.fit(TinyNet(MuonConfig(matrix=FP32)), _loader(_data(12)))
    assert len(recorder.before) == len(recorder.used) == 3
    for before, used in zip(recorder.before, recorder.used):
        if algorithm == "norm":
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in before]))
            assert norm > 2 * clip
            assert torch.linalg.vector_norm(torch.stack([g.norm() for g in used])) <= clip * (1 + 1e-6)
            # torch.nn.utils.clip_grad_norm_ by hand: every grad times clip / (norm + 1e-6).
            expected = [g * (clip / (norm + 1e-6)) for g in before]
        else:
            assert max(g.abs().max() for g in before) > 2 * clip
            assert max(g.abs().max() for g in used) <= clip
            expected = [g.clamp(-clip, clip) for g in before]
        for e, u in zip(expected, used):
            torch.testing.assert_close(u, e, rtol=1e-6, atol=1e-9)


def _manual_run(module: TinyNet, config: MuonConfig, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The reference: a plain loop with the same optimizer and scheduler, one step per batch."""
    out = configure_muon_optimizers(module, config)
    optimizer, scheduler = out["optimizer"], out["lr_scheduler"]["scheduler"]
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(module.net(x), y).backward()
        optimizer.step()
        scheduler.step()
    return _params(module)


def test_accumulate_grad_batches_equals_a_doubled_batch_and_a_manual_loop(tmp_path):
    config = MuonConfig(
        matrix=FP32,
        schedule=ScheduleSettings(falloff="linear", warmup=1, total_steps=3, momentum_warmup=MomentumWarmup(steps=2)),
    )
    dataset = _data(24)  # 6 batches of 4 = 3 optimizer steps of 8 samples
    start = TinyNet(config)

    accumulated, seen_accumulated = copy.deepcopy(start), GradRecorder()
    trainer = _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2, callbacks=[seen_accumulated])
    trainer.fit(accumulated, _loader(dataset, batch_size=4))
    assert trainer.global_step == 3  # one optimizer step per two batches
    assert len(accumulated.losses) == 6

    doubled, seen_doubled = copy.deepcopy(start), GradRecorder()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[seen_doubled])
    trainer.fit(doubled, _loader(dataset, batch_size=8))
    assert trainer.global_step == 3

    manual = _manual_run(copy.deepcopy(start), config, list(_loader(dataset, batch_size=8)))
    assert _differ(_params(start), manual)
    # Same batches, same ops: the Trainer with batch 8 is the manual loop, bit for bit.
    _assert_params_equal(_params(doubled), manual, rtol=0, atol=0)

    # Accumulation sums two half-batch means, (g1 + g2) / 2 (Lightning divides each loss by 2),
    # instead of one mean over 8: the grads the optimizer sees differ by float32 rounding only
    # (measured: <= 6e-8 on grads of size ~0.05). Muon and AdamW barely react to a grad's scale,
    # so this grad check, not the parameters, is what pins the 1/2 factor.
    assert len(seen_accumulated.used) == len(seen_doubled.used) == 3
    for step_a, step_d in zip(seen_accumulated.used, seen_doubled.used):
        for a, d in zip(step_a, step_d):
            torch.testing.assert_close(a, d, rtol=1e-5, atol=1e-7)
    # The parameters after three steps keep that rounding-level gap (measured: 2.3e-7).
    _assert_params_equal(_params(accumulated), manual, rtol=1e-5, atol=1e-6)


class AutocastProbe(TinyNet):
    def training_step(self, batch, batch_idx):
        self.seen = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), self.net(batch[0]).dtype)
        return super().training_step(batch, batch_idx)


def test_bf16_mixed_fits_and_changes_parameters(tmp_path):
    module = AutocastProbe(MuonConfig(matrix=FP32))
    before = _params(module)
    trainer = _trainer(tmp_path, max_steps=3, precision="bf16-mixed")
    trainer.fit(module, _loader(_data(12)))
    assert trainer.precision == "bf16-mixed"
    assert module.seen == (True, torch.bfloat16, torch.bfloat16)
    after = _params(module)
    assert all(after[n].dtype == torch.float32 for n in after)  # master weights stay fp32
    assert all(not torch.equal(after[n], before[n]) for n in after)  # every tensor moved
    assert all(torch.isfinite(p).all() for p in after.values())


def test_16_mixed_on_cpu_falls_back_to_bf16_mixed(tmp_path):
    # Lightning 2.6 does not run fp16 AMP (and so no GradScaler) on CPU: it warns and
    # switches to bf16-mixed. This pins that behaviour so a change in Lightning is noticed.
    with pytest.warns(UserWarning, match=r"AMP with fp16 is not supported on CPU\. Using `precision='bf16-mixed'`"):
        trainer = _trainer(tmp_path, max_steps=3, precision="16-mixed")
    assert trainer.precision == "bf16-mixed"
    assert getattr(trainer.precision_plugin, "scaler", None) is None
    module = AutocastProbe(MuonConfig(matrix=FP32))
    before = _params(module)
    trainer.fit(module, _loader(_data(12)))
    assert module.seen == (True, torch.bfloat16, torch.bfloat16)
    after = _params(module)
    assert all(not torch.equal(after[n], before[n]) for n in after)


# --- checkpoints ----------------------------------------------------------------------------


class StopAt(pl.Callback):
    """Interrupts a fit after ``step`` optimizer steps, as a crash or a preemption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_resume_from_checkpoint_continues_exactly(tmp_path):
    # Warmup + cosine and a momentum warmup: the scheduler's step, the momentum in the
    # optimizer's groups, Muon's buffers and AdamW's moments all have to come back.
    # total_steps comes from the trainer (max_steps=8) in every run.
    config = MuonConfig(
        matrix=FP32,
        schedule=ScheduleSettings(
            falloff="cosine", warmup=2, min_lr_ratio=0.1, momentum_warmup=MomentumWarmup(steps=5)
        ),
    )
    # Every batch is the same: a resumed fit with a plain DataLoader replays one batch
    # (Lightning does so after a fit that stopped at max_steps), and with identical batches
    # that cannot change the result, so
    # the comparison measures the optimizer and scheduler state only.
    dataset = _data(32, identical_batches_of=4)

    full = TinyNet(config)
    start = _params(full)
    _trainer(tmp_path / "full", max_steps=8).fit(full, _loader(dataset))

    first = TinyNet(config)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    trainer = _trainer(tmp_path / "first", max_steps=8, callbacks=[StopAt(4), checkpoint], enable_checkpointing=True)
    trainer.fit(first, _loader(dataset))
    assert trainer.global_step == 4
    path = tmp_path / "ckpt" / "step=4.ckpt"
    assert path.is_file()

    resumed = TinyNet(config, seed=123)  # other initial weights: they must come from the checkpoint
    assert _differ(_params(resumed), start)
    trainer = _trainer(tmp_path / "resumed", max_steps=8)
    with pytest.warns(UserWarning, match="ended before the epoch ended and your dataloader is not resumable"):
        trainer.fit(resumed, _loader(dataset), ckpt_path=path)
    assert trainer.global_step == 8
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 8 and scheduler.schedule.total_steps == 8

    # One process, one CPU, the same ops in the same order on the same float32 values:
    # the continuation is bitwise identical, so the tolerance is zero.
    torch.testing.assert_close(torch.stack(first.losses), torch.stack(full.losses[:4]), rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(resumed.losses), torch.stack(full.losses[4:]), rtol=0, atol=0)
    _assert_params_equal(_params(resumed), _params(full), rtol=0, atol=0)
    # And the check has teeth: restarting the schedule (fresh optimizer, same weights) differs.
    restarted = TinyNet(config, seed=123)
    restarted.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    _trainer(tmp_path / "restarted", max_steps=4).fit(restarted, _loader(dataset))
    assert _differ(_params(restarted), _params(full))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)), encoding="utf-8")
    return path


def test_save_hyperparameters_and_load_from_checkpoint(tmp_path, text_file):
    config = MuonConfig(
        matrix=MuonSettings(lr=0.03, adjust_lr="match_rms_adamw", ns_dtype="float32"),
        routing=RoutingSettings(
            rules=[Rule(name="qkv", algorithm="muon", names="*.attn.qkv.weight", options={"split_sizes": [32, 32, 32]})]
        ),
        schedule=ScheduleSettings(falloff="wsd", warmup=0.25, cooldown=0.5, momentum_warmup=MomentumWarmup(steps=2)),
    )
    module = CharGPTModule(n_layer=1, n_embd=32, n_head=2, block_size=16, muon_config=config)
    data = CharTextDataModule(
        text_path=str(text_file), block_size=16, batch_size=4, train_samples_per_epoch=16, val_samples=4
    )
    trainer = _trainer(tmp_path, max_steps=3, limit_val_batches=0, enable_checkpointing=True)
    trainer.fit(module, datamodule=data)
    path = Path(trainer.checkpoint_callback.best_model_path)
    assert path.is_file()
    assert {g["name"] for g in trainer.optimizers[0].param_groups} == {"qkv", "muon", "adamw", "adamw_no_decay"}

    raw = torch.load(path, weights_only=True)  # MuonConfig and Rule are allow-listed
    assert raw["hyper_parameters"]["muon_config"] == config
    assert raw["lr_schedulers"][0]["schedule"]["total_steps"] == 3
    loaded = CharGPTModule.load_from_checkpoint(path)
    assert loaded.hparams["muon_config"] == config
    assert loaded.resolve_muon_config() == config
    assert (loaded.hparams["n_layer"], loaded.hparams["n_embd"]) == (1, 32)
    _assert_params_equal(_params(loaded), _params(module), rtol=0, atol=0)


# --- the list API ---------------------------------------------------------------------------


class ManualNet(TinyNet):
    """Manual optimization with one optimizer per algorithm from the list API."""

    def __init__(self, muon_config: MuonConfig | None = None, seed: int = 0) -> None:
        super().__init__(muon_config, seed)
        self.automatic_optimization = False

    def configure_optimizers(self):
        config = self.resolve_muon_config()
        optimizers = build_optimizers(self, config)
        return optimizers, build_schedulers(optimizers, config, total_steps=config.schedule.total_steps)

    def training_step(self, batch, batch_idx):
        optimizers, schedulers = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()


def test_list_api_under_manual_optimization_matches_the_hybrid_optimizer(tmp_path):
    config = MuonConfig(
        matrix=FP32,
        scalar=AdamWSettings(weight_decay=0.1),
        schedule=ScheduleSettings(falloff="cosine", warmup=1, total_steps=4, momentum_warmup=MomentumWarmup(steps=2)),
    )
    dataset = _data(16)

    manual = ManualNet(config)
    start = _params(manual)
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(manual, _loader(dataset))
    optimizers = trainer.optimizers
    assert [[g["algorithm"] for g in o.param_groups] for o in optimizers] == [["muon"], ["adamw", "adamw"]]
    # Under manual optimization Lightning counts every optimizer.step() call: 4 batches x 2.
    assert trainer.global_step == 8
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [4, 4]

    hybrid = TinyNet(config)
    _assert_params_equal(_params(hybrid), start, rtol=0, atol=0)
    _trainer(tmp_path, max_epochs=1).fit(hybrid, _loader(dataset))
    # The same update rules on the same grads, split over two optimizers: bitwise equal.
    torch.testing.assert_close(torch.stack(manual.losses), torch.stack(hybrid.losses), rtol=0, atol=0)
    _assert_params_equal(_params(manual), _params(hybrid), rtol=0, atol=0)
    assert _differ(_params(manual), start)


def test_build_optimizers_on_flat_params_modules_and_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    # A flat list is split by shape only: every matrix (the embedding too) to Muon.
    flat = build_optimizers(list(model.parameters()), {"matrix": {"init_args": {"lr": 0.01}}})
    assert [[(g["algorithm"], len(g["params"])) for g in o.param_groups] for o in flat] == [
        [("muon", 3)],
        [("adamw", 4)],  # two Linear biases, the LayerNorm's weight and bias
    ]
    assert flat[0].param_groups[0]["lr"] == 0.01
    # A module is routed: embedding and head to AdamW.
    routed = build_optimizers(model)
    assert [[g["name"] for g in o.param_groups] for o in routed] == [["muon"], ["adamw", "adamw_no_decay"]]
    assert [p is model[1].weight for p in routed[0].param_groups[0]["params"]] == [True]
    # Lion as the scalar optimizer: Muon first, then Lion.
    lion = build_optimizers(model, {"scalar": {"class_path": "LionSettings"}})
    assert [{g["algorithm"] for g in o.param_groups} for o in lion] == [{"muon"}, {"lion"}]
    # Param-group dicts are taken as they are.
    groups = [
        {"params": [model[1].weight], "algorithm": "muon"},
        {"params": [model[3].weight], "algorithm": "lion", "lr": 1e-4},
        {"params": [model[3].bias], "algorithm": "adamw"},
    ]
    assert [o.param_groups[0]["algorithm"] for o in build_optimizers(groups)] == ["muon", "adamw", "lion"]


def test_list_api_in_a_plain_pytorch_loop():
    config = MuonConfig(
        matrix=FP32,
        schedule=ScheduleSettings(
            falloff="linear", warmup=2, min_lr_ratio=0.2, momentum_warmup=MomentumWarmup(steps=2)
        ),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizers = build_optimizers(model, config)
    schedulers = build_schedulers(optimizers, config, total_steps=6)
    ref_optimizer = config.make_optimizer(route_parameters(reference))
    ref_scheduler = MuonScheduler(ref_optimizer, config.lr_schedule(6), config.momentum_warmup())
    x, y = _data(8).tensors
    # Linear: W=2, decay over 4 steps to 0.2: 0.5, 1, 1, 0.8, 0.6, 0.4.
    multipliers = [0.5, 1, 1, 0.8, 0.6, 0.4]
    losses = []
    for step, factor in enumerate(multipliers):
        assert optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02 * factor)
        assert optimizers[1].param_groups[0]["lr"] == pytest.approx(3e-4 * factor)
        assert optimizers[0].param_groups[0]["momentum"] == pytest.approx([0.85, 0.9][step] if step < 2 else 0.95)
        for optimizer in (*optimizers, ref_optimizer):
            optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        F.mse_loss(reference(x), y).backward()
        for optimizer in (*optimizers, ref_optimizer):
            optimizer.step()
        for scheduler in (*schedulers, ref_scheduler):
            scheduler.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert math.isfinite(losses[-1])
    _assert_params_equal(_params(model), _params(reference), rtol=0, atol=0)
