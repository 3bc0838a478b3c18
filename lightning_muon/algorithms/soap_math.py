r"""SOAP's math on one matrix: Kronecker factors, their eigenbasis, and Adam run in that basis.

For a weight ``W`` (m, n) with gradient ``G`` at step ``t`` (counted from 1), ``soap_update``
keeps two Kronecker factors, their eigenbases and Adam's two moments in the rotated basis::

    L <- b_t L + (1 - b_t) G G^T                   # (m, m) left factor
    R <- b_t R + (1 - b_t) G^T G                   # (n, n) right factor
    every precondition_frequency steps, and at t = 1:
        M <- Q_L M Q_R^T                           # the first moment back in W's basis
        Q_L, Q_R <- their columns sorted by diag(Q^T L Q), diag(Q^T R Q), descending;
                    V's rows and columns permuted alike
        Q_L <- eigh(L) at t = 1 or with use_eigh, else QR(L Q_L) power_iter_steps times (Q_R alike)
        M <- Q_L^T M Q_R                           # into the new basis
    G' <- Q_L^T G Q_R                              # the gradient in the eigenbasis
    M <- b1 M + (1 - b1) G';  V <- b2 V + (1 - b2) G'^2
    U <- Q_L [(M / c1) / (sqrt(V / c2) + eps)] Q_R^T, scaled down to RMS max_update_rms

with ``c1 = 1 - b1^t`` and ``c2 = 1 - b2^t`` (1 without ``correct_bias``) and, when the
factors' bias is corrected, ``b_t = 1 - (1 - b) / (1 - b^t)``: the factors are then weighted
means of what they saw, the first one ``G G^T`` itself. KL-Shampoo (``use_kl_shampoo``)
changes what the factors average, each whitened by the other's inverse as the current bases
and the factors before this step's update estimate it (``λ = diag(Q^T R Q)``)::

    L <- b_t L + (1 - b_t) / n  G Q_R diag(1 / max(λ_R, eps)) Q_R^T G^T
    R <- b_t R + (1 - b_t) / m  G^T Q_L diag(1 / max(λ_L, eps)) Q_L^T G

The caller applies the weight decay and ``W <- W - lr U``. Every function here reads only
its arguments (no optimizer), so a rank that owns a whole matrix can step it alone.

The order of operations, the contractions included, follows NVIDIA Emerging-Optimizers 0.3.0
(``SOAP``) op for op: float32 weights agree bit for bit with its Adam run eagerly, and to
about 1e-7 with its ``torch.compile``'d Adam. That matters beyond tidiness: the first step's bases are ``G``'s
singular vectors, so ``G'`` is diagonal up to rounding, and Adam's first step, about
``G' / |G'|`` elementwise, divides that rounding (1e-7 of ``|G|`` in float32) by ``eps``. For
gradients of order 1e-3 the first update differs from exact arithmetic by a quarter of its
size (for order 1, by its whole size: +-1 in every off-diagonal coordinate), and only the
same rounding reproduces it. A non-square ``G`` adds a rank-deficient first factor, whose
null-space basis eigh picks as its rounding leads it.

KL-Shampoo's first factors are inflated by ``1 / eps`` (the zero factors' eigenvalues are
clamped at ``eps``), and what later steps add is ``eps^2`` smaller: they decay as
``shampoo_beta^t`` before new gradients shape them (about 300 steps at 0.95). That too is
Emerging-Optimizers' rule, kept.

References:
    Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv 2409.11321, 2024.
    Lin et al., "Understanding and Improving Shampoo and SOAP via Kullback-Leibler
    Minimization", arXiv 2509.03378, 2025.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from torch import Tensor

from lightning_muon.newton_schulz import matmul_precision

__all__ = [
    "SOAP_STATE_KEYS",
    "adam_direction_",
    "approx_eigvals",
    "clip_update_rms_",
    "eigenbasis_eigh",
    "eigenbasis_power_qr",
    "factor_beta",
    "from_eigenbasis",
    "init_soap_state",
    "refresh_eigenbasis",
    "soap_update",
    "to_eigenbasis",
    "update_factors_",
    "update_factors_kl_",
]

SOAP_STATE_KEYS = ("exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R")
"""The tensors ``init_soap_state`` makes per matrix (besides the optimizer's ``step``)."""
# Emerging-Optimizers' floor under the update's RMS before max_update_rms divides by it.
_RMS_EPS = 1e-7


def init_soap_state(weight: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """Zero moments and factors and identity bases for the (m, n) ``weight``, in ``dtype`` on its device."""
    m, n = weight.shape
    kw = dict(device=weight.device, dtype=dtype)
    return {
        "exp_avg": torch.zeros(m, n, **kw),  # (m, n) first moment, in the eigenbasis
        "exp_avg_sq": torch.zeros(m, n, **kw),  # (m, n) second moment, in the eigenbasis
        "L": torch.zeros(m, m, **kw),  # (m, m) left factor
        "R": torch.zeros(n, n, **kw),  # (n, n) right factor
        "Q_L": torch.eye(m, **kw),  # (m, m) left eigenbasis, one eigenvector a column
        "Q_R": torch.eye(n, **kw),  # (n, n) right eigenbasis
    }


def factor_beta(shampoo_beta: float, step: int, correct_bias: bool) -> float:
    """The factors' EMA rate at ``step`` (from 1): ``1 - (1 - b) / (1 - b^step)`` corrected, else ``b``."""
    if not correct_bias:
        return shampoo_beta
    return 1 - (1 - shampoo_beta) / (1 - shampoo_beta**step)


def update_factors_(L: Tensor, R: Tensor, grad: Tensor, beta: float) -> None:
    """Shampoo's factors, in place: ``L <- beta L + (1 - beta) G G^T``, ``R <- beta R + (1 - beta) G^T G``."""
    L.lerp_(grad @ grad.T, 1 - beta)  # (m, m)
    R.lerp_(grad.T @ grad, 1 - beta)  # (n, n)


def approx_eigvals(factor: Tensor, basis: Tensor) -> Tensor:
    """``diag(Q^T K Q)``: the eigenvalues of ``K`` as the (maybe stale) basis ``Q`` sees them."""
    return ((basis.T @ factor) * basis.T).sum(dim=1)


def update_factors_kl_(L: Tensor, R: Tensor, grad: Tensor, beta: float, Q_L: Tensor, Q_R: Tensor, eps: float) -> None:
    """KL-Shampoo's factors, in place: each averages ``G`` whitened by the other's approximate inverse.

    ``L`` and ``R`` are read (for their eigenvalue estimates) before either is written.
    """
    m, n = grad.shape
    # diag(1 / max(λ, eps)) / dim. eps floors the estimates of a factor still zero, and so
    # inflates the first factors by 1 / eps (the module docstring says what follows).
    scale_L = 1 / m * approx_eigvals(L, Q_L).clamp_min(eps) ** -1.0  # (m,)
    scale_R = 1 / n * approx_eigvals(R, Q_R).clamp_min(eps) ** -1.0  # (n,)
    inv_L = (Q_L * scale_L[None, :]) @ Q_L.T  # (m, m) L^-1 / m in the current basis
    inv_R = (Q_R * scale_R[None, :]) @ Q_R.T  # (n, n) R^-1 / n
    to_R = (grad.T @ inv_L) @ grad  # (n, n) G^T L^-1 G / m
    to_L = (grad @ inv_R) @ grad.T  # (m, m) G R^-1 G^T / n
    L.lerp_(to_L, 1 - beta)
    R.lerp_(to_R, 1 - beta)


def eigenbasis_eigh(factor: Tensor) -> Tensor:
    """The eigenvectors of the symmetric ``factor``, columns by descending eigenvalue.

    A float32 eigh that fails to converge is retried in float64 (then rounded back).
    """
    try:
        _, vectors = torch.linalg.eigh(factor)
    except (torch.linalg.LinAlgError, RuntimeError):
        _, vectors = torch.linalg.eigh(factor.to(torch.float64))
        vectors = vectors.to(factor.dtype)
    return torch.flip(vectors, [-1])  # eigh sorts ascending


def eigenbasis_power_qr(factor: Tensor, basis: Tensor, power_iter_steps: int) -> Tensor:
    """Orthogonal iteration from ``basis`` (sorted by descending estimate): ``Q <- QR(K Q)``, repeated."""
    for _ in range(power_iter_steps):
        basis = torch.linalg.qr(factor @ basis).Q
    return basis


def to_eigenbasis(x: Tensor, Q_L: Tensor, Q_R: Tensor) -> Tensor:
    """``Q_L^T x Q_R``: the (m, n) ``x`` in the eigenbasis."""
    # Two contractions over axis 0, (m, n) -> (n, m) -> (m, n): tensordot, as Emerging-Optimizers
    # writes it, for its rounding (matmul on the transposed views rounds differently).
    for basis in (Q_L, Q_R):
        x = torch.tensordot(x, basis, dims=([0], [0]))
    return x


def from_eigenbasis(x: Tensor, Q_L: Tensor, Q_R: Tensor) -> Tensor:
    """``Q_L x Q_R^T``: the (m, n) ``x`` back from the eigenbasis."""
    for basis in (Q_L, Q_R):
        x = torch.tensordot(x, basis, dims=([0], [1]))
    return x


def refresh_eigenbasis(state: MutableMapping[str, Tensor], use_eigh: bool, power_iter_steps: int) -> None:
    """New bases for the factors (eigh, or orthogonal iteration from the old ones), the moments carried over.

    The first moment is rotated exactly; the second, a per-coordinate scale, only follows its
    coordinate's new rank (the sort), as the bases drift little between refreshes.
    """
    L, R = state["L"], state["R"]
    exp_avg = from_eigenbasis(state["exp_avg"], state["Q_L"], state["Q_R"])  # (m, n) in W's basis
    exp_avg_sq = state["exp_avg_sq"]
    bases = []
    for axis, (factor, basis) in enumerate(((L, state["Q_L"]), (R, state["Q_R"]))):
        order = torch.argsort(approx_eigvals(factor, basis), descending=True)
        exp_avg_sq = exp_avg_sq.index_select(axis, order)
        sorted_basis = basis[:, order]
        bases.append(
            eigenbasis_eigh(factor) if use_eigh else eigenbasis_power_qr(factor, sorted_basis, power_iter_steps)
        )
    state["Q_L"], state["Q_R"] = bases
    state["exp_avg"] = to_eigenbasis(exp_avg, *bases)
    state["exp_avg_sq"] = exp_avg_sq


def adam_direction_(
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    betas: tuple[float, float],
    eps: float,
    step: int,
    correct_bias: bool,
    nesterov: bool,
) -> Tensor:
    """Adam's moments updated in place from ``grad`` and its direction ``m_hat / (sqrt(v_hat) + eps)``.

    Nesterov: ``m_hat = b1 m / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)`` (Dozat's NAdam, its
    look-ahead bias corrected one step on).
    """
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    c1 = 1.0 - beta1**step if correct_bias else 1.0
    c2 = 1.0 - beta2**step if correct_bias else 1.0
    if nesterov:
        c1_next = 1 - beta1 ** (step + 1) if correct_bias else 1.0
        momentum = beta1 * exp_avg / c1_next + (1 - beta1) * grad / c1
    else:
        momentum = exp_avg / c1
    return momentum / ((exp_avg_sq / c2).sqrt() + eps)


def clip_update_rms_(update: Tensor, max_rms: float) -> Tensor:
    """``update`` scaled in place so its RMS is at most ``max_rms`` (0: unclipped); returns it."""
    if max_rms == 0:
        return update
    rms = update.square().mean().sqrt()
    return update.mul_((max_rms / (rms + _RMS_EPS)).clamp(max=1.0))


def soap_update(
    grad: Tensor,
    state: MutableMapping[str, Tensor],
    *,
    step: int,
    betas: tuple[float, float],
    shampoo_beta: float,
    eps: float,
    nesterov: bool,
    correct_bias: bool,
    correct_shampoo_beta_bias: bool,
    use_eigh: bool,
    power_iter_steps: int,
    max_update_rms: float,
    use_kl_shampoo: bool,
    precondition_frequency: int,
    fp32_matmul_prec: str,
    qr_fp32_matmul_prec: str,
    weight: Tensor | None = None,
    l2_weight_decay: float = 0.0,
) -> Tensor:
    """One SOAP step of one matrix: ``state`` (``init_soap_state``'s tensors) updated, the direction ``U`` returned.

    ``grad`` is the whole (m, n) gradient in ``state``'s dtype; ``step`` counts from 1. The
    caller decays the weight (``decay_weight_``) and applies ``W <- W - lr U``. With
    ``weight_decay_method="l2"`` it passes the (m, n) ``weight`` and its ``l2_weight_decay``:
    ``wd W`` joins the gradient the inner Adam sees, not the one the factors average. The
    matmuls of the factors and of the projections run at ``fp32_matmul_prec``, those of the
    refresh at ``qr_fp32_matmul_prec`` (``matmul_precision``).
    """
    beta = factor_beta(shampoo_beta, step, correct_shampoo_beta_bias)
    with matmul_precision(fp32_matmul_prec, grad.device):
        if use_kl_shampoo:
            update_factors_kl_(state["L"], state["R"], grad, beta, state["Q_L"], state["Q_R"], eps)
        else:
            update_factors_(state["L"], state["R"], grad, beta)
    if (step - 1) % precondition_frequency == 0:
        with matmul_precision(qr_fp32_matmul_prec, grad.device):
            # The first bases come from eigh whatever use_eigh says: the identity they start
            # from is no estimate for orthogonal iteration to refine.
            refresh_eigenbasis(state, use_eigh or step == 1, power_iter_steps)
    if weight is not None and l2_weight_decay != 0.0:
        grad = grad.add(weight, alpha=l2_weight_decay)
    with matmul_precision(fp32_matmul_prec, grad.device):
        rotated = to_eigenbasis(grad, state["Q_L"], state["Q_R"])  # (m, n)
    direction = adam_direction_(
        rotated,
        state["exp_avg"],
        state["exp_avg_sq"],
        betas=betas,
        eps=eps,
        step=step,
        correct_bias=correct_bias,
        nesterov=nesterov,
    )
    with matmul_precision(fp32_matmul_prec, grad.device):
        update = from_eigenbasis(direction, state["Q_L"], state["Q_R"])  # (m, n) in W's basis
    return clip_update_rms_(update, max_update_rms)
