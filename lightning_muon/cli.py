"""LightningCLI entry point: ``python -m lightning_muon fit --config muon``.

``--config`` takes a file, a config string, or the name of a config shipped with the
package (``muon``, ``adamw``, ``muon_ddp``, ``muon_fsdp``, ``muon_schedulefree``: the files of
the repository's ``configs/``, installed with the wheel; see ``bundled_configs``).

Any LightningModule or LightningDataModule is taken by ``class_path``; there is no default
model (``python -m lightning_muon_demo fit`` is this CLI with the demo model as default).
Importing the package registers the Muon strategies, so ``--trainer.strategy=muon_ddp``
works.

A package may change a parsed config before its classes are made by adding a function to
``CONFIG_HOOKS``: ``lightning_muon_demo`` gives its model its data there, keeps it from a model
of yours with its own loaders, and notes what such a model keeps of the demo model's arguments.

The run's config is saved to the run's log directory as ``config.yaml``, never over a
``--config`` input or a file the CLI did not write (then ``config_1.yaml``, ...:
``lightning_muon.callbacks.MuonSaveConfigCallback``).

A rejected value or option is reported in two lines: the first names it as written
(``error: model.init_args.muon_config.falloff: 'cosin' is not one of ...; did you mean
'cosine'?``), with the choices or the nearest valid option name, the second points to ``--help``.

Besides LightningCLI's subcommands, ``convert-checkpoint DIR OUT.ckpt`` turns a ``muon_fsdp``
checkpoint folder into one file (``lightning_muon.checkpoints.convert_checkpoint``), and
``options [NAME]`` lists every setting of an algorithm or a config section with its doc
(``lightning_muon.options``); ``--help`` names both.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, NoReturn, Union

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_muon import checkpoints, options
from lightning_muon.bundled_configs import BundledConfigFile, bundled_configs
from lightning_muon.callbacks.save_config import DUMP_HEADER, MuonSaveConfigCallback

__all__ = ["CONFIG_HOOKS", "MuonCLI", "main"]

PROG = "python -m lightning_muon"

# Called in turn with the CLI once its config is parsed, before its classes are made; each may change ``cli.config``
# (``cli.parser.given`` is the command line). A package of models adds one on import, the library itself naming no
# model: lightning_muon_demo's give its model its data and note what a model of yours keeps from the demo configs.
CONFIG_HOOKS: list[Callable[[MuonCLI], None]] = []


def _import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _try_import(class_path: str) -> type | None:
    """The class at ``class_path``, or ``None`` where it does not import (the parser reports that)."""
    try:
        return _import_class(class_path)
    except (ImportError, AttributeError, ValueError):
        return None


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


# The structure of a jsonargparse error: the keys and class paths down to the cause, and the cause.
_KEY_LINE = re.compile(r'^Parser key "([^"]+)":$')
_CLASS_LINE = re.compile(r"^Problem with given class_path '([^']+)':$")
_UNKNOWN_KEY = (  # 4.41's words and 4.42's
    re.compile(r"Unrecognized arguments: --?([^\s=]+)"),
    re.compile(r"Key '([^']+)' is not expected"),
    re.compile(r"Option '([^']+)' is not accepted"),
)
_EXPECTED = re.compile(r"Expected an? (?:<class '([^']+)'>|(.+?))\. Got value: (.*)$")
_NESTED_ARG = re.compile(r"^NestedArg\(key='([^']*)', val=(.*)\)$")
_STRUCTURE = ("- Expected a <class 'NoneType'>", "Given value", "Subtypes:", "Errors:", *_UNION_NOISE)


def _text(line: str) -> str:
    return line.strip().removeprefix("- ")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fields(cls: Any) -> dict[str, Any]:
    """The init arguments of ``cls`` (a dataclass's fields, a class's ``__init__`` parameters) and their types."""
    try:
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls)
            return {f.name: hints.get(f.name) for f in dataclasses.fields(cls) if f.init}
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError, NameError):
        return {}
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve here: names without types
        hints = {}
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {name: hints.get(name) for name, p in parameters.items() if p.kind not in variadic}


def _alternatives(tp: Any) -> list[Any]:
    """The members of a union (``X | None`` included), else ``[tp]``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [a for alt in typing.get_args(tp) for a in _alternatives(alt)]
    return [tp]


def _choices(tp: Any) -> list[Any]:
    """The values a ``Literal`` type (or a union holding some) allows; empty for any other type."""
    return [c for alt in _alternatives(tp) if typing.get_origin(alt) is Literal for c in typing.get_args(alt)]


def _class_of(tp: Any) -> type | None:
    """The class a field's value is built from (``MuonConfig`` for ``MuonConfig | None``), if any."""
    classes = [a for a in _alternatives(tp) if inspect.isclass(a) and a is not type(None)]
    if len(classes) == 1 and classes[0].__module__ != "builtins":
        return classes[0]
    return None


