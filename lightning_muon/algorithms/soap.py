r"""``"soap"`` groups: SOAP (Adam in the eigenbasis of Shampoo's factors), with KL-Shampoo's factors on request.

The hyperparameters are NVIDIA Emerging-Optimizers' ``SOAP`` (0.3.0): its constructor's
names and defaults (``stream_list`` aside, a CUDA scheduling detail), plus
``precondition_frequency``, the SOAP paper's knob (1: Emerging-Optimizers' every step). The
math is ``soap_math``, one matrix at a time; ``SOAP.step_group`` collects the state.

State per parameter, in float32 (float64 for float64 parameters): ``step`` (a 0-D tensor),
``exp_avg`` and ``exp_avg_sq`` (m, n), in the eigenbasis; ``L`` (m, m) and ``R`` (n, n), the
factors; ``Q_L`` and ``Q_R``, their eigenbases. ``torch.optim.Optimizer.load_state_dict``
casts state to its parameter's dtype, so a bf16 parameter's state comes back rounded to bf16
(widened again at the next step); keep float32 parameters (bf16-mixed precision) to resume
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_muon.algorithms.adamw import momentum_readout, sync_beta1
from lightning_muon.algorithms.base import Algorithm, StepContext, group_lr, register_algorithm
from lightning_muon.algorithms.families import (
    UNSIGNED_DECAY_METHODS,
    Betas,
    FP32MatmulPrec,
    MatrixSettings,
    checked_betas,
)
from lightning_muon.algorithms.settings import setting
from lightning_muon.algorithms.soap_math import SOAP_STATE_KEYS, init_soap_state, soap_update
from lightning_muon.functional import decay_weights_

__all__ = ["SOAP", "SOAPSettings", "SOAP_ALGORITHM", "ShampooSettings", "check_soap_params"]


# soap_update's keywords that are group keys of the same name.
_SETTINGS = (
    "betas",
    "shampoo_beta",
    "eps",
    "nesterov",
    "correct_bias",
    "correct_shampoo_beta_bias",
    "use_eigh",
    "power_iter_steps",
    "max_update_rms",
    "use_kl_shampoo",
    "precondition_frequency",
    "fp32_matmul_prec",
    "qr_fp32_matmul_prec",
)


@dataclass(frozen=True, kw_only=True)
class ShampooSettings(MatrixSettings, defaults={"lr": 3e-3, "weight_decay": 0.01, "fp32_matmul_prec": "high"}):
    """The settings of SOAP and REKLS: an inner Adam in the eigenbases of Shampoo's Kronecker factors. The lr
    (Emerging-Optimizers has no default) is the SOAP paper's reference implementation's."""

    choices: ClassVar[dict[str, tuple]] = {"weight_decay_method": UNSIGNED_DECAY_METHODS}

    betas: Betas = (0.9, 0.95)
    """(beta1, beta2) of the inner Adam, each in [0, 1)."""
    shampoo_beta: float = setting(0.95, low=0.0, high=1.0, high_open=True)
    """EMA rate of the Kronecker factors L and R, in [0, 1)."""
    eps: float = setting(1e-8, low=0.0, low_open=True)
    """Added to the inner Adam's root of the second moment, and KL-Shampoo's floor under the factors'
    eigenvalues; > 0."""

    def normalize(self) -> None:
        self._set("betas", checked_betas(self, self.betas))


@dataclass(frozen=True, kw_only=True)
class SOAPSettings(ShampooSettings, algorithm="soap"):
    """SOAP groups, Emerging-Optimizers' defaults (``weight_decay_method="l2"`` decays the inner Adam's
    gradient, not the factors')."""

    nesterov: bool = False
    """Nesterov momentum in the inner Adam (NAdam's look-ahead)."""
    correct_bias: bool = True
    """Adam's bias correction of the inner moments (and of the factors' EMA, unless correct_shampoo_beta_bias
    says otherwise)."""
    use_eigh: bool = False
    """Refresh the bases by a full eigendecomposition; False: orthogonal iteration (power iteration and QR)
    from the current ones. The first bases always come from eigh."""
    qr_fp32_matmul_prec: FP32MatmulPrec = "high"
    """fp32_matmul_prec for the refresh's matmuls and QR."""
    power_iter_steps: int = setting(1, low=1, integer=True)
    """Power-iteration rounds, each followed by a QR, per refresh without eigh."""
    max_update_rms: float = setting(0.0, low=0.0)
    """Scale each matrix's update down to this RMS (0: no clipping)."""
    use_kl_shampoo: bool = False
    """KL-Shampoo's factors (Lin et al.): each averages the gradient whitened by the other."""
    correct_shampoo_beta_bias: bool | None = None
    """Bias-correct the factors' EMA; None follows correct_bias."""
    precondition_frequency: int = setting(1, low=1, integer=True)
    """Refresh the bases every this many steps (and at the first). Not an Emerging-Optimizers argument (it
    refreshes every step: 1); the SOAP paper's, and Megatron-Core's soap_precondition_frequency."""

    def normalize(self) -> None:
        super().normalize()
        if self.correct_shampoo_beta_bias is not None and not isinstance(self.correct_shampoo_beta_bias, bool):
            raise self.error(
                "correct_shampoo_beta_bias", f"must be None or a bool, got {self.correct_shampoo_beta_bias!r}"
            )


