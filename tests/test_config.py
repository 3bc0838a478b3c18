"""MuonConfig: defaults, one error per bad field (naming it), from_any / to_dict, jsonargparse from YAML."""

from __future__ import annotations

import dataclasses
import inspect

import jsonargparse
import pytest
import torch
from jsonargparse_compat import instantiate

from lightning_muon import Muon, MuonConfig, Rule
from lightning_muon.routing import DEFAULT_HEAD_NAMES


def test_defaults_are_valid_and_build_the_optimizer():
    config = MuonConfig()
    assert (config.lr, config.momentum, config.adamw_lr, config.falloff) == (0.02, 0.95, 3e-4, "constant")
    assert config.head_names == DEFAULT_HEAD_NAMES and config.rules == []
    optimizer = Muon([torch.zeros(3, 3, requires_grad=True)], **config.optimizer_kwargs())
    assert optimizer.param_groups[0]["lr"] == 0.02
    # Every optimizer knob is a Muon keyword argument.
    assert set(config.optimizer_kwargs()) <= set(inspect.signature(Muon).parameters)
    assert config.lr_schedule(None).falloff == "constant"
    assert config.momentum_warmup().steps == 0


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("lr", -1.0, r"MuonConfig\.lr: .*lr must be a finite number"),
        ("lr", float("inf"), r"MuonConfig\.lr:"),
        ("momentum", 1.0, r"MuonConfig\.momentum: .*momentum must be"),
        ("weight_decay", -0.1, r"MuonConfig\.weight_decay:"),
        ("nesterov", "yes", r"MuonConfig\.nesterov:"),
        ("adamw_lr", -1e-3, r"MuonConfig\.adamw_lr:"),
        ("adamw_betas", (1.0, 0.95), r"MuonConfig\.adamw_betas: .*betas\[0\]"),
        ("adamw_betas", (0.9, -0.1), r"MuonConfig\.adamw_betas: .*betas\[1\]"),
        ("adamw_betas", (0.9,), r"MuonConfig\.adamw_betas: .*pair"),
        ("adamw_eps", 0.0, r"MuonConfig\.adamw_eps: .*eps must be"),
        ("adamw_weight_decay", -1.0, r"MuonConfig\.adamw_weight_decay:"),
        ("lion_lr", -1.0, r"MuonConfig\.lion_lr:"),
        ("lion_betas", (0.9, 1.5), r"MuonConfig\.lion_betas:"),
        ("lion_weight_decay", -1.0, r"MuonConfig\.lion_weight_decay:"),
        ("ns_steps", 0, r"MuonConfig\.ns_steps: ns_steps must be a positive int"),
        ("ns_coefficients", "quartic", r"MuonConfig\.ns_coefficients: .*unknown schedule 'quartic'"),
        ("ns_coefficients", [(1.0, 2.0)], r"MuonConfig\.ns_coefficients: .*\(a, b, c\)"),
        ("ns_dtype", "int8", r"MuonConfig\.ns_dtype:"),
        ("adjust_lr", "sqrt", r"MuonConfig\.adjust_lr: .*adjust_lr must be one of"),
        ("extra_scale_factor", 0.0, r"MuonConfig\.extra_scale_factor:"),
        ("nonfinite", "warn", r"MuonConfig\.nonfinite: nonfinite must be one of"),
        (
            "scalar_optimizer",
            "sgd",
            r"MuonConfig\.scalar_optimizer must be one of "
            r"\('adamw', 'lion', 'adamw_schedulefree', 'laprop'\), got 'sgd'",
        ),
        ("adamw_schedulefree_lr", -1.0, r"MuonConfig\.adamw_schedulefree_lr: .*adamw_schedulefree_lr must be"),
        (
            "adamw_schedulefree_betas",
            (0.0, 0.999),
            r"MuonConfig\.adamw_schedulefree_betas: .*betas\[0\].*\(0\.0, 1\.0\)",
        ),
        ("adamw_schedulefree_betas", (0.9, 1.0), r"MuonConfig\.adamw_schedulefree_betas: .*betas\[1\]"),
        ("adamw_schedulefree_eps", 0.0, r"MuonConfig\.adamw_schedulefree_eps: .*eps must be"),
        ("adamw_schedulefree_weight_decay", -1.0, r"MuonConfig\.adamw_schedulefree_weight_decay:"),
        ("adamw_schedulefree_warmup_steps", 1.5, r"MuonConfig\.adamw_schedulefree_warmup_steps: .*int >= 0"),
        ("adamw_schedulefree_r", -1.0, r"MuonConfig\.adamw_schedulefree_r: "),
        ("adamw_schedulefree_weight_lr_power", float("nan"), r"MuonConfig\.adamw_schedulefree_weight_lr_power: "),
        ("falloff", "exponential", r"MuonConfig\.falloff must be one of"),
        ("warmup", -1, r"MuonConfig: warmup must be"),
        ("warmup", 1.5, r"MuonConfig: warmup must be a whole number"),
        ("stable", -2, r"MuonConfig: stable must be"),
        ("cooldown", -0.5, r"MuonConfig\.cooldown: cooldown must be"),
        ("min_lr_ratio", 1.5, r"MuonConfig: min_lr_ratio must be in \[0, 1\]"),
        ("total_steps", 0, r"MuonConfig: total_steps must be a positive int"),
        ("max_aspect_ratio", 0.5, r"MuonConfig\.max_aspect_ratio must be >= 1"),
        ("momentum_warmup_start", 1.0, r"MuonConfig\.momentum_warmup_start: "),
        ("momentum_warmup_steps", -1, r"MuonConfig\.momentum_warmup_steps: "),
        ("rules", [{"name": "r", "algorithm": "sgd"}], r"MuonConfig\.rules\[0\]: Rule 'r': algorithm must be one of"),
        ("rules", [Rule(name="ok", algorithm="adamw"), {"name": "r"}], r"MuonConfig\.rules\[1\]: .*'algorithm'"),
        ("rules", [{"name": "r", "algorithm": "adamw", "nmes": "*"}], r"MuonConfig\.rules\[0\]: .*'nmes'"),
    ],
)
def test_each_bad_field_raises_naming_it(field, value, match):
    with pytest.raises(ValueError, match=match):
        MuonConfig(**{field: value})


