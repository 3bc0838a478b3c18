"""``"rekls"`` groups: REKLS, SOAP with KL-Shampoo's factors and a fresh eigendecomposition every step.

The hyperparameters are NVIDIA Emerging-Optimizers' ``REKLS`` (0.3.0): its constructor's
names and defaults. Everything else is fixed at ``SOAP``'s defaults but for the two flags
that make it REKLS (``use_eigh=True``, ``use_kl_shampoo=True``); the step and the state are
``SOAP``'s (``algorithms.soap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_muon.algorithms.base import register_algorithm
from lightning_muon.algorithms.soap import SOAP, ShampooSettings, SOAPSettings

__all__ = ["REKLS", "REKLSSettings", "REKLS_ALGORITHM"]

# SOAP's settings that REKLS does not take: their defaults, the two REKLS flags set.
_FIXED = {
    name: value
    for name, value in SOAPSettings(use_eigh=True, use_kl_shampoo=True).asdict().items()
    if name not in ShampooSettings.field_names()
}


@dataclass(frozen=True, kw_only=True)
class REKLSSettings(ShampooSettings, algorithm="rekls"):
    """REKLS groups, Emerging-Optimizers' defaults: SOAP's, its bases by eigh every step."""


class REKLS(SOAP):
    r"""``"rekls"``: SOAP whose bases are the eigenvectors of KL-Shampoo's factors, recomputed every step.

    Per matrix ``W`` (m, n) with gradient ``G``, at step ``t`` (from 1), with ``b_t`` the
    bias-corrected ``shampoo_beta`` and the eigenvalue estimates ``λ = diag(Q^T L Q)`` in the
    bases of the step before::

        L <- b_t L + (1 - b_t) / n  G Q_R diag(1 / max(λ_R, eps)) Q_R^T G^T
        R <- b_t R + (1 - b_t) / m  G^T Q_L diag(1 / max(λ_L, eps)) Q_L^T G
        Q_L, Q_R <- eigh(L), eigh(R)                   # "realtime": this step's factors
        G' = Q_L^T G Q_R;   M <- b1 M + (1 - b1) G';   V <- b2 V + (1 - b2) G'^2
        W <- W (1 - lr wd) - lr Q_L [(M / c1) / (sqrt(V / c2) + eps)] Q_R^T

    References:
        Lin et al., "Understanding and Improving Shampoo and SOAP via Kullback-Leibler
        Minimization", arXiv 2509.03378, 2025.
        Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv 2409.11321, 2024.
        NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``soap/rekls.py``.
    """

    name = "rekls"
    settings = REKLSSettings

    def update_options(self, group: dict[str, Any]) -> dict[str, Any]:
        return super().update_options({**group, **_FIXED})  # SOAP's flags as REKLS fixes them


REKLS_ALGORITHM = register_algorithm(REKLS())
