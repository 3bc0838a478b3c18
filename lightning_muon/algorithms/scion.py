r"""``"scion"`` groups: Scion, a conditional-gradient (Frank-Wolfe) step onto a spectral-norm ball.

Scion keeps every weight matrix inside the ball ``{W : ||W||_{RMS->RMS} <= rho}`` of the
operator norm from RMS-normed inputs to RMS-normed outputs, ``||W||_{RMS->RMS} =
sqrt(fan_in / fan_out) ||W||_2``. Its linear minimization oracle over that ball,
``lmo(D) = argmin_{||S|| <= rho} <D, S> = -rho sqrt(fan_out / fan_in) U V^T`` for ``D = U S V^T``,
is Muon's orthogonalized update with a fixed scale. For a matrix ``W`` with gradient ``G``::

    B <- mu B + (1 - mu) G                         # EMA momentum, never Nesterov
    O <- NS(B)                                     # Newton-Schulz: ns_coefficients, ns_steps
    W <- (1 - lr) W - lr rho sqrt(fan_out / fan_in) O

that is ``W <- (1 - lr) W + lr lmo(B)``: a convex combination of the weight and a point on
the sphere of the ball, which keeps ``W`` in the ball when it starts there and ``lr <= 1`` (up
to Newton-Schulz's spread of singular values around 1). The shrink
``(1 - lr)`` is Emerging-Optimizers' decoupled weight decay fixed at 1, and so Scion has no
``weight_decay``, ``weight_decay_method`` or ``nesterov`` keys: ``Scion`` sets them itself
(``weight_decay=1``, ``"decoupled"``, ``nesterov=False``). ``rho`` is ``spectral_radius``;
``fan_out / fan_in`` is each matrix's own (each piece of a split tensor, each matrix of an
expert stack; a ``transposed`` one by its stored ``(fan_in, fan_out)``), Emerging-Optimizers'
``unit_rms_norm`` scale (our ``adjust_lr="spectral_norm"``).

The defaults are ``Scion``'s (Emerging-Optimizers 0.3.0); its constructor's names load through
``aliases``.

References:
    Pethick et al., "Training Deep Learning Models with Norm-Constrained LMOs", arXiv 2502.07529, 2025.
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/scion.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_muon.algorithms.base import register_algorithm
from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.emerging import EO_DEFAULTS, EmergingVariant
from lightning_muon.algorithms.families import NewtonSchulzSettings
from lightning_muon.algorithms.settings import setting

__all__ = ["FIXED", "SCION", "Scion", "ScionSettings"]

# What ``Scion``'s constructor sets itself (it takes no such keywords): a group that sets one
# otherwise is refused rather than silently overridden.
FIXED = {"weight_decay": 1.0, "weight_decay_method": "decoupled", "nesterov": False}


@dataclass(frozen=True, kw_only=True)
class ScionSettings(
    NewtonSchulzSettings,
    algorithm="scion",
    defaults={**EO_DEFAULTS, "adjust_lr": "spectral_norm"},
    fixed=FIXED,
):
    """Scion groups, Emerging-Optimizers' defaults: its Frank-Wolfe step fixes the decay at 1 and the momentum
    without Nesterov (no settings of Scion's; a group that sets them otherwise is refused)."""

    spectral_radius: float = setting(1.0, low=0.0, low_open=True)
    """Radius rho of the RMS-to-RMS spectral-norm ball the update's vertex lies on; > 0."""


class Scion(EmergingVariant):
    """``"scion"``: ``W <- (1 - lr) W - lr rho sqrt(fan_out / fan_in) NS(B)`` (module docstring)."""

    name = "scion"
    settings = ScionSettings

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        for key, fixed in FIXED.items():
            if key in group and group[key] != fixed:
                detail = (
                    f"{key} is fixed at {fixed!r} by scion's Frank-Wolfe step (it shrinks W by 1 - lr, with plain "
                    f"EMA momentum), got {group[key]!r}; drop {key!r}, or route these parameters to 'polargrad' or "
                    "'muon'"
                )
                raise HparamError(f"{where}: {detail}", key, detail)
        super().init_group(group, params, where)

    def scale(self, group: dict) -> float:
        return group["spectral_radius"]


SCION = register_algorithm(Scion())
