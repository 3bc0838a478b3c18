"""Per-algorithm hyperparameters: the one source of defaults and checks for ``Muon`` and ``MuonConfig``.

Each algorithm has a small typed, frozen config that validates itself on construction
(``MuonHparams``, ``AdamWHparams``, ``LionHparams``, ``ScheduleFreeHparams``);
``OptimizerConfig`` holds one of each plus the non-finite policy and builds the optimizer.
``Muon.__init__``'s keyword defaults and ``MuonConfig``'s optimizer fields are read off
these classes, and both validate through them, so a default or a rule is written once.
Choices are ``Literal`` types, so LightningCLI / jsonargparse rejects a bad one while
parsing. ``check_group`` applies the same rules to a param group's own overrides.

Errors are ``HparamError`` (a ``ValueError``) naming ``Muon``'s keyword (``adamw_eps``,
``lion_betas[0]``, ...), the rule and the value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from lightning_muon.distributed.tp_math import TP_MODES
from lightning_muon.functional import (
    ADJUST_LR_ALIASES,
    ADJUST_LR_MODES,
    MOMENTUM_FORMS,
    SECOND_MOMENTS,
    WEIGHT_DECAY_FORMS,
)
from lightning_muon.newton_schulz import check_ns_dtype, check_ns_method, dtype_name, resolve_coefficients

if TYPE_CHECKING:
    from lightning_muon.muon import Muon

__all__ = [
    "ALGORITHMS",
    "HPARAMS",
    "NONFINITE",
    "SCHEDULE_FREE",
    "AdamWHparams",
    "HparamError",
    "LionHparams",
    "MuonHparams",
    "OptimizerConfig",
    "ScheduleFreeHparams",
    "check_group",
]

SCHEDULE_FREE = "adamw_schedulefree"
ALGORITHMS = ("muon", "adamw", "lion", SCHEDULE_FREE)
NONFINITE = ("raise", "skip", "ignore")

AdjustLR = Literal["original", "match_rms_adamw", "spectral", "spectral_norm", "none", "shape_scaling", "unit_rms_norm"]
CoefficientName = Literal["polar_express", "polar_express_paper", "keller", "you", "cubic"]
NSDtype = Literal["float32", "bfloat16", "float64", "float16", "fp32", "bf16"]
NonFinite = Literal["raise", "skip", "ignore"]
Betas = tuple[float, float]


class HparamError(ValueError):
    """A bad hyperparameter; ``field`` is the ``Muon`` keyword it came from."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, kw_only=True)
class MuonHparams:
    """Muon groups: the update rule's knobs (``Muon``'s unprefixed keywords)."""

    lr: float = 0.02
    """Muon learning rate (peak, before the schedule)."""
    momentum: float = 0.95
    """Muon momentum ``mu`` in [0, 1) (after any momentum warmup)."""
    nesterov: bool = True
    """Nesterov form of the momentum."""
    weight_decay: float = 0.0
    """Decoupled weight decay, multiplied by the base lr."""
    ns_steps: int = 5
    """Newton-Schulz iterations."""
    ns_coefficients: CoefficientName | list[tuple[float, float, float]] = "polar_express"
    """A schedule name in ``COEFFICIENTS`` or a list of (a, b, c)."""
    ns_dtype: NSDtype | None = None
    """Newton-Schulz dtype: None (automatic: bf16 where its matmul is fast), "float32", "bfloat16", ..."""
    adjust_lr: AdjustLR = "original"
    """Update scale by shape: original, match_rms_adamw, spectral, spectral_norm, none (+ Megatron aliases)."""
    extra_scale_factor: float = 1.0
    """Multiplies the adjusted Muon lr; > 0."""
    momentum_form: Literal["ema", "sum"] = "ema"
    """"ema" (B <- mu B + (1 - mu) G) or "sum" (B <- mu B + G)."""
    second_moment: Literal["normuon", "adamuon"] | None = None
    """None, "normuon" (per-row second moment, arXiv 2510.05491) or "adamuon" (per element, arXiv 2507.11005)."""
    second_moment_beta2: float = 0.95
    """Decay of the second moment, in [0, 1)."""
    second_moment_eps: float = 1e-8
    """Added to the root of the second moment; > 0."""
    sign_momentum: bool = False
    """Orthogonalize sign(momentum) (AdaMuon's sign-stabilized update)."""
    weight_decay_form: Literal["decoupled", "cautious"] = "decoupled"
    """"decoupled", or "cautious": decay only where the update and the weight agree in sign."""
    ns_method: Literal["auto", "standard", "gram"] = "auto"
    """Newton-Schulz iteration: "auto", "standard" or "gram" (Gram Newton-Schulz)."""
    tp_mode: Literal["duplicated", "distributed", "blockwise"] = "duplicated"
    """Matrices split by tensor parallelism (``MuonFSDPStrategy`` with ``tensor_parallel_size > 1``;
    ignored elsewhere): "duplicated" (gathered whole in the group; exact), "distributed" (Gram
    matrices all-reduced, no whole matrix; exact) or "blockwise" (each block alone; approximate)."""

    prefix = ""  # not a field: the keyword prefix of this algorithm
    algorithm = "muon"

    def __post_init__(self) -> None:
        _normalize(self, check_group(dataclasses.asdict(self), "muon", "Muon()", self.prefix))


