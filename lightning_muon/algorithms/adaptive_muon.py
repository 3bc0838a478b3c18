r"""``"adaptive_muon"`` groups: Muon with a second moment of its orthogonalized update, Megatron-Core's way.

Megatron-Core's ``adaptive_muon`` (NVIDIA Emerging-Optimizers 0.3.0 ``AdaptiveMuon``)
normalizes the raw orthogonalized update ``O`` by a second moment, then applies Muon's
scale. Everything else is Muon's (``MuonAlgorithm``: momentum, Newton-Schulz, ``adjust_lr``,
decay); ``second_moment`` picks the second moment (Megatron-Core's ``moment2_method``), with
``second_moment_beta2`` and ``second_moment_eps`` (its ``beta2`` and ``eps``)::

    "adamuon":  v <- beta2 v + (1 - beta2) O * O                 per element
                O <- O / (sqrt(v) + eps)
    "normuon":  v <- beta2 v + (1 - beta2) mean_long(O * O)      per row (tall, square) or column (wide)
                O <- O rsqrt(max(v, eps)) ||O||_F / max(||O rsqrt(max(v, eps))||_F, eps)
    "namo":     v <- beta2 v + (1 - beta2) ||G||_F^2             per matrix, G the raw gradient
                O <- O ||U||_F / (sqrt(v) + eps)                  U the update Newton-Schulz was fed

    W <- W (1 - lr wd) - lr * adjust(rows, cols) * extra_scale_factor * O

The same three are ``second_moment`` of a ``"muon"`` group; these groups default to
"adamuon" and take no other (Emerging-Optimizers' ``moment2_method``, ``beta2`` and ``eps``,
and Megatron-Core's ``adaptive_muon_*``, load through ``aliases``). The papers' forms differ:
AdaMuon and NorMuon rescale the normalized update to a fixed RMS, and NorMuon keeps one
statistic per output; ``second_moment="adamuon_rms"`` and
``"normuon_rms"`` rescale to plain Muon's ``||O||_F`` (``functional.muon_second_moment_``).
Megatron-Core's defaults differ from Muon's too: ``nesterov=False``, ``coefficient_type
"quintic"`` (``ns_coefficients="you"``) and ``scale_mode "spectral"`` (``adjust_lr="spectral"``);
a Megatron block (``MuonConfig.from_megatron``) sets them.

References:
    Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005, 2025.
    Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491, 2025.
    NAMO, arXiv 2602.17080, 2026.
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/adaptive_muon.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lightning_muon.algorithms.base import register_algorithm
from lightning_muon.algorithms.muon import MuonAlgorithm, MuonSettings

__all__ = ["MOMENT2_METHODS", "AdaptiveMuon", "AdaptiveMuonSettings"]

MOMENT2_METHODS = ("adamuon", "normuon", "namo")


@dataclass(frozen=True, kw_only=True)
class AdaptiveMuonSettings(MuonSettings, algorithm="adaptive_muon", defaults={"second_moment": "adamuon"}):
    """AdaptiveMuon groups: Muon's settings, its second moment one of Emerging-Optimizers' forms."""

    choices: ClassVar[dict[str, tuple]] = {**MuonSettings.choices, "second_moment": MOMENT2_METHODS}


class AdaptiveMuon(MuonAlgorithm):
    """``"adaptive_muon"``: Muon whose orthogonalized update is normalized by ``second_moment`` (module docstring)."""

    name = "adaptive_muon"
    settings = AdaptiveMuonSettings


ADAPTIVE_MUON = register_algorithm(AdaptiveMuon())
