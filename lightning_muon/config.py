"""``MuonConfig``: every optimizer, routing and schedule knob, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_muon.muon import Muon
from lightning_muon.routing import DEFAULT_HEAD_NAMES, Rule
from lightning_muon.schedules import FALLOFFS, LRSchedule, MomentumWarmup, steps_of

__all__ = ["MuonConfig"]

_OPTIMIZER_FIELDS = (
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "adjust_lr",
    "extra_scale_factor",
    "adamw_lr",
    "adamw_betas",
    "adamw_eps",
    "adamw_weight_decay",
    "lion_lr",
    "lion_betas",
    "lion_weight_decay",
    "nonfinite",
)


@dataclass(kw_only=True)
class MuonConfig:
    """Configuration of the hybrid Muon optimizer, its routing and its schedules.

    Field names of the optimizer knobs equal ``Muon``'s keyword arguments. Every
    field is checked in ``__post_init__``; an error names the field and the value.
    """

    # --- Muon groups -------------------------------------------------------------------
    lr: float = 0.02
    """Muon learning rate (peak, before the schedule)."""
    momentum: float = 0.95
    """Muon momentum (after the momentum warmup)."""
    nesterov: bool = True
    """Nesterov form of the momentum."""
    weight_decay: float = 0.0
    """Muon decoupled weight decay, multiplied by the base lr."""
    ns_steps: int = 5
    """Newton-Schulz iterations."""
    ns_coefficients: str | list[tuple[float, float, float]] = "polar_express"
    """A schedule name in ``COEFFICIENTS`` or a list of (a, b, c)."""
    ns_dtype: str | None = None
    """Newton-Schulz dtype: None (automatic), "float32" or "bfloat16"."""
    adjust_lr: str = "original"
    """Update scale by shape: original, match_rms_adamw, spectral, spectral_norm, none (+ Megatron aliases)."""
    extra_scale_factor: float = 1.0
    """Multiplies the adjusted Muon lr."""
    # --- AdamW / Lion groups -------------------------------------------------------------
    scalar_optimizer: str = "adamw"
    """Algorithm for embeddings, head and vectors under the default rules: "adamw" or "lion"."""
    adamw_lr: float = 3e-4
    """AdamW learning rate (peak); follows the same schedule as Muon's."""
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    adamw_eps: float = 1e-8
    """AdamW epsilon."""
    adamw_weight_decay: float = 0.0
    """AdamW decoupled weight decay (the default ``vectors`` rule sets 0 for 1-D params)."""
    lion_lr: float | None = None
    """Lion learning rate; None uses ``adamw_lr``."""
    lion_betas: tuple[float, float] = (0.9, 0.99)
    """Lion (beta1, beta2)."""
    lion_weight_decay: float | None = None
    """Lion decoupled weight decay; None uses ``adamw_weight_decay``."""
    nonfinite: str = "raise"
    """On a NaN/inf gradient: "raise" or "skip" the step."""
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
    # --- schedule ------------------------------------------------------------------------
    falloff: str = "constant"
    """lr falloff after warmup and stable: constant, linear, cosine, wsd, inverse_sqrt."""
    warmup: float = 0
    """Warmup length: steps (>= 1) or a fraction of total steps (< 1)."""
    stable: float = 0
    """Steps (or fraction) held at the peak lr after warmup."""
    cooldown: float = 0.2
    """``wsd`` only: length of the final linear decay, steps or fraction."""
    min_lr_ratio: float = 0.0
    """Lowest lr as a fraction of the peak."""
    total_steps: int | None = None
    """Total optimizer steps; None takes ``trainer.estimated_stepping_batches``."""
    momentum_warmup_steps: int = 0
    """Steps over which Muon momentum rises from ``momentum_warmup_start`` to ``momentum``."""
    momentum_warmup_start: float = 0.85
    """Muon momentum at step 0 when warming up."""

    def __post_init__(self) -> None:
        self.rules = [_rule(i, r) for i, r in enumerate(self.rules)]
        self.head_names = tuple(self.head_names)
        self.adamw_betas = tuple(self.adamw_betas)
        self.lion_betas = tuple(self.lion_betas)
        if self.ns_coefficients is not None and not isinstance(self.ns_coefficients, str):
            self.ns_coefficients = [tuple(abc) for abc in self.ns_coefficients]
        if self.scalar_optimizer not in ("adamw", "lion"):
            raise ValueError(f"MuonConfig.scalar_optimizer must be 'adamw' or 'lion', got {self.scalar_optimizer!r}")
        if self.falloff not in FALLOFFS:
            raise ValueError(f"MuonConfig.falloff must be one of {FALLOFFS}, got {self.falloff!r}")
        if self.max_aspect_ratio is not None and not self.max_aspect_ratio >= 1:
            raise ValueError(f"MuonConfig.max_aspect_ratio must be >= 1 or None, got {self.max_aspect_ratio!r}")
        # The optimizer validates its own knobs, but its messages say "lr" or "betas[0]" for
        # the Muon, AdamW and Lion defaults alike: build one per field, on a dummy matrix,
        # so the error names the field.
        for name in _OPTIMIZER_FIELDS:
            try:
                Muon([torch.zeros(2, 2, requires_grad=True)], **{name: getattr(self, name)})
            except ValueError as err:
                raise ValueError(f"MuonConfig.{name}: {err}") from None
        total = self.total_steps if self.total_steps is not None else 1_000_000
        checks = {
            "momentum_warmup_start": lambda: MomentumWarmup(start=self.momentum_warmup_start),
            "momentum_warmup_steps": lambda: MomentumWarmup(steps=self.momentum_warmup_steps),
            # Only ``wsd`` reads it, but a bad value is a mistake under any falloff.
            "cooldown": lambda: steps_of(self.cooldown, total, "cooldown"),
        }
        for name, check in checks.items():
            try:
                check()
            except ValueError as err:
                raise ValueError(f"MuonConfig.{name}: {err}") from None
        try:
            Muon([torch.zeros(2, 2, requires_grad=True)], **self.optimizer_kwargs())
            self.lr_schedule(total)
        except ValueError as err:
            raise ValueError(f"MuonConfig: {err}") from None

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Muon``."""
        return {name: getattr(self, name) for name in _OPTIMIZER_FIELDS}

    def routing_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``route_parameters``."""
        return dict(
            rules=self.rules,
            default_rules=self.default_rules,
            max_aspect_ratio=self.max_aspect_ratio,
            head_names=self.head_names,
            head_by_position=self.head_by_position,
            scalar_algorithm=self.scalar_optimizer,
        )

    def lr_schedule(self, total_steps: int | None) -> LRSchedule:
        """The resolved lr schedule for ``total_steps`` optimizer steps."""
        return LRSchedule.create(
            self.falloff,
            warmup=self.warmup,
            stable=self.stable,
            cooldown=self.cooldown,
            total_steps=total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def momentum_warmup(self) -> MomentumWarmup:
        return MomentumWarmup(start=self.momentum_warmup_start, steps=self.momentum_warmup_steps)

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
