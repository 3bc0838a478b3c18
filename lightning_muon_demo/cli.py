"""The demo on the command line: what the bundled configs, written for the demo model and its data, do to yours.

The configs the library bundles (``--config muon``, ...) name ``CharGPTModule`` and ``CharTextDataModule``. This
package adds two functions to ``lightning_muon.cli.CONFIG_HOOKS`` on import (which the configs' ``class_path`` does),
so ``python -m lightning_muon`` and ``python -m lightning_muon_demo`` both follow them:

- ``note_kept_arguments``: ``--config muon --model.class_path=my_pkg.MyModel`` keeps the demo model's arguments that
  ``MyModel`` takes too (its ``muon_config``: the demo's whole optimizer and schedule) and drops the others, as
  jsonargparse does when a class changes, silently; a note on stderr says which.
- ``choose_data``: no datamodule (``--data=null``, or a config without ``data:``) gives ``CharGPTModule`` (or a
  subclass) ``CharTextDataModule`` with its defaults, and leaves any other model its own loaders. A
  ``CharTextDataModule`` (or a subclass) named for another model, as the bundled configs name it, would win over that
  model's loaders: a model with its own loader for the subcommand (``train_dataloader`` for ``fit``) trains on it
  instead; one without keeps the datamodule. A note says which.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

import lightning.pytorch as pl
import yaml
from jsonargparse import Namespace
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_muon.bundled_configs import bundled_configs
from lightning_muon.cli import MuonCLI
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.module import CharGPTModule

__all__ = ["choose_data", "note_kept_arguments"]

# The loader a model needs for each subcommand when no datamodule is given.
_LOADER_HOOK = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def _class(class_path: Any) -> type | None:
    """The class at an import path (jsonargparse has made a parsed ``class_path`` a full one); None for none."""
    if not isinstance(class_path, str):
        return None
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name, None)


def note_kept_arguments(cli: MuonCLI) -> None:
    """One note when a bundled config's model arguments meet another model: which were kept, which dropped.

    An argument the command line sets whole (``--model.init_args.muon_config=null``) is not kept.
    """
    config = cli.config[cli.subcommand] if cli.subcommand else cli.config
    model = config.get("model")
    if not model:
        return
    inputs = [*(cli.config.get("config") or []), *((config.get("config") or []) if cli.subcommand else [])]
    inputs = {os.path.realpath(path.absolute) for path in inputs if path}
    whole = {arg.partition("=")[0].lstrip("-") for arg in getattr(cli.parser, "given", ()) if arg.startswith("--")}
    init_args = model.get("init_args") or Namespace()
    for name, path in bundled_configs().items():
        if os.path.realpath(path) not in inputs:
            continue
        section = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        written_for, written = section.get("class_path"), section.get("init_args") or {}
        kept = [key for key in written if key in init_args and f"model.init_args.{key}" not in whole]
        if not kept or _class(written_for) is _class(model.class_path):
            continue
        dropped = ", ".join(key for key in written if key not in init_args)
        single = " (then set single fields: --model.init_args.muon_config.matrix.init_args.lr=0.01)"
        rank_zero_info(
            f"--config {name} was written for {written_for}; {model.class_path} keeps from it the trainer settings and "
            f"{', '.join(f'model.init_args.{key}' for key in kept)}{f', not {dropped}' if dropped else ''}. "
            f"{' '.join(f'--model.init_args.{key}=null' for key in kept)} starts from your model's defaults instead"
            + (single if "muon_config" in kept else "")
        )


def choose_data(cli: MuonCLI) -> None:
    """Sets ``config.data`` by the rules in the module docstring, with a note when the demo data meets another model."""
    config = cli.config[cli.subcommand] if cli.subcommand else cli.config
    model = _class((config.get("model") or Namespace()).get("class_path"))
    data = _class((config.get("data") or Namespace()).get("class_path"))
    if model is not None and issubclass(model, CharGPTModule):
        if data is None:
            parameters = inspect.signature(CharTextDataModule).parameters.values()
            defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
            class_path = f"{CharTextDataModule.__module__}.{CharTextDataModule.__qualname__}"
            config.data = Namespace(class_path=class_path, init_args=Namespace(**defaults))
        return
    if model is None or data is None or not issubclass(data, CharTextDataModule):
        return
    hook = _LOADER_HOOK.get(cli.subcommand, "train_dataloader")
    name, data_path = model.__qualname__, config.data.class_path
    if getattr(model, hook, None) is not getattr(pl.LightningModule, hook):
        config.data = None
        rank_zero_info(
            f"{name} defines {hook}: not using the demo datamodule {data_path} from the config"
            " (pass --data=<class_path> to train on a datamodule)"
        )
    else:
        rank_zero_info(
            f"{name} has no {hook}: it trains on the demo datamodule {data_path}"
            " from the config; pass --data=<class_path> for your own"
        )
