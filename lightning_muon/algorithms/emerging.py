r"""The base of NVIDIA Emerging-Optimizers' Muon variants (``scion``, ``polargrad``, ...), with its defaults.

Emerging-Optimizers 0.3.0 (the library behind Megatron-Core's ``emerging_optimizers``)
steps every orthogonalized optimizer alike, for a matrix ``W`` with gradient ``G``::

    W <- decay(W)                          # weight_decay_method, before the momentum
    B <- momentum B + (1 - momentum) G     # EMA momentum
    U <- lerp(G, B, momentum) if nesterov else B
    O <- scaled_orthogonalize(U)           # the variant's own: Newton-Schulz, SVD, times a scale
    W <- W - lr O
    W <- post_update(W)                    # the variant's own: a projection back onto a set

with ``decay``, by ``weight_decay_method``: ``"decoupled"`` ``W (1 - lr wd)``,
``"independent"`` ``W (1 - wd)``, ``"palm"`` ``W (1 - lr^2 wd)``, or ``"l2"``: ``G + wd W``
feeds the momentum instead. ``EmergingVariant`` maps those onto ``MuonAlgorithm``'s
stages: the decay runs in ``apply_update`` (or, for ``"l2"``, on a copy of the gradients
before the momentum), and a variant writes only its ``scale`` and its ``after_update``.

The settings are the Newton-Schulz family's (``families.NewtonSchulzSettings``) with
Emerging-Optimizers' defaults (``EO_DEFAULTS``); its constructor's names
(``coefficient_type``, ``num_ns_steps``, ``scale_mode``) load through ``aliases``.
``fp32_matmul_prec`` (``"highest"``, ``"high"``, ``"medium"``) says what precision the
group's float32 work runs in (``muon.MuonHparams``).

References:
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``OrthogonalizedOptimizer`` and ``WeightDecayMixin``.
"""

from __future__ import annotations

from lightning_muon.algorithms.base import StepContext
from lightning_muon.algorithms.muon import MuonAlgorithm, MuonRound

__all__ = ["EO_DEFAULTS", "EmergingVariant"]

# What Emerging-Optimizers' orthogonalized optimizers default to where Muon's settings say otherwise: its lr,
# no Nesterov, its "quintic" schedule (ours "you", 5 steps), the standard iteration and no scale by shape.
EO_DEFAULTS = {"lr": 3e-4, "nesterov": False, "ns_coefficients": "you", "ns_method": "standard", "adjust_lr": "none"}


class EmergingVariant(MuonAlgorithm):
    """A Muon variant of Emerging-Optimizers: Muon's stages, with its scale and, where it projects, ``after_update``.

    A subclass sets ``name`` and ``hparams`` (its settings, Emerging-Optimizers' defaults: ``EO_DEFAULTS``) and
    writes ``scale`` (its factor on the orthogonalized update besides ``adjust_lr`` and ``extra_scale_factor``)
    and, where it projects, ``after_update``. ``keeps_updates`` is True for a stage that reads the update after
    the orthogonalization (PolarGrad's nuclear norm, in ``normalize``).
    """

    def scale(self, group: dict) -> float:
        """The variant's own factor on every orthogonalized piece (Scion's spectral radius); 1 by default."""
        return 1.0

    def update_scale(self, group: dict, fan_out: int, fan_in: int) -> float:
        return super().update_scale(group, fan_out, fan_in) * self.scale(group)

    def apply_update(self, ctx: StepContext, rnd: MuonRound, extra: float = 1.0) -> None:
        """``W <- decay(W) - lr adjust(fan_out, fan_in) extra_scale_factor scale O``, each piece with its own shape."""
        super().apply_update(ctx, rnd, extra * self.scale(rnd.group))
