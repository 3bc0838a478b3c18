"""``"adamw_schedulefree"`` groups: parity with ``schedulefree.AdamWScheduleFree``, modes, schedules, Lightning.

The hybrid ``Muon`` steps these groups through the ``schedulefree`` package itself, so
the reference everywhere below is that package run on a copy of the same parameters.
"""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import schedulefree
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import (
    AdamWSettings,
    LionSettings,
    LRSchedule,
    MomentumWarmup,
    Muon,
    MuonConfig,
    MuonModuleMixin,
    MuonScheduler,
    MuonSettings,
    RoutingSettings,
    Rule,
    ScheduleFreeModeSwitch,
    ScheduleFreeSettings,
    ScheduleSettings,
    build_optimizers,
)
from lightning_muon.algorithms.adamw_schedulefree import schedule_free_training
from lightning_muon.callbacks import CheckpointChecks
from lightning_muon.schedules import lr_multiplier

SF = "adamw_schedulefree"
FP32 = {"ns_dtype": "float32"}

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
)


def _equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"{what}, tensor {i}: {m}")


# --- the optimizer --------------------------------------------------------------------------


def _sf_groups(params: list[torch.Tensor], **extra) -> list[dict]:
    # Two groups with different knobs; the second leaves several at schedulefree's defaults.
    return [
        {"params": params[:2], "lr": 0.01, "weight_decay": 0.1, "warmup_steps": 3, **extra},
        {
            "params": params[2:],
            "lr": 0.03,
            "betas": (0.8, 0.99),
            "eps": 1e-6,
            "r": 0.5,
            "weight_lr_power": 1.0,
            **extra,
        },
    ]


@pytest.mark.numerics
def test_steps_equal_schedulefree_adamw_step_for_step():
    torch.manual_seed(0)
    shapes = [(6, 5), (7,), (3, 4, 2), ()]
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    optimizer = Muon(_sf_groups(ours, algorithm=SF))
    reference = schedulefree.AdamWScheduleFree(_sf_groups(theirs))
    # Every key schedulefree keeps per group, with its values: our defaults are its defaults.
    for group, ref in zip(optimizer.param_groups, reference.param_groups):
        assert {k: v for k, v in group.items() if k not in ("params", "algorithm", "momentum")} == {
            k: v for k, v in ref.items() if k != "params"
        }
    optimizer.train()
    reference.train()
    for step in range(10):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        if step == 3:
            ours[1].grad = theirs[1].grad = None  # a parameter without a gradient this step
        if step == 5:
            for opt in (optimizer, reference):  # an lr change (a scheduler) moves lr_max and the weights
                opt.param_groups[1]["lr"] = 0.05
        optimizer.step()
        reference.step()
        _equal(ours, theirs, f"step {step}, train mode")
        if step in (2, 6):
            optimizer.eval()
            reference.eval()
            _equal(ours, theirs, f"step {step}, eval mode")
            assert not schedule_free_training(optimizer)
            optimizer.train()
            reference.train()
            _equal(ours, theirs, f"step {step}, back in train mode")
    for group, ref in zip(optimizer.param_groups, reference.param_groups):
        assert (group["k"], group["weight_sum"], group["lr_max"]) == (ref["k"], ref["weight_sum"], ref["lr_max"])
    for p, q in zip(ours, theirs):
        ours_state, their_state = optimizer.state[p], reference.state[q]
        _equal([ours_state["z"], ours_state["exp_avg_sq"]], [their_state["z"], their_state["exp_avg_sq"]], "state")