@dataclass(frozen=True, kw_only=True)
class AdamWHparams:
    """AdamW groups (``Muon``'s ``adamw_*`` keywords), as ``torch.optim.AdamW``."""

    lr: float = 3e-4
    """AdamW learning rate (peak); follows the same schedule as Muon's."""
    betas: Betas = (0.9, 0.95)
    """(beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """Added to the root of the second moment; > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""

    prefix = "adamw_"
    algorithm = "adamw"

    def __post_init__(self) -> None:
        _normalize(self, check_group(dataclasses.asdict(self), "adamw", "Muon()", self.prefix))


@dataclass(frozen=True, kw_only=True)
class LionHparams:
    """Lion groups (``Muon``'s ``lion_*`` keywords); Chen et al. with decoupled weight decay."""

    lr: float | None = None
    """Lion learning rate; None takes AdamW's (Lion usually wants 3-10x less)."""
    betas: Betas = (0.9, 0.99)
    """(beta1, beta2), each in [0, 1)."""
    weight_decay: float | None = None
    """Decoupled weight decay; None takes AdamW's."""

    prefix = "lion_"
    algorithm = "lion"

    def __post_init__(self) -> None:
        _normalize(self, check_group(_with_placeholders(self), "lion", "Muon()", self.prefix))


@dataclass(frozen=True, kw_only=True)
class ScheduleFreeHparams:
    """Schedule-Free AdamW groups (``Muon``'s ``adamw_schedulefree_*`` keywords), ``AdamWScheduleFree``'s own."""

    lr: float | None = None
    """Learning rate; None takes AdamW's. Warmup only, never a falloff."""
    betas: Betas = (0.9, 0.999)
    """(beta1, beta2); beta1 in (0, 1) interpolates between the average and the iterate."""
    eps: float = 1e-8
    """Added to the root of the second moment; > 0."""
    weight_decay: float | None = None
    """Weight decay (at y, times the lr); None takes AdamW's."""
    warmup_steps: int = 0
    """schedulefree's own warmup inside the optimizer."""
    r: float = 0.0
    """Polynomial weighting power of the average."""
    weight_lr_power: float = 2.0
    """The averaging weight is ``lr_max ** weight_lr_power``."""

    prefix = "adamw_schedulefree_"
    algorithm = SCHEDULE_FREE

    def __post_init__(self) -> None:
        _normalize(self, check_group(_with_placeholders(self), SCHEDULE_FREE, "Muon()", self.prefix))


