"""Other projects' names for our settings, in one table, applied wherever settings are read.

Our settings have one name each (``algorithms.families``). Three projects spell some of them
otherwise, and their users' configs load here as written:

- NVIDIA Emerging-Optimizers 0.3.0's constructor keywords: ``num_ns_steps``,
  ``coefficient_type``, ``scale_mode`` (any Newton-Schulz algorithm), and ``AdaptiveMuon``'s
  ``moment2_method``, ``beta2``, ``eps``;
- ``torch.optim.Muon``'s keywords ``adjust_lr_fn`` and ``eps`` (``ns_eps``; on ``"muon"`` settings only, so
  that AdamW's own ``eps`` and AdaptiveMuon's alias of that name keep their meanings);
- Megatron-Core's ``OptimizerConfig`` names (``optimizer``, ``muon_momentum``, ...) are not aliases: a
  Megatron optimizer block is translated whole, at the config's edge (``megatron``), since one of
  its names may set several of ours (``lr`` is every group's) and its defaults are Megatron's.

The aliases apply where settings come in, once: a settings dict (``settings_from``), a param group
(``Muon.add_param_group``, ``canonical_with_aliases``) or a routing rule's options. An alias is
renamed to its field, its value converted (``coefficient_type`` names a schedule over
``num_ns_steps`` steps), and an alias given beside its field with another value is an error
naming both. Errors name the alias as the user wrote it (``named_as_written``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.families import NewtonSchulzSettings, OrthogonalizedSettings
from lightning_muon.algorithms.settings import Settings
from lightning_muon.newton_schulz import COEFFICIENTS

__all__ = [
    "ALIASES",
    "EO_COEFFICIENT_TYPES",
    "MEGATRON_COEFFICIENTS",
    "SCALE_MODES",
    "Alias",
    "aliases_of",
    "canonical",
    "canonical_with_aliases",
    "build_settings",
    "eo_schedule",
    "named_as_written",
    "settings_from",
]

# Emerging-Optimizers' ``coefficient_type`` names (Megatron-Core's ``muon_coefficient_type``) and
# their schedules here. Emerging-Optimizers cycles "quintic" and "aol" when there are more
# steps than tuples (``eo_schedule``); the others repeat their last tuple, as ours do.
MEGATRON_COEFFICIENTS: dict[str, str | list[tuple[float, float, float]]] = {
    "simple": "keller",  # (3.4445, -4.7750, 2.0315) at every step
    "quintic": "you",  # Megatron's default, You Jiacheng's 5-step tuning
    # The paper's 8 tuples with the 1.01 safety folded in (Megatron rounds them to 4 digits),
    # pre-scaled by ||X||_F; our "polar_express_paper" is the same list at full precision,
    # pre-scaled by 1.01 ||X||_F. Megatron requires num_ns_steps >= 8.
    "polar_express": "polar_express_megatron",
    "cans": "cans",  # Grishina et al., arXiv 2506.10935
    "deepseekv4": "deepseekv4",  # 10 steps: Keller's quintic 8 times, then (2, -1.5, 0.5) twice
    # Megatron's "aol" list, from thib-s/flash-newton-schulz (Boissin et al.), 4 tuples.
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
EO_COEFFICIENT_TYPES = tuple(MEGATRON_COEFFICIENTS)
# Megatron-Core's and Emerging-Optimizers' ``scale_mode`` names, by our ``adjust_lr``.
# MOP's "nuclear_norm" is ours too (``MOPSettings``).
SCALE_MODES = {
    "shape_scaling": "original",
    "spectral": "spectral",
    "unit_rms_norm": "spectral_norm",
    "nuclear_norm": "nuclear_norm",
}
# torch.optim.Muon's ``adjust_lr_fn`` (None: its default, "original").
TORCH_ADJUST_LR = {None: "original", "original": "original", "match_rms_adamw": "match_rms_adamw"}


def eo_schedule(coefficient_type: str, num_ns_steps: int) -> str | list[tuple[float, float, float]]:
    """Our Newton-Schulz schedule for Emerging-Optimizers' ``coefficient_type`` over ``num_ns_steps`` steps."""
    schedule = MEGATRON_COEFFICIENTS[coefficient_type]
    if coefficient_type in ("quintic", "aol"):
        cycle = list(COEFFICIENTS[schedule]) if isinstance(schedule, str) else list(schedule)
        if num_ns_steps > len(cycle):
            return [tuple(cycle[i % len(cycle)]) for i in range(num_ns_steps)]
    return schedule


@dataclass(frozen=True)
class Alias:
    """Another project's ``name`` for our ``field`` of the settings of ``scope`` (a family's base or an algorithm)."""

    name: str
    field: str
    scope: type[Settings] | str
    source: str
    """Whose name it is, possessive ("Emerging-Optimizers'")."""
    convert: Callable[[Any, Mapping[str, Any], type[Settings]], Any] | None = None
    """``(value, the other values given, the settings class) -> our value``; raises ``ValueError`` naming
    what it accepts. None: the value as given."""

    def applies_to(self, cls: type[Settings]) -> bool:
        return cls.algorithm == self.scope if isinstance(self.scope, str) else issubclass(cls, self.scope)


def _choice(table: Mapping[Any, Any]) -> Callable[[Any, Mapping[str, Any], type], Any]:
    def convert(value: Any, values: Mapping[str, Any], cls: type) -> Any:
        if value not in table:
            raise ValueError(f"must be one of {tuple(table)}, got {value!r}")
        return table[value]

    return convert


