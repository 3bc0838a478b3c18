"""MuonConfig: sections, one error per bad field (naming it as written), from_any / to_dict, YAML, and the
settings' typed signatures (``Muon``'s keywords are ``MuonSettings``' fields, written once)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import jsonargparse
import pytest
import torch
from jsonargparse_compat import instantiate

from lightning_muon import (
    AdamWSettings,
    LionSettings,
    MomentumWarmup,
    Muon,
    MuonConfig,
    MuonSettings,
    RoutingSettings,
    Rule,
    ScheduleFreeSettings,
    ScheduleSettings,
    ScionSettings,
    Settings,
    StateSettings,
)
from lightning_muon.algorithms import HparamError, algorithm_names, get_algorithm
from lightning_muon.algorithms.settings import field_docs
from lightning_muon.routing import DEFAULT_HEAD_NAMES


def test_defaults_are_muon_and_adamw_and_build_the_optimizer():
    config = MuonConfig()
    assert (config.matrix, config.scalar, config.others) == (MuonSettings(), AdamWSettings(), [])
    assert (config.matrix.lr, config.scalar.lr, config.schedule.falloff) == (0.02, 3e-4, "constant")
    assert config.routing.head_names == DEFAULT_HEAD_NAMES and config.routing.rules == []
    optimizer = config.make_optimizer([torch.zeros(3, 3, requires_grad=True)])
    assert optimizer.param_groups[0]["lr"] == 0.02
    assert config.lr_schedule(None).falloff == "constant" and config.momentum_warmup().steps == 0


def test_muon_keywords_are_muon_and_adamw_settings_and_the_state_settings():
    """Written out in code (IDEs and type checkers see them); each default is the settings' own."""
    parameters = inspect.signature(Muon).parameters
    hints = typing.get_type_hints(Muon.__init__)
    for cls, prefix in ((MuonSettings, ""), (AdamWSettings, "adamw_"), (StateSettings, "")):
        defaults = cls()
        for f in dataclasses.fields(cls):
            name = prefix + f.name
            assert name in parameters and name in hints, name
            assert parameters[name].default == getattr(defaults, f.name), name
    # torch.optim.Muon's arguments first, in its order (a drop-in), each positional; ours keyword-only after them.
    torch_names = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
    assert list(inspect.signature(torch.optim.Muon).parameters)[1:] == list(torch_names)
    assert list(parameters)[1:9] == list(torch_names)
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in list(parameters.values())[:9])
    assert all(p.kind is p.KEYWORD_ONLY for p in list(parameters.values())[9:])
    own = {f.name for f in dataclasses.fields(MuonSettings)} | {
        "adamw_" + f.name for f in dataclasses.fields(AdamWSettings)
    }
    extra = set(parameters) - own - {f.name for f in dataclasses.fields(StateSettings)} - {"self", "params"}
    assert extra == {"settings", "eps", "adjust_lr_fn"}  # torch.optim.Muon's names for ns_eps and adjust_lr


def test_every_setting_has_a_doc_and_a_check():
    """Every field of every algorithm's settings and of the sections is documented (the help prints it)."""
    for name in algorithm_names():
        cls = get_algorithm(name).settings
        docs = cls.docs()
        assert set(cls.field_names()) <= set(docs), (name, set(cls.field_names()) - set(docs))
        assert "Args:" in cls.__doc__
    for cls in (StateSettings, RoutingSettings, ScheduleSettings, MuonConfig):
        docs = field_docs(cls)
        assert {f.name for f in dataclasses.fields(cls)} <= set(docs), cls


def test_a_variant_declares_only_its_own_fields():
    """The shared settings are declared once, in the family's base: a variant adds its own fields, and one it
    redeclares (a new default) keeps the base's type, metadata and doc."""
    new = {
        "muon": {"momentum_form", "second_moment", "second_moment_beta2", "second_moment_eps", "sign_momentum"},
        "scion": {"spectral_radius"},
        "adaptive_muon": set(),
    }
    for name, fields in new.items():
        cls = get_algorithm(name).settings
        bases = [b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)]
        inherited = {f.name: f for b in bases for f in dataclasses.fields(b)}
        assert set(cls.field_names()) - set(inherited) == fields, name
        hints, docs = typing.get_type_hints(cls), cls.docs()
        for f in dataclasses.fields(cls):
            if f.name in inherited:
                base = next(b for b in bases if f.name in {g.name for g in dataclasses.fields(b)})
                assert hints[f.name] == typing.get_type_hints(base)[f.name], (name, f.name)
                assert f.metadata == inherited[f.name].metadata and docs[f.name] == base.docs()[f.name]
    assert ScionSettings().lr == 3e-4 and MuonSettings().lr == 0.02  # a default changed, the field shared


