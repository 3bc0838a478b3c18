"""Faults a careful user meets: a NaN on one rank, a routing change on resume, typos, damaged checkpoints."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from ddp_modules import TinyRegressor
from dist_utils import run_distributed
from fault_modules import fault_worker
from torch import nn

from lightning_muon import (
    AdamWSettings,
    Muon,
    MuonConfig,
    MuonDDPStrategy,
    MuonFSDPStrategy,
    MuonSettings,
    Rule,
    ScheduleSettings,
    route_parameters,
)
from lightning_muon.strategies._checkpoint import CheckpointReadError, explained_reads

pytestmark = pytest.mark.policy_free  # see conftest.py


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["muon_ddp", "muon_fsdp"])
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_nan_in_a_replicated_gradient_on_one_rank_every_rank_returns(strategy, mode):
    """Rank 1 alone sees a NaN in head.bias (AdamW): both ranks skip, or both raise naming it; none hangs."""
    # A hung rank is killed at the timeout and fails the test, naming it.
    results = run_distributed(fault_worker, 2, strategy, mode, timeout=150)
    bias = "head.bias" if strategy == "muon_ddp" else "net.head.bias"
    if mode == "skip":
        assert all(r["ok"] and r["global_step"] == 4 for r in results), results
        assert results[1]["skipped"]  # the rank with the NaN warns; the other skips silently or alike
        assert results[0]["params"] == results[1]["params"]  # the replicas stayed identical
        assert all(v == v for values in results[0]["params"].values() for v in values)  # no NaN got in
    else:
        assert not results[0]["ok"] and not results[1]["ok"]
        assert f"'{bias}'" in results[1]["error"] and "on another rank" not in results[1]["error"]
        # The other rank's error names the parameter too.
        assert "on another rank" in results[0]["error"] and f"'{bias}'" in results[0]["error"]


# ------------------------------------------------- optimizer state on the wrong parameter


def _named_muon(routing: dict[str, str], model: nn.Module) -> Muon:
    """A Muon whose groups follow ``routing`` (parameter name -> algorithm), in name order."""
    groups = []
    for algorithm in ("muon", "adamw"):
        chosen = [(n, model.get_parameter(n)) for n in sorted(routing) if routing[n] == algorithm]
        groups.append({"params": chosen, "algorithm": algorithm, "name": algorithm})
    return Muon(groups, lr=0.02, ns_dtype="float32", adamw_lr=1e-3)


def _trained_state(routing: dict[str, str]) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(8, 8, bias=False), "b": nn.Linear(8, 8, bias=False), "c": nn.Linear(4, 8)})
    opt = _named_muon(routing, model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt.state_dict()


def test_resume_after_a_routing_swap_that_keeps_sizes_and_shapes_raises_naming_both_routings():
    """a.weight and b.weight (both 8 x 8) trade places between the Muon and the AdamW group."""
    before = {"a.weight": "muon", "b.weight": "adamw", "c.weight": "muon", "c.bias": "adamw"}
    after = {"a.weight": "adamw", "b.weight": "muon", "c.weight": "muon", "c.bias": "adamw"}
    model, saved = _trained_state(before)
    opt = _named_muon(after, model)
    names_before = [list(g["param_names"]) for g in opt.param_groups]
    # Positions, sizes and shapes all match: torch alone would hand a.weight's momentum to b.weight.
    match = (
        r"'b\.weight' was routed to param group 1 'adamw' \(adamw\) when the checkpoint was saved, "
        r"and to param group 0 'muon' \(muon\) now"
    )
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert [list(g["param_names"]) for g in opt.param_groups] == names_before  # untouched
    assert not opt.state  # nothing was loaded


def test_resume_after_a_routing_change_with_other_shapes_fails_at_load_not_mid_training():
    """c.weight (8 x 4) joins the AdamW group: caught at load, not in muon_momentum_ at the next step."""
    before = {"a.weight": "muon", "b.weight": "muon", "c.weight": "adamw", "c.bias": "adamw"}
    after = {"a.weight": "muon", "b.weight": "adamw", "c.weight": "muon", "c.bias": "adamw"}
    model, saved = _trained_state(before)
    with pytest.raises(ValueError, match=r"'c\.weight' was routed to param group 1 'adamw'"):
        _named_muon(after, model).load_state_dict(saved)


def test_resume_with_a_resized_layer_names_the_shapes():
    before = {"a.weight": "muon", "b.weight": "muon", "c.weight": "muon", "c.bias": "adamw"}
    _, saved = _trained_state(before)
    torch.manual_seed(0)
    resized = nn.ModuleDict({"a": nn.Linear(8, 8, bias=False), "b": nn.Linear(8, 8, bias=False), "c": nn.Linear(6, 8)})
    with pytest.raises(ValueError, match=r"'c\.weight' has shape \(8, 6\), but the checkpoint's 'momentum_buffer'"):
        _named_muon(before, resized).load_state_dict(saved)


def test_resume_with_the_same_routing_loads_exactly():
    routing = {"a.weight": "muon", "b.weight": "adamw", "c.weight": "muon", "c.bias": "adamw"}
    model, saved = _trained_state(routing)
    opt = _named_muon(routing, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(saved)
    assert torch.equal(
        opt.state[model.get_parameter("a.weight")]["momentum_buffer"], saved["state"][0]["momentum_buffer"]
    )


# ------------------------------------------------------- the NaN error names the right parameter


class _PoisonHeadBias(pl.Callback):
    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 1:
            pl_module.head.bias.grad[0] = float("nan")


def _fit_tiny(tmp_path, config: MuonConfig, steps: int = 3, **trainer_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset notices
        trainer.fit(TinyRegressor(config))
    return trainer


def test_nan_error_names_the_bad_parameter_even_with_clipping(tmp_path):
    """Clipping spreads head.bias's NaN to every gradient; the error still names head.bias."""
    config = MuonConfig(matrix=MuonSettings(lr=0.02, ns_dtype="float32"), scalar=AdamWSettings(lr=1e-2))
    with pytest.raises(
        FloatingPointError, match=r"non-finite gradient in param group \d \('\w+'\), parameter \d 'head\.bias'"
    ):
        _fit_tiny(tmp_path, config, callbacks=[_PoisonHeadBias()], gradient_clip_val=1.0)


