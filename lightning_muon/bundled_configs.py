"""The YAML configs shipped with the package, found by name: ``--config muon``.

A clone keeps them in the repository's ``configs/``; the wheel installs the same files as
``lightning_muon/configs/`` (``setup.py`` maps the one folder onto the other, so there is
one copy). ``config_dir`` finds whichever this installation has; ``find_config`` turns a
``--config`` value into a path: a file that exists, or a config string, is left as it is,
and a bare name (``muon``, ``muon.yaml``) is looked up among the bundled configs.
``BundledConfigFile`` is the ``--config`` option that reads it so.
"""

from __future__ import annotations

import difflib
import re
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile

__all__ = ["BundledConfigFile", "bundled_configs", "config_dir", "find_config"]

SUFFIX = ".yaml"
# A bare name: no folder, no YAML or JSON syntax (a config string like '{trainer: ...}').
_BARE_NAME = re.compile(r"[\w.-]+")


def config_dir() -> Path | None:
    """The folder of the bundled configs: inside the installed package, or the clone's ``configs/``."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "configs", package.parent / "configs"):  # a wheel; a clone (editable or not)
        if candidate.is_dir() and any(candidate.glob(f"*{SUFFIX}")):
            return candidate
    return None


def bundled_configs() -> dict[str, Path]:
    """Name -> path of every bundled config (``{"adamw": .../adamw.yaml, "muon": ..., ...}``)."""
    folder = config_dir()
    return {} if folder is None else {p.stem: p for p in sorted(folder.glob(f"*{SUFFIX}"))}


def find_config(value: str) -> str:
    """``value`` as ``--config`` should read it: a path or a config string as given, a bundled config's path by name.

    Raises:
        ValueError: ``value`` is a bare name that is neither a file nor a bundled config (the
            message lists the bundled names), or a missing file named like a bundled config
            (``configs/muon.yaml`` outside a clone: the message names ``--config muon``).
    """
    if not isinstance(value, str) or Path(value).is_file():
        return value
    configs = bundled_configs()
    if not _BARE_NAME.fullmatch(value):
        stem = Path(value).stem if value.endswith(SUFFIX) and "\n" not in value else None
        if stem in configs:
            raise ValueError(f"{value!r} is no file here; the bundled config of that name is: --config {stem}")
        return value  # a path jsonargparse reports, or a config string
    name = value.removesuffix(SUFFIX)
    if name in configs:
        return str(configs[name])
    close = difflib.get_close_matches(name, list(configs), n=1)
    raise ValueError(
        f"{value!r} is neither a file nor a bundled config (bundled: {', '.join(configs)})"
        + (f"; did you mean {close[0]!r}?" if close else "")
    )


class BundledConfigFile(ActionConfigFile):
    """``--config``: a file, a config string, or the name of a bundled config (``find_config``); a ``ValueError`` of
    ``find_config`` is the option's error."""

    def __call__(self, parser: Any, cfg: Any, values: Any, option_string: str | None = None) -> None:
        try:
            values = find_config(values)
        except ValueError as err:
            raise ArgumentError(self, str(err)) from None
        super().__call__(parser, cfg, values, option_string)


def without_lr_monitor_when_no_logger(cli: Any) -> None:
    """``--trainer.logger=false``: the config's ``LearningRateMonitor`` left out, with a note (in ``CONFIG_HOOKS``).

    The bundled configs carry one, and Lightning's refuses a trainer without a logger.
    """
    trainer = (cli.config[cli.subcommand] if cli.subcommand else cli.config).get("trainer")
    if trainer is None or trainer.get("logger") is not False or not trainer.get("callbacks"):
        return
    kept = [c for c in trainer.callbacks if not str(c.get("class_path", "")).endswith(".LearningRateMonitor")]
    if len(kept) < len(trainer.callbacks):
        sys.stderr.write("note: LearningRateMonitor left out: --trainer.logger=false leaves it nothing to log to\n")
        trainer.callbacks = kept
