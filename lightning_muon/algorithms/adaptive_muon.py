r"""``"adaptive_muon"`` groups: Muon with a second moment of its orthogonalized update, Megatron-Core's way.

Megatron-Core's ``adaptive_muon`` (NVIDIA Emerging-Optimizers 0.3.0 ``AdaptiveMuon``)
normalizes the raw orthogonalized update ``O`` by a second moment, then applies Muon's
scale. Everything else is Muon's (``MuonAlgorithm``: momentum, Newton-Schulz, ``adjust_lr``,
decay); ``moment2_method`` picks the second moment, with ``beta2`` and ``eps``::

    "adamuon":  v <- beta2 v + (1 - beta2) O * O                 per element
                O <- O / (sqrt(v) + eps)
    "normuon":  v <- beta2 v + (1 - beta2) mean_long(O * O)      per row (tall, square) or column (wide)
                O <- O rsqrt(max(v, eps)) ||O||_F / max(||O rsqrt(max(v, eps))||_F, eps)
    "namo":     v <- beta2 v + (1 - beta2) ||G||_F^2             per matrix, G the raw gradient
                O <- O ||U||_F / (sqrt(v) + eps)                  U the update Newton-Schulz was fed

    W <- W (1 - lr wd) - lr * adjust(rows, cols) * extra_scale_factor * O

The same three are ``second_moment`` of a ``"muon"`` group; these groups name them as
Megatron-Core does, and ``MuonConfig``'s ``adaptive_muon_moment2_method``,
``adaptive_muon_beta2`` and ``adaptive_muon_eps`` (its ``OptimizerConfig`` names) set their
defaults. The papers' forms differ: AdaMuon and NorMuon rescale the normalized update to a
fixed RMS, and NorMuon keeps one statistic per output; ``second_moment="adamuon_rms"`` and
``"normuon_rms"`` rescale to plain Muon's ``||O||_F`` (``functional.muon_second_moment_``).
Megatron-Core's defaults differ from Muon's too: ``nesterov=False``, ``coefficient_type
"quintic"`` (``ns_coefficients="you"``) and ``scale_mode "spectral"`` (``adjust_lr``).

References:
    Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005, 2025.
    Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491, 2025.
    NAMO, arXiv 2602.17080, 2026.
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/adaptive_muon.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from lightning_muon.algorithms.base import HparamsSource, register_algorithm
from lightning_muon.algorithms.checks import HparamError, check_choice, check_number, normalize
from lightning_muon.algorithms.muon import MUON, MuonAlgorithm

__all__ = ["MOMENT2_METHODS", "AdaptiveMuon", "AdaptiveMuonHparams", "check_adaptive_muon"]

MOMENT2_METHODS = ("adamuon", "normuon", "namo")


@dataclass(frozen=True, kw_only=True)
class AdaptiveMuonHparams:
    """AdaptiveMuon's own group keys (Megatron-Core's ``adaptive_muon_*``); its other knobs are Muon's."""

    moment2_method: Literal["adamuon", "normuon", "namo"] = "adamuon"
    """The second moment: "adamuon" (per element), "normuon" (per row or column) or "namo" (per matrix)."""
    beta2: float = 0.95
    """Decay of the second moment, in [0, 1)."""
    eps: float = 1e-8
    """"adamuon", "namo": added to the root of the second moment; "normuon": its floor; > 0."""

    prefix = "adaptive_muon_"  # not a field: Muon's keywords and MuonConfig's fields are these, prefixed

    def __post_init__(self) -> None:
        normalize(self, check_adaptive_muon(dataclasses.asdict(self), "Muon()", self.prefix))


def check_adaptive_muon(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check AdaptiveMuon's own keys in ``group``; returns them to store."""
    check_choice(group, "moment2_method", where, MOMENT2_METHODS)
    check_number(group["beta2"], prefix + "beta2", where, 0.0, 1.0, high_open=True)
    check_number(group["eps"], prefix + "eps", where, 0.0, low_open=True)
    if group.get("second_moment") is not None:
        detail = (
            f"adaptive_muon takes its second moment from moment2_method, so second_moment must be None, "
            f"got {group['second_moment']!r}"
        )
        raise HparamError(f"{where}: {detail}", "second_moment", detail)
    return {}


class AdaptiveMuon(MuonAlgorithm):
    """``"adaptive_muon"``: Muon whose orthogonalized update is normalized by ``moment2_method`` (module docstring)."""

    name = "adaptive_muon"
    hparams = AdaptiveMuonHparams

    def option_names(self) -> frozenset[str]:
        return MUON.option_names() | super().option_names()

    def check(self, values: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
        return {**super().check(values, where, prefix), **check_adaptive_muon(values, where, prefix)}

    def group_defaults(self, config: HparamsSource) -> dict[str, Any]:
        own = dataclasses.asdict(config.hparams_of(self.name))
        return {**super().group_defaults(config), "second_moment": None, **own}  # not Muon's second moment

    def second_moment_method(self, group: dict) -> str | None:
        return group["moment2_method"]

    def second_moment_options(self, group: dict) -> tuple[float, float]:
        return group["beta2"], group["eps"]


ADAPTIVE_MUON = register_algorithm(AdaptiveMuon())