HPARAMS = {"muon": MuonHparams, "adamw": AdamWHparams, "lion": LionHparams, SCHEDULE_FREE: ScheduleFreeHparams}


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Everything ``Muon`` takes besides its parameters: one config per algorithm and the non-finite policy."""

    muon: MuonHparams = field(default_factory=MuonHparams)
    """Muon groups."""
    adamw: AdamWHparams = field(default_factory=AdamWHparams)
    """AdamW groups."""
    lion: LionHparams = field(default_factory=LionHparams)
    """Lion groups."""
    adamw_schedulefree: ScheduleFreeHparams = field(default_factory=ScheduleFreeHparams)
    """Schedule-Free AdamW groups."""
    nonfinite: NonFinite = "raise"
    """On a NaN/inf gradient: "raise", "skip" the step, or "ignore" (no check, no host-device sync)."""

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE:
            raise HparamError(f"nonfinite must be one of {NONFINITE}, got {self.nonfinite!r}", "nonfinite")

    @staticmethod
    def keywords() -> dict[str, Any]:
        """``Muon``'s keyword arguments (besides ``params``) and their defaults, in signature order."""
        out = {}
        for part in HPARAMS.values():
            out.update({part.prefix + f.name: f.default for f in dataclasses.fields(part)})
        out["nonfinite"] = "raise"
        return out

    @classmethod
    def from_keywords(cls, **kwargs: Any) -> OptimizerConfig:
        """From ``Muon``'s flat keywords (``lr``, ``adamw_eps``, ...); missing ones keep their default."""
        unknown = set(kwargs) - set(cls.keywords())
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        parts = {}
        for algorithm, part in HPARAMS.items():
            names = {f.name for f in dataclasses.fields(part)}
            parts[algorithm] = part(**{n: kwargs[part.prefix + n] for n in names if part.prefix + n in kwargs})
        return cls(**parts, nonfinite=kwargs.get("nonfinite", "raise"))

    def to_keywords(self) -> dict[str, Any]:
        """``Muon``'s flat keywords for this config (the inverse of ``from_keywords``)."""
        out: dict[str, Any] = {}
        for algorithm, part in HPARAMS.items():
            values = getattr(self, algorithm)
            out.update({part.prefix + f.name: getattr(values, f.name) for f in dataclasses.fields(part)})
        out["nonfinite"] = self.nonfinite
        return out

    def group_defaults(self, algorithm: str) -> dict[str, Any]:
        """The hyperparameters a new param group of ``algorithm`` starts from (Lion and Schedule-Free resolved)."""
        adamw = self.adamw
        if algorithm == "muon":
            values = dataclasses.asdict(self.muon)
            return {**values, "split_sizes": None, "batched": False, "transposed": False}
        if algorithm == "adamw":
            return dataclasses.asdict(adamw)
        values = dataclasses.asdict(getattr(self, "lion" if algorithm == "lion" else "adamw_schedulefree"))
        values["lr"] = adamw.lr if values["lr"] is None else values["lr"]
        values["weight_decay"] = adamw.weight_decay if values["weight_decay"] is None else values["weight_decay"]
        return values

    def build(self, params: Any) -> Muon:
        """The hybrid ``Muon`` optimizer over ``params`` (tensors, named tensors or param groups)."""
        from lightning_muon.muon import Muon

        return Muon.from_config(params, self)


