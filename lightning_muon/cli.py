"""LightningCLI entry point: ``python -m lightning_muon fit --config muon``.

``--config`` also takes a bundled config's name. Any LightningModule or LightningDataModule is taken by ``class_path``;
the library names no model (``python -m lightning_muon_demo fit`` is this CLI with the demo model as default, and
gives it its data through ``CONFIG_HOOKS``). The run's config is saved to its log directory, never over a file the
CLI did not write (``MuonSaveConfigCallback``). ``convert-checkpoint`` and ``options`` run beside LightningCLI's.

An error is two lines on stderr, before anything else: what is wrong, then where to look. What is wrong comes from the
library's own checks: each ``MuonConfig`` is made once the command line is parsed, before Lightning seeds, so a
setting's own error is printed; and a command line the parser refuses is checked value by value against the types of
the classes it names (``_check``), the first bad value or option named as written, with its choices or the nearest
option; what neither finds, as jsonargparse words it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, Union

import lightning.pytorch as pl
import yaml
from jsonargparse import Namespace, dict_to_namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_muon import bundled_configs as bundled
from lightning_muon import checkpoints, options
from lightning_muon.algorithms import Settings
from lightning_muon.callbacks.save_config import DUMP_HEADER, MuonSaveConfigCallback
from lightning_muon.config import MuonConfig
from lightning_muon.module import MuonModuleMixin

__all__ = ["CONFIG_HOOKS", "MuonArgumentParser", "MuonCLI", "main"]

# Called in turn with the CLI once its config is parsed, before its classes are made; each may change ``cli.config``
# (``cli.parser.given`` is the command line). A package of models adds one on import, the library itself naming no
# model: lightning_muon_demo's give its model its data and note what a model of yours keeps from the demo configs.
CONFIG_HOOKS: list[Callable[[MuonCLI], None]] = [bundled.without_lr_monitor_when_no_logger]


def _given(args: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """Each value a command line sets (``--key value``, ``--key=value``, a ``--config`` input's), by dotted key, in
    the order the parser reads them; read as YAML, as jsonargparse reads them."""
    keys = [arg.startswith("--") or arg.partition("=")[0] == "-c" for arg in args]
    for n, arg in enumerate(args):
        if not keys[n]:
            continue
        key, eq, text = arg.partition("=")
        text, config = text if eq or n + 1 == len(args) or keys[n + 1] else args[n + 1], key in ("-c", "--config")
        try:
            path = bundled.find_config(text) if config else text
            value = yaml.safe_load(Path(path).read_text() if config and os.path.isfile(path) else path)
        except (ValueError, yaml.YAMLError):  # an input the parser reports itself
            continue
        if isinstance(value, dict) or not config:  # --trainer.callbacks+=...: appends
            yield from dict_to_namespace(value if config else {key.lstrip("-").removesuffix("+"): value}).items()


def _alternatives(tp: Any) -> list[Any]:
    """The members of a union (``X | None`` included), else ``[tp]``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [a for alt in typing.get_args(tp) for a in _alternatives(alt)]
    return [tp]


def _class_named(path: str) -> type | None:
    """The class an import path names; a bare name (as configs write a settings class) is ``lightning_muon``'s."""
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module or "lightning_muon"), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if inspect.isclass(found) else None


def _fields(cls: Any) -> dict[str, Any] | None:
    """The init arguments of class ``cls`` and their types; None where ``**kwargs`` (or none) leaves them open."""
    try:
        parameters = inspect.signature(cls).parameters.values()
        hints = typing.get_type_hints(cls if dataclasses.is_dataclass(cls) else cls.__init__)
    except Exception:  # not a class, or annotations that do not resolve here: not ours to check
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name: hints.get(p.name) for p in parameters if p.kind is not p.VAR_POSITIONAL}


def _nearest(word: str, options: Sequence[Any], otherwise: str = "") -> str:
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1)
    return f"; did you mean {close[0]!r}?" if close else otherwise


def _not_one_of(said: str, value: Any, choices: Sequence[Any]) -> str:
    return f"{said} not one of {', '.join(map(repr, choices))}" + _nearest(str(value), choices)


def _choices(tp: Any) -> list[Any]:
    """The values a ``Literal`` type (or a union holding some) allows; empty for any other type."""
    return [c for a in _alternatives(tp) if typing.get_origin(a) is Literal for c in typing.get_args(a)]


