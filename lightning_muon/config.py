"""``MuonConfig``: every optimizer, routing and schedule knob, validated on construction."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_muon.functional import ADJUST_LR_ALIASES, SECOND_MOMENTS
from lightning_muon.muon import SCHEDULE_FREE, Muon, _schedulefree
from lightning_muon.newton_schulz import COEFFICIENTS
from lightning_muon.routing import DEFAULT_HEAD_NAMES, SCALAR_ALGORITHMS, TRANSPOSED_MODULES, Rule
from lightning_muon.schedules import FALLOFFS, LRSchedule, MomentumWarmup, steps_of

__all__ = ["MEGATRON_COEFFICIENTS", "QKV_NAMES", "MuonConfig"]

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
    "momentum_form",
    "second_moment",
    "second_moment_beta2",
    "second_moment_eps",
    "sign_momentum",
    "weight_decay_form",
    "ns_method",
    "tp_mode",
    "adamw_lr",
    "adamw_betas",
    "adamw_eps",
    "adamw_weight_decay",
    "lion_lr",
    "lion_betas",
    "lion_weight_decay",
    "adamw_schedulefree_lr",
    "adamw_schedulefree_betas",
    "adamw_schedulefree_eps",
    "adamw_schedulefree_weight_decay",
    "adamw_schedulefree_warmup_steps",
    "adamw_schedulefree_r",
    "adamw_schedulefree_weight_lr_power",
    "nonfinite",
)

# Megatron-Core's ``coefficient_type`` names (emerging_optimizers ``muon_utils``) and their
# schedules here. Megatron cycles a list when ``num_ns_steps`` is a multiple of its length
# (and raises otherwise): those become explicit lists below.
MEGATRON_COEFFICIENTS: dict[str, str | list[tuple[float, float, float]]] = {
    "simple": "keller",  # (3.4445, -4.7750, 2.0315) at every step
    "quintic": "you",  # Megatron's default, You Jiacheng's 5-step tuning
    # The paper's 8 tuples with the 1.01 safety folded in (Megatron rounds them to 4 digits),
    # last repeated; Megatron requires num_ns_steps >= 8, shorter runs take the first tuples.
    # Megatron pre-scales by ||X||_F, ours by 1.01 ||X||_F (NORMALIZATION["polar_express_paper"]).
    "polar_express": "polar_express_paper",
    # Megatron's "aol" list, from thib-s/flash-newton-schulz (Boissin et al.), 4 tuples.
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
_MEGATRON_SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")
# Parameter names treated as fused QKV weights by ``split_qkv`` (besides Megatron's
# ``is_qkv`` attribute): Megatron-Core, timm/ViT, GPT-2/nanoGPT, GPT-NeoX, nn.MultiheadAttention.
QKV_NAMES = r"(^|\.)(linear_qkv|qkv|qkv_proj|c_attn|query_key_value)\.weight$|(^|\.)in_proj_weight$"


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
    momentum_form: str = "ema"
    """Muon momentum: "ema" (B <- mu B + (1 - mu) G) or "sum" (B <- mu B + G)."""
    second_moment: str | None = None
    """None, "normuon" (per-row second moment, arXiv 2510.05491) or "adamuon" (per element, arXiv 2507.11005)."""
    second_moment_beta2: float = 0.95
    """Decay of the NorMuon / AdaMuon second moment."""
    second_moment_eps: float = 1e-8
    """Added to the root of the NorMuon / AdaMuon second moment."""
    sign_momentum: bool = False
    """Orthogonalize sign(momentum) (AdaMuon's sign-stabilized update)."""
    weight_decay_form: str = "decoupled"
    """Muon weight decay: "decoupled" or "cautious" (only where update and weight agree in sign)."""
    ns_method: str = "auto"
    """Newton-Schulz iteration: "auto", "standard" or "gram" (Gram Newton-Schulz)."""
    tp_mode: str = "duplicated"
    """Matrices split by tensor parallelism: "duplicated" (exact: gathered whole in the group),
    "distributed" (exact: Gram matrices all-reduced, no whole matrix) or "blockwise" (approximate)."""
    # --- Megatron-Core names (mapped onto the fields above) -----------------------------
    coefficient_type: str | None = None
    """Megatron's schedule name: simple, quintic, polar_express, aol or custom (-> ns_coefficients)."""
    num_ns_steps: int | None = None
    """Megatron's name for ns_steps."""
    scale_mode: str | None = None
    """Megatron's shape_scaling, spectral or unit_rms_norm (-> adjust_lr)."""
    split_qkv: bool = False
    """Orthogonalize Q, K and V of fused QKV weights separately (needs qkv_split_shapes); also splits
    nn.MultiheadAttention's in_proj_weight, whose layout is known, into its three parts."""
    qkv_split_shapes: tuple[int, ...] | None = None
    """Rows of Q, K, V per query group, e.g. (heads_per_group * head_dim, head_dim, head_dim)."""
    moment2_method: str | None = None
    """Megatron's adamuon or normuon (-> second_moment)."""
    # --- AdamW / Lion / Schedule-Free AdamW groups ----------------------------------------
    scalar_optimizer: str = "adamw"
    """Algorithm for embeddings, head and vectors under the default rules: "adamw", "lion" or "adamw_schedulefree"."""
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
    adamw_schedulefree_lr: float | None = None
    """Schedule-Free AdamW learning rate; None uses ``adamw_lr``. Warmup only, never a falloff."""
    adamw_schedulefree_betas: tuple[float, float] = (0.9, 0.999)
    """Schedule-Free AdamW (beta1, beta2); beta1 interpolates between the average and the iterate."""
    adamw_schedulefree_eps: float = 1e-8
    """Schedule-Free AdamW epsilon."""
    adamw_schedulefree_weight_decay: float | None = None
    """Schedule-Free AdamW weight decay (at y, times the lr); None uses ``adamw_weight_decay``."""
    adamw_schedulefree_warmup_steps: int = 0
    """schedulefree's own warmup inside the optimizer; leave 0 when ``warmup`` is set (it applies already)."""
    adamw_schedulefree_r: float = 0.0
    """Schedule-Free's polynomial weighting power of the average."""
    adamw_schedulefree_weight_lr_power: float = 2.0
    """Schedule-Free's averaging weight is ``lr_max ** weight_lr_power``."""
    nonfinite: str = "raise"
    """On a NaN/inf gradient: "raise", "skip" the step, or "ignore" (no check, no host-device sync)."""
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
        self.adamw_schedulefree_betas = tuple(self.adamw_schedulefree_betas)
        if self.ns_coefficients is not None and not isinstance(self.ns_coefficients, str):
            self.ns_coefficients = [tuple(abc) for abc in self.ns_coefficients]
        self._map_megatron_names()
        if self.scalar_optimizer not in SCALAR_ALGORITHMS:
            raise ValueError(
                f"MuonConfig.scalar_optimizer must be one of {SCALAR_ALGORITHMS}, got {self.scalar_optimizer!r}"
            )
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
            schedule = self.lr_schedule(total)
        except ValueError as err:
            raise ValueError(f"MuonConfig: {err}") from None
        if self.uses_schedule_free:
            _schedulefree()  # the optional extra: fail here, naming the install, not at fit time
            if self.adamw_schedulefree_warmup_steps and schedule.warmup_steps:
                raise ValueError(
                    f"MuonConfig: warmup={self.warmup!r} and adamw_schedulefree_warmup_steps="
                    f"{self.adamw_schedulefree_warmup_steps!r} would warm the schedule-free groups up twice "
                    "(the scheduler's warmup applies to them too); set one of them to 0"
                )

    @property
    def uses_schedule_free(self) -> bool:
        """True when the routing can send parameters to ``"adamw_schedulefree"`` groups."""
        return self.scalar_optimizer == SCHEDULE_FREE or any(r.algorithm == SCHEDULE_FREE for r in self.rules)

    def _map_megatron_names(self) -> None:
        """Carry Megatron-Core's names over to ours; a clash with a field set to another value raises.

        A field of ours left at its default takes the Megatron value; one set to the same
        value is fine; one set to a different value raises naming both.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self)}

        def take(megatron: str, ours: str, value: Any, same: Callable[[Any, Any], bool] = operator.eq) -> None:
            current = getattr(self, ours)
            if current != defaults[ours] and not same(current, value):
                raise ValueError(
                    f"MuonConfig: {megatron}={getattr(self, megatron)!r} and {ours}={current!r} disagree; "
                    f"set one of them ({megatron} maps to {ours}={value!r})"
                )
            setattr(self, ours, value)

        if self.num_ns_steps is not None:
            if isinstance(self.num_ns_steps, bool) or not isinstance(self.num_ns_steps, int) or self.num_ns_steps < 1:
                raise ValueError(f"MuonConfig.num_ns_steps must be a positive int, got {self.num_ns_steps!r}")
            take("num_ns_steps", "ns_steps", self.num_ns_steps)
        if self.coefficient_type is not None:
            take("coefficient_type", "ns_coefficients", self._megatron_schedule(), _same_schedule)
        if self.scale_mode is not None:
            if self.scale_mode not in _MEGATRON_SCALE_MODES:
                raise ValueError(
                    f"MuonConfig.scale_mode must be one of {_MEGATRON_SCALE_MODES}, got {self.scale_mode!r}"
                )
            take("scale_mode", "adjust_lr", self.scale_mode, _same_adjust_lr)
        if self.moment2_method is not None:
            if self.moment2_method not in SECOND_MOMENTS:
                raise ValueError(
                    f"MuonConfig.moment2_method must be one of {SECOND_MOMENTS}, got {self.moment2_method!r}"
                )
            take("moment2_method", "second_moment", self.moment2_method)
        if not isinstance(self.split_qkv, bool):
            raise ValueError(f"MuonConfig.split_qkv must be a bool, got {self.split_qkv!r}")
        if self.qkv_split_shapes is not None:
            shapes = tuple(self.qkv_split_shapes)
            if not shapes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shapes):
                raise ValueError(
                    "MuonConfig.qkv_split_shapes must be a non-empty list of positive ints, "
                    f"got {self.qkv_split_shapes!r}"
                )
            self.qkv_split_shapes = shapes
        if self.split_qkv and self.qkv_split_shapes is None:
            raise ValueError(
                "MuonConfig.split_qkv needs qkv_split_shapes, the rows of Q, K and V per query group "
                "(Megatron derives them from the model: heads / groups * kv_channels, kv_channels, kv_channels)"
            )

    def _megatron_schedule(self) -> str | list[tuple[float, float, float]]:
        name = self.coefficient_type
        if name == "custom":
            if isinstance(self.ns_coefficients, str):
                raise ValueError("MuonConfig: coefficient_type='custom' needs ns_coefficients as a list of (a, b, c)")
            return self.ns_coefficients
        if name not in MEGATRON_COEFFICIENTS:
            raise ValueError(
                f"MuonConfig.coefficient_type must be one of {[*MEGATRON_COEFFICIENTS, 'custom']}, got {name!r}"
            )
        schedule = MEGATRON_COEFFICIENTS[name]
        if name in ("quintic", "aol"):
            cycle = list(schedule) if isinstance(schedule, list) else list(COEFFICIENTS[schedule])
            if isinstance(self.ns_steps, int) and self.ns_steps > len(cycle):  # Megatron repeats the whole list
                return [cycle[i % len(cycle)] for i in range(self.ns_steps)]
        return schedule

    def qkv_rules(self) -> list[Rule]:
        """The routing rules ``split_qkv`` adds: fused QKV weights to Muon, split by ``qkv_split_shapes``.

        A weight matches by Megatron's ``is_qkv`` attribute or by its name (the ``QKV_NAMES`` regex). The
        split follows Megatron: the rows are query groups of ``sum(qkv_split_shapes)`` rows
        each, and Q (K, V) gathers its rows from every group.
        """
        if not self.split_qkv:
            return []
        options = {"split_sizes": list(self.qkv_split_shapes)}
        return [
            Rule(
                name="split_qkv", algorithm="muon", group="muon_qkv", attributes="is_qkv", min_ndim=2, options=options
            ),
            Rule(name="qkv_names", algorithm="muon", group="muon_qkv", regex=QKV_NAMES, min_ndim=2, options=options),
        ]

    def transposed_qkv_rules(self) -> list[Rule]:
        """GPT-2's c_attn is a Conv1D, stored (fan_in, fan_out): Q | K | V lie along dim 1.

        Tried before ``qkv_rules``: the same names and sizes, split along the output axis.
        """
        if not self.split_qkv:
            return []
        transposed = {"split_sizes": list(self.qkv_split_shapes), "transposed": True}
        return [
            Rule(
                name="qkv_names_transposed",
                algorithm="muon",
                group="muon_qkv_transposed",
                regex=QKV_NAMES,
                module_types=TRANSPOSED_MODULES,
                min_ndim=2,
                options=transposed,
            )
        ]

    @staticmethod
    def mha_rules() -> list[Rule]:
        """nn.MultiheadAttention's in_proj_weight is Q | K | V of equal size along dim 0: three parts."""
        return [
            Rule(
                name="mha_in_proj",
                algorithm="muon",
                group="muon_mha_in_proj",
                names="*in_proj_weight",
                module_types="MultiheadAttention",
                options={"split_parts": 3},
            )
        ]

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Muon``."""
        return {name: getattr(self, name) for name in _OPTIMIZER_FIELDS}

    def routing_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``route_parameters``."""
        return dict(
            rules=[
                *self.rules,
                *(self.mha_rules() if self.split_qkv else ()),
                *self.transposed_qkv_rules(),
                *self.qkv_rules(),
            ],
            default_rules=self.default_rules,
            max_aspect_ratio=self.max_aspect_ratio,
            head_names=self.head_names,
            head_by_position=self.head_by_position,
            input_layer=self.input_layer,
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


def _same_schedule(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return [tuple(float(v) for v in abc) for abc in a] == [tuple(float(v) for v in abc) for abc in b]


def _same_adjust_lr(a: str, b: str) -> bool:
    return ADJUST_LR_ALIASES.get(a, a) == ADJUST_LR_ALIASES.get(b, b)


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
