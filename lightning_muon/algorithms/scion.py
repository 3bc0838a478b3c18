r"""``"scion"`` groups: Scion, a conditional-gradient (Frank-Wolfe) step onto a spectral-norm ball.

Scion keeps every weight matrix inside the ball ``{W : ||W||_{RMS->RMS} <= rho}`` of the
operator norm from RMS-normed inputs to RMS-normed outputs, ``||W||_{RMS->RMS} =
sqrt(fan_in / fan_out) ||W||_2``. Its linear minimization oracle over that ball,
``lmo(D) = argmin_{||S|| <= rho} <D, S> = -rho sqrt(fan_out / fan_in) U V^T`` for ``D = U S V^T``,
is Muon's orthogonalized update with a fixed scale. For a matrix ``W`` with gradient ``G``::

    B <- mu B + (1 - mu) G                         # EMA momentum, never Nesterov
    O <- NS(B)                                     # Newton-Schulz: coefficient_type, num_ns_steps
    W <- (1 - lr) W - lr rho sqrt(fan_out / fan_in) O

that is ``W <- (1 - lr) W + lr lmo(B)``: a convex combination of the weight and a point on
the sphere of the ball, which keeps ``W`` in the ball when it starts there and ``lr <= 1`` (up
to Newton-Schulz's spread of singular values around 1). The shrink
``(1 - lr)`` is Emerging-Optimizers' decoupled weight decay fixed at 1, and so Scion has no
``weight_decay``, ``weight_decay_method`` or ``nesterov`` keys: ``Scion`` sets them itself
(``weight_decay=1``, ``"decoupled"``, ``nesterov=False``). ``rho`` is ``spectral_radius``;
``fan_out / fan_in`` is each matrix's own (each piece of a split tensor, each matrix of an
expert stack; a ``transposed`` one by its stored ``(fan_in, fan_out)``), Emerging-Optimizers'
``unit_rms_norm`` scale.

The keys are ``Scion``'s constructor names and defaults (Emerging-Optimizers 0.3.0), plus
``ns_dtype`` (``EmergingVariant``).

References:
    Pethick et al., "Training Deep Learning Models with Norm-Constrained LMOs", arXiv 2502.07529, 2025.
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/scion.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_muon.algorithms.base import register_algorithm
from lightning_muon.algorithms.checks import HparamError, check_number, normalize
from lightning_muon.algorithms.emerging import CoefficientType, EmergingVariant, FP32MatmulPrec, check_emerging
from lightning_muon.algorithms.muon import NSDtype

__all__ = ["FIXED", "SCION", "Scion", "ScionHparams", "check_scion"]

# What ``Scion``'s constructor sets itself (it takes no such keywords): a group that sets one
# otherwise is refused rather than silently overridden.
FIXED = {"weight_decay": 1.0, "weight_decay_method": "decoupled", "nesterov": False}


@dataclass(frozen=True, kw_only=True)
class ScionHparams:
    """Scion groups, with Emerging-Optimizers' ``Scion`` names and defaults (weight decay 1 and no Nesterov, fixed)."""

    lr: float = 3e-4
    """Step size of the conditional-gradient step (peak, before the schedule); the weight also shrinks by ``1 - lr``."""
    momentum: float = 0.95
    """EMA momentum ``mu`` in [0, 1): ``B <- mu B + (1 - mu) G``."""
    fp32_matmul_prec: FP32MatmulPrec = "medium"
    """``torch.set_float32_matmul_precision`` around a CUDA group's step: "highest", "high" or "medium"."""
    coefficient_type: CoefficientType = "quintic"
    """Newton-Schulz coefficients by Emerging-Optimizers' name: "simple", "quintic", "polar_express", "aol", ..."""
    num_ns_steps: int = 5
    """Newton-Schulz iterations; >= 1."""
    spectral_radius: float = 1.0
    """Radius ``rho`` of the RMS-to-RMS spectral-norm ball the update's vertex lies on; > 0."""
    ns_dtype: NSDtype | None = None
    """Newton-Schulz dtype: None (automatic: bf16 where its matmul is fast), "float32", "bfloat16", ..."""

    prefix = "scion_"  # not a field: Muon's keywords and MuonConfig's fields are these, prefixed

    def __post_init__(self) -> None:
        normalize(self, check_scion(dataclasses.asdict(self), "Muon()", self.prefix))


def check_scion(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check Scion's keys in ``group`` (the shared ones: ``check_emerging``); returns the normalized ones to store."""
    out = check_emerging(group, where, prefix)
    check_number(group["spectral_radius"], prefix + "spectral_radius", where, 0.0, low_open=True)
    return out


class Scion(EmergingVariant):
    """``"scion"``: ``W <- (1 - lr) W - lr rho sqrt(fan_out / fan_in) NS(B)`` (module docstring)."""

    name = "scion"
    hparams = ScionHparams

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        for key, fixed in FIXED.items():
            if key in group and group[key] != fixed:
                detail = (
                    f"scion fixes {key}={fixed!r} (its Frank-Wolfe step shrinks W by 1 - lr, with plain EMA "
                    f"momentum), got {group[key]!r}; drop {key!r}, or route these parameters to 'polargrad' or 'muon'"
                )
                raise HparamError(f"{where}: {detail}", key, detail)
        super().init_group(group, params, where)

    def momentum_options(self, group: dict) -> tuple[float, bool, str]:
        return group["momentum"], False, "ema"  # Scion's momentum is never Nesterov

    def weight_decay(self, group: dict) -> tuple[float, str]:
        # The Frank-Wolfe step's (1 - lr) W: Emerging-Optimizers' decoupled decay fixed at 1.
        return 1.0, "decoupled"

    def adjust_lr(self, group: dict) -> str:
        return "unit_rms_norm"  # sqrt(fan_out / fan_in) per matrix

    def scale(self, group: dict) -> float:
        return group["spectral_radius"]


SCION = register_algorithm(Scion())
