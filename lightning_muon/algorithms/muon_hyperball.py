r"""``"muon_hyperball"`` groups: Muon whose weight update keeps every matrix on a sphere (MuonHyperball).

Everything up to the orthogonalized update ``O`` is Muon's (momentum, Newton-Schulz, any
second moment; ``MuonAlgorithm``). The weight update then keeps the Frobenius norm of each
parameter ``W``, after the decoupled decay ``W <- W (1 - lr wd)``::

    R <- ||W||_F, or the fixed radius r (every parameter rescaled to r before its first step)
    O <- R O / max(||O||_F, eps)
    W <- W - lr O
    W <- R W / max(||W||_F, eps)                    eps = hyperball_eps = 1e-8

so each step turns ``W`` on the sphere of radius ``R`` by a relative step of about ``lr``.
The norms span the whole parameter (every piece of a fused QKV split), as NVIDIA's
implementation takes ``p.norm()``, except in an expert stack (``batched``): it stands for
separate per-expert matrices (transformers 4's one ``nn.Linear`` per expert and
projection), so every matrix of the batch, and every piece of a split one (gate, up), keeps
its own sphere, as those ``nn.Linear`` would; ``adjust_lr`` and
``extra_scale_factor`` scale ``O`` before it is normalized and so change nothing. With
``R = ||W||_F`` a weight decay shrinks the radius by ``(1 - lr wd)`` per step; with a fixed
radius it does nothing. A parameter whose norm is 0 has no direction to keep and is refused.

Three sums per parameter give both norms: ``||W||^2``, ``<W, O>`` and ``||O||^2``, since
``||W - c O||^2 = ||W||^2 - 2 c <W, O> + c^2 ||O||^2``. Under a sharding they are summed
over the ranks' pieces (``Sharding.reduce_matrix_sums``): nothing moves under DDP, whose
owners hold whole matrices, and one all-reduce of ``3 K`` numbers per group under FSDP2,
where every rank holds a row block of every matrix. (Owners there hold ``O`` whole but not
``W``; sending ``W`` to them would move every element once more.) An expert stack's ranks hold
whole experts under every sharding (DDP blocks, FSDP2 and expert-parallel shards): its
per-expert sums are complete where they are taken, with no collective. The sums are taken in
float32 at least; the expansion loses relative precision only as ``||W - c O||`` falls far
below ``||W||``, a step that would all but cancel the weight.

References:
    NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``orthogonalized_optimizers/muon_hyperball.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_muon.algorithms.base import StepContext, register_algorithm
from lightning_muon.algorithms.muon import MuonAlgorithm, MuonRound, MuonSettings
from lightning_muon.algorithms.settings import setting
from lightning_muon.algorithms.state_dtypes import MAIN_PARAM
from lightning_muon.layout import MatrixLayout, layout_of

__all__ = ["MuonHyperball", "MuonHyperballSettings"]


@dataclass(frozen=True, kw_only=True)
class MuonHyperballSettings(MuonSettings, algorithm="muon_hyperball"):
    """MuonHyperball groups: Muon's settings and the sphere's; the decay is decoupled (it decays before it
    measures the radius)."""

    choices: ClassVar[dict[str, tuple]] = {**MuonSettings.choices, "weight_decay_method": ("decoupled",)}

    hyperball_radius: float | None = setting(None, low=0.0, low_open=True)
    """Fixed Frobenius norm of every parameter (rescaled to it before its first step); None: each keeps its own."""
    hyperball_eps: float = setting(1e-8, low=0.0, low_open=True)
    """Floor of the norms the update and the weight are divided by; > 0."""


class MuonHyperball(MuonAlgorithm):
    """``"muon_hyperball"``: Muon's update, normalized to the weight's radius, and the weight kept on it."""

    name = "muon_hyperball"
    settings = MuonHyperballSettings

    @torch.no_grad()
    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        super().init_group(group, params, where)
        for j, p in enumerate(params):
            if p.numel() and _whole_norm(p) == 0.0:
                name = f" ({group['param_names'][j]!r})" if "param_names" in group else ""
                raise ValueError(
                    f"{where}, parameter {j}{name}: muon_hyperball keeps each weight's Frobenius norm, and this "
                    f"one of shape {tuple(p.shape)} is all zeros (no direction to keep); initialize it, or route "
                    "it to 'muon'"
                )

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        radius = group["hyperball_radius"]
        if radius is not None:
            # Onto the sphere before the first step: a parameter without state has not stepped yet
            # (a resumed one has, and is on it already; rescaling it again would only round it).
            layout, local = layout_of(group), ctx.local_shard
            for p in params:
                if set(ctx.state[p]) - {MAIN_PARAM}:  # a master copy alone is made before the first step
                    continue
                if layout.batched:  # every matrix of the stack to its own sphere (whole experts are local)
                    for slot in _updated_slots(local(p), layout):
                        slot.mul_(radius / _per_matrix_sq(slot).sqrt().clamp_min(group["hyperball_eps"]).view(_b(slot)))
                else:
                    p.mul_(radius / max(_whole_norm(p), group["hyperball_eps"]))
        super().step_group(ctx, group, params, grads)

    def apply_update(self, ctx: StepContext, rnd: MuonRound, extra: float = 1.0) -> None:
        params, ortho, group = rnd.params, rnd.ortho, rnd.group
        lr, eps, radius = rnd.hp.lr, group["hyperball_eps"], group["hyperball_radius"]
        if lr == 0.0:
            return  # nothing moves (and no renormalization rounds a weight already on its sphere)
        if rnd.hp.weight_decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * rnd.hp.weight_decay)
        sharding = ctx.sharding
        local = ctx.local_shard
        layout = rnd.layout
        if layout.batched:
            for p, pieces in zip(params, ortho):
                _per_matrix_update(local(p), [local(o) for o in pieces], layout, lr, eps, radius)
            return
        # (K, 3): ||W||^2, <W, O>, ||O||^2 over this rank's part of each parameter
        parts = [_partial_sums(local(p.detach()), [local(o) for o in os], layout) for p, os in zip(params, ortho)]
        sums = torch.stack(parts)
        if sharding is not None:
            sums = sharding.reduce_matrix_sums(params, sums, layout)
        for p, pieces, (ww, wo, oo) in zip(params, ortho, sums.tolist()):
            R = radius if radius is not None else math.sqrt(ww)
            c = lr * R / max(math.sqrt(oo), eps)  # W <- W - c O is W - lr (R O / max(||O||, eps))
            new_norm = math.sqrt(max(ww - 2.0 * c * wo + c * c * oo, 0.0))
            target = p if p.is_contiguous() else p.contiguous()  # channels_last convs: update a copy
            for w, o in zip(layout.slots(target), pieces):
                w.add_(o.reshape(w.shape), alpha=-c)
            target.mul_(R / max(new_norm, eps))
            if target is not p:
                p.copy_(target)


def _b(slot: Tensor) -> tuple[int, ...]:
    """The shape that broadcasts one value per matrix (dim 0) over a slot."""
    return (slot.shape[0],) + (1,) * (slot.ndim - 1)


def _per_matrix_sq(slot: Tensor, other: Tensor | None = None) -> Tensor:
    """Per matrix (dim 0 of a slot), ``sum(slot * other)`` (``||slot||^2`` without ``other``), in float32 at least."""
    work = torch.promote_types(slot.dtype, torch.float32)
    x = slot.to(work)
    y = x if other is None else other.to(work)
    return (x * y).sum(dim=tuple(range(1, slot.ndim)))


def _updated_slots(w: Tensor, layout: MatrixLayout) -> list[Tensor]:
    """Writable slots of ``w`` with the batch as dim 0: this rank's whole expert matrices."""
    if not w.is_contiguous():
        raise ValueError("muon_hyperball: an expert stack must be contiguous")
    return layout.slots(w)