def _given_value(lines: list[str], path: list[str]) -> Any:
    """The value jsonargparse reports for the key at the end of ``path`` in the lines after its cause, or None.

    The value reported may be a section holding it (``{'schedule': {'falloff': 'cosin'}}``): the
    longest tail of ``path`` that leads into it is followed.
    """
    key = path[-1]
    for line in lines:
        text = _text(line)
        if not text.startswith("Given value: "):
            continue
        given = text.removeprefix("Given value: ")
        nested = _NESTED_ARG.match(given)
        if nested:
            if nested.group(1).split(".")[-1] != key:
                return None
            given = nested.group(2)
        try:
            value = ast.literal_eval(given)
        except (ValueError, SyntaxError):
            return given
        return _dig(value, path) if isinstance(value, dict) else value
    return None


def _dig(value: dict, path: list[str]) -> Any:
    """``value[path[i]][path[i + 1]]...`` for the smallest ``i`` where every key is there, else None."""
    for start in range(len(path)):
        found: Any = value
        for key in path[start:]:
            if not isinstance(found, dict) or key not in found:
                break
            found = found[key]
        else:
            return found
    return None


def _nearest(word: str, options: list[str]) -> str | None:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return close[0] if close else None


def _rejection(message: str, option_names: list[str]) -> str | None:
    """One line naming what jsonargparse rejected as the user wrote it, with its choices or the nearest option.

    ``model.init_args.muon_config.falloff: 'cosin' is not one of 'constant', ...; did you mean
    'cosine'?``; ``model.init_args.muon_config.lrr: MuonConfig has no option 'lrr'; did you mean
    'lr'?``. None where the message has no key and cause to read (the caller falls back).
    ``option_names``: the parser's own options, for an unknown one at the top.
    """
    lines = [line for line in message.splitlines() if line.strip()]
    marks = (_KEY_LINE, _CLASS_LINE)
    structure = [line.strip().startswith(_STRUCTURE) or any(m.match(_text(line)) for m in marks) for line in lines]
    causes = [i for i in range(len(lines)) if not structure[i]]
    if not causes:
        return None
    at = max(causes, key=lambda i: _indent(lines[i]))  # the deepest: the cause, not its context
    chain, level = [], _indent(lines[at])
    for line in reversed(lines[:at]):
        if _indent(line) < level:
            level = _indent(line)
            chain.append(_text(line))
    path: list[str] = []
    owner: Any = None  # the class the next key is an argument of
    field_type: Any = None
    for text in reversed(chain):
        if key := _KEY_LINE.match(text):
            for part in key.group(1).split("."):  # a nested dataclass's key comes dotted ("schedule.falloff")
                path.append(part)
                field_type = _fields(owner).get(part) if owner is not None else None
                owner = _class_of(field_type)
        elif class_path := _CLASS_LINE.match(text):
            owner = _try_import(class_path.group(1))
            path.append("init_args")
    cause = _text(lines[at])
    unknown = next((m.group(1) for pattern in _UNKNOWN_KEY if (m := pattern.search(cause))), None)
    if unknown is not None:
        while owner is not None and "." in unknown:  # an unknown key inside a nested section comes dotted
            part, unknown = unknown.split(".", 1)
            path.append(part)
            owner = _class_of(_fields(owner).get(part))
        where = ".".join([*path, unknown])
        if owner is not None:
            options, name = list(_fields(owner)), owner.__name__
            said = f"{where}: {name} has no option {unknown!r}"
        else:
            options, name = (option_names if not path else []), None
            said = f"{where}: no such option"
            unknown = where
        nearest = _nearest(unknown, options)
        if nearest is not None:
            return f"{said}; did you mean {nearest!r}?"
        return f"{said}; its options: {', '.join(options)}" if options else said
    if not path:
        return None
    where = ".".join(path)
    expected = _EXPECTED.search(cause)
    value = expected.group(3) if expected else _given_value(lines[at + 1 :], path)
    choices = _choices(field_type)
    if choices:
        listed = ", ".join(repr(c) for c in choices)
        said = f"{where}: {value!r} is not one of {listed}" if value is not None else f"{where}: not one of {listed}"
        nearest = _nearest(str(value), [str(c) for c in choices]) if value is not None else None
        return f"{said}; did you mean {nearest!r}?" if nearest is not None else said
    if expected:
        wanted = expected.group(1) or expected.group(2)
        return f"{where}: expected {wanted}, got {value!r}"
    return f"{where}: {cause}"


# jsonargparse 4.41, after a settings section written with a short class_path (``class_path: MuonSettings``)
# fails a check, reports only that it cannot import the short name; the nested parser said which setting failed.
_LOST_CLASS = re.compile(r"Expected a dot import path string: (\w+)$")


