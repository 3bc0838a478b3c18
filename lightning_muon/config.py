"""``MuonConfig``: the optimizer, its routing and its schedules, in sections that hold only what was chosen.

In YAML (a LightningCLI config's ``model.init_args.muon_config``)::

    matrix:                          # the hidden matrices' algorithm and its settings
      class_path: MuonSettings       # or AdaptiveMuonSettings, ScionSettings, SOAPSettings, ...
      init_args: {lr: 0.02, weight_decay: 0.1}
    scalar:                          # embeddings, head, vectors
      class_path: AdamWSettings      # or LionSettings, LaPropSettings, ScheduleFreeSettings
      init_args: {lr: 0.003}
    state: {exp_avg_dtype: bfloat16}
    routing: {split_qkv: true, qkv_split_shapes: [64, 16, 16]}
    schedule: {falloff: cosine, warmup: 100, momentum_warmup: {start: 0.85, steps: 300}}

A settings section is its class (``class_path``) and fields (``init_args``); other projects' names
for the fields are read there too (``aliases``: ``num_ns_steps``, ``moment2_method``, ...). A
section left out takes its defaults (Muon and AdamW). ``others`` holds the settings of any
further algorithm a routing rule names; per-group overrides are a rule's ``options``. A
Megatron-Core optimizer block loads under ``megatron`` (or ``MuonConfig.from_megatron``), its
names mapped onto the sections by one table (``aliases``). ``python -m lightning_muon options
ALGORITHM`` lists an algorithm's settings with their docs.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from torch import nn

from lightning_muon.algorithms import (
    SCHEDULE_FREE,
    AdamWSettings,
    HparamError,
    MatrixSettings,
    MuonSettings,
    ScalarSettings,
    Settings,
    get_algorithm,
    per_matrix,
)
from lightning_muon.algorithms.adamw_schedulefree import schedulefree
from lightning_muon.algorithms.base import settings_by_algorithm
from lightning_muon.megatron import megatron_sections
from lightning_muon.muon import Muon
from lightning_muon.routing.added_groups import ModuleRouter
from lightning_muon.routing.rules import ParamGroups
from lightning_muon.routing.settings import RoutingSettings
from lightning_muon.schedules import LRSchedule, MomentumWarmup, MuonScheduler, ScheduleSettings
from lightning_muon.state_settings import StateSettings

__all__ = ["MuonConfig"]

SECTIONS = ("matrix", "scalar", "others", "state", "routing", "schedule")
# A settings section given by its fields alone (no class_path) is for these.
_DEFAULT_CLASS: dict[str, type] = {"matrix": MuonSettings, "scalar": AdamWSettings}


@dataclass(kw_only=True)
class MuonConfig:
    """The hybrid optimizer, its routing and its schedules (module docstring). Every section is checked when
    made; an error names the section and the field as written."""

    matrix: MatrixSettings | dict[str, Any] = field(default_factory=lambda: _spec(MuonSettings))
    """The hidden matrices' algorithm, by its settings' class, and those settings: MuonSettings (default),
    AdaptiveMuonSettings, MuonHyperballSettings, ScionSettings, PolarGradSettings, MOPSettings, SpelSettings,
    SinkhornMuonSettings, SOAPSettings, REKLSSettings, or a registered algorithm's."""
    scalar: ScalarSettings | dict[str, Any] = field(default_factory=lambda: _spec(AdamWSettings))
    """The algorithm of embeddings, the head and vectors, by its settings' class: AdamWSettings (default),
    LionSettings, LaPropSettings, ScheduleFreeSettings, or a registered algorithm's."""
    others: list[Settings | dict[str, Any]] = field(default_factory=list)
    """Settings of further algorithms that routing rules name (one per algorithm)."""
    state: StateSettings = field(default_factory=StateSettings)
    """The non-finite gradient policy, the state's dtypes and the step's memory cap."""
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    """Routing rules and the default rules' knobs."""
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    """The lr schedule (warmup, stable, falloff) and the Muon momentum warmup."""
    megatron: dict[str, Any] | None = None
    """A Megatron-Core OptimizerConfig block (optimizer, lr, min_lr, weight_decay, adam_*, muon_*, lion_*, soap_*,
    adaptive_muon_*, precision-aware dtypes), mapped onto the sections above."""

    def __post_init__(self) -> None:
        self.matrix = _section(self, "matrix", MatrixSettings)
        self.scalar = _section(self, "scalar", ScalarSettings)
        self.others = [_section(self, f"others[{i}]", Settings, s) for i, s in enumerate(self.others)]
        self.state = _plain_section(self.state, StateSettings, "state")
        self.routing = _plain_section(self.routing, RoutingSettings, "routing")
        self.schedule = _schedule(self.schedule)
        if not per_matrix(self.matrix.algorithm):
            raise HparamError(
                f"MuonConfig.matrix: {type(self.matrix).__name__} is for {self.matrix.algorithm!r}, which does not "
                "step whole matrices; the matrix section takes a matrix algorithm's settings",
                "matrix",
            )
        if per_matrix(self.scalar.algorithm):
            raise HparamError(
                f"MuonConfig.scalar: {type(self.scalar).__name__} is for {self.scalar.algorithm!r}, a matrix "
                "algorithm; the scalar section takes AdamWSettings, LionSettings, LaPropSettings, ...",
                "scalar",
            )
        if self.megatron is not None:
            self._take_megatron(self.megatron)
        settings_by_algorithm([self.matrix, self.scalar, *self.others], "MuonConfig.others")
        if self.uses_schedule_free:
            schedulefree()  # the optional extra: fail here, naming the install, not at fit time
            warmup = self.settings_of(SCHEDULE_FREE).warmup_steps
            if warmup and self.schedule.warmup:
                raise HparamError(
                    f"MuonConfig: schedule.warmup={self.schedule.warmup!r} and ScheduleFreeSettings.warmup_steps="
                    f"{warmup!r} would warm the schedule-free groups up twice (the scheduler's warmup applies to "
                    "them too); set one of them to 0",
                    "warmup_steps",
                )

    @classmethod
    def from_megatron(cls, block: Mapping[str, Any] | Any, **sections: Any) -> MuonConfig:
        """The config a Megatron-Core ``OptimizerConfig`` block makes (a mapping of its names, or an object with
        them as attributes), with ``sections`` (``routing=``, ``schedule=``) beside it."""
        if not isinstance(block, Mapping):
            block = {k: v for k, v in vars(block).items() if not k.startswith("_")}
        return cls(megatron=dict(block), **sections)

    def _take_megatron(self, block: Mapping[str, Any]) -> None:
        """The sections from a Megatron block; a section also set here to other values raises naming both."""
        mapped = megatron_sections(block, lambda name: get_algorithm(name).settings, StateSettings)
        for name in ("matrix", "scalar", "state"):
            mine, theirs = getattr(self, name), mapped[name]
            default = {**_DEFAULT_CLASS, "state": StateSettings}[name]()
            if mine != default and mine != theirs:
                clash = [f for f in _fields(mine) if getattr(mine, f) != getattr(default, f)] or ["class_path"]
                raise HparamError(
                    f"MuonConfig: megatron and {name} both set the {name} section ({name}.{clash[0]}="
                    f"{getattr(mine, clash[0], type(mine).__name__)!r}); set it in one of them",
                    clash[0],
                )
            setattr(self, name, theirs)
        if self.routing.split_qkv != mapped["split_qkv"] and self.routing.split_qkv:
            raise HparamError(
                "MuonConfig: megatron's muon_split_qkv=False and routing.split_qkv=True disagree; set one", "split_qkv"
            )
        self.routing = dataclasses.replace(self.routing, split_qkv=mapped["split_qkv"])
        if "min_lr_ratio" in mapped:
            if self.schedule.min_lr_ratio not in (0.0, mapped["min_lr_ratio"]):
                raise HparamError(
                    f"MuonConfig: megatron's min_lr and schedule.min_lr_ratio={self.schedule.min_lr_ratio!r} "
                    "disagree; set one",
                    "min_lr",
                )
            self.schedule = dataclasses.replace(self.schedule, min_lr_ratio=mapped["min_lr_ratio"])
        self.megatron = None  # mapped: the sections say it all now (and save it so)

    # ------------------------------------------------------------------ views

    def settings_of(self, algorithm: str) -> Settings:
        """The settings groups of ``algorithm`` start from (its defaults where no section names it)."""
        name = get_algorithm(algorithm).name
        given = settings_by_algorithm([self.matrix, self.scalar, *self.others]).get(name)
        return given if given is not None else get_algorithm(name).settings()

    def make_optimizer(self, params: Iterable[Any]) -> Muon:
        """A ``Muon`` over ``params`` (tensors, named tensors or param groups) with these settings: the sections'
        objects themselves, and the state section's fields as its keywords."""
        return Muon(params, settings=[self.matrix, self.scalar, *self.others], **dataclasses.asdict(self.state))

    def route(self, module: nn.Module) -> ParamGroups:
        """``module``'s trainable parameters in named param groups: the routing section's rules, with the matrix and
        scalar sections' algorithms for the default rules (``RoutingSettings.route``)."""
        return self.routing.route(module, self.matrix.algorithm, self.scalar.algorithm)

    def router(self, module: nn.Module) -> ModuleRouter:
        """Routes groups added to the optimizer later (``BackboneFinetuning``) by the same rules over ``module``."""
        return ModuleRouter(module, self.routing, self.matrix.algorithm, self.scalar.algorithm)

    @property
    def uses_schedule_free(self) -> bool:
        """True when the routing can send parameters to ``"adamw_schedulefree"`` groups."""
        named = [self.scalar.algorithm, *(r.algorithm for r in self.routing.rules)]
        return any(get_algorithm(n).name == SCHEDULE_FREE for n in named)

    def build(self, module: nn.Module, total_steps: int | None = None) -> tuple[Muon, MuonScheduler]:
        """The hybrid ``Muon`` over ``module``'s routed parameters and its ``MuonScheduler``.

        ``total_steps`` is the run's length where the schedule needs one and the config
        does not set it (``configure_muon_optimizers`` takes the trainer's estimate).
        """
        optimizer = self.make_optimizer(self.route(module))
        optimizer.attach_router(self.router(module))  # groups added later are routed alike
        total = self.schedule.total_steps if total_steps is None else total_steps
        return optimizer, MuonScheduler(optimizer, self.schedule.build(total), self.schedule.momentum_warmup)

    def lr_schedule(self, total_steps: int | None) -> LRSchedule:
        """The resolved lr schedule for ``total_steps`` optimizer steps (``schedule.build``)."""
        return self.schedule.build(total_steps)

    def momentum_warmup(self) -> MomentumWarmup:
        """The Muon momentum warmup."""
        return self.schedule.momentum_warmup

    def with_lr(self, lr: float) -> MuonConfig:
        """A copy whose matrix lr is ``lr`` and whose every other lr moves by the same factor, ``lr / matrix.lr``.

        The scalar and ``others`` sections' lrs, the rules' ``lr`` options and the default lr of
        an algorithm a rule names keep their ratio to the matrix lr: this is how the lr finder's
        suggestion, a matrix lr, becomes a config (``MuonModuleMixin.lr``).

        Raises:
            ValueError: the matrix lr is 0 (no ratio to keep), or ``lr`` is not a valid lr.
        """
        if self.matrix.lr == 0:
            raise ValueError("MuonConfig.with_lr: the matrix lr is 0, so the other lrs have no ratio to it to keep")
        factor = lr / self.matrix.lr

        def scaled(settings: Settings) -> Settings:
            value = getattr(settings, "lr", None)
            return settings if value is None else settings.replace(lr=value * factor)

        rules = [
            dataclasses.replace(r, options={**r.options, "lr": r.options["lr"] * factor}) if "lr" in r.options else r
            for r in self.routing.rules
        ]
        # An algorithm a rule names that no section holds steps at its defaults: they move too.
        held = {s.algorithm for s in (self.matrix, self.scalar, *self.others)}
        named = dict.fromkeys(get_algorithm(r.algorithm).name for r in self.routing.rules)
        defaults = [get_algorithm(n).settings() for n in named if n not in held]
        return dataclasses.replace(
            self,
            matrix=self.matrix.replace(lr=lr),
            scalar=scaled(self.scalar),
            others=[scaled(s) for s in (*self.others, *defaults) if s in self.others or s != scaled(s)],
            routing=dataclasses.replace(self.routing, rules=rules),
        )

    # ------------------------------------------------------------------ plain forms

    @classmethod
    def from_any(cls, value: MuonConfig | Mapping[str, Any] | None) -> MuonConfig:
        """A ``MuonConfig`` from itself, a dict of its sections (YAML's form, ``to_dict``'s) or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                sections = [*SECTIONS, "megatron"]
                close = difflib.get_close_matches(unknown[0], sections, n=1)
                raise ValueError(
                    f"MuonConfig: unknown sections {unknown}"
                    + (f"; did you mean {close[0]!r}?" if close else "")
                    + f" (sections: {sections}; each algorithm's settings go in matrix, scalar or others)"
                )
            return cls(**value)
        raise ValueError(f"expected a MuonConfig or a dict of its sections, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (settings as ``class_path`` and ``init_args``), for ``save_hyperparameters`` and YAML;
        ``from_any`` reads it back."""
        return {
            "matrix": _settings_dict(self.matrix),
            "scalar": _settings_dict(self.scalar),
            "others": [_settings_dict(s) for s in self.others],
            "state": dataclasses.asdict(self.state),
            "routing": self.routing.to_dict(),
            "schedule": _schedule_dict(self.schedule),
            "megatron": None,
        }

    def __getstate__(self) -> dict[str, Any]:
        # Plain values: checkpoints load them with torch.load(weights_only=True).
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        made = MuonConfig.from_any(state)
        self.__dict__.update({f.name: getattr(made, f.name) for f in dataclasses.fields(MuonConfig)})


