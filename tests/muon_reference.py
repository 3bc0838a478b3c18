"""The float64 reference for Newton-Schulz and Muon, written from the formulas alone.

Every test that checks the optimizer's math against "the formula" uses these, so there is
one reference, independent of ``lightning_muon.functional`` (only the coefficient tables
are read from the library: they are data, checked against their sources in
test_newton_schulz.py). The Muon step for a matrix W with gradient G, as torch.optim.Muon
writes it::

    B <- mu B + (1 - mu) G                    (ema; "sum": B <- mu B + G)
    U <- (1 - mu) G + mu B if nesterov else B (sum: G + mu B)
    O <- NS(U)                                quintic Newton-Schulz on the short side,
                                              per piece of a split (fused QKV) matrix
    W <- W (1 - lr wd) - lr adjust(rows, cols) O

with NorMuon / AdaMuon second moments, sign momentum and the other weight decay methods
(independent, palm, l2, cautious) as options.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_muon.newton_schulz import COEFFICIENTS, NORMALIZATION

# adjust_lr modes: the lr scale for a (rows, cols) matrix.
ADJUST = {
    "original": lambda r, c: math.sqrt(max(1.0, r / c)),
    "match_rms_adamw": lambda r, c: 0.2 * math.sqrt(max(r, c)),
    "spectral": lambda r, c: math.sqrt(max(r, c)),
    "spectral_norm": lambda r, c: math.sqrt(r / c),
    "none": lambda r, c: 1.0,
}


def newton_schulz64(
    M: torch.Tensor, coefficients: str | Sequence[Sequence[float]] = "polar_express", steps: int = 5
) -> torch.Tensor:
    """Quintic Newton-Schulz in float64 on the short side: ``A = X X^T; X = a X + (b A + c A A) X``.

    ``X`` starts as ``M / (||M||_F * safety + eps)`` (the schedule's normalization; 1 and 1e-7
    for a list of coefficients); a schedule shorter than ``steps`` repeats its last tuple.
    """
    if isinstance(coefficients, str):
        schedule, (safety, eps) = list(COEFFICIENTS[coefficients]), NORMALIZATION[coefficients]
    else:
        schedule, (safety, eps) = list(coefficients), (1.0, 1e-7)
    schedule = (schedule + [schedule[-1]] * steps)[:steps]
    tall = M.shape[0] > M.shape[1]
    X = M.T if tall else M  # (short, long)
    X = X / (torch.linalg.matrix_norm(X) * safety + eps)
    for a, b, c in schedule:
        A = X @ X.T  # (short, short)
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """``U V^T`` of the float64 SVD ``G = U S V^T``: what Newton-Schulz approximates."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def piece_rows(rows: int, split_sizes: Sequence[int] | None) -> list[list[int]]:
    """Row indices of each matrix Muon orthogonalizes: Megatron's per-group [q | k | v] layout."""
    if not split_sizes:
        return [list(range(rows))]
    total, out, offset = sum(split_sizes), [], 0
    for size in split_sizes:
        out.append([g * total + offset + j for g in range(rows // total) for j in range(size)])
        offset += size
    return out


def momentum64(B: torch.Tensor, G: torch.Tensor, momentum: float, nesterov: bool, form: str = "ema"):
    """(new momentum B, the update U to orthogonalize) for gradient G: EMA or sum, Nesterov or not."""
    if form == "ema":
        B = momentum * B + (1 - momentum) * G
        return B, (1 - momentum) * G + momentum * B if nesterov else B
    B = momentum * B + G
    return B, G + momentum * B if nesterov else B


def muon64(
    W0: torch.Tensor,
    grads: Sequence[torch.Tensor],
    *,
    lr: float = 0.05,
    momentum: float = 0.9,
    nesterov: bool = True,
    weight_decay: float = 0.1,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    steps: int = 5,
    adjust: str = "original",
    extra: float = 1.0,
    momentum_form: str = "ema",
    second_moment: str | None = None,
    beta2: float = 0.9,
    eps: float = 1e-8,
    sign_momentum: bool = False,
    weight_decay_method: str = "decoupled",
    split_sizes: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The Muon loop over ``grads`` in float64: final weights, momentum and second moment.

    Tensors of more than 2 dims are taken as ``(rows, prod(rest))`` matrices (a conv as
    ``(out, in * kh * kw)``). ``extra`` is the extra scale factor on the update. The second
    moment is ``None`` without one, else shaped ``(rows, 1)`` (NorMuon per output, and
    Emerging-Optimizers' NorMuon of a tall or square matrix), ``(1, cols)`` (the latter of a
    wide one), ``(rows, cols)`` (AdaMuon) or ``()`` (NAMO). The forms:

    - ``"normuon_rms"``, ``"adamuon_rms"``: ``O / (sqrt(v) + eps)`` rescaled to ``||O||_F``;
    - ``"adamuon"``: ``O / (sqrt(v) + eps)``;
    - ``"normuon"``: ``v`` the mean over the longer axis, ``O rsqrt(max(v, eps))`` rescaled
      to ``||O||_F`` (the norm floored at eps);
    - ``"namo"``: ``O ||U||_F / (sqrt(v) + eps)``, ``v`` the EMA of ``||G||_F^2``.

    ``weight_decay_method``: ``"decoupled"`` ``W (1 - lr wd)``, ``"independent"`` ``W (1 - wd)``,
    ``"palm"`` ``W (1 - lr^2 wd)``, ``"l2"`` ``G + wd W`` in place of ``G`` (before the momentum),
    ``"cautious"`` decoupled only where the update and ``W`` agree in sign.
    """
    if weight_decay_method not in ("decoupled", "independent", "palm", "l2", "cautious"):
        raise ValueError(f"muon64: unknown weight_decay_method {weight_decay_method!r}")
    W = W0.to(torch.float64, copy=True)
    B = torch.zeros_like(W)
    rows = W.shape[0]
    cols = W[0].numel()
    V = None
    wide_normuon = second_moment == "normuon" and rows < cols
    if second_moment in ("normuon", "normuon_rms"):
        V = torch.zeros(1, cols, dtype=torch.float64) if wide_normuon else torch.zeros(rows, 1, dtype=torch.float64)
    elif second_moment in ("adamuon", "adamuon_rms"):
        V = torch.zeros(rows, cols, dtype=torch.float64)
    elif second_moment == "namo":
        V = torch.zeros((), dtype=torch.float64)
    for G in grads:
        G = G.to(torch.float64)
        if weight_decay_method == "l2":
            G = G + weight_decay * W
        B, U = momentum64(B, G, momentum, nesterov, momentum_form)
        if sign_momentum:
            U = torch.sign(U)
        M = U.reshape(rows, -1)
        if second_moment == "namo":
            V = beta2 * V + (1 - beta2) * G.square().sum()
            alpha = torch.linalg.vector_norm(M) / (V.sqrt() + eps)
        step = torch.zeros_like(M)  # the update direction, lr aside
        for idx in piece_rows(rows, split_sizes):
            Q = newton_schulz64(M[idx], coefficients, steps)  # the orthogonalized piece, O above
            if second_moment == "namo":
                Q = Q * alpha
            elif second_moment == "normuon" and wide_normuon:
                V = beta2 * V + (1 - beta2) * (Q**2).mean(dim=0, keepdim=True)
                Q_hat = Q * V.clamp_min(eps).rsqrt()
                Q = Q_hat * torch.linalg.matrix_norm(Q) / torch.linalg.matrix_norm(Q_hat).clamp_min(eps)
            elif second_moment is not None:
                per_output = second_moment in ("normuon", "normuon_rms")
                stat = (Q**2).mean(dim=1, keepdim=True) if per_output else Q**2
                V[idx] = beta2 * V[idx] + (1 - beta2) * stat
                if second_moment == "normuon":
                    Q_hat = Q * V[idx].clamp_min(eps).rsqrt()
                    Q = Q_hat * torch.linalg.matrix_norm(Q) / torch.linalg.matrix_norm(Q_hat).clamp_min(eps)
                else:
                    Q_hat = Q / (V[idx].sqrt() + eps)
                    rescale = second_moment != "adamuon"
                    Q = Q_hat * torch.linalg.matrix_norm(Q) / torch.linalg.matrix_norm(Q_hat) if rescale else Q_hat
            step[idx] = ADJUST[adjust](len(idx), M.shape[1]) * extra * Q
        Wm = W.reshape(rows, -1)
        if weight_decay_method == "cautious":  # decay where the update (subtracted) and W agree in sign
            Wm = Wm - lr * weight_decay * (step * Wm >= 0).double() * Wm  # a bool mask times a float is float32
        elif weight_decay_method != "l2":  # l2 decayed through the gradient
            factor = {"decoupled": lr * weight_decay, "independent": weight_decay, "palm": lr * lr * weight_decay}
            Wm = Wm * (1 - factor[weight_decay_method])
        W = (Wm - lr * step).reshape(W.shape)
    return W, B, V


def hyperball64(
    W0: torch.Tensor,
    grads: Sequence[torch.Tensor],
    *,
    lr: float = 0.05,
    momentum: float = 0.9,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    steps: int = 5,
    radius: float | None = None,
    eps: float = 1e-8,
    split_sizes: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MuonHyperball's loop over ``grads`` in float64 (NVIDIA Emerging-Optimizers 0.3.0): final weights and momentum.

    Muon's momentum and Newton-Schulz give ``O`` (per piece of a split matrix); then, after the
    decay ``W <- W (1 - lr wd)``::

        R = ||W||_F, or radius (W first rescaled to it: W <- radius W / max(||W||_F, eps))
        O <- R O / max(||O||_F, eps);   W <- W - lr O;   W <- R W / max(||W||_F, eps)
    """
    W = W0.to(torch.float64, copy=True)
    if radius is not None:
        W = radius * W / max(torch.linalg.vector_norm(W).item(), eps)
    B = torch.zeros_like(W)
    rows = W.shape[0]
    for G in grads:
        B, U = momentum64(B, G.to(torch.float64), momentum, nesterov)
        M = U.reshape(rows, -1)
        Q = torch.zeros_like(M)  # O above
        for idx in piece_rows(rows, split_sizes):
            Q[idx] = newton_schulz64(M[idx], coefficients, steps)
        W = W * (1 - lr * weight_decay)
        R = radius if radius is not None else torch.linalg.vector_norm(W).item()
        Q = R * Q / max(torch.linalg.vector_norm(Q).item(), eps)
        Wm = W.reshape(rows, -1) - lr * Q
        W = (R * Wm / max(torch.linalg.vector_norm(Wm).item(), eps)).reshape(W.shape)
    return W, B


def random_tensors(shapes: Sequence[Sequence[int]], seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Standard normal tensors of ``shapes``, drawn in float64 from ``seed`` (the same values in every dtype)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def run_steps(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], grad_steps) -> None:
    """Feed a fixed sequence of gradients: ``grad_steps[t][i]`` is param i's grad at step t."""
    for grads in grad_steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
