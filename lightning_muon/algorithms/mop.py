r"""``"mop"`` groups: MOP, the momentum's exact polar factor by SVD, scaled by its nuclear norm or by shape.

Emerging-Optimizers names it "Momentum Orthogonalized by Polar decomposition" and marks it
experimental ("not yet thoroughly tested"). It is Muon with the Newton-Schulz iteration
replaced by the SVD: for ``U = P S Q^T`` (thin SVD) the polar factor is ``P Q^T``. For a
matrix ``W`` with gradient ``G``::

    W <- decay(W)                                  # weight_decay_method (EmergingVariant)
    B <- mu B + (1 - mu) G
    U <- (1 - mu) G + mu B   if nesterov else B
    O <- P Q^T                                     # U = P S Q^T
    W <- W - lr extra_scale_factor s O

with ``s``, by ``adjust_lr`` (Emerging-Optimizers' ``scale_mode``): ``"nuclear_norm"``
``||U||_* = sum_i S_i`` (PolarGrad's steepest descent in the spectral norm, which
Emerging-Optimizers cites for it), or a Muon scale by the matrix's shape: ``"original"``
``sqrt(max(1, fan_out / fan_in))``, ``"spectral"`` ``sqrt(max(fan_out, fan_in))``,
``"spectral_norm"`` ``sqrt(fan_out / fan_in)``.

The SVD runs on whole matrices in float32 at least (``PolarFactorSVD``, through
``MuonAlgorithm.map_tensors``): a sharding runs it where each matrix is whole
(``Sharding.map_whole``), as it does Newton-Schulz, with no narrower wire dtype. The nuclear
norm is taken as ``<O, U>``, equal to ``sum_i S_i`` for the exact polar factor, so that a
sharding sums it over row blocks as it does PolarGrad's (``polargrad.scale_by_nuclear_norm``).
Each piece of a split tensor and each matrix of an expert stack is its own matrix.

One difference from Emerging-Optimizers: singular values at rounding level
(``S_i <= S_max max(rows, cols) eps``, ``torch.linalg.matrix_rank``'s tolerance) span no
direction of ``U``, and their singular vectors are arbitrary; Emerging-Optimizers keeps them,
so a zero or low-rank momentum (a first step from a rank-one gradient) moves the weight along
arbitrary directions. ``PolarFactorSVD`` drops them, as Newton-Schulz maps small singular
values to small ones. Full-rank updates are unaffected.

The defaults are ``MOP``'s (Emerging-Optimizers 0.3.0); its constructor's names load through
``aliases``.

References:
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/mop.py`` (``MOP``).
    Lau, Long, Su, "PolarGrad: A Class of Matrix-Gradient Optimizers from a Unifying
    Preconditioning Perspective", arXiv 2505.21799, 2025 (the nuclear-norm scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from lightning_muon.algorithms.base import StepContext, register_algorithm
from lightning_muon.algorithms.emerging import EO_DEFAULTS, EmergingVariant
from lightning_muon.algorithms.families import SHAPE_SCALES, OrthogonalizedSettings
from lightning_muon.algorithms.muon import MuonHparams, MuonRound
from lightning_muon.algorithms.polargrad import scale_by_nuclear_norm

__all__ = ["MOP", "MOPSettings", "MOP_ALGORITHM", "POLAR_FACTOR_SVD", "PolarFactorSVD"]


@dataclass(frozen=True, kw_only=True)
class MOPSettings(
    OrthogonalizedSettings,
    algorithm="mop",
    defaults={
        **{k: v for k, v in EO_DEFAULTS.items() if not k.startswith("ns_")},
        "weight_decay": 0.01,
        "fp32_matmul_prec": "highest",
        "adjust_lr": "nuclear_norm",
    },
):
    """MOP groups, Emerging-Optimizers' defaults: ``adjust_lr`` also takes "nuclear_norm" (its ``scale_mode``)."""

    choices: ClassVar[dict[str, tuple]] = {
        **OrthogonalizedSettings.choices,
        "adjust_lr": (*SHAPE_SCALES, "nuclear_norm"),
    }


class PolarFactorSVD:
    """``P Q^T`` of the thin SVD ``X = P S Q^T``, without the directions of rounding-level singular values."""

    def __call__(self, X: Tensor) -> Tensor:  # (rows, cols), float32 or float64
        if X.numel() == 0:
            return X.clone()
        P, S, Qh = torch.linalg.svd(X, full_matrices=False)  # (rows, k), (k,), (k, cols)
        # torch.linalg.matrix_rank's tolerance: below it a singular vector is rounding noise
        # (and all of them for a zero X, which then maps to zero, as Newton-Schulz maps it).
        tol = S[0] * max(X.shape) * torch.finfo(S.dtype).eps
        return (P * (tol < S).to(P.dtype)) @ Qh


POLAR_FACTOR_SVD = PolarFactorSVD()


class MOP(EmergingVariant):
    """``"mop"``: ``W <- decay(W) - lr extra_scale_factor s polar(U)`` (module docstring)."""

    name = "mop"
    settings = MOPSettings

    def plan(self, rnd: MuonRound) -> None:
        return None  # no Newton-Schulz: the SVD reads each update in its own dtype (float32 at least)

    def orthogonalize(
        self,
        ctx: StepContext,
        rnd: MuonRound,
        tensors: list[Tensor] | None = None,
        donate: bool = False,
        observe: bool = True,
    ) -> list[list[Tensor]]:
        """Per update, the polar factors of its matrices by SVD, each matrix whole (on its owner under a sharding)."""
        tensors = rnd.updates if tensors is None else tensors
        return self.map_tensors(ctx, rnd, tensors, POLAR_FACTOR_SVD, donate=donate, observe=observe)

    def work_dtype(self, hp: MuonHparams) -> torch.dtype:
        # A float64 work dtype makes step_memory's round estimate err high, as an SVD's workspace does.
        return torch.float64

    keeps_updates = True  # with adjust_lr="nuclear_norm", <O, U> reads the updates after the SVD

    def normalize(self, ctx: StepContext, rnd: MuonRound) -> list[list[Tensor]]:
        if rnd.group["adjust_lr"] != "nuclear_norm":
            return rnd.ortho
        return scale_by_nuclear_norm(ctx, rnd)


MOP_ALGORITHM = register_algorithm(MOP())
