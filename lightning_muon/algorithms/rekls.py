"""``"rekls"`` groups: REKLS, SOAP with KL-Shampoo's factors and a fresh eigendecomposition every step.

The hyperparameters are NVIDIA Emerging-Optimizers' ``REKLS`` (0.3.0): its constructor's
names and defaults. Everything else is fixed at ``SOAP``'s defaults but for the two flags
that make it REKLS (``use_eigh=True``, ``use_kl_shampoo=True``); the step and the state are
``SOAP``'s (``algorithms.soap``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_muon.algorithms.adamw import Betas
from lightning_muon.algorithms.base import register_algorithm
from lightning_muon.algorithms.checks import normalize
from lightning_muon.algorithms.soap import SOAP, SOAPHparams, check_soap
from lightning_muon.soap_math import WeightDecayMethod

__all__ = ["REKLS", "REKLSHparams", "REKLS_ALGORITHM", "check_rekls"]

# SOAP's settings that REKLS does not take as hyperparameters: its defaults, the two REKLS flags set.
_FIXED = {
    name: value
    for name, value in dataclasses.asdict(SOAPHparams(use_eigh=True, use_kl_shampoo=True)).items()
    if name not in {"lr", "betas", "shampoo_beta", "eps", "weight_decay", "weight_decay_method"}
}


@dataclass(frozen=True, kw_only=True)
class REKLSHparams:
    """REKLS groups, with Emerging-Optimizers' ``REKLS`` names and defaults (``rekls_*`` keywords)."""

    lr: float = 3e-3
    """Learning rate (peak); follows the same schedule as Muon's. Emerging-Optimizers has no
    default; 3e-3 is SOAP's here (``SOAPHparams.lr``)."""
    betas: Betas = (0.9, 0.95)
    """(beta1, beta2) of the inner Adam, each in [0, 1)."""
    shampoo_beta: float = 0.95
    """EMA rate of the Kronecker factors, in [0, 1)."""
    eps: float = 1e-8
    """Added to the inner Adam's root of the second moment, and the floor under the factors'
    eigenvalues that KL-Shampoo inverts; > 0."""
    weight_decay: float = 0.01
    """Weight decay coefficient; how it applies is ``weight_decay_method``."""
    weight_decay_method: WeightDecayMethod = "decoupled"
    """"decoupled" ``W (1 - lr wd)``, "independent" ``W (1 - wd)``, "l2" ``g + wd W`` (the inner
    Adam's gradient), "palm" ``W (1 - lr^2 wd)``."""

    prefix = "rekls_"  # not a field: the prefix of these knobs among Muon's keywords

    def __post_init__(self) -> None:
        normalize(self, check_rekls(dataclasses.asdict(self), "Muon()", self.prefix))


def check_rekls(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check REKLS's hyperparameters in ``group``; returns the normalized values (``betas`` a tuple)."""
    return check_soap({**group, **_FIXED}, where, prefix)


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
    hparams = REKLSHparams

    def check(self, values: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
        return check_rekls(values, where, prefix)

    def settings(self, group: dict[str, Any]) -> dict[str, Any]:
        return super().settings({**group, **_FIXED})  # a stray use_eigh key changes nothing


REKLS_ALGORITHM = register_algorithm(REKLS())
