r"""``"sinkhorn_muon"`` groups: Muon whose weights are mapped back to Sinkhorn-normalized matrices after each step.

Emerging-Optimizers' ``SinkhornMuon`` (0.3.0): its ``Muon`` step, then the Sinkhorn-Knopp
map of the weight. For an ``M x N`` matrix ``W`` with gradient ``G``::

    W <- decay(W)                                   # weight_decay_method (EmergingVariant)
    B <- momentum B + (1 - momentum) G
    U <- lerp(G, B, momentum) if nesterov else B
    W <- W - lr s(out, in) extra_scale_factor msign(U)
    W <- SK(W)

with ``s`` by ``adjust_lr`` (Emerging-Optimizers' ``scale_mode``): ``"original"``
``sqrt(max(1, out / in))``, ``"spectral"`` ``sqrt(max(out, in))``, ``"spectral_norm"``
``sqrt(out / in)``. ``SK`` (``sinkhorn_knopp``) makes the matrix positive and then scales its
columns and rows in turn::

    P <- exp(W - max W)
    num_iters times:
        P_ij <- c P_ij / max(sum_i P_ij, eps)       # every column sums to c
        P_ij <- r P_ij / max(sum_j P_ij, eps)       # every row sums to r

with targets ``r = max(1, N / M)`` and ``c = max(1, M / N)`` (1 and 1 for a square matrix:
doubly stochastic), so that both sides sum to ``max(M, N)``. The rows end exact; the
columns approach ``c`` as the alternation converges.

The weights must start Sinkhorn-normalized: every parameter is checked when its group is
made, as Emerging-Optimizers does, and one that has a negative entry, or a row or column
sum further than ``doubly_stochastic_tolerance`` from its target, is refused. Initialize
such weights with ``sinkhorn_knopp`` first::

    with torch.no_grad():
        layer.weight.copy_(sinkhorn_knopp(layer.weight))

Parameters are 2-D matrices, whole (no ``split_sizes``, no expert stacks). Under a sharding
the owner of a matrix gathers the weight, maps it whole (its max and its sums span every
row) and hands each rank its rows back.

References:
    Sinkhorn & Knopp, "Concerning nonnegative matrices and doubly stochastic matrices",
    Pacific Journal of Mathematics 21(2), 1967.
    Xie et al. (DeepSeek-AI), "mHC: Manifold-Constrained Hyper-Connections", arXiv 2512.24880, 2025.
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/sinkhorn_muon.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_muon.algorithms.base import StepContext, register_algorithm
from lightning_muon.algorithms.emerging import EO_DEFAULTS, EmergingVariant
from lightning_muon.algorithms.families import NewtonSchulzSettings
from lightning_muon.algorithms.muon import MuonRound
from lightning_muon.algorithms.settings import setting

__all__ = [
    "SINKHORN_MUON",
    "SinkhornMuon",
    "SinkhornMuonSettings",
    "sinkhorn_knopp",
    "sinkhorn_targets",
]


@dataclass(frozen=True, kw_only=True)
class SinkhornMuonSettings(
    NewtonSchulzSettings,
    algorithm="sinkhorn_muon",
    defaults={**EO_DEFAULTS, "weight_decay": 0.01, "adjust_lr": "spectral"},
):
    """Sinkhorn-Muon groups: Emerging-Optimizers' ``Muon`` and ``SinkhornMuon`` defaults, and the map's own settings."""

    use_syrk: bool = False
    """Emerging-Optimizers' Triton SYRK kernel switch, accepted for its signature; no effect here."""
    num_iters: int = setting(20, low=1, integer=True)
    """Column-then-row normalizations of the Sinkhorn-Knopp map after each step."""
    eps: float = setting(1e-8, low=0.0, low_open=True)
    """Floor of the column and row sums the map divides by; > 0."""
    doubly_stochastic_tolerance: float = setting(0.1, low=0.0, low_open=True)
    """Largest row or column sum deviation from its target a weight may start with; > 0."""


def sinkhorn_targets(rows: int, cols: int) -> tuple[float, float]:
    """``(row sum, column sum)`` of a Sinkhorn-normalized ``M x N`` matrix: ``(max(1, N/M), max(1, M/N))``."""
    return (cols / rows, 1.0) if cols > rows else (1.0, rows / cols)