def _per_matrix_update(
    w: Tensor, pieces: list[Tensor], layout: MatrixLayout, lr: float, eps: float, radius: float | None
) -> None:
    """The hyperball step of every matrix of an expert stack, each on its own sphere (module docstring).

    ``w`` and ``pieces`` are this rank's whole experts (a DDP owner's stack, an FSDP2 or
    expert-parallel shard over the experts), so every norm is complete here: no reduction.
    """
    if w.numel() == 0:
        return
    for slot, o in zip(_updated_slots(w, layout), pieces):
        o = o.reshape(slot.shape)
        ww, wo, oo = _per_matrix_sq(slot), _per_matrix_sq(slot, o), _per_matrix_sq(o)  # (B,) each
        R = ww.sqrt() if radius is None else torch.full_like(ww, radius)
        c = lr * R / oo.sqrt().clamp_min(eps)  # W <- W - c O is W - lr (R O / max(||O||, eps))
        new_norm = (ww - 2.0 * c * wo + c * c * oo).clamp_min(0.0).sqrt()
        slot.sub_((c.view(_b(slot)) * o.to(c.dtype)).to(slot.dtype))
        slot.mul_((R / new_norm.clamp_min(eps)).view(_b(slot)).to(slot.dtype))


def _partial_sums(w: Tensor, pieces: list[Tensor], layout: MatrixLayout) -> Tensor:
    """``[||W||^2, <W, O>, ||O||^2]`` over this rank's part of a parameter, in float32 at least."""
    work = torch.promote_types(w.dtype, torch.float32)
    w = w.contiguous()
    ww = torch.linalg.vector_norm(w, dtype=work).square()
    wo = torch.zeros((), dtype=work, device=w.device)
    oo = torch.zeros((), dtype=work, device=w.device)
    for slot, o in zip(layout.slots(w), pieces):
        o = o.reshape(slot.shape).to(work)
        wo += (slot.to(work) * o).sum()
        oo += o.square().sum()
    return torch.stack([ww, wo, oo]).to(torch.float64)


def _whole_norm(p: Tensor) -> float:
    """``||p||_F`` of the whole parameter (a DTensor's over every rank: a collective every rank makes)."""
    norm = torch.linalg.vector_norm(p.detach(), dtype=torch.promote_types(p.dtype, torch.float32))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


MUON_HYPERBALL = register_algorithm(MuonHyperball())
