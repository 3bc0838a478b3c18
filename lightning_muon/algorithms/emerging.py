r"""The base of Muon variants keyed by NVIDIA Emerging-Optimizers' constructor names (``scion``, ``polargrad``, ...).

Emerging-Optimizers 0.3.0 (the library behind Megatron-Core's ``emerging_optimizers``)
steps every orthogonalized optimizer alike, for a matrix ``W`` with gradient ``G``::

    W <- decay(W)                          # weight_decay_method, before the momentum
    B <- momentum B + (1 - momentum) G     # EMA momentum
    U <- lerp(G, B, momentum) if nesterov else B
    O <- scaled_orthogonalize(U)           # the variant's own: Newton-Schulz, SVD, times a scale
    W <- W - lr O
    W <- post_update(W)                    # the variant's own: a projection back onto a set

with ``decay``, by ``weight_decay_method``: ``"decoupled"`` ``W (1 - lr wd)``,
``"independent"`` ``W (1 - wd)``, ``"palm"`` ``W (1 - lr^2 wd)``, or ``"l2"``: ``G + wd W``
feeds the momentum instead. ``EmergingVariant`` maps those names onto ``MuonAlgorithm``'s
stages: ``coefficient_type`` and ``num_ns_steps`` become the Newton-Schulz schedule
(Megatron-Core's names, ``routing.megatron.MEGATRON_COEFFICIENTS``), the decay runs in
``apply_update`` (or, for ``"l2"``, on a copy of the gradients before the momentum), and a
variant writes only its ``scale`` and its ``after_update``.

The group keys are Emerging-Optimizers' names with its defaults, plus ours where it has
none: ``ns_dtype`` (None: the fastest safe dtype, ``newton_schulz.resolve_ns_dtype``) and
the layout keys (``split_sizes``, ``batched``, ``transposed``). ``fp32_matmul_prec``
(``"highest"``, ``"high"``, ``"medium"``) scopes ``torch.set_float32_matmul_precision``
around a CUDA group's step, as Emerging-Optimizers does; a CPU's float32 matmul is exact
whatever it says.

References:
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``OrthogonalizedOptimizer`` and ``WeightDecayMixin``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_muon.algorithms.base import HparamsSource, StepContext
from lightning_muon.algorithms.checks import HparamError, check_bool, check_choice, check_int, check_number
from lightning_muon.algorithms.muon import MuonAlgorithm, MuonRound, check_muon_params, resolve_split_parts
from lightning_muon.functional import adjust_lr_ratio, muon_apply_
from lightning_muon.layout import LAYOUT_KEYS, layout_of
from lightning_muon.newton_schulz import COEFFICIENTS, check_ns_dtype, dtype_name
from lightning_muon.soap_math import matmul_precision

__all__ = [
    "EO_COEFFICIENT_TYPES",
    "MEGATRON_COEFFICIENTS",
    "FP32_MATMUL_PRECS",
    "WEIGHT_DECAY_METHODS",
    "CoefficientType",
    "EmergingVariant",
    "FP32MatmulPrec",
    "WeightDecayMethod",
    "check_emerging",
    "eo_schedule",
]

WEIGHT_DECAY_METHODS = ("decoupled", "independent", "l2", "palm")
FP32_MATMUL_PRECS = ("highest", "high", "medium")
# Emerging-Optimizers 0.3.0's ``coefficient_type`` names for its orthogonalized optimizers.
EO_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "aol", "cans", "deepseekv4")
WeightDecayMethod = Literal["decoupled", "independent", "l2", "palm"]
FP32MatmulPrec = Literal["highest", "high", "medium"]
CoefficientType = Literal["simple", "quintic", "polar_express", "aol", "cans", "deepseekv4"]


# Megatron-Core's ``coefficient_type`` names (emerging_optimizers ``muon_utils``) and their
# schedules here. Megatron cycles a list when ``num_ns_steps`` is a multiple of its length
# (and raises otherwise): those become explicit lists below.
MEGATRON_COEFFICIENTS: dict[str, str | list[tuple[float, float, float]]] = {
    "simple": "keller",  # (3.4445, -4.7750, 2.0315) at every step
    "quintic": "you",  # Megatron's default, You Jiacheng's 5-step tuning
    # The paper's 8 tuples with the 1.01 safety folded in (Megatron rounds them to 4 digits),
    # last repeated; Megatron requires num_ns_steps >= 8, shorter runs take the first tuples.
    # Megatron pre-scales by ||X||_F (NORMALIZATION["polar_express_megatron"]); our
    # "polar_express_paper" is the same list at full precision, pre-scaled by 1.01 ||X||_F.
    "polar_express": "polar_express_megatron",
    # Emerging-Optimizers 0.3.0 repeats the last tuple of these two, as ours do.
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


def eo_schedule(coefficient_type: str, num_ns_steps: int) -> str | list[tuple[float, float, float]]:
    """Our Newton-Schulz schedule for Emerging-Optimizers' ``coefficient_type`` over ``num_ns_steps`` steps.

    ``"quintic"`` and ``"aol"`` cycle their tuples when there are more steps than tuples, as
    Emerging-Optimizers does; the others repeat their last tuple, as ours do.
    """
    schedule = MEGATRON_COEFFICIENTS[coefficient_type]
    if coefficient_type in ("quintic", "aol"):
        cycle = list(COEFFICIENTS[schedule]) if isinstance(schedule, str) else list(schedule)
        if num_ns_steps > len(cycle):
            return [tuple(cycle[i % len(cycle)]) for i in range(num_ns_steps)]
    return schedule


def check_emerging(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check the keys every ``EmergingVariant`` shares, those ``group`` has; returns the normalized ones to store."""
    out: dict[str, Any] = {}
    for name in ("lr", "weight_decay"):
        if name in group:
            check_number(group[name], prefix + name, where, 0.0)
    if "momentum" in group:
        check_number(group["momentum"], prefix + "momentum", where, 0.0, 1.0, high_open=True)
    if "nesterov" in group:
        check_bool({prefix + "nesterov": group["nesterov"]}, prefix + "nesterov", where)
    for name, choices in (
        ("weight_decay_method", WEIGHT_DECAY_METHODS),
        ("fp32_matmul_prec", FP32_MATMUL_PRECS),
        ("coefficient_type", EO_COEFFICIENT_TYPES),
    ):
        if name in group:  # the keyword as the user wrote it: a group's key, or Muon's prefixed keyword
            check_choice({prefix + name: group[name]}, prefix + name, where, choices)
    if "num_ns_steps" in group:
        check_int(group["num_ns_steps"], prefix + "num_ns_steps", where, 1)
    if "extra_scale_factor" in group:
        check_number(group["extra_scale_factor"], prefix + "extra_scale_factor", where, 0.0, low_open=True)
    if "ns_dtype" in group:
        try:
            dtype = check_ns_dtype(group["ns_dtype"])
        except ValueError as err:
            detail = f"{prefix}{err}"
            raise HparamError(f"{where}: {detail}", prefix + "ns_dtype", detail) from None
        out["ns_dtype"] = None if dtype is None else dtype_name(dtype)
    for key in ("batched", "transposed"):
        if key in group:
            check_bool(group, key, where)
    return out