def sinkhorn_knopp(W: Tensor, num_iters: int = 20, eps: float = 1e-8) -> Tensor:
    """The Sinkhorn-Knopp map of ``W`` (module docstring): ``exp(W - max W)``, then column and row scalings.

    Every matrix of ``W`` (its last two dims) is mapped on its own, in float32 at least; the
    result has ``W``'s shape and dtype and is a new tensor. Use it to initialize the weights
    of a ``"sinkhorn_muon"`` group, which must start Sinkhorn-normalized.

    Args:
        W: a tensor with at least two dims.
        num_iters: column-then-row normalizations; >= 1.
        eps: floor of the sums divided by; > 0.

    References:
        Sinkhorn & Knopp, "Concerning nonnegative matrices and doubly stochastic matrices", 1967.
    """
    if W.ndim < 2:
        raise ValueError(f"sinkhorn_knopp needs a matrix, got a {W.ndim}-D tensor of shape {tuple(W.shape)}")
    rows, cols = W.shape[-2:]
    row_target, col_target = sinkhorn_targets(rows, cols)
    work = torch.promote_types(W.dtype, torch.float32)
    X = W.detach().to(work)
    # Any shift cancels in the first column scaling; the max keeps exp from overflowing.
    P = (X - X.amax(dim=(-2, -1), keepdim=True)).exp_()  # (..., rows, cols), entries in (0, 1]
    for _ in range(num_iters):
        P.div_(P.sum(dim=-2, keepdim=True).clamp_min_(eps))  # columns
        if col_target != 1.0:
            P.mul_(col_target)
        P.div_(P.sum(dim=-1, keepdim=True).clamp_min_(eps))  # rows
        if row_target != 1.0:
            P.mul_(row_target)
    return P.to(W.dtype)


class SinkhornMuon(EmergingVariant):
    """``"sinkhorn_muon"``: Emerging-Optimizers' Muon step, then the weight mapped by ``sinkhorn_knopp``."""

    name = "sinkhorn_muon"
    settings = SinkhornMuonSettings

    @torch.no_grad()
    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        super().init_group(group, params, where)
        tolerance = group["doubly_stochastic_tolerance"]
        for j, p in enumerate(params):
            label = f"{where}, parameter {j}" + (f" ({group['param_names'][j]!r})" if "param_names" in group else "")
            if p.ndim != 2 or group.get("split_sizes") is not None:
                what = f"a {p.ndim}-D tensor" if p.ndim != 2 else "a split matrix (split_sizes)"
                raise ValueError(
                    f"{label}: sinkhorn_muon maps whole 2-D matrices, got {what} of shape {tuple(p.shape)}; "
                    "route it to 'muon' or 'spel'"
                )
            # The whole matrix: a DTensor (FSDP2) is gathered, once, when its group is made.
            W = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            if W.numel() == 0:
                continue
            W = W.to(torch.promote_types(W.dtype, torch.float32))
            row_target, col_target = sinkhorn_targets(*W.shape)
            low = W.min().item()
            row_dev = (W.sum(dim=-1) - row_target).abs().max().item()
            col_dev = (W.sum(dim=-2) - col_target).abs().max().item()
            if low < 0 or row_dev > tolerance or col_dev > tolerance:
                raise ValueError(
                    f"{label}: sinkhorn_muon needs a Sinkhorn-normalized weight (non-negative, rows summing to "
                    f"{row_target:.4g} and columns to {col_target:.4g} within doubly_stochastic_tolerance="
                    f"{tolerance}); this {tuple(W.shape)} one has min {low:.6g}, max row deviation {row_dev:.6g}, "
                    f"max column deviation {col_dev:.6g}. Apply the map first: with torch.no_grad(): "
                    "p.copy_(lightning_muon.algorithms.sinkhorn_muon.sinkhorn_knopp(p))"
                )

    @torch.no_grad()
    def after_update(self, ctx: StepContext, rnd: MuonRound) -> None:
        """``W <- sinkhorn_knopp(W)`` for every weight of the round, each whole (on its owner under a sharding)."""
        num_iters, eps = rnd.group["num_iters"], rnd.group["eps"]
        # Each matrix in its own dtype, float32 at least, whatever ns_dtype says (a sharding sends it so too).
        weights = [p.detach() for p in rnd.params]
        mapped = self.map_tensors(ctx, rnd, weights, lambda X: sinkhorn_knopp(X, num_iters, eps), observe=False)
        local = ctx.local_shard
        for p, (piece,) in zip(rnd.params, mapped):
            w = local(p)
            if w.numel():
                w.copy_(local(piece).reshape(w.shape))


SINKHORN_MUON = register_algorithm(SinkhornMuon())