def _plain(value: Any) -> Any:
    """``value`` with every tuple a list: what ``yaml.safe_load`` reads back (``from_any`` takes either)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


# A logger's hparams.yaml (Lightning's yaml.dump) holds the config as plain YAML, its to_dict(): yaml.safe_load
# and load_from_checkpoint(..., hparams_file=...) read it back.
for _dumper in (yaml.Dumper, yaml.SafeDumper):
    yaml.add_representer(MuonConfig, lambda dumper, config: dumper.represent_dict(_plain(config.to_dict())), _dumper)


def _spec(cls: type) -> dict[str, Any]:
    """A section's default as jsonargparse takes a subclass default (a class_path); made into the settings on init."""
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}"}


def _fields(settings: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(settings)]


def _settings_dict(settings: Settings) -> dict[str, Any]:
    cls = type(settings)
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": settings.arguments()}


def _schedule_dict(schedule: ScheduleSettings) -> dict[str, Any]:
    out = {f.name: getattr(schedule, f.name) for f in dataclasses.fields(schedule)}
    out["momentum_warmup"] = dataclasses.asdict(schedule.momentum_warmup)
    return out


def _section(config: MuonConfig, name: str, base: type, value: Any = None) -> Any:
    """A settings section from itself, or from YAML's ``{class_path, init_args}`` or a plain dict of the fields of
    the section's current class (aliases applied); an error names the section."""
    value = getattr(config, name) if value is None else value
    if isinstance(value, Settings):
        if not value.algorithm and name in _DEFAULT_CLASS:  # a family's base, made from init_args without a class
            return _DEFAULT_CLASS[name](**value.arguments())
        return value  # of the right kind: MuonConfig's checks
    if isinstance(value, Mapping):
        return _settings_from_dict(name, base, value)
    raise HparamError(
        f"MuonConfig.{name}: expected the settings of an algorithm ({base.__name__}: MuonSettings, AdamWSettings, "
        f"...), got {type(value).__name__}",
        name,
    )