# --------------------------------------------------------------- warmup longer than the run


@pytest.mark.parametrize("falloff", ["constant", "inverse_sqrt", "cosine"])
def test_warmup_longer_than_the_run_raises_for_every_falloff(tmp_path, falloff):
    config = MuonConfig(
        matrix=MuonSettings(lr=0.02, ns_dtype="float32"), schedule=ScheduleSettings(warmup=100, falloff=falloff)
    )
    with pytest.raises(ValueError, match=r"warmup \(100\) \+ \w+ \(\d+\) steps exceed total_steps \(4\)"):
        _fit_tiny(tmp_path, config, steps=4)


# ------------------------------------------------------------------ typos in a Rule's options


@pytest.mark.parametrize(
    ("algorithm", "options", "match"),
    [
        (
            "muon",
            {"momentm": 0.5},
            r"Rule 'r': option 'momentm' is not a hyperparameter of 'muon' groups; did you mean 'momentum'\?",
        ),
        (
            "adamw",
            {"beta": (0.9, 0.95)},
            r"option 'beta' is not a hyperparameter of 'adamw' groups; did you mean 'betas'\?",
        ),
        ("lion", {"eps": 1e-8}, r"option 'eps' is not a hyperparameter of 'lion' groups"),
        ("adamw", {"split_sizes": [2, 2]}, r"option 'split_sizes' is not a hyperparameter of 'adamw' groups"),
    ],
)
def test_rule_option_typos_are_refused_with_the_closest_name(algorithm, options, match):
    with pytest.raises(ValueError, match=match):
        Rule(name="r", algorithm=algorithm, names="*", options=options)


def test_rule_options_that_exist_are_accepted_and_reach_the_group():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    rule = Rule(name="slow", algorithm="muon", names="2.weight", options={"momentum": 0.5, "ns_steps": 6})
    groups = route_parameters(model, rules=[rule])
    slow = next(g for g in groups if g["name"] == "slow")
    assert slow["momentum"] == 0.5 and slow["ns_steps"] == 6


# ------------------------------------------------------------------------ damaged checkpoints


def test_truncated_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.randn(256, 256)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointReadError,
        match=rf"cannot read the checkpoint file '{path}' \(\d[\d,]* bytes\): it is damaged or incomplete",
    ):
        MuonDDPStrategy().load_checkpoint(path)


def test_distributed_checkpoint_missing_a_shard_names_the_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step=4.ckpt"
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=str(folder))
    for shard in folder.glob("*.distcp"):
        shard.unlink()
    with (
        pytest.raises(
            CheckpointReadError,
            match=r"cannot read the distributed checkpoint folder .*step=4\.ckpt.* \(holding: \.metadata\)",
        ),
        explained_reads(folder),
    ):
        dcp.load({"w": torch.empty(64, 64)}, checkpoint_id=str(folder))


def test_fsdp_strategy_explains_unreadable_checkpoints(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import ModelParallelStrategy

    def fail(self, path, *args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", str(Path(path) / "__1_0.distcp"))

    monkeypatch.setattr(ModelParallelStrategy, "load_checkpoint", fail)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointReadError, match=r"distributed checkpoint folder .*ckpt.* \(holding: nothing\)"):
        MuonFSDPStrategy().load_checkpoint(tmp_path / "ckpt")