def test_cross_field_errors():
    with pytest.raises(ValueError, match=r"warmup \(60\) \+ stable \(50\) steps exceed total_steps \(100\)"):
        MuonConfig(falloff="linear", warmup=60, stable=50, total_steps=100)
    # A fraction is fine without total_steps: the trainer supplies it later.
    MuonConfig(falloff="cosine", warmup=0.1)


def test_normalizes_sequences():
    config = MuonConfig(
        adamw_betas=[0.8, 0.99],
        lion_betas=[0.95, 0.98],
        head_names=["out"],
        ns_coefficients=[[3.4445, -4.775, 2.0315]],
        rules=[{"name": "r", "algorithm": "adamw", "names": "x"}],
    )
    assert config.adamw_betas == (0.8, 0.99) and config.lion_betas == (0.95, 0.98)
    assert config.head_names == ("out",)
    assert config.ns_coefficients == [(3.4445, -4.775, 2.0315)]
    assert config.rules == [Rule(name="r", algorithm="adamw", names="x")]


def test_from_any():
    assert MuonConfig.from_any(None) == MuonConfig()
    config = MuonConfig(lr=0.05)
    assert MuonConfig.from_any(config) is config
    from_dict = MuonConfig.from_any({"lr": 0.05, "falloff": "cosine", "total_steps": 10})
    assert (from_dict.lr, from_dict.falloff, from_dict.total_steps) == (0.05, "cosine", 10)
    with pytest.raises(ValueError, match=r"MuonConfig: unknown fields \['bogus', 'lrr'\]"):
        MuonConfig.from_any({"lrr": 0.1, "bogus": 1, "lr": 0.1})
    with pytest.raises(ValueError, match=r"expected a MuonConfig or a dict of its fields, got list"):
        MuonConfig.from_any([("lr", 0.1)])
    with pytest.raises(ValueError, match=r"MuonConfig\.lr:"):
        MuonConfig.from_any({"lr": -1})


def test_to_dict_round_trip():
    config = MuonConfig(
        lr=0.03,
        adamw_betas=(0.8, 0.99),
        falloff="wsd",
        warmup=0.05,
        cooldown=0.3,
        total_steps=200,
        momentum_warmup_steps=10,
        rules=[
            Rule(name="qkv", algorithm="muon", names="*.qkv.weight", options={"split_sizes": [4, 4, 4]}),
            Rule(name="norms", algorithm="lion", module_types="LayerNorm", group="scalars"),
        ],
    )
    data = config.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(MuonConfig)}
    # Rules become plain dicts: the fields that differ from Rule's defaults, and the options.
    assert data["rules"] == [
        {"name": "qkv", "algorithm": "muon", "names": "*.qkv.weight", "options": {"split_sizes": [4, 4, 4]}},
        {"name": "norms", "algorithm": "lion", "module_types": "LayerNorm", "group": "scalars", "options": {}},
    ]
    assert all(isinstance(r, dict) for r in data["rules"])
    again = MuonConfig.from_any(data)
    assert again == config
    assert again.to_dict() == data