@pytest.mark.parametrize(
    ("make", "field", "match"),
    [
        (lambda: MuonSettings(lr=-1.0), "lr", r"MuonSettings\.lr must be a finite number in \[0.0, inf\)"),
        (lambda: MuonSettings(lr=float("inf")), "lr", r"MuonSettings\.lr must be a finite number"),
        (lambda: MuonSettings(momentum=1.0), "momentum", r"MuonSettings\.momentum must be .* \[0.0, 1.0\)"),
        (lambda: MuonSettings(nesterov="yes"), "nesterov", r"MuonSettings\.nesterov must be a bool"),
        (lambda: MuonSettings(ns_steps=0), "ns_steps", r"MuonSettings\.ns_steps must be a positive int"),
        (lambda: MuonSettings(ns_coefficients="quartic"), "ns_coefficients", r"unknown schedule 'quartic'"),
        (lambda: MuonSettings(ns_coefficients=[(1.0, 2.0)]), "ns_coefficients", r"\(a, b, c\)"),
        (lambda: MuonSettings(ns_dtype="int8"), "ns_dtype", r"MuonSettings\.ns_dtype must be one of"),
        (lambda: MuonSettings(adjust_lr="sqrt"), "adjust_lr", r"MuonSettings\.adjust_lr must be one of"),
        (lambda: MuonSettings(extra_scale_factor=0.0), "extra_scale_factor", r"in \(0.0, inf\)"),
        (lambda: MuonSettings(weight_decay_method="l1"), "weight_decay_method", r"must be one of \('decoupled'"),
        (lambda: MuonSettings(second_moment="rms"), "second_moment", r"second_moment must be one of"),
        (lambda: AdamWSettings(betas=(1.0, 0.95)), "betas", r"AdamWSettings\.betas must be a pair"),
        (lambda: AdamWSettings(betas=(0.9,)), "betas", r"AdamWSettings\.betas must be a pair"),
        (lambda: AdamWSettings(eps=0.0), "eps", r"AdamWSettings\.eps must be"),
        (lambda: LionSettings(betas=(0.9, 1.5)), "betas", r"LionSettings\.betas"),
        (lambda: ScheduleFreeSettings(betas=(0.0, 0.999)), "betas", r"beta1 in \(0, 1\)"),
        (lambda: ScheduleFreeSettings(warmup_steps=1.5), "warmup_steps", r"must be an int >= 0"),
        (lambda: ScheduleFreeSettings(weight_lr_power=float("nan")), "weight_lr_power", r"finite number"),
        (lambda: StateSettings(nonfinite="warn"), "nonfinite", r"StateSettings\.nonfinite must be one of"),
        (lambda: MuonConfig(matrix=AdamWSettings()), "matrix", r"MuonConfig\.matrix: AdamWSettings is for 'adamw'"),
        (lambda: MuonConfig(scalar=MuonSettings()), "scalar", r"MuonConfig\.scalar: MuonSettings is for 'muon'"),
        (lambda: MuonConfig(others=[LionSettings(), LionSettings(lr=1.0)]), "MuonConfig.others",
         r"two settings for 'lion'"),
        (lambda: MuonConfig(matrix={"class_path": "Nope"}), "matrix", r"class_path 'Nope' names no settings class"),
        (lambda: MuonConfig(matrix={"init_args": {"momentum": 2}}), "momentum",
         r"MuonConfig\.matrix: momentum must be"),
    ],
)  # fmt: skip
def test_each_bad_setting_raises_naming_it(make, field, match):
    with pytest.raises(HparamError, match=match) as info:
        make()
    assert info.value.field == field


