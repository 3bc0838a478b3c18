"""Weights stored ``(fan_in, fan_out)``: transformers' ``Conv1D`` (GPT-2, GPT-J style).

``Conv1D`` computes ``x @ W + b``, so its 2-D ``weight`` is the transpose of an
``nn.Linear``'s. Muon orthogonalizes it as stored (the polar factor of a transpose is the
transpose of the polar factor), but the lr scale reads fan-out and fan-in, and a fused
QKV is split along the columns: the default rules route these weights to a Muon group with
``transposed=True`` (``MatrixLayout``).
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["TRANSPOSED_MODULES", "transposed_weights"]

# Module class names whose 2-D ``weight`` is stored (fan_in, fan_out), the transpose of
# nn.Linear: transformers' Conv1D. Matched by name: no import needed.
TRANSPOSED_MODULES = ("Conv1D",)


def transposed_weights(module: nn.Module) -> set[int]:
    """Ids of the 2-D weights of ``module``'s ``TRANSPOSED_MODULES`` submodules."""
    return {
        id(m.weight)
        for m in module.modules()
        if type(m).__name__ in TRANSPOSED_MODULES
        and isinstance(getattr(m, "weight", None), Tensor)
        and m.weight.ndim == 2
    }
