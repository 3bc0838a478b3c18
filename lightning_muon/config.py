"""``MuonConfig``: every optimizer, routing and schedule knob, flat as YAML writes them, composed of typed parts.

The fields are ``Muon``'s keyword arguments, the routing's and the schedule's, plus
Megatron-Core's names (``megatron``). Construction checks every field (an error names it)
and composes the parts once: ``optimizer`` (``OptimizerConfig``: one config per
algorithm), ``routing`` (``RoutingConfig``) and ``schedule`` (``ScheduleConfig``). Each
part's ``build()`` makes its object; ``MuonConfig.build()`` makes the optimizer and its
scheduler for a module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from lightning_muon.algorithms import SCHEDULE_FREE, HparamError, get_algorithm, get_algorithm_of_kind
from lightning_muon.algorithms.adamw_schedulefree import schedulefree
from lightning_muon.hparams import BUILTIN_HPARAMS, NonFinite, OptimizerConfig, flat_keyword_fields
from lightning_muon.muon import Muon
from lightning_muon.routing import DEFAULT_HEAD_NAMES, RoutingConfig, Rule
from lightning_muon.routing.added_groups import ModuleRouter
from lightning_muon.routing.fused_qkv import QKV_NAMES, split_rules
from lightning_muon.routing.megatron import MEGATRON_COEFFICIENTS, map_megatron_names
from lightning_muon.schedules import Falloff, LRSchedule, MomentumWarmup, MuonScheduler, ScheduleConfig

__all__ = ["MEGATRON_COEFFICIENTS", "QKV_NAMES", "MuonConfig"]

# Defaults are the parts' own (their class attributes): written once, there.
_SCHEDULE, _WARMUP = ScheduleConfig, MomentumWarmup
# Schedule fields whose errors have always named the field (the others: "MuonConfig: <error>").
_NAMED_SCHEDULE_ERRORS = ("cooldown", "momentum_warmup_start", "momentum_warmup_steps")


def _optimizer_fields() -> type:
    """A dataclass of ``Muon``'s flat keywords (``hparams.flat_keyword_fields``): ``MuonConfig``'s first fields.

    Made from the algorithms' hyperparameters, so that a built-in algorithm's keys are
    ``MuonConfig`` fields (and YAML keys) without being written again here.
    """
    flat = flat_keyword_fields()
    fields = [(name, annotation, field(default=default, kw_only=True)) for name, annotation, default, _ in flat]
    base = dataclasses.make_dataclass("OptimizerFields", fields, kw_only=True)
    base.__module__ = __name__
    base.__doc__ = "Muon's flat keywords, each the field of an algorithm's hyperparameters.\n\nArgs:\n" + "\n".join(
        f"    {name}: {doc}" for name, _, _, doc in flat
    )
    return base


OptimizerFields = _optimizer_fields()


@dataclass(kw_only=True)
class MuonConfig(OptimizerFields):
    """Configuration of the hybrid Muon optimizer, its routing and its schedules.

    The optimizer fields are ``Muon``'s keyword arguments, made from the algorithms'
    hyperparameters (``OptimizerFields``: ``lr``, ``ns_dtype``, ``adamw_eps``,
    ``soap_shampoo_beta``, ``adaptive_muon_moment2_method``, ...; each documented in its
    ``algorithms`` module). Every field is checked in ``__post_init__``; an error names the
    field and the value.
    """

    # --- Megatron-Core names (mapped onto the fields above) -----------------------------
    coefficient_type: Literal["simple", "quintic", "polar_express", "aol", "cans", "deepseekv4", "custom"] | None = None
    """Megatron's schedule name: simple, quintic, polar_express, aol, cans, deepseekv4 or custom -> ns_coefficients."""
    num_ns_steps: int | None = None
    """Megatron's name for ns_steps."""
    scale_mode: Literal["shape_scaling", "spectral", "unit_rms_norm"] | None = None
    """Megatron's shape_scaling, spectral or unit_rms_norm (-> adjust_lr)."""
    split_qkv: bool = False
    """Orthogonalize Q, K and V of fused QKV weights separately (needs qkv_split_shapes); also splits
    nn.MultiheadAttention's in_proj_weight, whose layout is known, into its three parts."""
    qkv_split_shapes: tuple[int, ...] | None = None
    """Rows of Q, K, V per query group, e.g. (heads_per_group * head_dim, head_dim, head_dim)."""
    moment2_method: Literal["adamuon", "normuon", "namo"] | None = None
    """Megatron's adamuon, normuon or namo (-> second_moment, Emerging-Optimizers' forms)."""
    # --- AdamW / Lion / Schedule-Free AdamW groups ----------------------------------------
    scalar_optimizer: str = "adamw"
    """Algorithm for embeddings, head and vectors under the default rules: "adamw", "lion",
    "adamw_schedulefree", or a registered algorithm of your own (its name or import path)."""
    matrix_optimizer: str = "muon"
    """Algorithm for the hidden matrices under the default rules: "muon" or a registered variant of it
    ("muon_hyperball"; a name or an import path)."""
    algorithm_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Group defaults of other registered algorithms, by name: ``{"muon_hyperball": {"hyperball_radius": 1.0}}``."""
    nonfinite: NonFinite = "raise"
    """On a NaN/inf gradient: "raise", "skip" the step, or "ignore" (no check, no host-device sync)."""
    exp_avg_dtype: Literal["float32", "bfloat16"] = "float32"
    """Megatron's name: the dtype first moments (Muon's momentum, AdamW's and Lion's exp_avg) are stored
    in, where narrower than the parameter's; computed in float32 and rounded once when stored."""
    exp_avg_sq_dtype: Literal["float32", "bfloat16"] = "float32"
    """Megatron's name: the same for second moments (AdamW's exp_avg_sq, NorMuon's and AdaMuon's)."""
    main_params_dtype: Literal["float32"] | None = None
    """Megatron's name: None, or "float32": bf16/fp16 parameters step on an fp32 master copy kept in the
    optimizer state (one process, not under a sharding); no effect on fp32 parameters."""
    step_memory_mb: float | Literal["auto"] | None = "auto"
    """The most MiB of temporaries one Muon group's step holds at once: "auto" (32 on a CPU, 1024 on a
    GPU), a number, or null (no cap); larger groups step in rounds, with the same results."""
    # --- routing -------------------------------------------------------------------------
    rules: list[Rule] = field(default_factory=list)
    """User routing rules, tried in order before the default rules."""
    default_rules: bool = True
    """Append the default rules (embedding, head, vectors to AdamW; matrices to Muon)."""
    max_aspect_ratio: float | None = None
    """Send matrices whose long side exceeds this many times the short side to AdamW."""
    head_names: tuple[str, ...] = DEFAULT_HEAD_NAMES
    """Attribute names that mark a Linear as the output head."""
    head_by_position: bool = True
    """Without a named head, treat the last nn.Linear as the head."""
    input_layer: bool = False
    """Send the first convolution or Linear weight (a convnet's stem) to AdamW."""
    split_gate_up: bool = True
    """Mixture-of-experts fused gate/up stacks: orthogonalize gate and up apart, per expert (False: fused)."""
    router_algorithm: str | None = None
    """Mixture-of-experts router weights: None keeps them on the scalar optimizer; "muon" sends them to Muon."""
    probe_experts: bool = True
    """Read mixture-of-experts layouts and routers transformers' metadata does not give from the model's forward."""
    # --- schedule ------------------------------------------------------------------------
    falloff: Falloff = _SCHEDULE.falloff
    """lr falloff after warmup and stable: constant, linear, cosine, wsd, inverse_sqrt."""
    warmup: float = _SCHEDULE.warmup
    """Warmup length: steps (>= 1) or a fraction of total steps (< 1)."""
    stable: float = _SCHEDULE.stable
    """Steps (or fraction) held at the peak lr after warmup."""
    cooldown: float = _SCHEDULE.cooldown
    """``wsd`` only: length of the final linear decay, steps or fraction."""
    min_lr_ratio: float = _SCHEDULE.min_lr_ratio
    """Lowest lr as a fraction of the peak."""
    total_steps: int | None = _SCHEDULE.total_steps
    """Total optimizer steps; None takes ``trainer.estimated_stepping_batches``."""
    momentum_warmup_steps: int = _WARMUP.steps
    """Steps over which Muon momentum rises from ``momentum_warmup_start`` to ``momentum``."""
    momentum_warmup_start: float = _WARMUP.start
    """Muon momentum at step 0 when warming up."""

    def __post_init__(self) -> None:
        self.rules = [_rule(i, r) for i, r in enumerate(self.rules)]
        self.head_names = tuple(self.head_names)
        for name, _, default, _ in flat_keyword_fields():
            value = getattr(self, name)
            if isinstance(default, tuple) and isinstance(value, list):
                setattr(self, name, tuple(value))  # YAML gives a list for (beta1, beta2)
        if self.ns_coefficients is not None and not isinstance(self.ns_coefficients, str):
            self.ns_coefficients = [tuple(abc) for abc in self.ns_coefficients]
        map_megatron_names(self)
        get_algorithm_of_kind(self.scalar_optimizer, False, "MuonConfig.scalar_optimizer")
        get_algorithm_of_kind(self.matrix_optimizer, True, "MuonConfig.matrix_optimizer")
        if self.router_algorithm is not None:
            try:
                get_algorithm(self.router_algorithm)
            except ValueError as err:
                raise ValueError(f"MuonConfig.router_algorithm: {err}") from None
        if self.max_aspect_ratio is not None and not self.max_aspect_ratio >= 1:
            raise ValueError(f"MuonConfig.max_aspect_ratio must be >= 1 or None, got {self.max_aspect_ratio!r}")
        self.__dict__["_composed"] = _compose(self)  # kept until a field is set again

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        self.__dict__.pop("_composed", None)  # a field changed: the parts are rebuilt (and checked) when next read

    def __getstate__(self) -> dict[str, Any]:
        # The fields only: checkpoints load them with torch.load(weights_only=True).
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _parts(self) -> tuple[OptimizerConfig, RoutingConfig, ScheduleConfig]:
        if "_composed" not in self.__dict__:
            self.__dict__["_composed"] = _compose(self)
        return self.__dict__["_composed"]

    @property
    def optimizer(self) -> OptimizerConfig:
        """The optimizer part: one config per algorithm (``MuonHparams``, ``AdamWHparams``, ...)."""
        return self._parts()[0]

    @property
    def routing(self) -> RoutingConfig:
        """The routing part: the user's rules, Megatron's QKV split rules, then the defaults."""
        return self._parts()[1]

    @property
    def schedule(self) -> ScheduleConfig:
        """The schedule part: lr phases and the Muon momentum warmup."""
        return self._parts()[2]

    @property
    def uses_schedule_free(self) -> bool:
        """True when the routing can send parameters to ``"adamw_schedulefree"`` groups."""
        return self.scalar_optimizer == SCHEDULE_FREE or any(r.algorithm == SCHEDULE_FREE for r in self.rules)

    def build(self, module: nn.Module, total_steps: int | None = None) -> tuple[Any, MuonScheduler]:
        """The hybrid ``Muon`` over ``module``'s routed parameters and its ``MuonScheduler``.

        ``total_steps`` is the run's length where the schedule needs one and the config
        does not set it (``configure_muon_optimizers`` takes the trainer's estimate).
        """
        optimizer = Muon.from_config(self.routing.build(module), self.optimizer)
        optimizer.attach_router(ModuleRouter(module, self.routing))  # groups added later are routed alike
        total = self.total_steps if total_steps is None else total_steps
        return optimizer, MuonScheduler(optimizer, self.schedule.build(total), self.schedule.momentum_warmup)

    def with_lr(self, lr: float) -> MuonConfig:
        """A copy whose Muon lr is ``lr`` and whose every other lr moves by the same factor, ``lr / self.lr``.

        ``adamw_lr``, ``lion_lr`` and ``adamw_schedulefree_lr`` (``None`` keeps following
        ``adamw_lr``), every other built-in algorithm's (``laprop_lr``, ``soap_lr``, ...), the
        rules' ``lr`` options and the lr of every other registered algorithm this config names
        (in ``algorithm_defaults``, a rule, ``matrix_optimizer`` or ``scalar_optimizer``) whose
        hyperparameters have one keep their ratio to the Muon lr:
        this is how the lr finder's suggestion, a Muon lr, becomes a config
        (``MuonModuleMixin.lr``). Variants of Muon without an lr of their own
        (``muon_hyperball``) follow ``lr``.

        Raises:
            ValueError: the Muon lr is 0 (no ratio to keep), or ``lr`` is not a valid lr.
        """
        if self.lr == 0:
            raise ValueError("MuonConfig.with_lr: the Muon lr is 0, so the other lrs have no ratio to it to keep")
        factor = lr / self.lr

        def scaled(value: float | None) -> float | None:
            return None if value is None else value * factor

        rules = [
            dataclasses.replace(r, options={**r.options, "lr": r.options["lr"] * factor}) if "lr" in r.options else r
            for r in self.rules
        ]
        lrs = {
            BUILTIN_HPARAMS[name].prefix + "lr": scaled(getattr(self, BUILTIN_HPARAMS[name].prefix + "lr"))
            for name in BUILTIN_HPARAMS
            if name != "muon" and "lr" in {f.name for f in dataclasses.fields(BUILTIN_HPARAMS[name])}
        }
        return dataclasses.replace(
            self,
            lr=lr,
            **lrs,
            rules=rules,
            algorithm_defaults={**self.algorithm_defaults, **self._scaled_algorithm_lrs(factor)},
        )

    def _scaled_algorithm_lrs(self, factor: float) -> dict[str, dict[str, Any]]:
        """``algorithm_defaults`` entries whose ``lr`` is ``factor`` times the current one (``with_lr``)."""
        named = [
            *self.algorithm_defaults,
            *(r.algorithm for r in self.rules),
            self.matrix_optimizer,
            self.scalar_optimizer,
        ]
        out = {}
        for name in dict.fromkeys(get_algorithm(n).name for n in named):  # an import path: its registered name
            if name in BUILTIN_HPARAMS:
                continue  # their lrs are this config's own fields
            values = dataclasses.asdict(self.optimizer.hparams_of(name))
            if "lr" in values:
                out[name] = {**values, "lr": values["lr"] * factor}
        return out

    # ------------------------------------------------------------------ views kept for callers

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Muon`` (``optimizer.to_keywords()``)."""
        return self.optimizer.to_keywords()

    def routing_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``route_parameters`` (``routing.kwargs()``)."""
        return self.routing.kwargs()

    def qkv_rules(self) -> list[Rule]:
        """The routing rules ``split_qkv`` adds (``routing.fused_qkv.split_rules``)."""
        return [r for r in split_rules(self) if r.group == "muon_qkv"]

    def lr_schedule(self, total_steps: int | None) -> LRSchedule:
        """The resolved lr schedule for ``total_steps`` optimizer steps (``schedule.build``)."""
        return self.schedule.build(total_steps)

    def momentum_warmup(self) -> MomentumWarmup:
        """The Muon momentum warmup (``schedule.momentum_warmup``)."""
        return self.schedule.momentum_warmup

    @classmethod
    def from_any(cls, value: MuonConfig | dict[str, Any] | None) -> MuonConfig:
        """A ``MuonConfig`` from itself, a dict of its fields (e.g. from YAML) or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"MuonConfig: unknown fields {sorted(unknown)}")
            return cls(**value)
        raise ValueError(f"expected a MuonConfig or a dict of its fields, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (rules as dicts), for ``save_hyperparameters`` and YAML."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["rules"] = [
            {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if getattr(r, f.name) != f.default}
            for r in self.rules
        ]
        return out


def _compose(config: MuonConfig) -> tuple[OptimizerConfig, RoutingConfig, ScheduleConfig]:
    """The parts of ``config``, built from its fields (each part checks its own)."""
    try:
        optimizer = OptimizerConfig.from_keywords(**{n: getattr(config, n) for n in OptimizerConfig.keywords()})
    except HparamError as err:
        raise ValueError(f"MuonConfig.{err.field}: {err}") from None
    schedule = _schedule_part(config)
    if config.uses_schedule_free:
        schedulefree()  # the optional extra: fail here, naming the install, not at fit time
        if config.adamw_schedulefree_warmup_steps and config.warmup:
            raise ValueError(
                f"MuonConfig: warmup={config.warmup!r} and adamw_schedulefree_warmup_steps="
                f"{config.adamw_schedulefree_warmup_steps!r} would warm the schedule-free groups up twice "
                "(the scheduler's warmup applies to them too); set one of them to 0"
            )
    routing = RoutingConfig(
        rules=tuple(config.rules),
        optional_rules=tuple(split_rules(config)),
        default_rules=config.default_rules,
        max_aspect_ratio=config.max_aspect_ratio,
        head_names=config.head_names,
        head_by_position=config.head_by_position,
        input_layer=config.input_layer,
        scalar_algorithm=config.scalar_optimizer,
        matrix_algorithm=config.matrix_optimizer,
        split_gate_up=config.split_gate_up,
        router_algorithm=config.router_algorithm,
        probe_experts=config.probe_experts,
    )
    return optimizer, routing, schedule


def _schedule_part(config: MuonConfig) -> ScheduleConfig:
    try:
        warmup = MomentumWarmup(start=config.momentum_warmup_start, steps=config.momentum_warmup_steps)
    except ValueError as err:
        name = "momentum_warmup_start" if "start" in str(err) else "momentum_warmup_steps"
        raise ValueError(f"MuonConfig.{name}: {err}") from None
    try:
        return ScheduleConfig(
            falloff=config.falloff,
            warmup=config.warmup,
            stable=config.stable,
            cooldown=config.cooldown,
            min_lr_ratio=config.min_lr_ratio,
            total_steps=config.total_steps,
            momentum_warmup=warmup,
        )
    except ValueError as err:
        message = str(err)
        named = next((n for n in _NAMED_SCHEDULE_ERRORS if message.startswith(n)), None)
        if message.startswith("falloff"):
            raise ValueError(f"MuonConfig.{message}") from None
        raise ValueError(f"MuonConfig.{named}: {message}" if named else f"MuonConfig: {message}") from None


def _rule(index: int, value: Rule | dict[str, Any]) -> Rule:
    if isinstance(value, Rule):
        return value
    try:
        return Rule(**_plain(value))
    except (TypeError, ValueError) as err:  # TypeError: an unknown or missing field
        raise ValueError(f"MuonConfig.rules[{index}]: {err}") from None


def _plain(value: Any) -> dict[str, Any]:
    # jsonargparse may hand dict-like Namespaces for nested dataclass items.
    return dict(vars(value)) if hasattr(value, "__dict__") and not isinstance(value, dict) else dict(value)
