"""Megatron-LM's Muon option names on MuonConfig: how they map onto ours, agree or clash with them,
and read from YAML."""

from __future__ import annotations

import pytest
import torch
from jsonargparse_compat import instantiate
from torch.testing import assert_close

from lightning_muon import MuonConfig
from lightning_muon.config import MEGATRON_COEFFICIENTS
from lightning_muon.newton_schulz import COEFFICIENTS


def test_megatron_names_map_onto_ours():
    config = MuonConfig(
        coefficient_type="simple", num_ns_steps=6, scale_mode="unit_rms_norm", moment2_method="adamuon",
        extra_scale_factor=0.5,
    )  # fmt: skip
    kw = config.optimizer_kwargs()
    assert (kw["ns_coefficients"], kw["ns_steps"], kw["adjust_lr"]) == ("keller", 6, "unit_rms_norm")
    assert (kw["second_moment"], kw["extra_scale_factor"]) == ("adamuon", 0.5)
    assert MuonConfig(coefficient_type="polar_express", num_ns_steps=8).ns_coefficients == "polar_express_megatron"
    assert MuonConfig(coefficient_type="quintic").ns_coefficients == "you"
    assert MuonConfig(scale_mode="spectral").adjust_lr == "spectral"
    assert MuonConfig(scale_mode="shape_scaling").adjust_lr == "shape_scaling"  # our "original"
    custom = [(3.0, -3.2, 1.2)]
    assert MuonConfig(coefficient_type="custom", ns_coefficients=custom).ns_coefficients == custom
    # Megatron cycles a list over num_ns_steps (a multiple of its length).
    quintic10 = MuonConfig(coefficient_type="quintic", num_ns_steps=10).ns_coefficients
    assert quintic10 == list(COEFFICIENTS["you"]) * 2
    aol8 = MuonConfig(coefficient_type="aol", num_ns_steps=8).ns_coefficients
    assert aol8 == MEGATRON_COEFFICIENTS["aol"] * 2
    # cans and deepseekv4 repeat their last tuple (Emerging-Optimizers 0.3.0): our schedules do.
    assert MuonConfig(coefficient_type="cans", num_ns_steps=7).ns_coefficients == "cans"
    assert MuonConfig(coefficient_type="deepseekv4", num_ns_steps=10).ns_coefficients == "deepseekv4"
    # Megatron's polar_express numbers are the paper's divided by the 1.01 safety, to 4 digits.
    paper, megatron = COEFFICIENTS["polar_express_paper"], COEFFICIENTS["polar_express_megatron"]
    assert_close(
        torch.tensor(paper, dtype=torch.float64), torch.tensor(megatron, dtype=torch.float64), atol=1.1e-4, rtol=0
    )


def test_megatron_settings_build_the_same_optimizer_as_ours():
    megatron = MuonConfig(coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral", moment2_method="normuon")
    ours = MuonConfig(ns_coefficients="you", ns_steps=5, adjust_lr="spectral", second_moment="normuon")
    assert megatron.optimizer_kwargs() == ours.optimizer_kwargs()
    assert MuonConfig.from_any(megatron.to_dict()) == megatron  # the round trip does not clash with itself


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(ns_steps=6, num_ns_steps=8), r"num_ns_steps=8 and ns_steps=6 disagree"),
        (dict(ns_coefficients="keller", coefficient_type="quintic"), r"coefficient_type='quintic' and ns_coeff"),
        (dict(adjust_lr="match_rms_adamw", scale_mode="spectral"), r"scale_mode='spectral' and adjust_lr="),
        (dict(second_moment="adamuon", moment2_method="normuon"), r"moment2_method='normuon' and second_moment="),
        (dict(coefficient_type="cubic"), r"MuonConfig\.coefficient_type must be one of"),
        (dict(coefficient_type="custom"), r"coefficient_type='custom' needs ns_coefficients as a list"),
        (dict(num_ns_steps=0), r"MuonConfig\.num_ns_steps must be a positive int"),
        (dict(scale_mode="rms"), r"MuonConfig\.scale_mode must be one of"),
        (dict(moment2_method="adamuon_rms"), r"MuonConfig\.moment2_method must be one of"),
        (dict(split_qkv=True), r"MuonConfig\.split_qkv needs qkv_split_shapes"),
        (dict(split_qkv=True, qkv_split_shapes=[4, 0]), r"MuonConfig\.qkv_split_shapes must be"),
        (dict(second_moment="rms"), r"MuonConfig\.second_moment: .*second_moment must be one of"),
        (dict(ns_method="fast"), r"MuonConfig\.ns_method: .*ns_method must be one of"),
        (dict(weight_decay_form="l2"), r"MuonConfig\.weight_decay_form: "),
        (dict(momentum_form="x"), r"MuonConfig\.momentum_form: "),
    ],
)
def test_megatron_and_variant_config_errors_name_the_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MuonConfig(**kwargs)


def test_megatron_names_read_from_yaml():
    """A Megatron user's YAML (its names, plus ours) parses through jsonargparse as LightningCLI does."""
    import jsonargparse

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    yaml = (
        "muon:\n  coefficient_type: polar_express\n  num_ns_steps: 8\n  scale_mode: spectral\n"
        "  extra_scale_factor: 0.2\n  split_qkv: true\n  qkv_split_shapes: [64, 16, 16]\n"
        "  moment2_method: normuon\n  weight_decay_form: cautious\n"
    )
    config = instantiate(parser, parser.parse_string(yaml)).muon
    kw = config.optimizer_kwargs()
    assert (kw["ns_coefficients"], kw["ns_steps"], kw["adjust_lr"]) == ("polar_express_megatron", 8, "spectral")
    assert (kw["extra_scale_factor"], kw["second_moment"], kw["weight_decay_form"]) == (0.2, "normuon", "cautious")
    assert config.qkv_split_shapes == (64, 16, 16) and len(config.qkv_rules()) == 2
    for name, steps in (("cans", 5), ("deepseekv4", 10)):  # Emerging-Optimizers 0.3.0's newest types
        parsed = instantiate(
            parser, parser.parse_string(f"muon:\n  coefficient_type: {name}\n  num_ns_steps: {steps}\n")
        )
        assert (parsed.muon.ns_coefficients, parsed.muon.ns_steps) == (name, steps)
    with pytest.raises(jsonargparse.ArgumentError, match="coefficient_type"):  # refused while parsing
        parser.parse_string("muon:\n  coefficient_type: deepseek\n")


def test_megatron_agreeing_values_are_accepted():
    config = MuonConfig(ns_steps=8, num_ns_steps=8, adjust_lr="original", scale_mode="shape_scaling")
    assert config.ns_steps == 8