@pytest.mark.numerics
def test_state_dict_resumes_exactly_through_a_weights_only_load():
    torch.manual_seed(1)
    shapes = [(5, 4), (4,), (3,)]
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    grads = [[torch.randn_like(p) for p in params] for _ in range(8)]

    def run(optimizer: Muon, ps: list[torch.Tensor], steps: range) -> None:
        optimizer.train()
        for step in steps:
            for p, g in zip(ps, grads[step]):
                p.grad = g.clone()
            optimizer.step()
        optimizer.eval()  # saved, and compared, in eval mode

    full = Muon(_sf_groups(params, algorithm=SF))
    run(full, params, range(8))
    half_params = [p.detach().clone().requires_grad_() for p in params]  # a fresh start
    torch.manual_seed(1)
    start = [torch.randn(s) for s in shapes]
    with torch.no_grad():
        for p, s in zip(half_params, start):
            p.copy_(s)
    half = Muon(_sf_groups(half_params, algorithm=SF))
    run(half, half_params, range(4))
    buffer = io.BytesIO()
    torch.save({"optimizer": half.state_dict(), "params": [p.detach() for p in half_params]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert [g["train_mode"] for g in saved["optimizer"]["param_groups"]] == [False, False]
    resumed_params = [p.clone().requires_grad_() for p in saved["params"]]  # the averaged weights
    resumed = Muon(_sf_groups(resumed_params, algorithm=SF, lr=0.5))  # other knobs: the state brings them back
    resumed.load_state_dict(saved["optimizer"])
    run(resumed, resumed_params, range(4, 8))
    # The uninterrupted run went through the same eval()/train() at step 4 as the saved one.
    reference = Muon(_sf_groups([s.clone().requires_grad_() for s in start], algorithm=SF))
    ref_params = [p for g in reference.param_groups for p in g["params"]]
    run(reference, ref_params, range(4))
    run(reference, ref_params, range(4, 8))
    _equal(resumed_params, ref_params, "resumed")
    # And the state matters: a fresh optimizer on the averaged weights goes elsewhere.
    restarted_params = [p.clone().requires_grad_() for p in saved["params"]]
    run(Muon(_sf_groups(restarted_params, algorithm=SF)), restarted_params, range(4, 8))
    assert not torch.equal(restarted_params[0], ref_params[0])


@pytest.mark.numerics
def test_hybrid_steps_muon_and_schedule_free_groups_each_as_alone():
    torch.manual_seed(2)
    matrices = [torch.randn(8, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)]
    vectors = [torch.randn(6, requires_grad=True), torch.randn(8, 6, requires_grad=True)]
    muon_alone = [p.detach().clone().requires_grad_() for p in matrices]
    sf_alone = [p.detach().clone().requires_grad_() for p in vectors]
    hybrid = Muon(
        [
            {"params": matrices, "algorithm": "muon", "weight_decay": 0.1},
            {"params": vectors, "algorithm": SF, "lr": 0.01, "weight_decay": 0.01},
        ],
        **FP32,
    )
    muon = Muon([{"params": muon_alone, "algorithm": "muon", "weight_decay": 0.1}], **FP32)
    reference = schedulefree.AdamWScheduleFree(sf_alone, lr=0.01, weight_decay=0.01)
    hybrid.train()
    reference.train()
    for _ in range(5):
        for p, q in zip(matrices + vectors, muon_alone + sf_alone):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        hybrid.step()
        muon.step()
        reference.step()
    _equal(matrices, muon_alone, "muon")
    _equal(vectors, sf_alone, "schedule-free")
    hybrid.eval()
    reference.eval()
    _equal(matrices, muon_alone, "muon after eval()")  # eval() leaves Muon groups alone
    _equal(vectors, sf_alone, "schedule-free after eval()")


def test_step_refuses_eval_mode_naming_the_group():
    p = torch.zeros(3, requires_grad=True)
    optimizer = Muon([{"params": [p], "algorithm": SF, "name": "scalars"}])
    p.grad = torch.ones(3)
    # A new schedule-free optimizer starts in eval mode, as schedulefree's does.
    with pytest.raises(RuntimeError, match=r"param group 0 \('scalars'\) is schedule-free and in eval mode.*train\(\)"):
        optimizer.step()
    optimizer.train()
    optimizer.step()
    assert optimizer.param_groups[0]["k"] == 1


def test_missing_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "schedulefree", None)  # import schedulefree now raises ImportError
    install = r"needs the schedulefree package.*pip install 'lightning_muon\[schedulefree\]'"
    with pytest.raises(ImportError, match=install):
        Muon([{"params": [torch.zeros(3, requires_grad=True)], "algorithm": SF}])
    with pytest.raises(ImportError, match=install):
        MuonConfig(scalar=ScheduleFreeSettings())
    with pytest.raises(ImportError, match=install):
        MuonConfig(routing=RoutingSettings(rules=[Rule(name="gates", algorithm=SF, names="*.gate")]))
    # Nothing else needs it.
    Muon([torch.zeros(3, 3, requires_grad=True), torch.zeros(3, requires_grad=True)])
    # Schedule-Free's settings held for no group (no section or rule routes to it) need no install either.
    MuonConfig(scalar=LionSettings(), others=[ScheduleFreeSettings(lr=0.1)])


@pytest.mark.parametrize(
    ("knob", "value", "match"),
    [
        (
            "betas",
            (0.0, 0.999),
            r"param group 0: betas must be a pair \(beta1, beta2\), beta1 in \(0, 1\) and beta2 in \[0, 1\), "
            r"got \(0\.0, 0\.999\)",
        ),
        ("warmup_steps", -1, r"param group 0: warmup_steps must be an int >= 0"),
        ("r", -0.5, r"param group 0: r must be"),
        ("weight_lr_power", float("inf"), r"param group 0: weight_lr_power must be"),
        ("eps", 0.0, r"param group 0: eps must be"),
    ],
)
def test_bad_group_knobs_are_named(knob, value, match):
    with pytest.raises(ValueError, match=match):
        Muon([{"params": [torch.zeros(3, requires_grad=True)], "algorithm": SF, knob: value}])


def _sf_optimizer_groups(config: MuonConfig) -> dict[str, dict]:
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = build_optimizers(module, config)
    assert [o.param_groups[0]["algorithm"] for o in optimizer] == ["muon", SF]
    return {g["name"]: g for g in optimizer[1].param_groups}


def test_config_defaults_and_the_double_warmup_error():
    config = MuonConfig(scalar=ScheduleFreeSettings(lr=1e-3, weight_decay=0.05))
    assert config.uses_schedule_free and not MuonConfig().uses_schedule_free
    groups = _sf_optimizer_groups(config)
    # The section's lr and weight decay; the no-decay rule still applies.
    assert groups[SF]["lr"] == 1e-3 and groups[SF]["weight_decay"] == 0.05
    assert groups["adamw_schedulefree_no_decay"]["weight_decay"] == 0.0
    assert groups[SF]["betas"] == (0.9, 0.999)
    # Left unset, they are Schedule-Free's own defaults, not AdamW's settings (held under others here).
    groups = _sf_optimizer_groups(
        MuonConfig(scalar=ScheduleFreeSettings(), others=[AdamWSettings(lr=1e-3, weight_decay=0.05)])
    )
    assert (groups[SF]["lr"], groups[SF]["weight_decay"]) == (3e-4, 0.0)
    assert groups["adamw_schedulefree_no_decay"]["weight_decay"] == 0.0
    with pytest.raises(
        ValueError, match=r"schedule\.warmup=5 and ScheduleFreeSettings\.warmup_steps=3 would warm .* twice"
    ):
        MuonConfig(scalar=ScheduleFreeSettings(warmup_steps=3), schedule=ScheduleSettings(warmup=5))
    MuonConfig(scalar=ScheduleFreeSettings(warmup_steps=3))  # one warmup is fine


def test_scheduler_gives_schedule_free_groups_the_warmup_and_no_falloff():
    a, b, c = (
        torch.zeros(4, 4, requires_grad=True),
        torch.zeros(4, requires_grad=True),
        torch.zeros(2, requires_grad=True),
    )
    optimizer = Muon(
        [
            {"params": [a], "algorithm": "muon", "lr": 0.02},
            {"params": [b], "algorithm": SF, "lr": 0.01},
            {"params": [c], "algorithm": "adamw", "lr": 0.003},
        ]
    )
    schedule = LRSchedule.create("wsd", warmup=2, cooldown=3, total_steps=7)
    scheduler = MuonScheduler(optimizer, schedule)
    optimizer.train()
    seen = []
    for _ in range(7):
        seen.append([g["lr"] for g in optimizer.param_groups])
        for p in (a, b, c):
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
    full = [lr_multiplier(s, schedule) for s in range(7)]
    assert full == pytest.approx([0.5, 1, 1, 1, 1, 2 / 3, 1 / 3])  # warmup, stable, linear cooldown
    assert [lrs[0] for lrs in seen] == pytest.approx([0.02 * f for f in full], rel=1e-12)
    assert [lrs[2] for lrs in seen] == pytest.approx([0.003 * f for f in full], rel=1e-12)
    assert [lrs[1] for lrs in seen] == pytest.approx([0.005] + [0.01] * 6, rel=1e-12)
    # schedulefree weighted its average by the lr it was given: the warmup shows in lr_max.
    assert optimizer.param_groups[1]["lr_max"] == 0.01
    assert scheduler.state_dict()["warmup_only"] == [False, True, False]


# --- Lightning --------------------------------------------------------------------------------


class Net(MuonModuleMixin, pl.LightningModule):
    """An MLP: two hidden matrices and a head; records losses and the weights validation sees."""

    def __init__(self, muon_config: MuonConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.losses: list[torch.Tensor] = []
        self.validated: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated.append(_params(self))
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _loader(n: int = 24, identical_batches_of: int | None = None, seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    rows = identical_batches_of or n
    x, y = torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)
    if identical_batches_of:
        x, y = x.repeat(n // rows, 1), y.repeat(n // rows, 1)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


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


def _assert_params_equal(a: dict, b: dict, **tolerance) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, n=name: f"{n}: {m}", **tolerance)


def test_mixin_adds_the_mode_switch_only_for_schedule_free_configs():
    assert not any(isinstance(c, ScheduleFreeModeSwitch) for c in Net().configure_callbacks())
    callbacks = Net(MuonConfig(scalar=ScheduleFreeSettings())).configure_callbacks()
    assert [type(c) for c in callbacks if not isinstance(c, CheckpointChecks)] == [ScheduleFreeModeSwitch]


def test_validation_sees_the_averaged_weights_and_training_goes_on_at_the_training_ones(tmp_path):
    # Every parameter schedule-free: the run must be schedulefree's own plain loop with
    # eval() around each validation and train() after it.
    config = MuonConfig(
        others=[ScheduleFreeSettings(lr=0.02, weight_decay=0.01)],
        routing=RoutingSettings(default_rules=False, rules=[Rule(name="all", algorithm=SF, group="all")]),
    )
    model = Net(config)
    trainer = _trainer(tmp_path, max_steps=6, val_check_interval=2, num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(model, _loader(24), _loader(8, seed=5))
    assert len(model.validated) == 3

    reference = Net(config)
    optimizer = schedulefree.AdamWScheduleFree(reference.parameters(), lr=0.02, weight_decay=0.01)
    losses, validated, training = [], [], []
    for step, (x, y) in enumerate(_loader(24)):
        optimizer.train()  # before every batch: a no-op unless a validation came before it
        optimizer.zero_grad()
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if step % 2 == 1:
            training.append(_params(reference))
            optimizer.eval()
            validated.append(_params(reference))
    optimizer.eval()  # the end of training (a no-op here: the last step had a validation)

    for ours, theirs in zip(model.validated, validated):
        _assert_params_equal(ours, theirs, rtol=0, atol=0)
    # Validation saw other weights than the training ones (the average, not y) ...
    assert all(not torch.equal(v["net.4.weight"], t["net.4.weight"]) for v, t in zip(validated, training))
    # ... and training went on at y: every loss equals the plain loop's.
    torch.testing.assert_close(torch.stack(model.losses), torch.stack(losses), rtol=0, atol=0)
    # After fit the module holds the averaged weights.
    _assert_params_equal(_params(model), _params(reference), rtol=0, atol=0)
    assert not schedule_free_training(trainer.optimizers[0])


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


class AveragedAt(Callback):
    """The averaged weights at a step, from a copy of the optimizer put in eval mode."""

    def __init__(self, step: int) -> None:
        self.step, self.weights, self.training = step, None, None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step:
            self.training = {f"net.{n}": p.detach().clone() for n, p in pl_module.net.named_parameters()}
            twin = copy.deepcopy({"module": pl_module.net, "optimizer": trainer.optimizers[0]})
            twin["optimizer"].eval()
            self.weights = {f"net.{n}": p.detach().clone() for n, p in twin["module"].named_parameters()}


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
@pytest.mark.parametrize("weights_only", [False, True])
def test_resume_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(tmp_path, weights_only):
    # Muon on the hidden matrices with a cosine falloff, Schedule-Free AdamW on the head and
    # biases (warmup only). The checkpoint at step 4 is saved in train mode (no validation):
    # it must hold the averaged weights and eval-mode groups, and let a new run continue
    # exactly as the run that saved it.
    config = MuonConfig(
        matrix=MuonSettings(**FP32),
        scalar=ScheduleFreeSettings(lr=0.02),
        schedule=ScheduleSettings(
            falloff="cosine", warmup=2, min_lr_ratio=0.1, momentum_warmup=MomentumWarmup(steps=5)
        ),
    )
    loader = _loader(32, identical_batches_of=4)  # a resumed fit replays one batch; identical batches hide it
    full = Net(config)
    averaged = AveragedAt(4)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        every_n_train_steps=4,
        save_top_k=-1,
        filename="{step}",
        save_weights_only=weights_only,
    )
    trainer = _trainer(tmp_path / "full", max_steps=8, callbacks=[averaged, checkpoint], enable_checkpointing=True)
    trainer.fit(full, loader)
    path = tmp_path / "ckpt" / "step=4.ckpt"
    saved = torch.load(path, weights_only=True)

    # The weights in the checkpoint are the averaged ones for the schedule-free parameters.
    sf_names = {"net.4.weight", "net.0.bias", "net.2.bias", "net.4.bias"}
    for name in sf_names:
        torch.testing.assert_close(saved["state_dict"][name], averaged.weights[name], rtol=0, atol=0)
    # ... not the training weights the parameters held at that step; the Muon matrices as they were.
    assert not torch.equal(saved["state_dict"]["net.4.weight"], averaged.training["net.4.weight"])
    for name in ("net.0.weight", "net.2.weight"):
        torch.testing.assert_close(saved["state_dict"][name], averaged.training[name], rtol=0, atol=0)
    if weights_only:
        assert "optimizer_states" not in saved
        return
    groups = saved["optimizer_states"][0]["param_groups"]
    assert {g["name"]: g.get("train_mode") for g in groups} == {
        "muon": None,
        "adamw_schedulefree_no_decay": False,
        SF: False,
    }

    resumed = Net(config, seed=123)  # other initial weights: they must come from the checkpoint
    # Saving in train mode is eval(), save, train() (schedulefree's own protocol), which rounds
    # the training weights: the resumed run saves at step 8 as the full run did.
    again = ModelCheckpoint(dirpath=tmp_path / "again", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    trainer = _trainer(tmp_path / "resumed", max_steps=8, callbacks=[again], enable_checkpointing=True)
    with pytest.warns(UserWarning, match="ended before the epoch ended and your dataloader is not resumable"):
        trainer.fit(resumed, loader, ckpt_path=path)
    assert trainer.global_step == 8
    torch.testing.assert_close(torch.stack(resumed.losses), torch.stack(full.losses[4:]), rtol=0, atol=0)
    _assert_params_equal(_params(resumed), _params(full), rtol=0, atol=0)

    # The schedule-free state matters: the checkpoint's weights with a fresh optimizer differ.
    restarted = Net(config, seed=123)
    restarted.load_state_dict(saved["state_dict"])
    _trainer(tmp_path / "restarted", max_steps=4).fit(restarted, loader)
    assert not torch.equal(_params(restarted)["net.4.weight"], _params(full)["net.4.weight"])
    # Saving moved the live run only by the rounding of eval() then train(), as schedulefree's
    # own save (eval, save, train) does: a run that saved nothing ends next to it.
    unsaved = Net(config)
    _trainer(tmp_path / "unsaved", max_steps=8).fit(unsaved, loader)
    _assert_params_equal(_params(unsaved), _params(full), rtol=1e-4, atol=1e-6)
