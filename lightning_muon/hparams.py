"""``OptimizerConfig``: every algorithm's hyperparameters, the non-finite policy and the state dtypes of one ``Muon``.

Each algorithm keeps its typed, frozen hyperparameters in its own module
(``algorithms.muon.MuonHparams``, ``algorithms.adamw.AdamWHparams``, ...), checked when
made. ``OptimizerConfig`` holds one of each built-in, the hyperparameters of any other
registered algorithm (``algorithm_defaults``), the non-finite policy and the dtypes the
state is stored in (``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``main_params_dtype``:
Megatron-Core's names, ``algorithms.state_dtypes``). ``Muon``'s flat keyword arguments
(``lr``, ``adamw_eps``, ``lion_betas``, ...) and ``MuonConfig``'s optimizer fields are read
off these classes, so a default or a rule is written once.

Errors are ``HparamError`` (a ``ValueError``) naming ``Muon``'s keyword (``adamw_eps``,
``lion_betas[0]``, ...), the rule and the value.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_muon.algorithms import (
    AdamWHparams,
    HparamError,
    LionHparams,
    MuonHparams,
    ScheduleFreeHparams,
    algorithm_names,
    get_algorithm,
)
from lightning_muon.algorithms.state_dtypes import (
    STATE_SETTINGS,
    MainParamsDtype,
    StateDtype,
    check_main_params_dtype,
    check_state_dtype,
)
from lightning_muon.step_memory import StepMemory, check_step_memory_mb

__all__ = ["BUILTIN_HPARAMS", "NONFINITE", "NonFinite", "OptimizerConfig", "flat_keyword_fields"]

NONFINITE = ("raise", "skip", "ignore")
NonFinite = Literal["raise", "skip", "ignore"]
# The algorithms the package registers (``lightning_muon.algorithms``) whose hyperparameters
# have a ``prefix``: name -> hyperparameters. Their fields are ``Muon``'s flat keywords and
# ``MuonConfig``'s fields, each ``prefix + field`` (``adamw_eps``, ``soap_shampoo_beta``), in
# registration order; an algorithm registered later (a user's) takes ``algorithm_defaults``.
BUILTIN_HPARAMS: dict[str, type] = {
    name: get_algorithm(name).hparams
    for name in algorithm_names()
    if isinstance(getattr(get_algorithm(name).hparams, "prefix", None), str)
}
# The four with a field of their own in ``OptimizerConfig``; the others live in ``variants``.
_TYPED = {"muon": MuonHparams, "adamw": AdamWHparams, "lion": LionHparams, "adamw_schedulefree": ScheduleFreeHparams}
_SETTINGS: dict[str, Any] = {
    "algorithm_defaults": None,
    "nonfinite": "raise",
    **STATE_SETTINGS,
    "step_memory_mb": "auto",
}


def _flat_names() -> dict[str, tuple[str, str]]:
    """Every flat keyword -> (algorithm, field); two algorithms may not claim one name."""
    out: dict[str, tuple[str, str]] = {}
    for algorithm, part in BUILTIN_HPARAMS.items():
        for f in dataclasses.fields(part):
            key = part.prefix + f.name
            if key in out or key in _SETTINGS:
                raise RuntimeError(f"flat keyword {key!r} of {algorithm!r} is taken by {out.get(key, ('Muon',))[0]!r}")
            out[key] = (algorithm, f.name)
    return out


_FLAT = _flat_names()


def flat_keyword_fields() -> list[tuple[str, Any, Any, str]]:
    """``(keyword, type, default, doc)`` of every flat keyword, in signature order.

    The type is the hparams field's (a string under postponed annotations, resolved here),
    the doc the docstring under the field: ``Muon.__init__``'s signature and ``MuonConfig``'s
    fields are made from these.
    """
    out = []
    for part in BUILTIN_HPARAMS.values():
        hints = typing.get_type_hints(part)
        docs = field_docs(part)
        for f in dataclasses.fields(part):
            out.append((part.prefix + f.name, hints[f.name], f.default, docs.get(f.name, "")))
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source (``{}`` when it has none)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for node, after in zip(body, body[1:]):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        doc = isinstance(text, str)
        if named and doc:
            out[node.target.id] = " ".join(text.split())
    return out


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Everything ``Muon`` takes besides its parameters: one config per algorithm, non-finite policy, state dtypes."""

    muon: MuonHparams = field(default_factory=MuonHparams)
    """Muon groups."""
    adamw: AdamWHparams = field(default_factory=AdamWHparams)
    """AdamW groups."""
    lion: LionHparams = field(default_factory=LionHparams)
    """Lion groups."""
    adamw_schedulefree: ScheduleFreeHparams = field(default_factory=ScheduleFreeHparams)
    """Schedule-Free AdamW groups."""
    variants: Mapping[str, Any] = field(default_factory=dict)
    """The other built-in algorithms with flat keywords (``adaptive_muon``, ``laprop``, ``scion``, ``soap``, ...):
    name -> their hyperparameters; one left out takes its defaults."""
    algorithm_defaults: Mapping[str, Any] = field(default_factory=dict)
    """Group defaults of other registered algorithms, by name: their ``hparams`` (or dicts of its fields)."""
    nonfinite: NonFinite = "raise"
    """On a NaN/inf gradient: "raise", "skip" the step, or "ignore" (no check, no host-device sync)."""
    exp_avg_dtype: StateDtype = "float32"
    """Megatron's name: the dtype first moments are stored in (Muon's momentum, AdamW's and Lion's
    ``exp_avg``), "float32" or "bfloat16"; computed in float32 (``algorithms.state_dtypes``)."""
    exp_avg_sq_dtype: StateDtype = "float32"
    """Megatron's name: the dtype second moments are stored in (AdamW's ``exp_avg_sq``, NorMuon's and
    AdaMuon's ``second_moment``), "float32" or "bfloat16"; computed in float32."""
    main_params_dtype: MainParamsDtype = None
    """Megatron's name: None (the parameters are the master copy) or "float32": bf16 and fp16 parameters
    step on an fp32 copy kept in the optimizer state, written back rounded."""
    step_memory_mb: StepMemory = "auto"
    """The most MiB of temporaries one Muon group's step holds at once (updates, Newton-Schulz stacks and
    workspace, the owners' exchange): "auto" (32 on a CPU, 1024 on a GPU), a number, or None (no cap)."""

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE:
            raise HparamError(f"nonfinite must be one of {NONFINITE}, got {self.nonfinite!r}", "nonfinite")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            object.__setattr__(self, name, check_state_dtype(getattr(self, name), name))
        object.__setattr__(self, "main_params_dtype", check_main_params_dtype(self.main_params_dtype))
        object.__setattr__(self, "step_memory_mb", check_step_memory_mb(self.step_memory_mb))
        object.__setattr__(self, "algorithm_defaults", _registered_hparams(self.algorithm_defaults))
        object.__setattr__(self, "variants", _variant_hparams(self.variants))

    @staticmethod
    def keywords() -> dict[str, Any]:
        """``Muon``'s keyword arguments (besides ``params``) and their defaults, in signature order."""
        out = {keyword: default for keyword, _, default, _ in flat_keyword_fields()}
        out.update(_SETTINGS)
        return out

    @classmethod
    def from_keywords(cls, **kwargs: Any) -> OptimizerConfig:
        """From ``Muon``'s flat keywords (``lr``, ``adamw_eps``, ...); missing ones keep their default."""
        unknown = set(kwargs) - set(_FLAT) - set(_SETTINGS)
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        parts: dict[str, Any] = {}
        for algorithm, part in BUILTIN_HPARAMS.items():
            names = {f.name for f in dataclasses.fields(part)}
            parts[algorithm] = part(**{n: kwargs[part.prefix + n] for n in names if part.prefix + n in kwargs})
        return cls(
            **{name: parts.pop(name) for name in _TYPED},
            variants=parts,
            algorithm_defaults=kwargs.get("algorithm_defaults") or {},
            nonfinite=kwargs.get("nonfinite", "raise"),
            **{name: kwargs.get(name, default) for name, default in STATE_SETTINGS.items()},
            step_memory_mb=kwargs.get("step_memory_mb", "auto"),
        )

    def to_keywords(self) -> dict[str, Any]:
        """``Muon``'s flat keywords for this config (the inverse of ``from_keywords``)."""
        out: dict[str, Any] = {}
        for algorithm, part in BUILTIN_HPARAMS.items():
            values = self.hparams_of(algorithm)
            out.update({part.prefix + f.name: getattr(values, f.name) for f in dataclasses.fields(part)})
        out["algorithm_defaults"] = {n: dataclasses.asdict(h) for n, h in self.algorithm_defaults.items()} or None
        out["nonfinite"] = self.nonfinite
        out.update({name: getattr(self, name) for name in STATE_SETTINGS})
        out["step_memory_mb"] = self.step_memory_mb
        return out

    def non_default_state_settings(self) -> dict[str, Any]:
        """The state-dtype settings away from their defaults (``exp_avg_dtype``, ...): name -> value."""
        return {name: getattr(self, name) for name, default in STATE_SETTINGS.items() if getattr(self, name) != default}

    def hparams_of(self, algorithm: str) -> Any:
        """The hyperparameters new groups of ``algorithm`` start from (its ``hparams`` defaults if not set here)."""
        if algorithm in _TYPED:
            return getattr(self, algorithm)
        values = (
            self.variants.get(algorithm) if algorithm in BUILTIN_HPARAMS else self.algorithm_defaults.get(algorithm)
        )
        return values if values is not None else get_algorithm(algorithm).make_hparams({})

    def group_defaults(self, algorithm: str) -> dict[str, Any]:
        """The hyperparameters a new param group of ``algorithm`` starts from (Lion and Schedule-Free resolved)."""
        return get_algorithm(algorithm).group_defaults(self)