def _bad_value(where: str, tp: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for a field of type ``tp``: not one of a ``Literal``'s choices, a number, a bool."""
    kinds = [a for a in _alternatives(tp) if a is not type(None)]
    if value is None and len(kinds) < len(_alternatives(tp)):
        return None
    if _choices(tp):
        return None if value in _choices(tp) else _not_one_of(f"{where}: {value!r} is", value, _choices(tp))
    integer = isinstance(value, int) and not isinstance(value, bool)
    fits = {int: integer, float: integer or isinstance(value, float), bool: isinstance(value, bool)}
    if kinds and all(a in fits for a in kinds) and not any(fits[a] for a in kinds):
        return f"{where}: expected {' or '.join(a.__name__ for a in kinds)}, got {value!r}"
    return None


def _check(parts: list[str], i: int, tp: Any, value: Any, classes: dict[str, type | None]) -> str | None:
    """What is wrong with setting the dotted key ``parts`` to ``value``, where ``parts[:i]`` is a field of type ``tp``.

    ``classes`` holds the class each section taken by ``class_path`` has so far, by its key, and learns new ones. A
    name a settings section does not know is left to the section, which reads other projects' names (``aliases``).
    """
    where = ".".join(parts[:i])
    cls = next((a for a in _alternatives(tp) if inspect.isclass(a) and a.__module__ != "builtins"), None)
    if cls is not None and not all(dataclasses.is_dataclass(c) for c in cls.__mro__[:-1]):  # class_path, init_args
        if i == len(parts) or parts[i] == "class_path":
            classes[where] = _class_named(value) if isinstance(value, str) else None
            return None
        i, cls = i + (parts[i] == "init_args"), classes.get(where)
    if i == len(parts):
        return _bad_value(where, tp, value)
    fields, name = _fields(cls), parts[i]
    if fields is None or name not in fields and issubclass(cls, Settings):
        return None
    if name not in fields:
        said = f"{'.'.join(parts[: i + 1])}: {cls.__name__} has no option {name!r}"
        return said + _nearest(name, list(fields), f"; its options: {', '.join(fields)}")
    if issubclass(cls, Settings) and i + 1 == len(parts):  # named by its class, which a config may give short
        choices = cls.choices.get(name) or _choices(fields[name])
        said = f"{where.rpartition('.')[0]}: {cls.__name__}.{name}:"
        return _not_one_of(said, value, choices) if choices and value not in choices else None
    return _check(parts, i + 1, fields[name], value, classes)


def _problem(parser: LightningArgumentParser, args: Sequence[str]) -> str | None:
    """The first value of ``args`` that ``_check`` finds wrong, or that no option takes; None where there is none."""
    actions = {action.dest: action for action in parser._actions}
    # A group's keys are its options' (trainer.max_steps, ...); a class's (model.help aside), the class's arguments.
    groups = {name.rpartition(".")[0] for name in actions if not name.endswith(".help")}
    defaults = {name: action.default for name, action in actions.items() if isinstance(action.default, Namespace)}
    classes = {name: _class_named(str(d.get("class_path"))) for name, d in defaults.items()}  # a default model
    for key, value in _given(args):
        option = next((o for o in actions if key == o or key.startswith(f"{o}.") and o not in groups), None)
        if option is None:
            return f"{key}: no such option" + _nearest(key, list(actions))
        tp = getattr(actions[option], "_typehint", None)  # jsonargparse's type of it; without one, names only
        if problem := _check(key.split("."), option.count(".") + 1, tp, value, classes):
            return problem
    return None


def _report(message: str, prog: str) -> NoReturn:
    """The two lines of an error on stderr (what is wrong, where to look), and exit code 2."""
    sys.stderr.write(
        f"error: {message}\ntip: {prog} --help lists the options; python -m lightning_muon options NAME lists the "
        "settings of an algorithm (muon, adamw, ...) or a config section (state, routing, schedule)\n"
    )
    raise SystemExit(2)


def _made(value: Any) -> Any:
    """A parsed value as jsonargparse makes it: each ``class_path`` made with its ``init_args``."""
    if isinstance(value, Namespace) and isinstance(value.get("class_path"), str):
        return _class_named(value.class_path)(**_made(value.get("init_args") or Namespace()))
    if isinstance(value, Namespace):
        return {key: _made(inner) for key, inner in vars(value).items()}
    return [_made(inner) for inner in value] if isinstance(value, list) else value


class MuonArgumentParser(LightningArgumentParser):
    """A parse error in two lines (``_report``), the first ``_problem``'s where it finds one; no usage (jsonargparse
    prints some 50 lines of it first, and words the cause deep in nested lines, or not at all)."""

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Namespace:
        self.given = sys.argv[1:] if args is None else list(args)  # what error() checks, and CONFIG_HOOKS may read
        return super().parse_args(args, *rest, **kwargs)

    def format_help(self) -> str:
        """jsonargparse's help; the top level's also names the commands ``main`` runs itself (``OWN_COMMANDS``)."""
        text = super().format_help()
        if self._subcommands_action is None:
            return text
        return text + "\nmore commands:\n" + "".join(f"  {self.prog} {k} {v}\n" for k, (_, v) in OWN_COMMANDS.items())

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):  # a nested parser's: its owner reports it
            super().error(message, ex)
        # The top level's command line holds the subcommand's, which only the subcommand's parser checks.
        problem = _problem(self, getattr(self, "given", ())) if self._subcommands_action is None else None
        _report(problem or message.strip(), self.prog.replace(" [options]", ""))


