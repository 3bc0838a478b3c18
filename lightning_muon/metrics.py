r"""Spectral metrics of update matrices: pure functions and torchmetrics ``Metric`` classes.

For a matrix ``A`` (m x n, k = min(m, n)) with singular values
``s_1 >= s_2 >= ... >= s_k >= 0``:

=========================  ====================================================================
``sigma_max``              ``s_1 = ||A||_2``, the spectral norm.
``sigma_min``              smallest *kept* singular value: ``min {s_i : s_i > rtol * s_1}``
                           (0 for the zero matrix). Directions weaker than ``rtol`` times the
                           strongest are treated as numerically absent, so round-off in a
                           rank-deficient matrix does not read as a tiny singular value.
``stable_rank``            ``||A||_F^2 / ||A||_2^2 = sum s_i^2 / s_1^2`` (Rudelson & Vershynin).
``effective_rank``         ``exp(H(p))`` with ``p_i = s_i / sum_j s_j`` and ``H`` the Shannon
                           entropy (Roy & Vetterli): k for a flat spectrum, 1 for rank one.
``orthogonality_error``    ``||G - I||_F / sqrt(k)`` with ``G`` the k x k Gram matrix on the
                           short side (``A A^T`` if m <= n, else ``A^T A``); equal to
                           ``sqrt(mean_i (s_i^2 - 1)^2)``: 0 for a semi-orthogonal matrix.
``rms``                    ``||A||_F / sqrt(m n)``.
=========================  ====================================================================

Stable and effective rank are 0 for the zero matrix. Every function takes the singular
values (last dim k, any leading batch dims) except ``singular_values``, ``rms`` and
``gram_orthogonality_error``, which take matrices ``(..., m, n)``.

The ``Metric`` classes average one quantity over every matrix passed to ``update`` (a
batch ``(..., m, n)`` counts each matrix once) on every rank: their states are a sum and a
count, reduced with ``"sum"``, so ``compute()`` under DDP equals the single-process mean
over the union of all ranks' matrices.

References:
    Roy & Vetterli, "The effective rank: a measure of effective dimensionality", EUSIPCO 2007.
    Rudelson & Vershynin, "Sampling from large matrices: an approach through geometric
    functional analysis", J. ACM 54(4), 2007 (stable rank).
    Higham, "Functions of Matrices", SIAM 2008, ch. 8 (polar decomposition, orthogonality).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = [
    "DEFAULT_RTOL",
    "EffectiveRank",
    "LargestSingularValue",
    "OrthogonalityError",
    "RelativeUpdateRMS",
    "SmallestKeptSingularValue",
    "SpectrumMetrics",
    "StableRank",
    "UpdateRMS",
    "effective_rank",
    "gram_orthogonality_error",
    "largest_singular_value",
    "orthogonality_error",
    "rms",
    "singular_values",
    "smallest_kept_singular_value",
    "spectrum_stats",
    "stable_rank",
]

DEFAULT_RTOL = 1e-3
"""Relative threshold of ``smallest_kept_singular_value``: well above float32 round-off
(~1e-7 * k relative), and a direction updated 1000x less than the strongest one hardly moves."""

SPECTRUM_KEYS = ("sigma_max", "sigma_min", "stable_rank", "effective_rank", "orthogonality_error")


def _check_matrix(matrix: Tensor, where: str) -> None:
    if not isinstance(matrix, Tensor) or matrix.ndim < 2:
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise ValueError(f"{where}: expected a matrix or a batch of matrices (..., m, n), got {shape}")
    if matrix.is_complex():
        raise ValueError(f"{where}: complex matrices are not supported")


def _work_dtype(t: Tensor) -> torch.dtype:
    # float64 stays float64 (exact tests); everything else, bf16 included, goes through float32.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def singular_values(matrix: Tensor) -> Tensor:
    """Singular values ``(..., k)`` of ``(..., m, n)``, descending, in float32 (float64 kept)."""
    _check_matrix(matrix, "singular_values")
    x = matrix.detach().to(_work_dtype(matrix))
    # Same singular values either way; LAPACK's bidiagonalization is ~2x faster on the tall form.
    return torch.linalg.svdvals(x.mT if x.shape[-2] < x.shape[-1] else x)


def rms(matrix: Tensor) -> Tensor:
    """Root mean square ``||A||_F / sqrt(m n)`` per matrix of ``(..., m, n)``."""
    _check_matrix(matrix, "rms")
    x = matrix.detach().to(_work_dtype(matrix))
    return x.square().mean(dim=(-2, -1)).sqrt()


def largest_singular_value(sv: Tensor) -> Tensor:
    """``s_1``, the spectral norm, from descending singular values ``(..., k)``."""
    return sv[..., 0]


def smallest_kept_singular_value(sv: Tensor, rtol: float = DEFAULT_RTOL) -> Tensor:
    """``min {s_i : s_i > rtol * s_1}`` from singular values ``(..., k)``; 0 where all are 0."""
    kept = sv > rtol * sv[..., :1]  # (..., k)
    smallest = torch.where(kept, sv, torch.full_like(sv, float("inf"))).amin(dim=-1)
    return torch.where(kept.any(dim=-1), smallest, torch.zeros_like(smallest))


def stable_rank(sv: Tensor) -> Tensor:
    """``sum s_i^2 / s_1^2`` from singular values ``(..., k)``; 0 for the zero matrix."""
    top = sv[..., 0].square()
    ratio = sv.square().sum(dim=-1) / torch.where(top > 0, top, torch.ones_like(top))
    return torch.where(top > 0, ratio, torch.zeros_like(ratio))


def effective_rank(sv: Tensor) -> Tensor:
    """``exp(-sum p_i log p_i)`` with ``p = s / sum(s)`` (Roy & Vetterli 2007); 0 for the zero matrix."""
    total = sv.sum(dim=-1, keepdim=True)  # (..., 1)
    p = sv / torch.where(total > 0, total, torch.ones_like(total))
    # xlogy(0, 0) = 0: zero singular values add no entropy.
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)
    return torch.where(total[..., 0] > 0, entropy.exp(), torch.zeros_like(entropy))


def orthogonality_error(sv: Tensor) -> Tensor:
    """``||G - I||_F / sqrt(k)`` on the short side, from singular values: ``sqrt(mean (s_i^2 - 1)^2)``.

    ``G``'s eigenvalues are the ``s_i^2``, so this equals ``gram_orthogonality_error`` of the
    matrix without forming ``G``.
    """
    return (sv.square() - 1.0).square().mean(dim=-1).sqrt()


def gram_orthogonality_error(matrix: Tensor) -> Tensor:
    """``||G - I||_F / sqrt(k)`` with ``G`` the Gram matrix on the short side, formed explicitly."""
    _check_matrix(matrix, "gram_orthogonality_error")
    x = matrix.detach().to(_work_dtype(matrix))
    m, n = x.shape[-2:]
    gram = x @ x.mT if m <= n else x.mT @ x  # (..., k, k)
    eye = torch.eye(min(m, n), dtype=x.dtype, device=x.device)
    return torch.linalg.matrix_norm(gram - eye) / min(m, n) ** 0.5


def spectrum_stats(sv: Tensor, rtol: float = DEFAULT_RTOL) -> dict[str, Tensor]:
    """Every spectral quantity of ``SPECTRUM_KEYS`` from singular values ``(..., k)``, each ``(...)``."""
    return {
        "sigma_max": largest_singular_value(sv),
        "sigma_min": smallest_kept_singular_value(sv, rtol),
        "stable_rank": stable_rank(sv),
        "effective_rank": effective_rank(sv),
        "orthogonality_error": orthogonality_error(sv),
    }


def _check_rtol(rtol: Any) -> float:
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0.0 < rtol < 1.0:
        raise ValueError(f"rtol must be a number in (0, 1), got {rtol!r}")
    return float(rtol)


class _MatrixMean(Metric):
    """Mean of a per-matrix quantity over every matrix seen, on every rank (sum and count states)."""

    is_differentiable = False
    higher_is_better: bool | None = None
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # float64 sums: thousands of float32 values summed without visible round-off.
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _per_matrix(self, matrix: Tensor) -> Tensor:
        raise NotImplementedError

    def update(self, matrix: Tensor) -> None:
        """Add one matrix ``(m, n)`` or a batch ``(..., m, n)``."""
        _check_matrix(matrix, type(self).__name__)
        values = self._per_matrix(matrix).reshape(-1)
        self.total += values.sum(dtype=torch.float64).to(self.total.device)
        self.count += values.numel()

    def compute(self) -> Tensor:
        """The mean over all matrices (NaN before any update)."""
        return self.total / self.count


class LargestSingularValue(_MatrixMean):
    """Mean spectral norm ``s_1`` of the matrices seen."""

    def _per_matrix(self, matrix: Tensor) -> Tensor:
        return largest_singular_value(singular_values(matrix))


class SmallestKeptSingularValue(_MatrixMean):
    """Mean smallest kept singular value ``min {s_i : s_i > rtol * s_1}`` of the matrices seen.

    Args:
        rtol: relative threshold in (0, 1) below which a singular value counts as absent.
    """

    def __init__(self, rtol: float = DEFAULT_RTOL, **kwargs: Any) -> None:
        self.rtol = _check_rtol(rtol)
        super().__init__(**kwargs)

    def _per_matrix(self, matrix: Tensor) -> Tensor:
        return smallest_kept_singular_value(singular_values(matrix), self.rtol)


class StableRank(_MatrixMean):
    """Mean stable rank ``||A||_F^2 / ||A||_2^2`` of the matrices seen."""

    def _per_matrix(self, matrix: Tensor) -> Tensor:
        return stable_rank(singular_values(matrix))


class EffectiveRank(_MatrixMean):
    """Mean effective rank (exponential of the singular-value entropy, Roy & Vetterli 2007)."""

    def _per_matrix(self, matrix: Tensor) -> Tensor:
        return effective_rank(singular_values(matrix))


class OrthogonalityError(_MatrixMean):
    """Mean ``||G - I||_F / sqrt(k)`` (Gram matrix on the short side) of the matrices seen."""

    def _per_matrix(self, matrix: Tensor) -> Tensor:
        return orthogonality_error(singular_values(matrix))


class UpdateRMS(_MatrixMean):
    """Mean RMS ``||A||_F / sqrt(m n)`` of the update matrices seen (no SVD)."""

    def _per_matrix(self, matrix: Tensor) -> Tensor:
        return rms(matrix)


class RelativeUpdateRMS(_MatrixMean):
    """Mean ``rms(update) / rms(weight)`` over the (update, weight) pairs seen.

    A pair whose weight is all zeros has no defined ratio and raises.
    """

    def update(self, update: Tensor, weight: Tensor) -> None:  # type: ignore[override]
        """Add an update and the weight it applies to, both ``(m, n)`` or ``(..., m, n)``."""
        _check_matrix(update, "RelativeUpdateRMS")
        _check_matrix(weight, "RelativeUpdateRMS")
        if update.shape != weight.shape:
            raise ValueError(
                f"RelativeUpdateRMS: update and weight shapes differ: {tuple(update.shape)} vs {tuple(weight.shape)}"
            )
        w = rms(weight)
        if bool((w == 0).any()):
            raise ValueError("RelativeUpdateRMS: a weight matrix is all zeros; its relative update is undefined")
        values = (rms(update) / w).reshape(-1)
        self.total += values.sum(dtype=torch.float64).to(self.total.device)
        self.count += values.numel()


class SpectrumMetrics(Metric):
    """Every spectral quantity of an update from one SVD per matrix, averaged over matrices and ranks.

    ``update(update, weight=None)`` adds matrices ``(m, n)`` or ``(..., m, n)``;
    ``compute()`` returns a dict with the mean of each of ``sigma_max``, ``sigma_min``,
    ``stable_rank``, ``effective_rank``, ``orthogonality_error``, ``update_rms`` and, once a
    weight has been passed, ``update_to_weight_rms`` (NaN until then).

    Args:
        rtol: relative threshold of the smallest kept singular value.
    """

    is_differentiable = False
    higher_is_better: bool | None = None
    full_state_update = False

    KEYS = (*SPECTRUM_KEYS, "update_rms", "update_to_weight_rms")

    def __init__(self, rtol: float = DEFAULT_RTOL, **kwargs: Any) -> None:
        self.rtol = _check_rtol(rtol)
        super().__init__(**kwargs)
        for key in self.KEYS:
            self.add_state(key, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("weight_count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, update: Tensor, weight: Tensor | None = None) -> None:
        """Add update matrices and, optionally, the weights they apply to (same shape)."""
        _check_matrix(update, "SpectrumMetrics")
        sv = singular_values(update)  # (..., k)
        values = spectrum_stats(sv, self.rtol)
        m, n = update.shape[-2:]
        values["update_rms"] = (sv.square().sum(dim=-1) / (m * n)).sqrt()  # ||A||_F^2 = sum s_i^2
        if weight is not None:
            _check_matrix(weight, "SpectrumMetrics")
            if weight.shape != update.shape:
                raise ValueError(
                    f"SpectrumMetrics: update and weight shapes differ: {tuple(update.shape)} vs {tuple(weight.shape)}"
                )
            w = rms(weight)
            if bool((w == 0).any()):
                raise ValueError("SpectrumMetrics: a weight matrix is all zeros; its relative update is undefined")
            values["update_to_weight_rms"] = values["update_rms"] / w
        for key, value in values.items():
            state = getattr(self, key)
            setattr(self, key, state + value.reshape(-1).sum(dtype=torch.float64).to(state.device))
        count = sv[..., 0].numel()
        self.count += count
        if weight is not None:
            self.weight_count += count

    def compute(self) -> dict[str, Tensor]:
        """The mean of every quantity over all matrices seen, on all ranks."""
        out = {key: getattr(self, key) / self.count for key in self.KEYS[:-1]}
        out["update_to_weight_rms"] = self.update_to_weight_rms / self.weight_count
        return out
