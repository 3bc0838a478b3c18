"""Every YAML we ship parses unchanged: configs/ through the CLI's parser, the examples' MuonConfig sections.

Parsing checks the types (``Literal`` choices included) as LightningCLI does; building
the ``MuonConfig`` of every ``muon_config`` mapping runs its checks; and every value the
file sets comes out of the config as written: a settings section (``matrix``, ``scalar``,
``others``) as its ``class_path`` (the class it names, short or dotted) and each of its
``init_args`` (other projects' names read as the fields they set), a plain section
(``state``, ``routing``, ``schedule``) field by field.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import jsonargparse
import lightning.pytorch as pl
import pytest
import yaml
from jsonargparse_compat import instantiate
from lightning.pytorch.cli import LightningCLI

from lightning_muon import MuonConfig, Settings
from lightning_muon.aliases import canonical
from lightning_muon.cli import MuonArgumentParser, MuonCLI

ROOT = Path(__file__).resolve().parents[1]
CLI_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
EXAMPLE_CONFIGS = sorted((ROOT / "examples").glob("*/*.yaml"))
SECTIONS = ("muon_config", "adamw_config")  # the keys that hold a MuonConfig in our YAML files


class _ParseOnly(MuonCLI):
    def instantiate_classes(self) -> None:  # parsing is the point; nothing is built
        pass


def _parse_with_example_cli(path: Path) -> None:
    """examples/lightning_cli: its own LightningCLI (its model and datamodule classes) parses the file."""
    spec = importlib.util.spec_from_file_location("lightning_cli_example", path.parent / "main.py")
    module = importlib.util.module_from_spec(spec)
    # Registered as imported modules are: jsonargparse resolves the postponed annotations
    # (``MuonConfig | None``) through sys.modules (before 4.42 it found no type without it).
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    parse_only = type("ParseOnly", (LightningCLI,), {"instantiate_classes": lambda self: None})
    cli = parse_only(module.DigitsMLP, module.DigitsDataModule, args=["--config", str(path)], run=False)
    assert cli.config.model.muon_config is not None


def _sections(tree: Any, path: str = "") -> list[tuple[str, dict]]:
    """Every ``muon_config`` / ``adamw_config`` mapping in a YAML tree, with where it sits."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in SECTIONS and isinstance(value, dict):
                found.append((f"{path}{key}", value))
            else:
                found += _sections(value, f"{path}{key}.")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            found += _sections(value, f"{path}{i}.")
    return found


def _same(value: Any, written: Any) -> bool:
    if isinstance(value, Settings) and isinstance(written, dict):
        return _same_settings(value, written)
    if isinstance(value, (list, tuple)) and isinstance(written, (list, tuple)):
        return len(value) == len(written) and all(_same(v, w) for v, w in zip(value, written))
    if dataclasses.is_dataclass(value) and isinstance(written, dict):
        return all(hasattr(value, k) and _same(getattr(value, k), w) for k, w in written.items())
    return value == written


def _same_settings(value: Settings, written: dict) -> bool:
    """A settings section as YAML writes it: ``{class_path, init_args}``, ``{init_args}`` (the section's default
    class) or the fields alone; the class named must be the one made, and each field given must hold its value."""
    sectioned = "class_path" in written or "init_args" in written
    if sectioned and set(written) - {"class_path", "init_args"}:
        return False
    class_path = written.get("class_path")
    if class_path is not None and class_path.rpartition(".")[2] != type(value).__name__:
        return False
    args = (written.get("init_args") or {}) if sectioned else written
    fields = canonical(type(value), args, type(value).__name__)  # other projects' names, as the config read them
    return all(hasattr(value, k) and _same(getattr(value, k), w) for k, w in fields.items())


def _assert_unchanged(config: MuonConfig, written: dict, where: str) -> None:
    for key, value in written.items():
        assert _same(getattr(config, key), value), f"{where}.{key}: wrote {value!r}, got {getattr(config, key)!r}"


@pytest.mark.parametrize("path", CLI_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cli_configs_parse_unchanged(path):
    cli = _ParseOnly(
        pl.LightningModule,
        None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=MuonArgumentParser,
        args=["--config", str(path)],
        run=False,
    )
    parsed = cli.config.model.init_args.muon_config
    written = yaml.safe_load(path.read_text())["model"]
    written = written.get("init_args", written)["muon_config"]
    config = MuonConfig.from_any(parsed.as_dict() if not isinstance(parsed, dict) else parsed)
    _assert_unchanged(config, written, f"{path.name}: model.muon_config")


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_configs_parse_unchanged(path):
    if path.parent.name == "lightning_cli":
        _parse_with_example_cli(path)
    sections = _sections(yaml.safe_load(path.read_text()))
    if not sections:
        # muon_vs_adamw: RunSpec fields, from which the experiment builds its MuonConfig.
        from lightning_muon_demo.experiment import RunSpec, muon_config_for

        fields = {f.name for f in dataclasses.fields(RunSpec)}
        written = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k in fields}
        assert written, f"{path}: neither a MuonConfig section nor RunSpec fields"
        spec = RunSpec(**written)
        assert isinstance(muon_config_for(spec), MuonConfig)
        return
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    for where, written in sections:
        config = instantiate(parser, parser.parse_object({"muon": copy.deepcopy(written)})).muon
        _assert_unchanged(config, written, f"{path.name}: {where}")


def test_every_yaml_file_is_covered():
    assert len(CLI_CONFIGS) >= 5 and len(EXAMPLE_CONFIGS) >= 7
    assert not list((ROOT / "configs").rglob("*.yml")) and not list((ROOT / "examples").rglob("*.yml"))


def test_a_bad_choice_is_rejected_while_parsing_or_building():
    # A plain section's Literal types: jsonargparse refuses the value before any MuonConfig is built.
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    with pytest.raises(jsonargparse.ArgumentError, match=r"muon\.schedule\.falloff"):
        parser.parse_object({"muon": {"schedule": {"falloff": "exponential"}}})
    with pytest.raises(jsonargparse.ArgumentError, match=r"muon\.state\.exp_avg_dtype"):
        parser.parse_object({"muon": {"state": {"exp_avg_dtype": "float16"}}})
    parsed = parser.parse_object({"muon": {"schedule": {"falloff": "wsd"}}})
    assert parsed.muon.schedule.falloff == "wsd"
    assert instantiate(parser, parsed).muon.schedule.falloff == "wsd"
    # A settings section's choices (a section may also be a plain dict, for other projects' names): refused
    # when the section's settings are built, naming the section and the field as written.
    bad = [
        ({"init_args": {"adjust_lr": "sqrt"}}, r"MuonConfig\.matrix: adjust_lr must be one of \('original', "),
        (
            {"class_path": "lightning_muon.AdaptiveMuonSettings", "init_args": {"second_moment": "adam"}},
            r"MuonConfig\.matrix: second_moment must be one of \('adamuon', 'normuon', 'namo'\), got 'adam'",
        ),
        ({"init_args": {"scale_mode": "sqrt"}}, r"MuonConfig\.matrix: scale_mode"),  # Emerging-Optimizers' name
    ]
    for matrix, message in bad:
        parsed = parser.parse_object({"muon": {"matrix": copy.deepcopy(matrix)}})
        with pytest.raises(ValueError, match=message):
            instantiate(parser, parsed)