class EmergingVariant(MuonAlgorithm):
    """A Muon variant under Emerging-Optimizers' names: its momentum, decay and schedule (module docstring).

    A subclass sets ``name`` and ``hparams`` (the constructor's names and defaults) and
    writes ``scale`` (the group's factor on the orthogonalized update), ``adjust_lr`` where a
    factor follows each matrix's shape (Scion's ``unit_rms_norm``), and, where it projects,
    ``after_update``. ``keeps_updates`` is True for a stage that reads the update after the
    orthogonalization (PolarGrad's nuclear norm, in ``normalize``).
    """

    def option_names(self) -> frozenset[str]:
        own = {f.name for f in dataclasses.fields(self.hparams)}
        return frozenset({"name", "param_names"} | own | self.layout_options)

    def check(self, values: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
        fields = [f.name for f in dataclasses.fields(self.hparams)]
        self.make_hparams({k: values[k] for k in fields if k in values}, where, prefix)
        return check_emerging({k: values[k] for k in fields if k in values}, where, prefix)

    def group_defaults(self, config: HparamsSource) -> dict[str, Any]:
        return {
            **dataclasses.asdict(config.hparams_of(self.name)),
            **{key: None if key in ("split_sizes", "blocks") else False for key in LAYOUT_KEYS},
        }

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        resolve_split_parts(group, params, where)
        check_muon_params(group, params, where)

    # ------------------------------------------------------------------ Emerging-Optimizers' names

    def ns_options(self, group: dict) -> dict[str, Any]:
        steps = group["num_ns_steps"]
        return {
            "ns_steps": steps,
            "ns_coefficients": eo_schedule(group["coefficient_type"], steps),
            "ns_dtype": group.get("ns_dtype"),
            "ns_method": "standard",
        }

    def momentum_options(self, group: dict) -> tuple[float, bool, str]:
        return group["momentum"], group.get("nesterov", False), "ema"

    def second_moment_method(self, group: dict) -> str | None:
        return None

    def weight_decay(self, group: dict) -> tuple[float, str]:
        """``(weight_decay, weight_decay_method)`` of the group (Scion fixes its own)."""
        return group.get("weight_decay", 0.0), group.get("weight_decay_method", "decoupled")

    def adjust_lr(self, group: dict) -> str:
        """The factor by each piece's shape on its update (``functional.ADJUST_LR_MODES``); ``"none"`` here.

        A variant whose scale depends only on the shape (Scion's ``unit_rms_norm``) names it
        here: each piece of a split or batched tensor then takes its own fan-out and fan-in.
        """
        return "none"

    # ------------------------------------------------------------------ the stages

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        with matmul_precision(group.get("fp32_matmul_prec"), params[0].device):
            super().step_group(ctx, group, params, grads)

    def momentum(
        self, ctx: StepContext, group: dict, rnd: MuonRound, out_dtypes: list[torch.dtype] | None = None
    ) -> list[Tensor]:
        wd, method = self.weight_decay(group)
        if method == "l2" and wd != 0.0:
            # L2 regularization: the decay joins the gradient the momentum sees (a copy: the
            # user's .grad stays what backward made).
            rnd.grads = torch._foreach_add(rnd.grads, rnd.params, alpha=wd)
        return super().momentum(ctx, group, rnd, out_dtypes)

    def scale(self, group: dict) -> float:
        """The group's factor on every orthogonalized piece, with ``adjust_lr``'s by shape (before the lr)."""
        raise NotImplementedError(f"{type(self).__name__} does not define scale")

    def update_scale(self, group: dict, fan_out: int, fan_in: int) -> float:
        return adjust_lr_ratio(self.adjust_lr(group), fan_out, fan_in, self.scale(group))

    def apply_update(self, ctx: StepContext, group: dict, rnd: MuonRound) -> None:
        """``W <- decay(W) - lr adjust(fan_out, fan_in) scale O``, each piece with its own shape's factor."""
        lr = group["lr"]
        wd, method = self.weight_decay(group)
        factor = {"decoupled": lr * wd, "independent": wd, "palm": lr * lr * wd, "l2": 0.0}[method]
        if factor != 0.0:
            # W + (-factor) W, as Emerging-Optimizers writes it: 1 - factor would round to 1 for
            # palm's lr^2 wd below float32's spacing near 1, and the decay would vanish.
            torch._foreach_add_(rnd.params, rnd.params, alpha=-factor)
        layout, adjust, scale = layout_of(group), self.adjust_lr(group), self.scale(group)
        muon_apply_(
            rnd.params, rnd.ortho, layout=layout, lr=lr, weight_decay=0.0, adjust_lr=adjust, extra_scale_factor=scale
        )