def _registered_hparams(values: Mapping[str, Any]) -> dict[str, Any]:
    """``algorithm_defaults`` as hparams instances, each checked by its algorithm."""
    if not isinstance(values, Mapping):
        raise HparamError(
            f"algorithm_defaults must be a dict of algorithm name -> hyperparameters, got {values!r}",
            "algorithm_defaults",
        )
    out = {}
    for name, given in values.items():
        where = f"Muon(): algorithm_defaults[{name!r}]"
        try:
            algorithm = get_algorithm(name)
        except ValueError as err:
            raise HparamError(f"{where}: {err}", "algorithm_defaults") from None
        if name in BUILTIN_HPARAMS:
            part = BUILTIN_HPARAMS[name]
            first = part.prefix + dataclasses.fields(part)[0].name
            raise HparamError(
                f"{where}: {name!r} takes its defaults from Muon's own keywords ({first}, ...), not from here",
                "algorithm_defaults",
            )
        if isinstance(given, algorithm.hparams):
            out[algorithm.name] = given  # an import path stored under the registered name
        elif isinstance(given, Mapping):
            try:
                out[algorithm.name] = algorithm.make_hparams(dict(given), where)
            except HparamError as err:
                raise HparamError(str(err), "algorithm_defaults") from None
        else:
            raise HparamError(f"{where} must be a dict of hyperparameters, got {given!r}", "algorithm_defaults")
    return out


def _variant_hparams(values: Mapping[str, Any]) -> dict[str, Any]:
    """``variants`` as hparams instances of built-in algorithms with flat keywords (a dict of fields made into one)."""
    out = {}
    for name, given in dict(values).items():
        if name not in BUILTIN_HPARAMS or name in _TYPED:
            raise HparamError(
                f"OptimizerConfig.variants: {name!r} is not one of {sorted(set(BUILTIN_HPARAMS) - set(_TYPED))}",
                "variants",
            )
        out[name] = given if isinstance(given, BUILTIN_HPARAMS[name]) else get_algorithm(name).make_hparams(given)
    return out
