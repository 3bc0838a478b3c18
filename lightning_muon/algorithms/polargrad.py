r"""``"polargrad"`` groups: PolarGrad, Muon's orthogonalized update scaled by the momentum's nuclear norm.

PolarGrad takes the steepest-descent step in the spectral norm: for ``U = P H`` the polar
decomposition of the update, ``argmin_D <U, D> + ||D||_2^2 / 2 = -||U||_* P``, whose length
is the nuclear norm ``||U||_* = tr(H) = <P, U>``; Muon and Scion take only the direction ``P``
(a linear minimization oracle over a ball). For a matrix ``W`` with gradient ``G``::

    W <- decay(W)                                  # weight_decay_method (EmergingVariant)
    B <- mu B + (1 - mu) G
    U <- (1 - mu) G + mu B   if nesterov else B
    O <- NS(U)                                     # Newton-Schulz: ns_coefficients, ns_steps
    W <- W - lr extra_scale_factor <O, U> O        # <O, U> = sum_ij O_ij U_ij

Newton-Schulz's ``O`` has singular values near, not at, 1, so ``<O, U>`` stands for the
nuclear norm as Emerging-Optimizers takes it (``(orth_grad * grad).sum()``). Each matrix has
its own: every piece of a split tensor, every matrix of an expert stack. Under a sharding the
sums are whole-matrix sums (``Sharding.reduce_matrix_sums``): nothing moves under DDP, whose
owners hold whole matrices; one all-reduce of ``K P`` numbers per round under FSDP2 (``K``
parameters of ``P`` pieces), whose ranks hold row blocks; an expert stack's ranks hold whole
experts under every sharding, so its sums need no collective. The sums are taken in float32
at least; the scaled ``O`` is kept in float32 at least.

The defaults are ``PolarGrad``'s (Emerging-Optimizers 0.3.0); its constructor's names load
through ``aliases``.

References:
    Lau, Long, Su, "PolarGrad: A Class of Matrix-Gradient Optimizers from a Unifying
    Preconditioning Perspective", arXiv 2505.21799, 2025.
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/polargrad.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_muon.algorithms.base import StepContext, register_algorithm
from lightning_muon.algorithms.emerging import EO_DEFAULTS, EmergingVariant
from lightning_muon.algorithms.families import NewtonSchulzSettings
from lightning_muon.algorithms.muon import MuonRound
from lightning_muon.layout import MatrixLayout

__all__ = ["POLARGRAD", "PolarGrad", "PolarGradSettings", "scale_by_nuclear_norm"]


@dataclass(frozen=True, kw_only=True)
class PolarGradSettings(
    NewtonSchulzSettings,
    algorithm="polargrad",
    defaults={**EO_DEFAULTS, "weight_decay": 0.01, "fp32_matmul_prec": "highest"},
):
    """PolarGrad groups, Emerging-Optimizers' defaults: the orthogonalized update scaled by its nuclear norm."""


def scale_by_nuclear_norm(ctx: StepContext, rnd: MuonRound) -> list[list[Tensor]]:
    """Every orthogonalized matrix ``O`` of the round times ``<O, U>``, ``U`` the matrix it came from.

    ``rnd.updates`` must still hold the updates Newton-Schulz (or a map) was fed
    (``keeps_updates``). For the exact polar factor ``<O, U>`` is the nuclear norm of ``U``
    (MOP). Returns new pieces, in float32 at least.
    """
    layout = rnd.layout
    sharding = ctx.sharding
    local = ctx.local_shard
    sums = [_inner_products(local(u), [local(o) for o in pieces], layout) for u, pieces in zip(rnd.updates, rnd.ortho)]
    total = torch.cat(sums)  # (sum B, P): per matrix of each batch (B = 1: one matrix), this rank's part
    if sharding is not None:
        total = sharding.reduce_matrix_sums(rnd.params, total, layout)  # as they are where the matrices are whole
    per_param = total.split([s.shape[0] for s in sums])
    return [[_times_per_matrix(o, s[:, j]) for j, o in enumerate(pieces)] for pieces, s in zip(rnd.ortho, per_param)]


def _inner_products(u: Tensor, pieces: list[Tensor], layout: MatrixLayout) -> Tensor:
    """``<O, U>`` per matrix and piece over this rank's part, float64: ``(B, P)``, ``B`` the matrices of a batch
    on this rank (1 for one matrix)."""
    out = []
    for view, o in zip(layout.views(u.contiguous()), pieces):
        work = torch.promote_types(torch.promote_types(view.dtype, o.dtype), torch.float32)
        prod = view.reshape(o.shape).to(work) * o.to(work)  # (B?, rows, cols)
        out.append(prod.sum(dim=(-2, -1)).reshape(-1))  # (B,)
    return torch.stack(out, dim=1).to(torch.float64)


def _times_per_matrix(o: Tensor, s: Tensor) -> Tensor:
    """``o`` (``(B?, rows, cols)``; a DTensor's local part under FSDP2) times ``s[b]`` per matrix, in float32+."""
    x = o.to_local() if isinstance(o, DTensor) else o
    work = torch.promote_types(x.dtype, torch.float32)
    x = x.to(work) * s.to(device=x.device, dtype=work).view(*x.shape[:-2], 1, 1)
    if isinstance(o, DTensor):
        x = DTensor.from_local(x, o.device_mesh, o.placements, run_check=False, shape=o.shape, stride=o.stride())
    return x


class PolarGrad(EmergingVariant):
    """``"polargrad"``: ``W <- decay(W) - lr extra_scale_factor <O, U> O`` (module docstring)."""

    name = "polargrad"
    settings = PolarGradSettings

    keeps_updates = True  # <O, U> reads the updates after Newton-Schulz

    def normalize(self, ctx: StepContext, rnd: MuonRound) -> list[list[Tensor]]:
        return scale_by_nuclear_norm(ctx, rnd)


POLARGRAD = register_algorithm(PolarGrad())
