"""``Settings``: an algorithm's typed, documented, checked group defaults, each field written once.

Every algorithm's settings are a frozen dataclass deriving from ``Settings``, one field per
knob with its docstring under it. What a knob may hold is read off the field: a ``Literal``
type gives its choices, ``bool`` a bool, and ``setting(default, low=..., high=...)`` a finite
number in a range (``integer=True``: an int). ``__post_init__`` checks every field from that, so a
check is never written by hand for a plain knob; a class adds ``normalize`` for what is more
(a schedule, a pair of betas). A variant derives from its family's base and declares only its
own fields, changing a shared field's default with ``defaults={...}`` in its class statement
(the field, its type, its check and its docstring stay the base's):

    @dataclass(frozen=True, kw_only=True)
    class ScionSettings(NewtonSchulzSettings, algorithm="scion", defaults={"lr": 3e-4}):
        spectral_radius: float = setting(1.0, low=0.0, low_open=True)
        \"\"\"The radius of the spectral-norm ball the update steps to.\"\"\"

Each class's docstring gets an ``Args:`` section made from its fields' docstrings (its own and
its bases'), which the command line's help and ``python -m lightning_muon options`` print.

``Settings`` itself is a plain class, not a dataclass: jsonargparse then takes a field typed
with a family's base (``MuonConfig.matrix: MatrixSettings``) as a choice of subclass
(``class_path: ScionSettings`` and its ``init_args``), which is how a config holds only the
chosen algorithm's settings.

Errors are ``HparamError`` (a ``ValueError``) naming the field as the user wrote it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import numbers
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import torch

from lightning_muon.algorithms.checks import HparamError

__all__ = ["Settings", "choices_of", "field_docs", "setting"]


def setting(
    default: Any,
    *,
    low: float | None = None,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    convert: Callable[[Any], Any] | None = None,
    tensor: bool = False,
) -> Any:
    """A field's default, the range its value must lie in (checked by ``Settings.__post_init__``; none
    without ``low``), and ``convert``, applied to a value before it is checked (a ``torch.dtype`` to its name).

    ``tensor=True`` also admits a 1-element floating ``Tensor`` in the range, kept as given (an lr:
    torch.optim's LR schedulers ``fill_`` a Tensor lr in place, and the steps read it as a number).
    """
    bounds = None
    if low is not None or high != math.inf or integer:
        bounds = {"low": low, "high": high, "low_open": low_open, "high_open": high_open, "int": integer}
    return dataclasses.field(default=default, metadata={"bounds": bounds, "convert": convert, "tensor": tensor})


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field the class itself declares, read from its source (``{}`` without one)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for node, after in zip(body, body[1:]):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if named and isinstance(text, str) and "ClassVar" not in ast.unparse(node.annotation):
            out[node.target.id] = " ".join(text.split())
    return out


def _literal(hint: Any) -> tuple | None:
    """The values a ``Literal`` (or an optional one) admits, None included; None when ``hint`` is not one."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        literals = [a for a in args if typing.get_origin(a) is Literal]
        if len(literals) == 1 and all(a is type(None) or a is literals[0] for a in args):
            return (*typing.get_args(literals[0]), *((None,) if type(None) in args else ()))
    return None


def choices_of(cls: type, name: str) -> tuple:
    """The values field ``name`` of ``cls`` admits, from its ``Literal`` type (``()`` when it is not one)."""
    return _literal(typing.get_type_hints(cls)[name]) or ()


class Settings:
    """The group defaults of one algorithm (module docstring). Subclasses are frozen, keyword-only dataclasses.

    Class statement keywords: ``algorithm``, the registered name these settings are for
    (set on the classes a config may name), ``defaults``, new defaults of inherited fields, and
    ``fixed``, inherited fields the algorithm sets itself: they keep that value, are no
    argument of the class (a config switching to it drops them, as jsonargparse drops any
    argument the new class lacks), and are not ``field_names`` a user may set.
    """

    algorithm: ClassVar[str] = ""
    """The registered algorithm these settings are for (empty on a family's base)."""
    choices: ClassVar[Mapping[str, tuple]] = {}
    """Per field, the values this class admits where it narrows its base's ``Literal`` (MOP's adjust_lr)."""

    def __init_subclass__(
        cls,
        *,
        algorithm: str | None = None,
        defaults: Mapping[str, Any] | None = None,
        fixed: Mapping[str, Any] | None = None,
        **kw,
    ):
        super().__init_subclass__(**kw)
        if algorithm is not None:
            cls.algorithm = algorithm
        for keyword, changes in (("defaults", defaults), ("fixed", fixed)):
            for name, value in (changes or {}).items():
                base = next((b for b in cls.__mro__[1:] if name in getattr(b, "__dataclass_fields__", {})), None)
                if base is None:
                    raise TypeError(f"{cls.__name__}: {keyword} names {name!r}, which no base declares")
                inherited = base.__dataclass_fields__[name]
                # The base's type, evaluated where the base was written (a string here would be read in this module).
                cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}), name: _hints(base)[name]}
                field = dataclasses.field(default=value, init=keyword != "fixed", metadata=inherited.metadata)
                setattr(cls, name, field)
        own = cls.__dict__.get("__annotations__", {})
        if own:  # evaluated now, where the class is written: jsonargparse and IDEs read real types off __init__
            hints = typing.get_type_hints(cls, include_extras=True)
            cls.__annotations__ = {name: hints[name] for name in own}
        docs: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            if klass is not object and issubclass(klass, Settings):
                docs.update(field_docs(klass))
        head = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
        args = "\n".join(f"    {name}: {doc}" for name, doc in docs.items())
        cls.__doc__ = f"{head}\n\nArgs:\n{args}" if args else head

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, self._checked(f, getattr(self, f.name)))
        self.normalize()

    def normalize(self) -> None:
        """What a field's type and bounds cannot say (a class overrides it; ``_set`` stores a normalized value)."""

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _checked(self, f: dataclasses.Field, value: Any) -> Any:
        hints = _hints(type(self))
        name, hint = f.name, hints[f.name]
        convert = f.metadata.get("convert")
        if convert is not None:
            value = convert(value)
        allowed = self.choices.get(name) or _literal(hint)
        if allowed is not None:
            if not any(value is c or (isinstance(value, str) and value == c) for c in allowed):
                raise self.error(name, f"must be one of {allowed}, got {value!r}")
            return value
        if hint is bool:
            if not isinstance(value, bool):
                raise self.error(name, f"must be a bool, got {value!r}")
            return value
        bounds = f.metadata.get("bounds")
        if f.metadata.get("tensor") and isinstance(value, torch.Tensor):
            return self._tensor_in_bounds(name, value, bounds)
        if bounds is not None and not (value is None and _optional(hint)):
            return self._in_bounds(name, value, bounds)
        return value

    def _tensor_in_bounds(self, name: str, value: torch.Tensor, bounds: dict[str, Any] | None) -> torch.Tensor:
        if value.numel() != 1 or not value.is_floating_point():
            raise self.error(
                name,
                f"must be a number or a 1-element floating Tensor, got a Tensor of shape {tuple(value.shape)} "
                f"and dtype {value.dtype}",
            )
        if bounds is not None:
            self._in_bounds(name, value.item(), bounds)
        return value  # the Tensor itself: a scheduler that fills it moves this setting

    def _in_bounds(self, name: str, value: Any, bounds: dict[str, Any]) -> Any:
        if bounds["int"]:
            low = bounds["low"] if bounds["low"] is not None else -math.inf
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                what = "a positive int" if low == 1 else f"an int >= {low}"
                raise self.error(name, f"must be {what}, got {value!r}")
            return int(value)
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        low, high = bounds["low"] if bounds["low"] is not None else -math.inf, bounds["high"]
        if ok:
            ok = (value > low if bounds["low_open"] else value >= low) and (
                value < high if bounds["high_open"] else value <= high
            )
        if not ok:
            lo = "(" if bounds["low_open"] else "["
            hi = ")" if bounds["high_open"] or high == math.inf else "]"
            raise self.error(name, f"must be a finite number in {lo}{low}, {high}{hi}, got {value!r}")
        return value

    @classmethod
    def error(cls, name: str, detail: str) -> HparamError:
        """The error of field ``name``: ``"<Class>.<name> <detail>"``, naming the field (``HparamError.field``)."""
        return HparamError(f"{cls.__name__}.{name} {detail}", name, f"{name} {detail}")

    # ------------------------------------------------------------------ views

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields a user sets, in declaration order (a base's first); not the ``fixed`` ones."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def arguments(self) -> dict[str, Any]:
        """The fields a user sets (``field_names``) as a dict: what makes these settings again (YAML's init_args)."""
        return {name: getattr(self, name) for name in self.field_names()}

    def asdict(self) -> dict[str, Any]:
        """Every field as a dict, ``fixed`` ones included (the keys a param group of the algorithm stores)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``, checked."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Every field's docstring, a base's included."""
        out: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            if klass is not object and issubclass(klass, Settings):
                out.update(field_docs(klass))
        return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
