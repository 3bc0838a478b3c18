"""The step of ``Muon``'s ``"muon"`` param groups: momentum, orthogonalize, second moment, observe, apply.

Four stages, each one place to extend: the momentum (``muon_momentum_``), the
orthogonalization (Newton-Schulz here, or across ranks by an attached ``Sharding``), the
update hooks (``Muon.register_update_hook``), and the update (``muon_apply_``, with the
lr scaled by shape). The math lives in ``functional``; this mixin collects the tensors
and the optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_muon.functional import (
    muon_apply_,
    muon_momentum_,
    muon_orthogonalize,
    muon_second_moment_,
    second_moment_buffer,
)
from lightning_muon.newton_schulz import donated_dtypes

__all__ = ["MuonGroups"]


class MuonGroups:
    """The step of ``"muon"`` groups over this optimizer's state (a mixin of ``Muon``)."""

    state: Any
    _algorithm_defaults: dict[str, dict[str, Any]]
    _sharding: Any
    _update_hooks: Any

    def _muon_step(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        # Four stages, each one place to extend: momentum, orthogonalize (a sharding may
        # do it across ranks), observe (UpdateSpectrumMonitor), apply.
        for key, value in self._algorithm_defaults["muon"].items():
            group.setdefault(key, value)  # groups loaded from a checkpoint older than a knob
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        # Without a hook or a sharding to hand the momentum to, the Nesterov update is a
        # temporary that Newton-Schulz may use up, made in the dtype ``donated_dtypes`` names
        # (the cast folded into the momentum kernel). Splits and batches keep theirs: their
        # pieces are cut and copied first.
        donate = group["nesterov"] and not self._update_hooks and self._sharding is None
        out_dtypes = None
        if donate and group["split_sizes"] is None and not group["batched"]:
            flat = [g.reshape(g.shape[0], -1) for g in grads]  # the matrices Newton-Schulz will see
            out_dtypes = donated_dtypes(flat, group["ns_dtype"], group["ns_method"])
        updates = muon_momentum_(
            grads, bufs, group["momentum"], group["nesterov"], group["momentum_form"], out_dtypes=out_dtypes
        )
        if group["sign_momentum"]:
            updates = list(torch._foreach_sign(updates))
        ortho = self._orthogonalize(group, params, updates, donate=donate)
        if group["second_moment"] is not None:
            ortho = self._second_moment(group, params, ortho)
        # A sharding that holds the full matrices only on owner ranks runs the hooks itself.
        if self._update_hooks and (self._sharding is None or not self._sharding.observes_updates):
            self.run_update_hooks(group, params, updates, ortho)
        muon_apply_(
            params,
            ortho,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            adjust_lr=group["adjust_lr"],
            extra_scale_factor=group["extra_scale_factor"],
            split_sizes=group["split_sizes"],
            batched=group["batched"],
            weight_decay_form=group["weight_decay_form"],
            transposed=group["transposed"],
        )

    def _second_moment(self, group: dict, params: list[Tensor], ortho: list[list[Tensor]]) -> list[list[Tensor]]:
        """NorMuon / AdaMuon normalization; the buffer lives in ``state[p]["second_moment"]``."""
        method, buffers = group["second_moment"], []
        for p in params:
            state = self.state[p]
            if "second_moment" not in state:
                state["second_moment"] = second_moment_buffer(p, method, group["batched"])
            buffers.append(state["second_moment"])
        return muon_second_moment_(
            ortho,
            buffers,
            method=method,
            beta2=group["second_moment_beta2"],
            eps=group["second_moment_eps"],
            split_sizes=group["split_sizes"],
            batched=group["batched"],
        )

    def _orthogonalize(
        self, group: dict, params: list[Tensor], updates: list[Tensor], donate: bool = False
    ) -> list[list[Tensor]]:
        """Per update, its orthogonalized pieces; a sharding does it across ranks."""
        kwargs = dict(
            ns_steps=group["ns_steps"],
            ns_coefficients=group["ns_coefficients"],
            ns_dtype=group["ns_dtype"],
            ns_method=group["ns_method"],
            split_sizes=group["split_sizes"],
            batched=group["batched"],
            transposed=group["transposed"],
        )
        if self._sharding is not None:
            return self._sharding.orthogonalize(params, updates, **kwargs)
        # Pieces stay in Newton-Schulz's dtype: muon_apply_ adds them into the parameters in one pass.
        return muon_orthogonalize(updates, **kwargs, keep_work_dtype=True, donate=donate)
