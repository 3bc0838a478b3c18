"""``python -m lightning_muon options [NAME]``: every setting of an algorithm or a config section, with its doc.

``options`` alone lists ``MuonConfig``'s sections and the algorithms a section may hold;
``options muon`` (any registered algorithm) lists its settings' fields: type or choices,
default, doc, and the other projects' names it also reads (``aliases``); ``options state``,
``routing``, ``schedule`` list those sections; ``options megatron`` lists the Megatron-Core
names a ``megatron`` block reads and those it refuses, with what to use instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import textwrap
import typing
from collections.abc import Callable
from typing import Any

from lightning_muon.algorithms import algorithm_names, get_algorithm, per_matrix
from lightning_muon.algorithms.settings import field_docs
from lightning_muon.aliases import aliases_of
from lightning_muon.megatron import MEGATRON_DEFAULTS, MEGATRON_REFUSED

__all__ = ["main", "render"]

WIDTH = 100


def _type_text(hint: Any) -> str:
    text = str(hint).replace("typing.", "")
    return text.removeprefix("<class '").removesuffix("'>")


def _fields_text(cls: type, docs: dict[str, str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        if not f.init:  # ``fixed``: the algorithm's own value, no setting
            lines.append(f"  {f.name} = {default!r} (fixed by the algorithm)")
            continue
        choices = getattr(cls, "choices", {}).get(f.name)
        kind = f"one of {choices}" if choices else _type_text(hints[f.name])
        lines.append(f"  {f.name}: {kind} = {default!r}")
        doc = docs.get(f.name, "")
        lines += textwrap.wrap(doc, WIDTH, initial_indent="      ", subsequent_indent="      ") if doc else []
    return lines


def _algorithm(name: str) -> list[str]:
    algorithm = get_algorithm(name)
    cls = algorithm.settings
    section = "matrix" if per_matrix(algorithm.name) else "scalar"
    head = inspect.cleandoc(cls.__doc__ or "").split("\n\nArgs:")[0]
    lines = [
        f"{algorithm.name}: {cls.__name__} ({cls.__module__})",
        *textwrap.wrap(head, WIDTH),
        "",
        f"In a config: muon_config.{section}: {{class_path: {cls.__name__}, init_args: {{...}}}}",
        "(or under muon_config.others, when a routing rule names it); per group: a rule's options.",
        "",
        "settings:",
        *_fields_text(cls, cls.docs()),
    ]
    aliases = aliases_of(cls)
    if aliases:
        lines += ["", "also read under other projects' names:"]
        lines += [f"  {a.name} -> {a.field} ({a.source})" for a in aliases.values()]
    return lines


def _section(cls: type, title: str) -> list[str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(field_docs(klass))
    head = inspect.cleandoc(cls.__doc__ or "")
    return [f"muon_config.{title}: {cls.__name__}", *textwrap.wrap(head, WIDTH), "", *_fields_text(cls, docs)]


def _overview() -> list[str]:
    from lightning_muon.config import MuonConfig

    lines = ["MuonConfig sections (python -m lightning_muon options NAME for one of them or an algorithm):", ""]
    lines += _fields_text(MuonConfig, field_docs(MuonConfig))
    matrix = [n for n in algorithm_names() if per_matrix(n)]
    scalar = [n for n in algorithm_names() if not per_matrix(n)]
    return [
        *lines,
        "",
        "matrix algorithms: " + ", ".join(matrix),
        "scalar algorithms: " + ", ".join(scalar),
        "sections: state, routing, schedule; Megatron-Core's names: megatron",
    ]


def _megatron() -> list[str]:
    lines = [
        "muon_config.megatron: a Megatron-Core OptimizerConfig block (MuonConfig.from_megatron)",
        "",
        "read (Megatron's default where left out):",
        "  optimizer: 'muon', 'adaptive_muon' or 'soap' (required)",
    ]
    lines += [f"  {name} = {default!r}" for name, default in MEGATRON_DEFAULTS.items()]
    lines += ["", "refused, with what to use instead:"]
    lines += [f"  {name}: {advice}" for name, advice in MEGATRON_REFUSED.items()]
    return lines


def render(name: str | None) -> str:
    """The text ``options NAME`` prints; a ``ValueError`` names the known names for an unknown one."""
    from lightning_muon.routing.settings import RoutingSettings
    from lightning_muon.schedules import ScheduleSettings
    from lightning_muon.state_settings import StateSettings

    sections: dict[str, Callable[[], list[str]]] = {
        "state": lambda: _section(StateSettings, "state"),
        "routing": lambda: _section(RoutingSettings, "routing"),
        "schedule": lambda: _section(ScheduleSettings, "schedule"),
        "megatron": _megatron,
    }
    if name is None:
        lines = _overview()
    elif name in sections:
        lines = sections[name]()
    else:
        try:
            lines = _algorithm(name)
        except ValueError:
            known = [*algorithm_names(), *sections]
            close = difflib.get_close_matches(name, known, n=1)
            raise ValueError(
                f"options: {name!r} is neither an algorithm nor a section; one of {known}"
                + (f"; did you mean {close[0]!r}?" if close else "")
            ) from None
    return "\n".join(lines) + "\n"


def main(argv: list[str], prog: str) -> int:
    """``options [NAME]``: print, and return the exit code (2 for an unknown name)."""
    if argv[:1] in (["-h"], ["--help"]) or len(argv) > 1:
        sys.stdout.write(f"usage: {prog} [NAME]\n\n{inspect.cleandoc(__doc__ or '').splitlines()[0]}\n")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        sys.stdout.write(render(argv[0] if argv else None))
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    return 0