class MuonCLI(LightningCLI):
    """LightningCLI with optional data, ``CONFIG_HOOKS``, two-line errors and ``default_model``, the class path of the
    model when neither ``--model`` nor the config names one (``None``, the default: ``--model`` is required)."""

    def __init__(self, *args: Any, default_model: str | None = None, **kwargs: Any) -> None:
        self.default_model = default_model  # read by add_arguments_to_parser, inside super().__init__
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # LightningCLI.init_parser, with --config taking a bundled config's name too.
        kwargs.setdefault("dump_header", [DUMP_HEADER, f"lightning.pytorch=={pl.__version__}"])
        parser = self.parser_class(**kwargs)
        names = ", ".join(bundled.bundled_configs())
        help = f"A YAML or JSON file, a config string, or the name of a bundled config: {names}."
        parser.add_argument("-c", "--config", action=bundled.BundledConfigFile, help=help)
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        if self.default_model is not None:
            parser.set_defaults({"model": {"class_path": self.default_model}})

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """LightningCLI's parse, then, before Lightning seeds and logs: ``--optimizer`` or ``--lr_scheduler`` with a
        ``MuonModuleMixin`` model refused (LightningCLI would replace its ``configure_optimizers``, dropping
        ``muon_config``), and each ``MuonConfig`` argument of the model made (a bad setting: its own error)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config, prog = self.config[subcommand] if subcommand else self.config, f"{parser.prog} {subcommand or ''}"
        model = config.get("model") or Namespace(class_path="", init_args=None)
        cls = _class_named(model.class_path)
        given = [key for key in ("optimizer", "lr_scheduler") if config.get(key) is not None]
        if given and isinstance(cls, type) and issubclass(cls, MuonModuleMixin):
            _report(
                f"--{given[0]} would replace {cls.__name__}.configure_optimizers (MuonModuleMixin's) and drop "
                "model.init_args.muon_config with it (the routing, the AdamW lr, the schedule); set the optimizer "
                "there instead (--model.init_args.muon_config.matrix.init_args.lr=0.01), or leave the mixin out",
                prog.rstrip(),
            )
        init_args = model.get("init_args") or Namespace()
        try:
            for name, tp in (_fields(cls) or {}).items():
                if MuonConfig in _alternatives(tp) and isinstance(init_args.get(name), Namespace):
                    MuonConfig(**_made(init_args[name]))
        except ValueError as err:
            if os.environ.get("JSONARGPARSE_DEBUG"):
                raise
            _report(str(err), prog.rstrip())

    def before_instantiate_classes(self) -> None:
        for hook in CONFIG_HOOKS:
            hook(self)
        config = self.config[self.subcommand] if self.subcommand else self.config
        callback = self.save_config_callback
        if isinstance(callback, type) and issubclass(callback, MuonSaveConfigCallback):
            # Every --config input, of the main parser and of the subcommand's.
            inputs = [*(self.config.get("config") or []), *((config.get("config") or []) if self.subcommand else [])]
            self.save_config_kwargs["input_configs"] = [os.fspath(path.absolute) for path in inputs if path]


# The commands ``main`` runs itself, with what the top-level help says of each beside LightningCLI's.
OWN_COMMANDS = {
    "convert-checkpoint": (checkpoints.main, "DIR OUT.ckpt: turn a muon_fsdp checkpoint folder into one file."),
    "options": (options.main, "[NAME]: the settings of an algorithm or a config section, each documented; alone, all."),
}


def main(
    args: list[str] | None = None, *, default_model: str | None = None, prog: str = "python -m lightning_muon"
) -> MuonCLI | None:
    """Run the CLI on ``args`` (the command line after the program name; default ``sys.argv[1:]``), ``prog`` its name
    in help and errors. ``OWN_COMMANDS`` run here and return None (a failure exits with its code); every other command
    line goes to ``MuonCLI`` (``fit``, ``validate``, ...), with ``default_model`` (``MuonCLI``'s)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] and argv[0] in OWN_COMMANDS:
        code = OWN_COMMANDS[argv[0]][0](argv[1:], prog=f"{prog} {argv[0]}")
        if code:
            raise SystemExit(code)
        return None
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