def _settings_from_dict(name: str, base: type, value: Mapping[str, Any]) -> Settings:
    from lightning_muon.aliases import settings_from

    cls = _settings_class(name, base, value.get("class_path"))
    args = value.get("init_args", {}) if "class_path" in value or "init_args" in value else value
    return settings_from(cls, dict(args or {}), f"MuonConfig.{name}")


def _settings_class(name: str, base: type, class_path: Any) -> type:
    if class_path is None:
        if name in _DEFAULT_CLASS:
            return _DEFAULT_CLASS[name]
        raise HparamError(f"MuonConfig.{name}: needs a class_path (the algorithm's settings class)", name)
    if isinstance(class_path, type):
        cls = class_path
    else:
        import lightning_muon.algorithms as algorithms

        module, _, attr = str(class_path).rpartition(".")
        try:
            cls = getattr(algorithms, attr) if not module or module.startswith("lightning_muon") else None
            if cls is None:
                import importlib

                cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            raise HparamError(f"MuonConfig.{name}: class_path {class_path!r} names no settings class", name) from None
    if not (isinstance(cls, type) and issubclass(cls, base) and issubclass(cls, Settings)):
        raise HparamError(f"MuonConfig.{name}: {class_path!r} is not a {base.__name__}", name)
    return cls


def _plain_section(value: Any, cls: type, name: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return cls(**value)
        except TypeError as err:
            raise HparamError(f"MuonConfig.{name}: {err}", name) from None
    raise HparamError(f"MuonConfig.{name}: expected {cls.__name__} or a dict of its fields, got {value!r}", name)


def _schedule(value: Any) -> ScheduleSettings:
    try:
        if isinstance(value, Mapping):
            value = dict(value)
            warmup = value.get("momentum_warmup")
            if isinstance(warmup, Mapping):
                value["momentum_warmup"] = MomentumWarmup(**warmup)
        return _plain_section(value, ScheduleSettings, "schedule")
    except ValueError as err:
        if isinstance(err, HparamError):
            raise
        raise ValueError(f"MuonConfig.schedule.{err}") from None
