r"""``"spel"`` groups: SPEL, spectral steepest descent on the Stiefel manifold (Emerging-Optimizers' ``Spel``).

SPEL is the spectral-norm case of manifold-constrained steepest descent: the step is
Muon's orthogonalized momentum, unscaled, and the weight is then projected back onto the
orthogonal matrices by the same matrix sign. For a matrix ``W`` with gradient ``G``::

    W <- decay(W)                          # weight_decay_method (EmergingVariant)
    B <- momentum B + (1 - momentum) G
    U <- lerp(G, B, momentum) if nesterov else B
    W <- W - lr msign(U)                   # no shape scale
    W <- msign(W)

``msign`` is Newton-Schulz with ``ns_coefficients`` over ``ns_steps`` iterations, both
times: its singular values land near 1, in the schedule's band, not exactly on it. A decay
before the projection still acts: it sets how much of the old weight the projected mixture
``(1 - lr wd) W - lr msign(U)`` keeps against the update.

The projection runs per matrix piece, as the update's does (a fused QKV's pieces, each
expert of a stack, a conv as ``(out, in * kh * kw)``), through the group's exchange: under
a sharding the owner of a matrix gathers the weight whole, projects it and hands each rank
its rows back (FSDP2), or the owner projects the whole matrix it holds (DDP). The update
hooks do not see the projection.

References:
    Yang & Lai, "Manifold Constrained Steepest Descent", arXiv 2601.21487, 2026.
    Bernstein & Newhouse, "Modular Duality in Deep Learning", arXiv 2410.21265, 2024.
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/spel.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_muon.algorithms.base import StepContext, register_algorithm
from lightning_muon.algorithms.emerging import EO_DEFAULTS, EmergingVariant
from lightning_muon.algorithms.families import NewtonSchulzSettings
from lightning_muon.algorithms.muon import MuonRound
from lightning_muon.layout import MatrixLayout

__all__ = ["SPEL", "Spel", "SpelSettings"]


@dataclass(frozen=True, kw_only=True)
class SpelSettings(NewtonSchulzSettings, algorithm="spel", defaults={**EO_DEFAULTS, "weight_decay": 0.1}):
    """SPEL groups, Emerging-Optimizers' defaults: the update is not scaled by shape, and the Newton-Schulz
    settings serve both matrix signs (the update's and the weight's)."""


class Spel(EmergingVariant):
    """``"spel"``: the unscaled orthogonalized momentum, then the weight projected by its matrix sign."""

    name = "spel"
    settings = SpelSettings

    @torch.no_grad()
    def after_update(self, ctx: StepContext, rnd: MuonRound) -> None:
        """``W <- msign(W)``: every piece of every weight, with the group's Newton-Schulz settings."""
        weights = [p.detach() for p in rnd.params]
        signs = self.orthogonalize(ctx, rnd, weights, observe=False)
        _copy_pieces_(rnd.params, signs, rnd.layout, ctx.local_shard)


def _copy_pieces_(params: list[Tensor], pieces: list[list[Tensor]], layout: MatrixLayout, local=None) -> None:
    """Write per parameter its pieces (``MatrixLayout.views`` of it) into it, in place.

    ``local`` gives this rank's part of a tensor (``Sharding.local_shard``): under FSDP2 a
    parameter and its pieces are ``Shard(0)`` DTensors, and this rank's rows of each piece
    are the pieces of its rows of the parameter (``MuonFSDPSharding.orthogonalize``), so
    only the local shard is written. Pieces in another dtype (Newton-Schulz's) are cast on
    the way in.
    """
    local = local or (lambda t: t)
    for p, ps in zip(params, pieces):
        w = local(p)
        if w.numel() == 0:
            continue  # an empty shard (more ranks than rows)
        target = w if w.is_contiguous() else w.contiguous()  # channels_last convs: write a copy
        for slot, piece in zip(layout.slots(target), ps):
            slot.copy_(local(piece).reshape(slot.shape))
        if target is not w:
            w.copy_(target)


SPEL = register_algorithm(Spel())