def check_group(group: dict[str, Any], algorithm: str, where: str, prefix: str = "") -> dict[str, Any]:
    """Check the hyperparameters of ``algorithm`` in ``group``; returns the normalized values to store.

    ``where`` starts every message (``"Muon()"``, ``"param group 2 ('muon')"``) and ``prefix``
    makes names the keywords a user passed (``adamw_eps``). Raises ``HparamError``.
    """
    out: dict[str, Any] = {}

    def number(name: str, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False):
        _check_number(group[name], prefix + name, where, low, high, low_open, high_open)

    number("lr", 0.0)
    number("weight_decay", 0.0)
    if algorithm == "muon":
        number("momentum", 0.0, 1.0, high_open=True)
        _check_bool(group, "nesterov", where)
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise HparamError(f"ns_steps must be a positive int, got {steps!r}", "ns_steps")
        coefficients = group["ns_coefficients"]
        try:
            resolve_coefficients(coefficients, steps)
        except ValueError as err:
            raise HparamError(str(err), "ns_coefficients") from None
        if not isinstance(coefficients, str):
            out["ns_coefficients"] = [tuple(abc) for abc in coefficients]
        try:
            dtype = check_ns_dtype(group["ns_dtype"])
        except ValueError as err:
            raise HparamError(str(err), "ns_dtype") from None
        # Groups keep a plain name: checkpoints (torch.save and distributed) store it as is.
        out["ns_dtype"] = None if dtype is None else dtype_name(dtype)
        mode = group["adjust_lr"]
        if ADJUST_LR_ALIASES.get(mode, mode) not in ADJUST_LR_MODES:
            modes = sorted(ADJUST_LR_MODES) + sorted(ADJUST_LR_ALIASES)
            raise HparamError(f"{where}: adjust_lr must be one of {modes}, got {mode!r}", "adjust_lr")
        number("extra_scale_factor", 0.0, low_open=True)
        _check_choice(group, "momentum_form", where, MOMENTUM_FORMS)
        _check_choice(group, "second_moment", where, (None, *SECOND_MOMENTS))
        number("second_moment_beta2", 0.0, 1.0, high_open=True)
        number("second_moment_eps", 0.0, low_open=True)
        _check_choice(group, "weight_decay_form", where, WEIGHT_DECAY_FORMS)
        _check_choice(group, "tp_mode", where, TP_MODES)
        try:
            check_ns_method(group["ns_method"])
        except ValueError as err:
            raise HparamError(f"{where}: {err}", "ns_method") from None
        _check_bool(group, "sign_momentum", where)
        if "batched" in group:
            _check_bool(group, "batched", where)
        return out
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise HparamError(f"{where}: {prefix}betas must be a pair (beta1, beta2), got {betas!r}", f"{prefix}betas")
    for k, beta in enumerate(betas):
        # Schedule-Free's eval() divides by beta1: 0 is out for it.
        low_open = k == 0 and algorithm == SCHEDULE_FREE
        _check_number(beta, f"{prefix}betas[{k}]", where, 0.0, 1.0, low_open, True, field=f"{prefix}betas")
    out["betas"] = tuple(betas)
    if algorithm in ("adamw", SCHEDULE_FREE):
        number("eps", 0.0, low_open=True)
    if algorithm == SCHEDULE_FREE:
        steps = group["warmup_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise HparamError(
                f"{where}: {prefix}warmup_steps must be an int >= 0, got {steps!r}", f"{prefix}warmup_steps"
            )
        number("r", 0.0)
        number("weight_lr_power", 0.0)
    return out


def _check_number(
    value: Any,
    name: str,
    where: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    field: str | None = None,
) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        message = f"{where}: {name} must be a finite number in {lo}{low}, {high}{hi}, got {value!r}"
        raise HparamError(message, field or name)


def _check_choice(group: dict[str, Any], name: str, where: str, choices: tuple) -> None:
    value = group[name]
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        raise HparamError(f"{where}: {name} must be one of {choices}, got {value!r}", name)


def _check_bool(group: dict[str, Any], name: str, where: str) -> None:
    if not isinstance(group[name], bool):
        raise HparamError(f"{where}: {name} must be a bool, got {group[name]!r}", name)


def _with_placeholders(part: Any) -> dict[str, Any]:
    # lr and weight decay of None take AdamW's, which is checked there: 0 stands in here.
    values = dataclasses.asdict(part)
    for name in ("lr", "weight_decay"):
        values[name] = 0.0 if values[name] is None else values[name]
    return values


def _normalize(part: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        object.__setattr__(part, name, value)  # frozen: normalized once, here