YAML = """
muon:
  lr: 0.03
  momentum: 0.9
  adjust_lr: match_rms_adamw
  adamw_betas: [0.8, 0.99]
  falloff: cosine
  warmup: 0.1
  min_lr_ratio: 0.1
  total_steps: 100
  momentum_warmup_steps: 20
  rules:
    - name: qkv
      algorithm: muon
      names: "*.attn.qkv.weight"
      options: {split_sizes: [8, 8, 8]}
    - name: norms
      algorithm: lion
      module_types: [LayerNorm]
      group: scalars
"""

EXPECTED_RULES = [
    Rule(name="qkv", algorithm="muon", names="*.attn.qkv.weight", options={"split_sizes": [8, 8, 8]}),
    Rule(name="norms", algorithm="lion", module_types=("LayerNorm",), group="scalars"),
]


def _check_parsed(config: MuonConfig) -> None:
    assert isinstance(config, MuonConfig)
    assert (config.lr, config.momentum, config.adjust_lr) == (0.03, 0.9, "match_rms_adamw")
    assert config.adamw_betas == (0.8, 0.99)
    assert (config.falloff, config.warmup, config.min_lr_ratio, config.total_steps) == ("cosine", 0.1, 0.1, 100)
    assert config.momentum_warmup_steps == 20
    assert config.rules == EXPECTED_RULES
    assert config.lr_schedule(config.total_steps).warmup_steps == 10


def test_jsonargparse_reads_it_as_a_typed_argument():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    _check_parsed(instantiate(parser, parser.parse_string(YAML)).muon)


def test_jsonargparse_reads_it_as_class_arguments():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MuonConfig, "muon")
    _check_parsed(instantiate(parser, parser.parse_string(YAML)).muon)
    # A command-line override on top of the YAML.
    config = instantiate(parser, parser.parse_args(["--muon.lr=0.07"], defaults=True)).muon
    assert config.lr == 0.07


def test_jsonargparse_rejects_a_bad_value_with_the_field_name():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    with pytest.raises((jsonargparse.ArgumentError, ValueError), match=r"lr"):
        instantiate(parser, parser.parse_string("muon:\n  lr: -1.0\n"))


def test_config_variant_fields_reach_the_optimizer():
    all_on = dict(momentum_form="sum", second_moment="normuon", weight_decay_form="cautious", ns_method="gram")
    config = MuonConfig(**all_on, sign_momentum=True, second_moment_beta2=0.8)
    opt = Muon([torch.zeros(4, 4, requires_grad=True)], **config.optimizer_kwargs())
    group = opt.param_groups[0]
    assert {k: group[k] for k in all_on} == all_on
    assert group["sign_momentum"] is True and group["second_moment_beta2"] == 0.8


def test_with_lr_moves_every_lr_by_the_muon_lrs_factor():
    rule = Rule(name="first", algorithm="muon", names="fc1.weight", options={"lr": 0.01, "weight_decay": 0.1})
    config = MuonConfig(lr=0.02, adamw_lr=3e-4, lion_lr=1e-4, rules=[rule], momentum=0.9)
    tuned = config.with_lr(0.05)
    assert (tuned.lr, tuned.lion_lr, tuned.adamw_schedulefree_lr) == (0.05, 1e-4 * 2.5, None)  # None: AdamW's
    assert tuned.adamw_lr == pytest.approx(3e-4 * 2.5, rel=1e-15)
    assert tuned.rules[0].options == {"lr": 0.01 * 2.5, "weight_decay": 0.1}
    assert tuned.momentum == 0.9 and config.lr == 0.02  # everything else kept; the original untouched
    with pytest.raises(ValueError, match=r"MuonConfig\.lr: .*lr must be a finite number"):
        config.with_lr(-1.0)
    with pytest.raises(ValueError, match=r"MuonConfig.with_lr: the Muon lr is 0"):
        MuonConfig(lr=0.0).with_lr(0.01)
