"""``Muon``: a hybrid optimizer, Muon on hidden matrices and AdamW, Lion or Schedule-Free AdamW on the rest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.added_groups import split_added_group
from lightning_muon.attachments import Attachments, UpdateHook
from lightning_muon.checkpoint_routing import RoutingChecks
from lightning_muon.elementwise import ElementwiseGroups
from lightning_muon.hparams import (
    ALGORITHMS,
    SCHEDULE_FREE,
    AdamWHparams,
    AdjustLR,
    LionHparams,
    MuonHparams,
    NonFinite,
    OptimizerConfig,
    ScheduleFreeHparams,
    check_group,
)
from lightning_muon.muon_groups import MuonGroups
from lightning_muon.nonfinite import NonFiniteChecks
from lightning_muon.param_groups import algorithm_of, as_groups, check_muon_params, option_names, resolve_split_parts
from lightning_muon.schedule_free import ScheduleFreeGroups, schedulefree_group

__all__ = ["ALGORITHMS", "SCHEDULE_FREE", "Muon", "UpdateHook"]

_M, _A, _L, _S = MuonHparams, AdamWHparams, LionHparams, ScheduleFreeHparams  # defaults: their class attributes


class Muon(Attachments, NonFiniteChecks, ScheduleFreeGroups, RoutingChecks, MuonGroups, ElementwiseGroups, Optimizer):
    r"""Muon for hidden weight matrices, AdamW, Lion or Schedule-Free AdamW for everything else, in one optimizer.

    Each param group has an ``"algorithm"``: ``"muon"``, ``"adamw"``, ``"lion"`` or
    ``"adamw_schedulefree"``. For a
    Muon matrix ``W`` with gradient ``G`` (torch.optim.Muon's form, the defaults)::

        B <- mu B + (1 - mu) G                       # EMA momentum
        U <- (1 - mu) G + mu B   if nesterov else B
        O <- orthogonalize(U)                        # Newton-Schulz, short side first
        W <- W (1 - lr wd)                           # decoupled decay, base lr
        W <- W - lr * adjust(rows, cols) * extra_scale_factor * O

    Variants, each a keyword (all per group too):

    - ``momentum_form="sum"``: ``B <- mu B + G``, ``U <- G + mu B`` with Nesterov (Moonlight, dion).
    - ``sign_momentum=True``: orthogonalize ``sign(U)`` (AdaMuon's sign-stabilized update).
    - ``second_moment="normuon"`` / ``"adamuon"``: after orthogonalization,
      ``v <- b2 v + (1 - b2) mean_cols(O^2)`` per row (NorMuon) or ``O^2`` per element
      (AdaMuon), ``O <- O / (sqrt(v) + eps)``, rescaled to the Frobenius norm ``O`` had, so
      the update keeps plain Muon's RMS and its lr (see ``muon_second_moment_``).
    - ``weight_decay_form="cautious"``: decay only entries where ``O * W >= 0``.
    - ``ns_method``: ``"standard"``, ``"gram"`` (Gram Newton-Schulz) or ``"auto"`` (Gram
      only where it was measured faster at equal accuracy: ``resolve_ns_method``).

    Tensors with more than two dims are flattened to ``(dim 0, rest)``; a group with
    ``split_sizes`` orthogonalizes blocks along dim 0 separately (fused QKV; sizes summing
    to a divisor of dim 0 repeat per group of rows, Megatron's GQA layout), and a group
    with ``batched=True`` treats a ``(..., rows, cols)`` tensor as a batch of matrices
    (experts). AdamW groups follow ``torch.optim.AdamW``; Lion groups follow
    Chen et al. with decoupled weight decay. Every update scales with the group's lr,
    so a step at lr = 0 changes nothing.

    ``"adamw_schedulefree"`` groups are stepped by ``schedulefree.AdamWScheduleFree`` over
    this optimizer's groups and state (``schedule_free``): ``train()`` and ``eval()`` switch
    their parameters between the training and the averaged weights. Param groups are made
    from what ``params`` holds as ``param_groups.as_groups`` says (a flat list: matrices to
    Muon, the rest to AdamW); a group given without an ``"algorithm"``, here or later by
    ``add_param_group`` (``BackboneFinetuning``), is routed and split by algorithm
    (``added_groups``, by the rules of ``attach_router``); a sharding (``attach_sharding``) splits the Newton-Schulz
    work across ranks, and ``register_update_hook`` observes the applied updates.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts.
        lr, momentum, ..., ns_method, tp_mode: Muon group defaults, the fields of ``MuonHparams``
            (documented there, each with its default and valid range).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW group defaults,
            ``AdamWHparams``.
        lion_lr, lion_betas, lion_weight_decay: Lion group defaults, ``LionHparams`` (lr and
            weight decay default to AdamW's).
        adamw_schedulefree_*: Schedule-Free AdamW group defaults, ``ScheduleFreeHparams``
            (``AdamWScheduleFree``'s keywords; lr and weight decay default to AdamW's).
        nonfinite: ``"raise"`` (default) on a NaN/inf gradient, naming the group and
            parameter, ``"skip"`` the whole step with a warning, or ``"ignore"``: no check, as
            in torch.optim (a NaN reaches the weights, and a step is free of host-device
            synchronization).

    References:
        Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024.
        Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982, 2025.
        Loshchilov & Hutter, "Decoupled Weight Decay Regularization", arXiv 1711.05101.
        Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675.
        Defazio et al., "The Road Less Scheduled", arXiv 2405.15682, 2024.
        Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491, 2025.
        Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005, 2025.
        Chen et al., "Cautious Weight Decay", arXiv 2510.12402, 2025.
        Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz", 2026 (dao-ailab.github.io/blog/2026/gram-newton-schulz).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _M.lr,
        momentum: float = _M.momentum,
        nesterov: bool = _M.nesterov,
        weight_decay: float = _M.weight_decay,
        ns_steps: int = _M.ns_steps,
        ns_coefficients: str | list[tuple[float, float, float]] = _M.ns_coefficients,
        ns_dtype: torch.dtype | str | None = _M.ns_dtype,
        adjust_lr: AdjustLR = _M.adjust_lr,
        extra_scale_factor: float = _M.extra_scale_factor,
        momentum_form: str = _M.momentum_form,
        second_moment: str | None = _M.second_moment,
        second_moment_beta2: float = _M.second_moment_beta2,
        second_moment_eps: float = _M.second_moment_eps,
        sign_momentum: bool = _M.sign_momentum,
        weight_decay_form: str = _M.weight_decay_form,
        ns_method: str = _M.ns_method,
        tp_mode: str = _M.tp_mode,
        adamw_lr: float = _A.lr,
        adamw_betas: tuple[float, float] = _A.betas,
        adamw_eps: float = _A.eps,
        adamw_weight_decay: float = _A.weight_decay,
        lion_lr: float | None = _L.lr,
        lion_betas: tuple[float, float] = _L.betas,
        lion_weight_decay: float | None = _L.weight_decay,
        adamw_schedulefree_lr: float | None = _S.lr,
        adamw_schedulefree_betas: tuple[float, float] = _S.betas,
        adamw_schedulefree_eps: float = _S.eps,
        adamw_schedulefree_weight_decay: float | None = _S.weight_decay,
        adamw_schedulefree_warmup_steps: int = _S.warmup_steps,
        adamw_schedulefree_r: float = _S.r,
        adamw_schedulefree_weight_lr_power: float = _S.weight_lr_power,
        nonfinite: NonFinite = "raise",
    ) -> None:
        keywords = {k: v for k, v in locals().items() if k not in ("self", "params", "__class__")}
        self._setup(params, OptimizerConfig.from_keywords(**keywords))

    @classmethod
    def from_config(cls, params: Iterable[Any], config: OptimizerConfig) -> Muon:
        """A ``Muon`` with the settings of ``config``, checked when it was made (``OptimizerConfig.build``)."""
        optimizer = cls.__new__(cls)
        optimizer._setup(params, config)
        return optimizer

    def _setup(self, params: Iterable[Any], config: OptimizerConfig) -> None:
        self.config = config
        """The settings, checked, as one config per algorithm."""
        self.nonfinite = config.nonfinite
        self._algorithm_defaults = {a: config.group_defaults(a) for a in ALGORITHMS}
        self._init_attachments()
        # Only keys every group has live in ``defaults``: Optimizer copies them into each
        # group, and LearningRateMonitor would read ``betas`` from every group if it were here.
        super().__init__(as_groups(params), {"momentum": config.muon.momentum})

    @classmethod
    def option_names(cls, algorithm: str) -> frozenset[str]:
        """The keys a param group of ``algorithm`` may set (``param_groups.option_names``)."""
        return option_names(algorithm)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; one without an ``"algorithm"`` is routed, and split by algorithm (``added_groups``)."""
        if param_group.get("algorithm") is None:
            for part in split_added_group(param_group, self.param_groups, self._algorithm_defaults, self._router):
                self.add_param_group(part)
            return
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if params and isinstance(params[0], tuple):
            group.setdefault("param_names", [n for n, _ in params])
            params = [p for _, p in params]
        group["params"] = params
        where = f"param group {len(self.param_groups)}" + (f" ({group['name']!r})" if "name" in group else "")
        algorithm = group["algorithm"] = algorithm_of(group, params, where)
        defaults = self._algorithm_defaults[algorithm]
        overrides = [key for key in defaults if key in group]
        for key, value in defaults.items():
            group.setdefault(key, value)
        if overrides:  # the defaults were checked (and normalized) with the config: only the group's own values now
            group.update(check_group(group, algorithm, where))
        if algorithm == "muon":
            resolve_split_parts(group, params, where)
            check_muon_params(group, params, where)
        elif algorithm == SCHEDULE_FREE:
            knobs = {key: group[key] for key in self._algorithm_defaults[SCHEDULE_FREE]}
            for key, value in schedulefree_group(params, knobs).items():
                group.setdefault(key, value)
        # For AdamW, Lion and Schedule-Free, a read-out of beta1 for loggers (LearningRateMonitor
        # logs group["momentum"]); their step reads ``betas`` and refreshes this copy.
        if algorithm != "muon":
            group["momentum"] = group["betas"][0]
        super().add_param_group(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every group; ``closure`` re-evaluates the loss."""
        self._check_train_mode()  # before the closure: its gradients would be taken at the averaged weights
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, *self._collect(i, group)) for i, group in enumerate(self.param_groups)]
        if not self._grads_finite(work):
            return loss
        sharding = self._sharding
        for group, params, grads in work:
            if not params:
                continue
            algorithm = group["algorithm"]
            if algorithm == "muon":
                self._muon_step(group, params, grads)
            elif algorithm == "adamw":
                self._adamw_step(group, params, grads)
            elif algorithm == "lion":
                self._lion_step(group, params, grads)
        inner = self._schedule_free_optimizer()
        if inner is not None:
            # All schedule-free groups at once, as AdamWScheduleFree steps its own: a group
            # without gradients still counts the step (its k and weight_sum advance).
            inner.step()
        if sharding is not None:
            sharding.gather_parameters()  # every rank calls it, owner of matrices or not
        return loss

    def _collect(self, index: int, group: dict) -> tuple[list[Tensor], list[Tensor]]:
        params, grads = [], []
        for j, p in enumerate(group["params"]):
            # An empty tensor (a zero-width layer) has nothing to update; skipping it also keeps
            # it out of the inf-norm check and the adjust_lr ratio, which both fail on size 0.
            if p.grad is None or p.numel() == 0:
                continue
            if self._sharding is not None and not self._sharding.owns(p):
                continue  # another rank orthogonalizes it and sends the result
            if p.grad.is_sparse:
                raise ValueError(f"param group {index}, parameter {j}: sparse gradients are not supported")
            if p.grad.is_complex():
                raise ValueError(f"param group {index}, parameter {j}: complex gradients are not supported")
            params.append(p)
            grads.append(p.grad)
        return params, grads
