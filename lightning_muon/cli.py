"""LightningCLI entry point: ``python -m lightning_muon fit --config muon``.

``--config`` takes a file, a config string, or the name of a config shipped with the
package (``muon``, ``adamw``, ``muon_ddp``, ``muon_fsdp``, ``muon_schedulefree``: the files of
the repository's ``configs/``, installed with the wheel; see ``bundled_configs``).

Any LightningModule or LightningDataModule is taken by ``class_path``; there is no default
model (``python -m lightning_muon_demo fit`` is this CLI with the demo model as default).
Importing the package registers the Muon strategies, so ``--trainer.strategy=muon_ddp``
works.

Which data a model gets:

- ``--data`` (or the config's ``data:``) names a datamodule: the model trains on it,
  except that a demo datamodule (one registered with :func:`register_demo_data` for its
  model, such as the demo's ``CharTextDataModule``) is not given to another model that
  has its own loader for the subcommand (``train_dataloader`` for ``fit``): the bundled
  configs name it for the demo model, and a datamodule would win over your
  loaders. A note on stderr says so.
- No datamodule (``--data=null``, or a config without ``data:``): a model with a
  registered demo datamodule gets it with its defaults; any other model uses its own
  loaders.

The run's config is saved to the run's log directory as ``config.yaml``, never over a
``--config`` input or a file the CLI did not write (then ``config_1.yaml``, ...).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from argparse import ArgumentError
from typing import Any, NoReturn

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile, Namespace
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_muon.bundled_configs import bundled_configs, find_config

__all__ = ["BundledConfigFile", "MuonCLI", "MuonSaveConfigCallback", "main", "register_demo_data"]

PROG = "python -m lightning_muon"

# Demo datamodules by the class path of the model they were made for. A package that ships
# a model with its own data registers the pair on import (lightning_muon_demo does); the
# library itself names no model, so it never imports a demo.
_DEMO_DATA: dict[str, str] = {}

# The loader a model needs for each subcommand when no datamodule is given.
_LOADER_HOOK = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}

# First line of every config this CLI saves: how it recognizes its own files, the only
# ones it may write over.
DUMP_HEADER = "lightning_muon: the config of a run, saved by the CLI"


def register_demo_data(model: str, datamodule: str) -> None:
    """Registers ``datamodule`` as the demo data made for ``model`` (class paths).

    The CLI then gives ``model`` (and its subclasses) this datamodule when no ``--data`` is
    given, and leaves it out for another model that has its own loaders (see the module
    docstring). Registering the same pair again is a no-op.

    Raises:
        ValueError: ``model`` or ``datamodule`` is not a dotted class path, or ``model``
            already has another demo datamodule.
    """
    for name, path in (("model", model), ("datamodule", datamodule)):
        if not isinstance(path, str) or "." not in path:
            raise ValueError(f"register_demo_data: {name} must be a dotted class path, got {path!r}")
    if _DEMO_DATA.get(model, datamodule) != datamodule:
        raise ValueError(
            f"register_demo_data: model {model!r} already has the demo datamodule {_DEMO_DATA[model]!r},"
            f" got {datamodule!r}"
        )
    _DEMO_DATA[model] = datamodule


def _import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _try_import(class_path: str) -> type | None:
    """The class at ``class_path``, or ``None`` where it does not import (the parser reports that)."""
    try:
        return _import_class(class_path)
    except (ImportError, AttributeError, ValueError):
        return None


def _is_class(class_path: object, target: str) -> bool:
    """Whether ``class_path`` names ``target`` or a subclass of it."""
    if not isinstance(class_path, str):
        return False
    if class_path == target:
        return True
    try:
        return issubclass(_import_class(class_path), _import_class(target))
    except (ImportError, AttributeError, TypeError):
        return False


def _class_spec(class_path: str) -> Namespace:
    """``class_path`` with its defaults, as the parser holds a class given by name."""
    parameters = inspect.signature(_import_class(class_path)).parameters.values()
    init_args = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return Namespace(class_path=class_path, init_args=Namespace(**init_args))


def _error_summary(message: str) -> str:
    """The most specific line of a jsonargparse error, e.g. "Option 'lr' is not accepted".

    jsonargparse nests the cause under the key and the union alternatives it tried; the
    deepest line is the cause. Lines about the alternative ``None`` and the given value
    are context, not the cause.
    """
    lines = [line for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return message.strip()
    noise = ("- Expected a <class 'NoneType'>", "Given value", "Subtypes:", "Errors:")
    candidates = [line for line in lines[1:] if not line.strip().startswith(noise)]
    if not candidates:
        return lines[0].strip()
    deepest = max(candidates, key=lambda line: len(line) - len(line.lstrip()))
    key = lines[0].strip().rstrip(":")
    return f"{key}: {deepest.strip().removeprefix('- ')}"


_UNION_NOISE = ("Expected a <class 'NoneType'>", "Does not validate against any of the Union subtypes")


def _instantiation_cause(err: ValueError) -> str | None:
    """The message of the error that names the field and the fix, from a jsonargparse instantiation error.

    jsonargparse wraps a class's own ``ValueError`` once per nesting level (the MuonConfig in
    the module in the subcommand). Newer versions chain it as the innermost ``__cause__``;
    before 4.42 the innermost cause is the union's ``None`` alternative and the class's
    error survives only as the deepest line of the outermost message. None: not a
    ``ValueError`` chain (re-raised as it is).
    """
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    if not isinstance(chain[-1], ValueError):
        return None
    for error in reversed(chain):  # innermost first
        message = str(error).strip()
        if isinstance(error, ValueError) and not message.startswith(_UNION_NOISE) and len(message.splitlines()) == 1:
            return message
    noise = ("- Expected a <class 'NoneType'>", "Given value", "Subtypes:", "Errors:", *_UNION_NOISE)
    lines = [line for line in str(chain[0]).splitlines() if line.strip() and not line.strip().startswith(noise)]
    if not lines:
        return str(chain[-1]).strip()
    deepest = max(lines, key=lambda line: len(line) - len(line.lstrip()))
    return deepest.strip().removeprefix("- ")


class MuonArgumentParser(LightningArgumentParser):
    """Reports a parse error as its cause first, then the details and a hint; no usage.

    jsonargparse prints the whole usage (some 50 lines) before the error, so the one line
    that says what is wrong ends up below the fold.
    """

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        summary = _error_summary(message)
        sys.stderr.write(f"error: {summary}\n")
        if len(message.strip().splitlines()) > 2:  # more than the summary says
            sys.stderr.write("details:\n" + "".join(f"  {line}\n" for line in message.strip().splitlines()))
        if summary.endswith(".model") or ".model " in summary:  # no model named, and no default
            sys.stderr.write(
                "tip: name one with --model=<class_path> or --config=<file>;"
                " python -m lightning_muon_demo fit trains the demo model\n"
            )
        sys.stderr.write(f"tip: {prog} --help lists every option\n")
        self.exit(2)


class BundledConfigFile(ActionConfigFile):
    """``--config``: a file, a config string, or the name of a config shipped with the package (``--config muon``).

    A path that exists wins over a bundled name (``bundled_configs.find_config``).
    """

    def __call__(self, parser: Any, cfg: Any, values: Any, option_string: str | None = None) -> None:
        try:
            values = find_config(values)
        except ValueError as err:
            raise ArgumentError(self, str(err)) from None
        super().__call__(parser, cfg, values, option_string)


class MuonSaveConfigCallback(SaveConfigCallback):
    """Saves the run's config to the log directory without writing over the user's files.

    With ``logger: false`` the log directory is ``default_root_dir`` (the working
    directory by default), where ``config.yaml`` may be the very file the run was started
    with. The config goes to ``config.yaml`` unless that is a ``--config`` input or a file
    this CLI did not save; then to ``config_1.yaml``, ``config_2.yaml``, ... (the first
    free one). The path is printed.

    Args:
        input_configs: The ``--config`` files of the run.
    """

    def __init__(self, *args: Any, input_configs: list[str] | tuple[str, ...] = (), **kwargs: Any) -> None:
        kwargs["overwrite"] = True  # over the CLI's own earlier saves only; _choose_name avoids the rest
        super().__init__(*args, **kwargs)
        self.input_configs = {os.path.realpath(path) for path in input_configs}

    def _writable(self, fs: Any, path: str) -> bool:
        if os.path.realpath(path) in self.input_configs:
            return False
        if not fs.isfile(path):
            return True
        with fs.open(path, "r") as f:
            return f.readline().strip() == f"# {DUMP_HEADER}"

    def _choose_name(self, log_dir: str) -> str:
        fs = get_filesystem(log_dir)
        stem, ext = os.path.splitext(self.config_filename)
        candidates = (self.config_filename if n == 0 else f"{stem}_{n}{ext}" for n in range(10_000))
        for name in candidates:
            if self._writable(fs, os.path.join(log_dir, name)):
                return name
        raise RuntimeError(f"no free name for the run's config in {log_dir}")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir:
            log_dir = trainer.log_dir  # on every rank: it broadcasts
            # Only rank zero writes; with overwrite on, the other ranks never look at the name.
            if trainer.is_global_zero and log_dir is not None:
                self.config_filename = self._choose_name(log_dir)
                rank_zero_info(f"The run's config: {os.path.join(log_dir, self.config_filename)}")
        super().setup(trainer, pl_module, stage)


def _demo_data_of(model_path: str | None) -> str | None:
    """The demo datamodule registered for ``model_path`` or a base class of it, if any."""
    if model_path is None:
        return None
    _try_import(model_path)  # importing the model's package registers its pairs
    return next((data for model, data in _DEMO_DATA.items() if _is_class(model_path, model)), None)


def _is_demo_data(data_path: str | None) -> bool:
    """Whether ``data_path`` is a registered demo datamodule or a subclass of one."""
    if data_path is None:
        return False
    _try_import(data_path)  # importing the datamodule's package registers its pairs
    return any(_is_class(data_path, data) for data in _DEMO_DATA.values())


class MuonCLI(LightningCLI):
    """LightningCLI with optional data, an optional default model and short errors.

    See the module docstring for which datamodule a model gets and where the config is
    saved.

    Args:
        *args: ``LightningCLI``'s arguments.
        default_model: The class path of the model when neither ``--model`` nor the config
            names one; ``None`` (the default) makes ``--model`` required.
        **kwargs: ``LightningCLI``'s keyword arguments.
    """

    def __init__(self, *args: Any, default_model: str | None = None, **kwargs: Any) -> None:
        self.default_model = default_model  # read by add_arguments_to_parser, inside super().__init__
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # LightningCLI.init_parser, with --config taking a bundled config's name too.
        kwargs.setdefault("dump_header", [DUMP_HEADER, f"lightning.pytorch=={pl.__version__}"])
        parser = self.parser_class(**kwargs)
        names = ", ".join(bundled_configs())
        parser.add_argument(
            "-c",
            "--config",
            action=BundledConfigFile,
            help=f"A YAML or JSON file, a config string, or the name of a bundled config: {names}.",
        )
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        if self.default_model is not None:
            parser.set_defaults({"model": {"class_path": self.default_model}})

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        self._choose_data(config)
        if isinstance(self.save_config_callback, type) and issubclass(
            self.save_config_callback, MuonSaveConfigCallback
        ):
            # Every --config input, of the main parser and of the subcommand's.
            inputs = [*(self.config.get("config") or []), *((config.get("config") or []) if self.subcommand else [])]
            self.save_config_kwargs["input_configs"] = [os.fspath(path.absolute) for path in inputs if path]

    def _choose_data(self, config: Any) -> None:
        """Sets ``config.data`` by the rules in the module docstring, with a note when the demo data is involved."""
        model_path = config.model.class_path if config.get("model") else None
        data_path = config.data.class_path if config.get("data") else None
        demo_data = _demo_data_of(model_path)
        if demo_data is not None:
            if data_path is None:
                config.data = _class_spec(demo_data)
            return
        if not _is_demo_data(data_path):
            return
        hook = _LOADER_HOOK.get(self.subcommand or "fit", "train_dataloader")
        model_class = _import_class(model_path)
        own_loader = getattr(model_class, hook, None) is not getattr(pl.LightningModule, hook)
        name = model_class.__qualname__
        if own_loader:
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

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:
            # A bad value reaches us wrapped by jsonargparse once per nesting level (the
            # MuonConfig in the module in the subcommand), each with its traceback; the
            # innermost error is the one that names the field and the fix.
            if os.environ.get("JSONARGPARSE_DEBUG"):
                raise
            cause = _instantiation_cause(err)
            if cause is None:
                raise
            sys.stderr.write(f"error: {cause}\n")
            sys.stderr.write("tip: JSONARGPARSE_DEBUG=1 shows the traceback\n")
            raise SystemExit(2) from None


def main(args: list[str] | None = None, *, default_model: str | None = None, prog: str = PROG) -> MuonCLI:
    """Run the CLI; ``args`` defaults to ``sys.argv[1:]``.

    Args:
        args: The command line after the program name.
        default_model: The model's class path when none is given; ``None``: ``--model`` is
            required.
        prog: The program name shown in help and errors.
    """
    return MuonCLI(
        pl.LightningModule,
        None,  # optional: a model with its own loaders needs no datamodule
        save_config_callback=MuonSaveConfigCallback,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=MuonArgumentParser,
        parser_kwargs={"prog": prog},
        args=args,
        default_model=default_model,
    )