def check_soap_params(group: dict[str, Any], params: list[Tensor], where: str, algorithm: str) -> None:
    """Every parameter of the group is a real 2-D matrix (SOAP's factors need two axes)."""
    for j, p in enumerate(params):
        label = f"{where}, parameter {j}" + (f" ({group['param_names'][j]!r})" if "param_names" in group else "")
        if p.ndim != 2:
            raise ValueError(
                f"{label}: {algorithm!r} preconditions 2-D matrices (one Kronecker factor per axis), got shape "
                f"{tuple(p.shape)}; route it to 'adamw', or reshape it into a matrix"
            )
        if p.is_complex():
            raise ValueError(f"{label}: complex parameters are not supported by {algorithm!r}")


class SOAP(Algorithm):
    r"""``"soap"``: Adam run in the eigenbasis of Shampoo's Kronecker factors, refreshed every few steps.

    Per matrix ``W`` (m, n) with gradient ``G``, at step ``t`` (from 1), refreshing every
    ``f = precondition_frequency`` steps (``soap_math`` has the full rule)::

        b_t = 1 - (1 - b) / (1 - b^t)                      # b = shampoo_beta, bias corrected
        L <- b_t L + (1 - b_t) G G^T;   R <- b_t R + (1 - b_t) G^T G
        if (t - 1) mod f = 0:  Q_L, Q_R <- eigenbases of L, R   # eigh, or QR(L Q_L) iterations
        G' = Q_L^T G Q_R
        M <- b1 M + (1 - b1) G';   V <- b2 V + (1 - b2) G'^2
        W <- W (1 - lr wd)                                 # weight_decay_method="decoupled"
        W <- W - lr Q_L [(M / c1) / (sqrt(V / c2) + eps)] Q_R^T

    with ``c1 = 1 - b1^t``, ``c2 = 1 - b2^t``. ``M`` follows the basis at every refresh (it is
    rotated), ``V`` only its order. With ``use_kl_shampoo`` the factors average
    ``G R^-1 G^T / n`` and ``G^T L^-1 G / m`` instead, the inverses taken in the current bases.

    References:
        Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv 2409.11321, 2024.
        Lin et al., "Understanding and Improving Shampoo and SOAP via Kullback-Leibler
        Minimization", arXiv 2509.03378, 2025.
    """

    name = "soap"
    settings = SOAPSettings
    orthogonalizes = False
    per_matrix = True  # its eigenbases are whole-matrix work: the matrices' role, and owners under a sharding
    # Its state is float32 (or wider) whatever exp_avg_dtype says; a master copy it steps on as on any parameter.
    state_dtype_settings = frozenset({"main_params_dtype"})

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        check_soap_params(group, params, where, self.name)
        momentum_readout(group)

    def update_options(self, group: dict[str, Any]) -> dict[str, Any]:
        """``soap_update``'s keywords from the group's settings."""
        settings = {name: group[name] for name in _SETTINGS}
        if settings["correct_shampoo_beta_bias"] is None:
            settings["correct_shampoo_beta_bias"] = group["correct_bias"]
        return settings

    def init_state(self, ctx: StepContext, group: dict[str, Any], params: list[Tensor]) -> None:
        for p in params:
            self._state(ctx, p)

    @torch.no_grad()
    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        """Step each matrix of ``params`` on its own; ``ctx`` gives the per-parameter ``state``.

        A DTensor (FSDP2, a 2-D mesh) steps whole on its owner rank (``Sharding.map_whole``):
        its state is sharded as the parameter is, gathered with the gradient for the step,
        and each rank keeps its rows of the new state and applies its rows of the update.
        Under DDP an owner steps its whole matrices here and the sharding sends them on.
        """
        sync_beta1(ctx, group)  # a scheduler or a user may have moved beta1 since
        sharded = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
        if sharded:
            if ctx.sharding is None:
                p = params[sharded[0]]
                raise ValueError(
                    f"{self.name!r} steps whole matrices, and this parameter of shape {tuple(p.shape)} is a DTensor "
                    "without a sharding to gather it: train under the muon_fsdp strategy (or attach a "
                    "MuonFSDPSharding), or route it to 'adamw'"
                )
            self._step_sharded(ctx, group, [params[i] for i in sharded], [grads[i] for i in sharded])
        lr, weight_decay, method = group_lr(group), group["weight_decay"], group["weight_decay_method"]
        for p, g in zip(params, grads):
            if isinstance(p, DTensor):
                continue
            entry = self._state(ctx, p)
            update = self._update(group, entry, g, p)
            decay_weights_([p], lr, weight_decay, method, multiply_decoupled=False)
            p.add_(update, alpha=-lr)
            entry["step"] += 1

    def _state(self, ctx: StepContext, p: Tensor) -> dict[str, Tensor]:
        """``p``'s state, made on its first step (sharded as ``p`` is) and widened back if a load narrowed it."""
        work = torch.promote_types(p.dtype, torch.float32)
        entry = ctx.state[p]
        if "Q_L" not in entry:
            entry["step"] = torch.tensor(0.0)
            fresh = init_soap_state(p, work)
            if isinstance(p, DTensor):  # every rank cuts its own part of the same whole: no collective
                mesh, placements = p.device_mesh, p.placements
                fresh = {k: distribute_tensor(v, mesh, placements, src_data_rank=None) for k, v in fresh.items()}
            entry.update(fresh)
        for key in SOAP_STATE_KEYS:
            if entry[key].dtype != work:  # load_state_dict cast it to a narrower parameter's dtype
                entry[key] = entry[key].to(work)
        return entry

    def _update(self, group: dict, state: dict[str, Tensor], grad: Tensor, weight: Tensor | None) -> Tensor:
        """One matrix's SOAP direction from its whole ``grad`` and ``state`` (updated in place; ``step`` not)."""
        work = state["Q_L"].dtype
        l2 = group["weight_decay"] if group["weight_decay_method"] == "l2" else 0.0
        step = int(state["step"].item()) + 1
        return soap_update(
            grad.to(work), state, step=step, weight=weight, l2_weight_decay=l2, **self.update_options(group)
        )

    def _step_sharded(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        """The DTensor parameters' step: gradient, weight and state whole on each owner (``step_group``)."""
        entries = [self._state(ctx, p) for p in params]
        l2 = group["weight_decay_method"] == "l2"  # then the inner Adam reads the whole weight too
        tensors = [
            [g, *(e[k] for k in SOAP_STATE_KEYS), *([p.detach()] if l2 else [])]
            for p, g, e in zip(params, grads, entries)
        ]

        def step_one(i: int, wholes: list[Tensor]) -> list[Tensor]:
            grad, state, weight = wholes[0], wholes[1 : 1 + len(SOAP_STATE_KEYS)], wholes[1 + len(SOAP_STATE_KEYS) :]
            whole = dict(zip(SOAP_STATE_KEYS, state), step=entries[i]["step"])
            update = self._update(group, whole, grad, weight[0] if weight else None)
            return [update.to(grad.dtype), *(whole[k] for k in SOAP_STATE_KEYS), *weight]

        def step_whole(indices: list[int], wholes: list[list[Tensor]]) -> list[list[Tensor]]:
            return [step_one(i, ws) for i, ws in zip(indices, wholes)]  # each matrix on its own

        lr, weight_decay, method = group_lr(group), group["weight_decay"], group["weight_decay_method"]
        for p, entry, parts in zip(params, entries, ctx.sharding.map_whole(params, tensors, step_whole)):
            for key, rows in zip(SOAP_STATE_KEYS, parts[1:]):
                entry[key].to_local().copy_(rows)
            local = p.to_local()
            decay_weights_([local], lr, weight_decay, method, multiply_decoupled=False)
            local.add_(parts[0].to(local.dtype), alpha=-lr)
            entry["step"] += 1


SOAP_ALGORITHM = register_algorithm(SOAP())
