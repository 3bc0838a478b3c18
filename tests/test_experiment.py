"""The runner behind the main job and the quality benchmark: specs, configs, curves."""

from __future__ import annotations

import pytest

from lightning_muon.routing import route_parameters
from lightning_muon_demo.experiment import RunSpec, muon_config_for, steps_to_reach, train
from lightning_muon_demo.models import CharGPT


def test_steps_to_reach_is_the_first_step_at_or_below_the_target():
    assert steps_to_reach([10, 20, 30], [3.0, 2.0, 1.5], 2.0) == 20
    assert steps_to_reach([10, 20, 30], [3.0, 2.5, 2.1], 2.0) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(optimizer="sgd"), "optimizer must be one of"),
        (dict(steps=0), "steps must be a positive int"),
        (dict(eval_every=True), "eval_every must be a positive int"),
        (dict(lr=-1.0), "lr must be a positive finite number"),
        (dict(scalar_optimizer="lion"), "scalar_optimizer must be one of"),
        (dict(optimizer="adamw", scalar_optimizer="adamw_schedulefree"), "needs optimizer='muon'"),
        (dict(schedule="cosine"), "schedule must be one of"),
        (dict(state_dtype="float16"), "state_dtype must be one of"),
        (dict(state_dtype="bfloat16", scalar_optimizer="adamw_schedulefree"), "needs scalar_optimizer='adamw'"),
    ],
)
def test_bad_specs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RunSpec(**kwargs)


def test_the_adamw_baseline_sends_every_parameter_to_adamw_and_muon_only_hidden_matrices():
    model = CharGPT(256, 16, 1, 2, 32, 0.0, False)
    adamw = route_parameters(model, **muon_config_for(RunSpec(optimizer="adamw", lr=1e-3)).routing_kwargs())
    assert {g["algorithm"] for g in adamw} == {"adamw"}
    muon = route_parameters(model, **muon_config_for(RunSpec(optimizer="muon")).routing_kwargs())
    names = {n for g in muon if g["algorithm"] == "muon" for n in g["param_names"]}
    assert names == {
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc2.weight",
    }
    assert muon_config_for(RunSpec(optimizer="adamw", lr=1e-3)).adamw_lr == 1e-3
    narrow = muon_config_for(RunSpec(optimizer="muon", state_dtype="bfloat16")).optimizer
    assert (narrow.exp_avg_dtype, narrow.exp_avg_sq_dtype) == ("bfloat16", "bfloat16")


def test_train_records_validation_at_every_interval_and_the_end():
    spec = RunSpec(steps=5, eval_every=2, n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4, val_samples=4)
    result = train(spec)
    assert result["steps"] == [2, 4, 5]
    assert len(result["val_loss"]) == 3 and result["label"] == "muon (lr 0.01, polar_express)"


def test_the_schedule_free_run_keeps_muon_and_a_constant_schedule():
    spec = RunSpec(optimizer="muon", scalar_optimizer="adamw_schedulefree", schedule="constant", steps=200)
    config = muon_config_for(spec)
    assert (config.scalar_optimizer, config.falloff, config.adamw_lr) == ("adamw_schedulefree", "constant", 3e-3)
    assert config.lr_schedule(spec.steps).warmup_steps == 10  # the same 5% warmup as the wsd runs
    assert spec.label == "muon (lr 0.01, polar_express, adamw_schedulefree, constant)"
    model = CharGPT(256, 16, 1, 2, 32, 0.0, False)
    groups = route_parameters(model, **config.routing_kwargs())
    assert {g["algorithm"] for g in groups} == {"muon", "adamw_schedulefree"}