def _refused_setting(where: str, class_name: str, nested: list[str]) -> str | None:
    """``where`` (``model.init_args.muon_config: ``) and the setting of ``class_name`` a nested parser refused,
    with its choices; None where the nested errors name none."""
    import lightning_muon.algorithms as algorithms

    owner = getattr(algorithms, class_name, None)
    for text in nested:
        key = _KEY_LINE.match(text.splitlines()[0].strip()) if text.strip() else None
        if key is None or owner is None or key.group(1) not in _fields(owner):
            continue
        name = key.group(1)
        choices = owner.choices.get(name) or _choices(_fields(owner)[name])
        said = f"{where}{class_name}.{name}:"
        return f"{said} not one of {', '.join(repr(c) for c in choices)}" if choices else f"{said} {text.strip()}"
    return None


class MuonArgumentParser(LightningArgumentParser):
    """Reports a parse error as its cause first, then a hint; no usage.

    jsonargparse prints the whole usage (some 50 lines) before the error, so the one line
    that says what is wrong ends up below the fold. A rejected value or option is named as
    written (``model.init_args.muon_config.falloff``), with its choices or the nearest valid
    option name (``_rejection``); other errors keep jsonargparse's details.
    """

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Namespace:
        self.given = sys.argv[1:] if args is None else list(args)  # what CONFIG_HOOKS may read
        return super().parse_args(args, *rest, **kwargs)

    def format_help(self) -> str:
        """jsonargparse's help; the top level's also names the commands ``main`` runs itself (``OWN_COMMANDS``)."""
        text = super().format_help()
        if self._subcommands_action is None:
            return text
        own = "".join(f"  {self.prog} {name} {what}\n" for name, what in OWN_COMMANDS.items())
        return f"{text}\nmore commands:\n{own}"

    # The errors of nested parsers (a section's own), first first: the top-level message may have lost them.
    _nested_errors: ClassVar[list[str]] = []

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            MuonArgumentParser._nested_errors.append(message)
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        nested, MuonArgumentParser._nested_errors = MuonArgumentParser._nested_errors, []
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        options = [a.dest for a in parser._actions if a.dest not in ("help", "config", "print_config")]
        rejected = _rejection(message, [name for name in options if not name.endswith(".help")])
        if rejected is not None and (lost := _LOST_CLASS.search(rejected)):
            rejected = _refused_setting(rejected[: lost.start()], lost.group(1), nested) or rejected
        summary = rejected or _error_summary(message)
        sys.stderr.write(f"error: {summary}\n")
        if rejected is None and len(message.strip().splitlines()) > 2:  # more than the summary says
            sys.stderr.write("details:\n" + "".join(f"  {line}\n" for line in message.strip().splitlines()))
        if summary.endswith(".model") or ".model " in summary:  # no model named, and no default
            sys.stderr.write(
                "tip: name one with --model=<class_path> or --config=<file>;"
                " python -m lightning_muon_demo fit trains the demo model\n"
            )
        sys.stderr.write(
            f"tip: {prog} --help lists the options; python -m lightning_muon options NAME lists the settings of an "
            "algorithm (muon, adamw, ...) or a config section (state, routing, schedule)\n"
        )
        self.exit(2)


class MuonCLI(LightningCLI):
    """LightningCLI with optional data, an optional default model, ``CONFIG_HOOKS`` and short errors.

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
        # Every --config input, of the main parser and of the subcommand's.
        inputs = [*(self.config.get("config") or []), *((config.get("config") or []) if self.subcommand else [])]
        inputs = [os.fspath(path.absolute) for path in inputs if path]
        for hook in CONFIG_HOOKS:
            hook(self)
        if isinstance(self.save_config_callback, type) and issubclass(
            self.save_config_callback, MuonSaveConfigCallback
        ):
            self.save_config_kwargs["input_configs"] = inputs

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


CONVERT_CHECKPOINT = "convert-checkpoint"
OPTIONS = "options"
# The commands ``main`` runs itself, named in the top-level help beside LightningCLI's.
OWN_COMMANDS = {
    CONVERT_CHECKPOINT: "DIR OUT.ckpt: turn a muon_fsdp checkpoint folder into one file.",
    OPTIONS: "[NAME]: every setting of an algorithm (muon, adamw, scion, ...) or a config section "
    "(state, routing, schedule, megatron), with its doc; alone, the sections and algorithms.",
}


def main(args: list[str] | None = None, *, default_model: str | None = None, prog: str = PROG) -> MuonCLI | None:
    """Run the CLI; ``args`` defaults to ``sys.argv[1:]``.

    ``convert-checkpoint DIR OUT.ckpt`` converts a distributed checkpoint folder into one
    file (``lightning_muon.checkpoints``) and returns None (a failure exits with code 2);
    every other command line goes to LightningCLI (``fit``, ``validate``, ...).

    Args:
        args: The command line after the program name.
        default_model: The model's class path when none is given; ``None``: ``--model`` is
            required.
        prog: The program name shown in help and errors.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == [CONVERT_CHECKPOINT]:
        code = checkpoints.main(argv[1:], prog=f"{prog} {CONVERT_CHECKPOINT}")
        if code:
            raise SystemExit(code)
        return None
    if argv[:1] == [OPTIONS]:
        code = options.main(argv[1:], prog=f"{prog} {OPTIONS}")
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
