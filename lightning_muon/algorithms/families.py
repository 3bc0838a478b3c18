"""The settings every algorithm of a family shares, each declared once (``settings.Settings``).

- ``MatrixSettings``: the algorithms of the hidden matrices (``MuonConfig.matrix``): lr, weight
  decay and how it applies, and the float32 matmul precision.
- ``OrthogonalizedSettings``: those that step along an orthogonalized momentum (Muon and its
  variants, MOP): momentum, Nesterov, the update's scale by shape.
- ``NewtonSchulzSettings``: those whose orthogonalization is Newton-Schulz: its schedule, steps,
  dtype, method, and tensor-parallel mode.
- ``ScalarSettings``: the algorithms of everything else (``MuonConfig.scalar``): lr and weight
  decay; ``AdamLikeSettings`` adds Adam's betas and eps.

A variant derives from one of these and declares only what is its own (``algorithms.scion``:
``spectral_radius``), changing a shared default in its class statement (``defaults={"lr": 3e-4}``).

``fp32_matmul_prec`` (Emerging-Optimizers' and Megatron-Core's name) says which precision the
algorithm's float32 work may run in: ``"highest"`` float32 Newton-Schulz and float32 matmuls,
``"high"`` float32 Newton-Schulz with TF32 matmuls where the device has them, ``"medium"`` the
fastest safe dtype (``newton_schulz.resolve_ns_dtype``: bf16 where its matmul is fast). An
``ns_dtype`` set by the user wins over it (``algorithms.muon.MuonHparams``).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from lightning_muon.algorithms.settings import Settings, choices_of, setting
from lightning_muon.functional import ADJUST_LR_MODES
from lightning_muon.newton_schulz import NSMethod, check_ns_dtype, coefficient_list, dtype_name, resolve_coefficients

__all__ = [
    "SHAPE_SCALES",
    "UNSIGNED_DECAY_METHODS",
    "AdamLikeSettings",
    "AdjustLR",
    "CoefficientName",
    "FP32MatmulPrec",
    "MatrixSettings",
    "NSDtype",
    "NewtonSchulzSettings",
    "OrthogonalizedSettings",
    "ScalarSettings",
    "TPMode",
    "WeightDecayMethod",
    "checked_betas",
]

WeightDecayMethod = Literal["decoupled", "independent", "l2", "palm", "cautious"]
# The methods of an algorithm whose update has no sign to agree with (SOAP, LaProp): all but "cautious".
UNSIGNED_DECAY_METHODS = tuple(m for m in typing.get_args(WeightDecayMethod) if m != "cautious")
FP32MatmulPrec = Literal["highest", "high", "medium"]
# ``functional.ADJUST_LR_MODES``, and MOP's nuclear norm.
AdjustLR = Literal["original", "match_rms_adamw", "spectral", "spectral_norm", "none", "nuclear_norm"]
CoefficientName = Literal[
    "polar_express", "polar_express_paper", "polar_express_megatron", "keller", "you", "cubic", "cans", "deepseekv4"
]
NSDtype = Literal["float32", "bfloat16", "float64", "float16"]
# How a matrix split by tensor parallelism is orthogonalized (``distributed.tensor_parallel``).
TPMode = Literal["duplicated", "distributed", "blockwise"]
Betas = tuple[float, float]
# The scales by shape every orthogonalized algorithm takes (``functional.adjust_lr_ratio``).
SHAPE_SCALES = tuple(ADJUST_LR_MODES)


def _dtype_name(value: Any) -> Any:
    """A ``torch.dtype`` or a short name ("bf16", "fp32") by its full name ("bfloat16"); anything else as it is."""
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return {"bf16": "bfloat16", "fp32": "float32"}.get(value, value) if isinstance(value, str) else value


@dataclass(frozen=True, kw_only=True)
class MatrixSettings(Settings):
    """The settings of every algorithm of the hidden matrices."""

    lr: float = setting(0.02, low=0.0, tensor=True)
    """Learning rate (the peak, before the schedule); a 1-element Tensor is kept as given (LR schedulers fill it)."""
    weight_decay: float = setting(0.0, low=0.0)
    """Weight decay coefficient; how it applies is ``weight_decay_method``."""
    weight_decay_method: WeightDecayMethod = "decoupled"
    """"decoupled" W (1 - lr wd), "independent" W (1 - wd), "palm" W (1 - lr^2 wd), "l2" adds wd W to the
    gradient, "cautious" decoupled only where the update and the weight agree in sign (arXiv 2510.12402)."""
    fp32_matmul_prec: FP32MatmulPrec = "medium"
    """Precision of the float32 work: "highest" float32 Newton-Schulz and matmuls, "high" float32 Newton-Schulz with
    TF32 matmuls where the device has them, "medium" the fastest safe dtype (bf16 Newton-Schulz where its matmul is
    fast; float64 parameters stay float64); ns_dtype wins over it."""


@dataclass(frozen=True, kw_only=True)
class OrthogonalizedSettings(MatrixSettings):
    """The settings of the algorithms that step along an orthogonalized momentum."""

    choices: ClassVar[dict[str, tuple]] = {"adjust_lr": SHAPE_SCALES}  # MOP adds "nuclear_norm"

    momentum: float = setting(0.95, low=0.0, high=1.0, high_open=True)
    """Momentum mu in [0, 1): B <- mu B + (1 - mu) G."""
    nesterov: bool = True
    """Orthogonalize (1 - mu) G + mu B (Nesterov) instead of B."""
    adjust_lr: AdjustLR = "original"
    """The update's scale by each matrix's shape: "original" sqrt(max(1, out/in)), "match_rms_adamw"
    0.2 sqrt(max(out, in)), "spectral" sqrt(max(out, in)), "spectral_norm" sqrt(out/in), "none"."""
    extra_scale_factor: float = setting(1.0, low=0.0, low_open=True)
    """Multiplies the update's scale; > 0."""


