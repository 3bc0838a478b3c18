"""The runner behind the main job and the quality benchmark: specs, configs, curves."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_muon import AdamWSettings, ScheduleFreeSettings, SOAPSettings, StateSettings
from lightning_muon.algorithms import get_algorithm
from lightning_muon.algorithms.sinkhorn_muon import sinkhorn_targets
from lightning_muon_demo.experiment import (
    RunSpec,
    build_run,
    matrix_settings,
    muon_config_for,
    shares_muon_settings,
    sinkhorn_normalize_matrices_,
    steps_to_reach,
    train,
)
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
        (dict(matrix_optimizer="adamw"), "matrix_optimizer must be one of"),
        (dict(optimizer="adamw", matrix_optimizer="scion"), "needs optimizer='muon'"),
        (dict(matrix_optimizer="scion", matrix_options=["momentum"]), "matrix_options must be a dict"),
        (dict(matrix_optimizer="scion", matrix_options={"lr": 0.1}), "must not set 'lr'"),
        (dict(matrix_optimizer="scion", matrix_options={"shampoo_beta": 0.9}), r"keys \['shampoo_beta'\] that 'scion'"),
        (
            dict(matrix_optimizer="scion", matrix_options={"weight_decay": 0.1}),
            r"matrix_options of 'scion': ScionSettings: weight_decay is fixed at 1\.0",
        ),
        (  # a value given under another project's name is refused under that name
            dict(matrix_optimizer="adaptive_muon", matrix_options={"moment2_method": "adam"}),
            r"matrix_options of 'adaptive_muon': AdaptiveMuonSettings: moment2_method \(Emerging-Optimizers' name for "
            r"second_moment\) must be one of \('adamuon', 'normuon', 'namo'\), got 'adam'",
        ),
        (dict(matrix_optimizer="soap", matrix_options={"betas": (0.9, 1.5)}), "matrix_options of 'soap'"),
        (dict(matrix_optimizer="scion", ns_coefficients="keller"), "ns_coefficients is Muon's"),
    ],
)
def test_bad_specs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RunSpec(**kwargs)


def test_the_adamw_baseline_sends_every_parameter_to_adamw_and_muon_only_hidden_matrices():
    model = CharGPT(256, 16, 1, 2, 32, 0.0, False)
    adamw = muon_config_for(RunSpec(optimizer="adamw", lr=1e-3)).route(model)
    assert {g["algorithm"] for g in adamw} == {"adamw"}
    muon = muon_config_for(RunSpec(optimizer="muon")).route(model)
    names = {n for g in muon if g["algorithm"] == "muon" for n in g["param_names"]}
    assert names == {
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc2.weight",
    }
    assert muon_config_for(RunSpec(optimizer="adamw", lr=1e-3)).scalar == AdamWSettings(lr=1e-3, weight_decay=0.01)
    narrow = muon_config_for(RunSpec(optimizer="muon", state_dtype="bfloat16")).state
    assert (narrow.exp_avg_dtype, narrow.exp_avg_sq_dtype) == ("bfloat16", "bfloat16")
    assert muon_config_for(RunSpec(optimizer="muon")).state == StateSettings()


def test_train_records_validation_at_every_interval_and_the_end():
    spec = RunSpec(steps=5, eval_every=2, n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4, val_samples=4)
    result = train(spec)
    assert result["steps"] == [2, 4, 5]
    assert len(result["val_loss"]) == 3 and result["label"] == "muon (lr 0.01, polar_express)"


def test_the_schedule_free_run_keeps_muon_and_a_constant_schedule():
    spec = RunSpec(optimizer="muon", scalar_optimizer="adamw_schedulefree", schedule="constant", steps=200)
    config = muon_config_for(spec)
    assert config.scalar == ScheduleFreeSettings(lr=3e-3, weight_decay=0.01) and config.uses_schedule_free
    assert (config.scalar.algorithm, config.schedule.falloff) == ("adamw_schedulefree", "constant")
    assert config.lr_schedule(spec.steps).warmup_steps == 10  # the same 5% warmup as the wsd runs
    assert spec.label == "muon (lr 0.01, polar_express, adamw_schedulefree, constant)"
    model = CharGPT(256, 16, 1, 2, 32, 0.0, False)
    groups = config.route(model)
    assert {g["algorithm"] for g in groups} == {"muon", "adamw_schedulefree"}


HIDDEN = {"blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"}


# The Muon run's matrix settings (experiment.MUON_RUN and RunSpec.ns_coefficients), which Muon's variants share.
MUON_RUN = dict(momentum=0.95, weight_decay=0.01, adjust_lr="match_rms_adamw", ns_coefficients="polar_express")


@pytest.mark.parametrize(
    ("algorithm", "options", "fields", "shares_muon"),
    [
        ("adaptive_muon", {"moment2_method": "normuon"}, {"second_moment": "normuon"}, True),  # Muon's and more
        ("scion", {"spectral_radius": 2.0}, {"spectral_radius": 2.0}, False),
        ("polargrad", {}, {}, False),
        ("mop", {}, {}, False),
        ("spel", {}, {}, False),
        ("sinkhorn_muon", {}, {}, False),
        ("soap", {"use_kl_shampoo": False}, {"use_kl_shampoo": False}, False),
        ("rekls", {}, {}, False),
    ],
)
def test_a_matrix_optimizer_takes_the_hidden_matrices_at_lr(algorithm, options, fields, shares_muon):
    spec = RunSpec(matrix_optimizer=algorithm, matrix_options=options, lr=0.0123)
    config = muon_config_for(spec)
    cls = get_algorithm(algorithm).settings
    assert shares_muon_settings(algorithm) is shares_muon and shares_muon_settings("muon")
    # The matrix section is the algorithm's settings at lr, the options set (other projects' names read as
    # the fields they are); the rest are the Muon run's for Muon's variants, else the algorithm's own defaults.
    base = MUON_RUN if shares_muon else {}
    assert type(config.matrix) is cls and config.matrix == cls(**base, **fields, lr=0.0123)
    assert config.matrix == matrix_settings(spec) and config.settings_of(algorithm) == config.matrix
    # The rest stays the Muon run's.
    muon_run = muon_config_for(RunSpec(lr=0.0123))
    assert (config.scalar, config.state, config.schedule) == (muon_run.scalar, muon_run.state, muon_run.schedule)
    assert config.scalar == AdamWSettings(lr=3e-3, weight_decay=0.01)
    model = CharGPT(256, 16, 1, 2, 32, 0.0, False)
    groups = config.route(model)
    assert {n for g in groups if g["algorithm"] == algorithm for n in g["param_names"]} == HIDDEN
    assert {g["algorithm"] for g in groups} == {algorithm, "adamw"}
    assert spec.label.startswith(f"{algorithm} (lr 0.0123")


def test_the_lr_of_a_matrix_optimizer_defaults_to_its_own():
    assert RunSpec(matrix_optimizer="soap").resolved_lr == SOAPSettings().lr == 3e-3  # SOAPSettings' lr
    assert RunSpec(matrix_optimizer="adaptive_muon").resolved_lr == 0.01  # Muon's DEFAULT_LR
    assert RunSpec(optimizer="adamw").resolved_lr == 3e-3
    assert muon_config_for(RunSpec(matrix_optimizer="soap")).matrix.lr == 3e-3
    spec = RunSpec(matrix_optimizer="adaptive_muon", matrix_options={"moment2_method": "normuon"}, lr=0.02)
    assert spec.label == "adaptive_muon (lr 0.02, polar_express, moment2_method=normuon)"


def _sinkhorn_normalized(w: torch.Tensor) -> bool:
    rows, cols = sinkhorn_targets(*w.shape)
    return bool(
        w.min() >= 0
        and torch.allclose(w.sum(dim=-1), torch.full((w.shape[0],), rows), atol=1e-4)
        and torch.allclose(w.sum(dim=-2), torch.full((w.shape[1],), cols), atol=1e-2)
    )


def test_sinkhorn_muon_runs_start_from_sinkhorn_normalized_hidden_matrices():
    spec = RunSpec(matrix_optimizer="sinkhorn_muon", lr=0.1, n_layer=1, n_head=2, n_embd=32, block_size=16)
    assert spec.label == "sinkhorn_muon (lr 0.1, Sinkhorn-normalized init)"
    module, _ = build_run(spec)
    params = dict(module.model.named_parameters())
    assert all(_sinkhorn_normalized(params[name]) for name in HIDDEN)
    assert not _sinkhorn_normalized(params["lm_head.weight"])  # on AdamW: the GPT-2 initialization
    # Only sinkhorn_muon's matrices are mapped.
    plain = CharGPT(256, 16, 1, 2, 32, 0.0, False)
    assert sinkhorn_normalize_matrices_(plain, muon_config_for(RunSpec())) == []


def test_every_new_matrix_optimizer_trains_a_few_steps():
    tiny = dict(steps=2, eval_every=2, n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4, val_samples=4)
    for algorithm in ("sinkhorn_muon", "soap", "polargrad"):  # the checked start, the non-Newton-Schulz, the scale
        result = train(RunSpec(matrix_optimizer=algorithm, **tiny))
        assert result["steps"] == [2] and math.isfinite(result["val_loss"][-1]), algorithm