def _schedule(value: Any, values: Mapping[str, Any], cls: type) -> Any:
    if value == "custom":  # the coefficients are given beside it
        given = values.get("ns_coefficients")
        if given is None or isinstance(given, str):
            raise ValueError("'custom' needs ns_coefficients as a list of (a, b, c), one per step")
        return given
    if value not in MEGATRON_COEFFICIENTS:
        raise ValueError(f"must be one of {(*EO_COEFFICIENT_TYPES, 'custom')}, got {value!r}")
    steps = values.get("ns_steps", values.get("num_ns_steps", cls.__dataclass_fields__["ns_steps"].default))
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return MEGATRON_COEFFICIENTS[value]  # a bad ns_steps is refused by its own check
    return eo_schedule(value, steps)


_EO, _TORCH = "Emerging-Optimizers'", "torch.optim.Muon's"
ALIASES: tuple[Alias, ...] = (
    Alias("num_ns_steps", "ns_steps", NewtonSchulzSettings, _EO),
    Alias("coefficient_type", "ns_coefficients", NewtonSchulzSettings, _EO, _schedule),
    Alias("scale_mode", "adjust_lr", OrthogonalizedSettings, _EO, _choice(SCALE_MODES)),
    Alias("moment2_method", "second_moment", "adaptive_muon", _EO),
    Alias("beta2", "second_moment_beta2", "adaptive_muon", _EO),
    Alias("eps", "second_moment_eps", "adaptive_muon", _EO),
    Alias("adjust_lr_fn", "adjust_lr", "muon", _TORCH, _choice(TORCH_ADJUST_LR)),
    Alias("eps", "ns_eps", "muon", _TORCH),
)


def aliases_of(cls: type[Settings]) -> dict[str, Alias]:
    """The aliases that apply to ``cls``'s fields, by name."""
    return {a.name: a for a in ALIASES if a.applies_to(cls) and a.field in cls.__dataclass_fields__}


def canonical(cls: type[Settings], values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` with every alias of ``cls`` renamed to its field and converted; other keys as given.

    Raises ``HparamError`` (naming the alias as written) for a value the alias's source does not
    accept, or for an alias and its field both given with different values.
    """
    return _canonical(cls, values, where)[0]


def canonical_with_aliases(
    cls: type[Settings], values: Mapping[str, Any], where: str
) -> tuple[dict[str, Any], dict[str, Alias]]:
    """``canonical``, and the aliases used, by the field each set (``named_as_written`` reads them)."""
    return _canonical(cls, values, where)


def named_as_written(err: HparamError, used: Mapping[str, Alias], where: str) -> HparamError:
    """``err`` about a field that an alias set, told about the alias instead (itself otherwise)."""
    alias = used.get(err.field)
    if alias is None:
        return err
    return _alias_error(where, alias, err.detail.removeprefix(f"{err.field} "))


def _canonical(cls: type[Settings], values: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Alias]]:
    """``canonical``, and the aliases used, by the field each set."""
    table = aliases_of(cls)
    used = {name: alias for name, alias in table.items() if name in values}
    if not used:
        return dict(values), {}
    out = {k: v for k, v in values.items() if k not in table}
    for name, alias in used.items():
        value = values[name]
        if alias.convert is not None:
            try:
                value = alias.convert(value, values, cls)
            except ValueError as err:
                raise _alias_error(where, alias, str(err)) from None
        if alias.field in out and not _same(out[alias.field], value):
            raise HparamError(
                f"{where}: {name}={values[name]!r} ({alias.source} name for {alias.field}) and "
                f"{alias.field}={out[alias.field]!r} disagree; set one of them",
                name,
            )
        out[alias.field] = value
    return out, {alias.field: alias for alias in used.values()}


def _alias_error(where: str, alias: Alias, what: str) -> HparamError:
    detail = f"{alias.name} ({alias.source} name for {alias.field}) {what}"
    return HparamError(f"{where}: {detail}", alias.name, detail)


def settings_from(cls: type[Settings], values: Mapping[str, Any], where: str) -> Settings:
    """``cls`` made from ``values``, its aliases renamed (``canonical``) and its values checked (``build_settings``); a
    bad value names the key as written (an alias by its own name)."""
    values, used = _canonical(cls, values, where)
    try:
        return build_settings(cls, values, where)
    except HparamError as err:
        if err.field in used:
            raise named_as_written(err, used, where) from None
        raise


def build_settings(cls: type[Settings], values: Mapping[str, Any], where: str) -> Settings:
    """``cls`` made from ``values`` that use our names (no alias is read here); an unknown key is refused naming the
    valid ones, a fixed field may only hold its own value, and an error starts with ``where``."""
    values = dict(values)
    fields = cls.field_names()
    for f in dataclasses.fields(cls):
        if not f.init and f.name in values:  # fixed by the algorithm: its own value passes, no other
            value = values.pop(f.name)
            if value != f.default:
                raise HparamError(
                    f"{where}: {f.name} is fixed at {f.default!r} by {cls.algorithm or cls.__name__!r}, got {value!r}",
                    f.name,
                )
    unknown = sorted(set(values) - set(fields))
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*fields, *aliases_of(cls)], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise HparamError(
            f"{where}: {unknown} are not settings of {cls.algorithm or cls.__name__!r}{hint} (valid: "
            f"{sorted(fields)}; other projects' names: {sorted(aliases_of(cls))})",
            unknown[0],
        )
    try:
        return cls(**values)
    except HparamError as err:
        raise HparamError(f"{where}: {err.detail}", err.field, err.detail) from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=0, abs_tol=0) or a == b
    return a == b