@pytest.mark.parametrize(
    ("section", "match"),
    [
        (dict(schedule={"falloff": "exponential"}), r"MuonConfig\.schedule\.falloff must be one of"),
        (dict(schedule={"warmup": -1}), r"MuonConfig\.schedule\.warmup must be"),
        (dict(schedule={"warmup": 1.5}), r"MuonConfig\.schedule\.warmup must be a whole number"),
        (dict(schedule={"cooldown": -0.5}), r"MuonConfig\.schedule\.cooldown must be"),
        (dict(schedule={"min_lr_ratio": 1.5}), r"MuonConfig\.schedule\.min_lr_ratio must be in \[0, 1\]"),
        (dict(schedule={"total_steps": 0}), r"MuonConfig\.schedule\.total_steps must be a positive int"),
        (dict(schedule={"momentum_warmup": {"start": 1.0}}), r"MuonConfig\.schedule\.momentum_warmup start"),
        (dict(schedule={"momentum_warmup": {"steps": -1}}), r"MuonConfig\.schedule\.momentum_warmup steps"),
        (dict(routing={"max_aspect_ratio": 0.5}), r"RoutingSettings\.max_aspect_ratio must be >= 1"),
        (dict(routing={"rules": [{"name": "r", "algorithm": "sgd"}]}), r"rules\[0\]: Rule 'r': algorithm must be"),
        (dict(routing={"rules": [{"name": "r", "algorithm": "adamw", "nmes": "*"}]}), r"rules\[0\]: .*'nmes'"),
        (dict(routing={"qkv_split_shapes": [4, 0]}), r"RoutingSettings\.qkv_split_shapes must be"),
        (dict(routing={"split_qkv": "yes"}), r"RoutingSettings\.split_qkv must be a bool"),
        (dict(routing={"head_nmes": ["out"]}), r"MuonConfig\.routing: .*head_nmes"),
        (dict(state={"exp_avg_dtype": "int8"}), r"exp_avg_dtype"),
    ],
)
def test_each_bad_section_field_raises_naming_it(section, match):
    with pytest.raises(ValueError, match=match):
        MuonConfig(**section)


def test_cross_field_errors():
    with pytest.raises(ValueError, match=r"warmup \(60\) \+ stable \(50\) steps exceed total_steps \(100\)"):
        MuonConfig(schedule=ScheduleSettings(falloff="linear", warmup=60, stable=50, total_steps=100))
    MuonConfig(schedule=ScheduleSettings(falloff="cosine", warmup=0.1))  # a fraction: the trainer's total later
    with pytest.raises(HparamError, match=r"would warm the schedule-free groups up twice"):
        MuonConfig(scalar=ScheduleFreeSettings(warmup_steps=5), schedule=ScheduleSettings(warmup=3))


def test_normalizes_sequences():
    config = MuonConfig(
        matrix=MuonSettings(ns_coefficients=[[3.4445, -4.775, 2.0315]]),
        scalar={"class_path": "AdamWSettings", "init_args": {"betas": [0.8, 0.99]}},
        routing={"head_names": ["out"], "rules": [{"name": "r", "algorithm": "adamw", "names": "x"}]},
    )
    assert config.scalar.betas == (0.8, 0.99) and config.routing.head_names == ("out",)
    assert config.matrix.ns_coefficients == [(3.4445, -4.775, 2.0315)]
    assert config.routing.rules == [Rule(name="r", algorithm="adamw", names="x")]


def test_from_any():
    assert MuonConfig.from_any(None) == MuonConfig()
    config = MuonConfig(matrix=MuonSettings(lr=0.05))
    assert MuonConfig.from_any(config) is config
    from_dict = MuonConfig.from_any({"matrix": {"init_args": {"lr": 0.05}}, "schedule": {"falloff": "cosine"}})
    assert (from_dict.matrix.lr, from_dict.schedule.falloff) == (0.05, "cosine")
    with pytest.raises(ValueError, match=r"MuonConfig: unknown sections \['lr'\]"):
        MuonConfig.from_any({"lr": 0.1})
    with pytest.raises(ValueError, match=r"expected a MuonConfig or a dict of its sections, got list"):
        MuonConfig.from_any([("lr", 0.1)])