@dataclass(frozen=True, kw_only=True)
class NewtonSchulzSettings(OrthogonalizedSettings):
    """The settings of the algorithms that orthogonalize by Newton-Schulz."""

    ns_steps: int = setting(5, low=1, integer=True)
    """Newton-Schulz iterations."""
    ns_coefficients: CoefficientName | list[tuple[float, float, float]] | tuple[float, float, float] = "polar_express"
    """A schedule name in COEFFICIENTS or a list of (a, b, c), one per step (the last repeats); one (a, b, c),
    torch.optim.Muon's form, is every step's (stored as a list of one)."""
    ns_eps: float | None = setting(None, low=0.0, low_open=True)
    """Newton-Schulz's pre-scaling floor (torch.optim.Muon's eps): X = U / max(||U||_F * safety, ns_eps), so a U
    whose norm is below it is divided by it and stays small; None: the schedule's own, X = U / (||U||_F * safety +
    eps) (safety 1, eps 1e-7; polar_express 1.02 and 1e-6, polar_express_paper 1.01 and 1e-7); > 0."""
    ns_dtype: NSDtype | None = setting(None, convert=_dtype_name)
    """Newton-Schulz dtype; None: as fp32_matmul_prec says (automatic under "medium")."""
    ns_method: NSMethod = "auto"
    """"standard", "gram" (Gram Newton-Schulz on wide matrices) or "auto" (gram where it was measured faster)."""
    tp_mode: TPMode = "duplicated"
    """Matrices split by tensor parallelism (2-D meshes): "duplicated" gathered whole (exact),
    "distributed" Gram matrices all-reduced (exact), "blockwise" each block alone (approximate)."""

    def normalize(self) -> None:
        try:
            resolve_coefficients(self.ns_coefficients, self.ns_steps)
        except (TypeError, ValueError) as err:
            raise self.error("ns_coefficients", str(err).removeprefix("ns_coefficients").lstrip(": ")) from None
        if not isinstance(self.ns_coefficients, str):
            self._set("ns_coefficients", coefficient_list(self.ns_coefficients))
        try:
            dtype = check_ns_dtype(self.ns_dtype)
        except ValueError as err:
            raise self.error("ns_dtype", str(err)) from None
        self._set("ns_dtype", None if dtype is None else dtype_name(dtype))


@dataclass(frozen=True, kw_only=True)
class ScalarSettings(Settings):
    """The settings of every algorithm of the parameters that are not hidden matrices."""

    lr: float = setting(3e-4, low=0.0, tensor=True)
    """Learning rate (the peak, before the schedule); a 1-element Tensor is kept as given (LR schedulers fill it)."""
    weight_decay: float = setting(0.0, low=0.0)
    """Decoupled weight decay: W (1 - lr wd)."""


@dataclass(frozen=True, kw_only=True)
class AdamLikeSettings(ScalarSettings):
    """The settings of the algorithms with Adam's moments."""

    betas: Betas = (0.9, 0.95)
    """(beta1, beta2): the decays of the first and second moments, each in [0, 1)."""
    eps: float = setting(1e-8, low=0.0, low_open=True)
    """Added to the root of the second moment; > 0."""

    def normalize(self) -> None:
        self._set("betas", checked_betas(self, self.betas))


def checked_betas(settings: Settings, betas: Any, beta1_open: bool = False) -> Betas:
    """``betas`` as a pair of floats in [0, 1) (``beta1_open``: beta1 in (0, 1)), or ``settings.error``."""
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2
    if ok:
        low = 0.0
        ok = all(
            isinstance(b, (int, float))
            and not isinstance(b, bool)
            and (b > low if k == 0 and beta1_open else b >= low)
            and b < 1.0
            for k, b in enumerate(betas)
        )
    if not ok:
        lo = "(0, 1)" if beta1_open else "[0, 1)"
        raise settings.error(
            "betas", f"must be a pair (beta1, beta2), beta1 in {lo} and beta2 in [0, 1), got {betas!r}"
        )
    return (float(betas[0]), float(betas[1]))


if set(choices_of(OrthogonalizedSettings, "adjust_lr")) != {*SHAPE_SCALES, "nuclear_norm"}:  # the Literal, the table
    raise RuntimeError("AdjustLR does not list functional.ADJUST_LR_MODES and 'nuclear_norm'")