def test_to_dict_round_trip_and_pickle():
    config = MuonConfig(
        matrix=ScionSettings(lr=0.03),
        scalar=LionSettings(betas=(0.8, 0.99)),
        others=[AdamWSettings(lr=1e-3)],
        state=StateSettings(nonfinite="skip"),
        routing=RoutingSettings(
            rules=[
                Rule(name="qkv", algorithm="scion", names="*.qkv.weight", options={"split_sizes": [4, 4, 4]}),
                Rule(name="norms", algorithm="adamw", module_types="LayerNorm", group="scalars"),
            ]
        ),
        schedule=ScheduleSettings(
            falloff="wsd", warmup=0.05, cooldown=0.3, total_steps=200, momentum_warmup=MomentumWarmup(steps=10)
        ),
    )
    data = config.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(MuonConfig)}
    assert data["matrix"]["class_path"] == "lightning_muon.algorithms.scion.ScionSettings"
    assert data["routing"]["rules"][0] == {
        "name": "qkv", "algorithm": "scion", "names": "*.qkv.weight", "options": {"split_sizes": [4, 4, 4]}
    }  # fmt: skip
    again = MuonConfig.from_any(data)
    assert again == config and again.to_dict() == data
    import io

    buffer = io.BytesIO()
    torch.save({"muon_config": config}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["muon_config"] == config  # checkpoints' hyperparameters


YAML = """
muon:
  matrix:
    class_path: MuonSettings
    init_args:
      lr: 0.03
      momentum: 0.9
      adjust_lr: match_rms_adamw
  scalar:
    class_path: AdamWSettings
    init_args:
      betas: [0.8, 0.99]
  schedule:
    falloff: cosine
    warmup: 0.1
    min_lr_ratio: 0.1
    total_steps: 100
    momentum_warmup: {steps: 20}
  routing:
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
    assert config.matrix == MuonSettings(lr=0.03, momentum=0.9, adjust_lr="match_rms_adamw")
    assert config.scalar == AdamWSettings(betas=(0.8, 0.99))
    assert config.schedule == ScheduleSettings(
        falloff="cosine", warmup=0.1, min_lr_ratio=0.1, total_steps=100, momentum_warmup=MomentumWarmup(steps=20)
    )
    assert config.routing.rules == EXPECTED_RULES
    assert config.lr_schedule(config.schedule.total_steps).warmup_steps == 10


def test_jsonargparse_reads_it_as_a_typed_argument():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    _check_parsed(instantiate(parser, parser.parse_string(YAML)).muon)


def test_jsonargparse_reads_it_as_class_arguments_and_takes_overrides():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MuonConfig, "muon")
    _check_parsed(instantiate(parser, parser.parse_string(YAML)).muon)
    config = instantiate(parser, parser.parse_args(["--muon.matrix.init_args.lr=0.07"], defaults=True)).muon
    assert config.matrix.lr == 0.07
    # Switching the class keeps what the classes share (jsonargparse's rule, Muon's defaults included) and drops
    # what the new class fixes itself (Scion's weight_decay of 1: no argument of ScionSettings).
    scion = instantiate(parser, parser.parse_args(["--muon.matrix=ScionSettings", "--muon.matrix.spectral_radius=2"]))
    shared = {k: v for k, v in MuonSettings().arguments().items() if k in ScionSettings.field_names()}
    assert scion.muon.matrix == ScionSettings(**shared, spectral_radius=2.0)
    assert scion.muon.matrix.weight_decay == 1.0 and scion.muon.matrix.nesterov is False


def test_jsonargparse_rejects_a_bad_value_with_the_field_name():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    with pytest.raises((jsonargparse.ArgumentError, ValueError), match=r"lr"):
        instantiate(parser, parser.parse_string("muon:\n  matrix:\n    init_args:\n      lr: -1.0\n"))


def test_config_variant_fields_reach_the_optimizer():
    all_on = dict(momentum_form="sum", second_moment="normuon", weight_decay_method="cautious", ns_method="gram")
    config = MuonConfig(matrix=MuonSettings(**all_on, sign_momentum=True, second_moment_beta2=0.8))
    opt = config.make_optimizer([torch.zeros(4, 4, requires_grad=True)])
    group = opt.param_groups[0]
    assert {k: group[k] for k in all_on} == all_on
    assert group["sign_momentum"] is True and group["second_moment_beta2"] == 0.8


def test_with_lr_moves_every_lr_by_the_matrix_lrs_factor():
    rule = Rule(name="first", algorithm="muon", names="fc1.weight", options={"lr": 0.01, "weight_decay": 0.1})
    config = MuonConfig(
        matrix=MuonSettings(lr=0.02, momentum=0.9),
        scalar=AdamWSettings(lr=3e-4),
        others=[LionSettings(lr=1e-4)],
        routing=RoutingSettings(rules=[rule]),
    )
    tuned = config.with_lr(0.05)
    assert (tuned.matrix.lr, tuned.others[0].lr) == (0.05, pytest.approx(1e-4 * 2.5, rel=1e-15))
    assert tuned.scalar.lr == pytest.approx(3e-4 * 2.5, rel=1e-15)
    assert tuned.routing.rules[0].options == {"lr": 0.01 * 2.5, "weight_decay": 0.1}
    assert tuned.matrix.momentum == 0.9 and config.matrix.lr == 0.02  # everything else kept; the original untouched
    with pytest.raises(HparamError, match=r"MuonSettings\.lr must be a finite number"):
        config.with_lr(-1.0)
    with pytest.raises(ValueError, match=r"MuonConfig.with_lr: the matrix lr is 0"):
        MuonConfig(matrix=MuonSettings(lr=0.0)).with_lr(0.01)


def test_settings_are_the_plain_base_jsonargparse_takes_by_class_path():
    assert not dataclasses.is_dataclass(Settings)  # so a field typed MatrixSettings takes any subclass
    assert all(dataclasses.is_dataclass(get_algorithm(n).settings) for n in algorithm_names())
