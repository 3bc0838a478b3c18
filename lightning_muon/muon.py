"""``Muon``: a hybrid optimizer, Muon on hidden matrices and AdamW, Lion or Schedule-Free AdamW on the rest."""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_muon.distributed.tp_math import TP_MODES
from lightning_muon.functional import (
    ADJUST_LR_ALIASES,
    ADJUST_LR_MODES,
    MOMENTUM_FORMS,
    SECOND_MOMENTS,
    WEIGHT_DECAY_FORMS,
    adamw_,
    all_finite,
    lion_,
    muon_apply_,
    muon_momentum_,
    muon_orthogonalize,
    muon_second_moment_,
    second_moment_buffer,
)
from lightning_muon.newton_schulz import (
    BATCH_MAX_ELEMENTS,
    check_ns_dtype,
    check_ns_method,
    dtype_name,
    resolve_coefficients,
    resolve_ns_dtype,
)

if TYPE_CHECKING:
    from lightning_muon.distributed.protocol import Sharding

__all__ = ["ALGORITHMS", "SCHEDULE_FREE", "Muon", "UpdateHook"]

# ``hook(group, params, updates, ortho)``: see ``Muon.register_update_hook``.
UpdateHook = Callable[[dict, list, list, list], None]

SCHEDULE_FREE = "adamw_schedulefree"
ALGORITHMS = ("muon", "adamw", "lion", SCHEDULE_FREE)
_NONFINITE = ("raise", "skip", "ignore")
# State entries shaped like their parameter (second moments may be reduced: not checked).
_PARAM_SHAPED = ("momentum_buffer", "exp_avg", "exp_avg_sq")


class Muon(Optimizer):
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

    ``"adamw_schedulefree"`` groups are stepped by the ``schedulefree`` package's own
    ``AdamWScheduleFree`` (Defazio et al.; ``pip install lightning_muon[schedulefree]``),
    which keeps two sequences per parameter: ``z`` (the SGD-like iterate) and the average
    ``x`` of the ``z`` seen so far, step ``k`` weighted by ``(k + 1) ** r * lr_max **
    weight_lr_power``. The parameter holds ``y = (1 - beta1) z + beta1 x`` in train mode,
    where gradients are taken, and ``x`` in eval mode. ``train()`` and ``eval()`` switch
    those groups (``step`` needs train mode; evaluate and save in eval mode); the groups'
    counters and mode flags and the per-parameter ``z`` and ``exp_avg_sq`` live in this
    optimizer's param groups and state, so ``state_dict()`` resumes them exactly. As in
    ``schedulefree``, their step overwrites the gradients it reads.

    A flat list of tensors (or ``(name, tensor)`` pairs) is split by rule: tensors with
    two or more dims to a ``"muon"`` group, the rest to an ``"adamw"`` group. A dict
    without ``"algorithm"`` gets ``"muon"`` if all its tensors are matrices, ``"adamw"``
    if none is, and an error otherwise.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts.
        lr: Muon learning rate.
        momentum: Muon momentum ``mu`` in [0, 1).
        nesterov: use the Nesterov form of the momentum.
        weight_decay: Muon decoupled weight decay (multiplied by the base lr).
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: a name in ``COEFFICIENTS`` or a list of (a, b, c) tuples.
        ns_dtype: Newton-Schulz dtype: None (automatic), "float32", "bfloat16" or a dtype.
        adjust_lr: "original", "match_rms_adamw", "spectral", "spectral_norm" or "none"
            (Megatron's "shape_scaling" and "unit_rms_norm" are aliases).
        extra_scale_factor: multiplies the adjusted Muon lr.
        momentum_form: ``"ema"`` (default) or ``"sum"``.
        second_moment: None, ``"normuon"`` (per row) or ``"adamuon"`` (per element).
        second_moment_beta2: decay of the second moment, in [0, 1).
        second_moment_eps: added to ``sqrt(v)``, > 0.
        sign_momentum: orthogonalize ``sign(U)`` instead of ``U``.
        weight_decay_form: ``"decoupled"`` (default) or ``"cautious"``.
        ns_method: ``"auto"`` (default), ``"standard"`` or ``"gram"``.
        tp_mode: for matrices split by tensor parallelism (``MuonFSDPStrategy`` with
            ``tensor_parallel_size > 1``; ignored elsewhere, where no matrix is split):
            ``"duplicated"`` (the whole matrix gathered and orthogonalized on every rank of
            the group; exact), ``"distributed"`` (Newton-Schulz on the blocks, Gram matrices
            summed across the group; exact) or ``"blockwise"`` (each block alone; an
            approximation). Megatron-Core's names.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW group defaults.
        lion_lr, lion_betas, lion_weight_decay: Lion group defaults (lr defaults to
            ``adamw_lr``; Lion usually wants 3-10x less).
        adamw_schedulefree_lr, adamw_schedulefree_betas, adamw_schedulefree_eps,
        adamw_schedulefree_weight_decay, adamw_schedulefree_warmup_steps,
        adamw_schedulefree_r, adamw_schedulefree_weight_lr_power: Schedule-Free AdamW group
            defaults, ``AdamWScheduleFree``'s keywords (lr and weight decay default to
            ``adamw_lr`` and ``adamw_weight_decay``; betas to its (0.9, 0.999)). Its weight
            decay is taken at ``y`` and scaled by the lr, as in ``schedulefree``.
        nonfinite: ``"raise"`` (default) on a NaN/inf gradient, naming the group and
            parameter, ``"skip"`` the whole step with a warning, or ``"ignore"``: no check, as
            in torch.optim (a NaN reaches the weights). The check reads every gradient once
            and syncs the host with the device once per step; ``"ignore"`` makes a step
            free of host-device synchronization (CUDA graphs, overlapped input pipelines).

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
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: str | list[tuple[float, float, float]] = "polar_express",
        ns_dtype: torch.dtype | str | None = None,
        adjust_lr: str = "original",
        extra_scale_factor: float = 1.0,
        momentum_form: str = "ema",
        second_moment: str | None = None,
        second_moment_beta2: float = 0.95,
        second_moment_eps: float = 1e-8,
        sign_momentum: bool = False,
        weight_decay_form: str = "decoupled",
        ns_method: str = "auto",
        tp_mode: str = "duplicated",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        lion_lr: float | None = None,
        lion_betas: tuple[float, float] = (0.9, 0.99),
        lion_weight_decay: float | None = None,
        adamw_schedulefree_lr: float | None = None,
        adamw_schedulefree_betas: tuple[float, float] = (0.9, 0.999),
        adamw_schedulefree_eps: float = 1e-8,
        adamw_schedulefree_weight_decay: float | None = None,
        adamw_schedulefree_warmup_steps: int = 0,
        adamw_schedulefree_r: float = 0.0,
        adamw_schedulefree_weight_lr_power: float = 2.0,
        nonfinite: str = "raise",
    ) -> None:
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self._algorithm_defaults = {
            "muon": dict(
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                weight_decay=weight_decay,
                ns_steps=ns_steps,
                ns_coefficients=ns_coefficients,
                ns_dtype=ns_dtype,
                adjust_lr=adjust_lr,
                extra_scale_factor=extra_scale_factor,
                momentum_form=momentum_form,
                second_moment=second_moment,
                second_moment_beta2=second_moment_beta2,
                second_moment_eps=second_moment_eps,
                sign_momentum=sign_momentum,
                weight_decay_form=weight_decay_form,
                ns_method=ns_method,
                tp_mode=tp_mode,
                split_sizes=None,
                batched=False,
                transposed=False,
            ),
            "adamw": dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay),
            "lion": dict(
                lr=adamw_lr if lion_lr is None else lion_lr,
                betas=lion_betas,
                weight_decay=adamw_weight_decay if lion_weight_decay is None else lion_weight_decay,
            ),
            # The keywords of schedulefree.AdamWScheduleFree; its bookkeeping entries (step
            # count, weight sum, mode flag) are added per group from the package itself.
            SCHEDULE_FREE: dict(
                lr=adamw_lr if adamw_schedulefree_lr is None else adamw_schedulefree_lr,
                betas=adamw_schedulefree_betas,
                eps=adamw_schedulefree_eps,
                weight_decay=(
                    adamw_weight_decay if adamw_schedulefree_weight_decay is None else adamw_schedulefree_weight_decay
                ),
                warmup_steps=adamw_schedulefree_warmup_steps,
                r=adamw_schedulefree_r,
                weight_lr_power=adamw_schedulefree_weight_lr_power,
            ),
        }
        for algorithm, defaults in self._algorithm_defaults.items():
            # Errors name the keyword the user passed: adamw_eps, lion_betas, ...
            prefix = "" if algorithm == "muon" else f"{algorithm}_"
            _validate_hparams(defaults, algorithm, where="Muon()", prefix=prefix)
        self._sharding: Sharding | None = None
        self._update_hooks: OrderedDict[int, UpdateHook] = OrderedDict()
        # Only keys every group has live in ``defaults``: Optimizer copies them into each
        # group, and LearningRateMonitor would read ``betas`` from every group if it were here.
        super().__init__(_as_groups(params), {"momentum": momentum})

    # A schedulefree.AdamWScheduleFree run over this optimizer's schedule-free groups and state.
    _schedule_free = None

    # ------------------------------------------------------------------ sharding and hooks

    @property
    def sharding(self) -> Sharding | None:
        """The ``distributed.Sharding`` that splits Newton-Schulz across ranks, or None (one process)."""
        return self._sharding

    def attach_sharding(self, sharding: Sharding | None) -> None:
        """Let ``sharding`` split this optimizer's Muon work across ranks (None: detach).

        A ``Sharding`` calls this from its constructor; ``step`` then asks it which
        parameters this rank steps (``owns``), what part of a gradient it holds
        (``local_shard``), whether every rank's gradients are finite (``step_finite``), to
        orthogonalize (``orthogonalize``) and to share the results (``gather_parameters``).
        """
        if sharding is not None and sharding.optimizer is not self:
            raise ValueError("Muon.attach_sharding: the sharding was built for another optimizer")
        self._sharding = sharding

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(group, params, updates, ortho)`` on every Muon update; returns a handle to remove it.

        Called after orthogonalization (and any second moment), before the update is
        applied, on the rank that steps the matrices: ``updates`` are the momentum tensors
        fed to Newton-Schulz, ``ortho`` per parameter its list of pieces (shaped like
        ``functional.matrix_views``), as they are applied before the lr scale. Under a
        sharding that holds whole matrices only on owners (FSDP2) the sharding runs the
        hooks there, with the whole matrices, before any second moment. Hooks must not
        modify their arguments. ``handle.remove()`` unregisters it, as for torch's hooks.
        """
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    @property
    def has_update_hooks(self) -> bool:
        """True when an update hook is registered."""
        return bool(self._update_hooks)

    def run_update_hooks(
        self, group: dict[str, Any], params: list[Tensor], updates: list[Tensor], ortho: list[list[Tensor]]
    ) -> None:
        """Call every registered update hook, in registration order (a sharding that observes updates calls it)."""
        for hook in list(self._update_hooks.values()):
            hook(group, params, updates, ortho)

    @classmethod
    def option_names(cls, algorithm: str) -> frozenset[str]:
        """The keys a param group of ``algorithm`` may set: its hyperparameters, and ``name``.

        Read off ``__init__``'s keywords: each belongs to the algorithm whose ``<name>_``
        prefix is the longest one it starts with (``adamw_schedulefree_lr`` is Schedule-Free's,
        ``adamw_lr`` AdamW's), unprefixed ones to Muon, which also takes ``split_sizes``,
        ``split_parts``, ``batched`` and ``transposed``.
        """
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        prefixes = sorted((f"{a}_" for a in ALGORITHMS if a != "muon"), key=len, reverse=True)
        own = {"name", "param_names"}
        if algorithm == "muon":
            own |= {"split_sizes", "split_parts", "batched", "transposed"}
        for key in inspect.signature(cls.__init__).parameters:
            if key in ("self", "params", "nonfinite"):
                continue
            prefix = next((p for p in prefixes if key.startswith(p)), None)
            if (prefix is None and algorithm == "muon") or prefix == f"{algorithm}_":
                own.add(key.removeprefix(prefix or ""))
        return frozenset(own)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if params and isinstance(params[0], tuple):
            group.setdefault("param_names", [n for n, _ in params])
            params = [p for _, p in params]
        group["params"] = params
        where = f"param group {len(self.param_groups)}" + (f" ({group['name']!r})" if "name" in group else "")
        algorithm = group.get("algorithm")
        if algorithm is None:
            is_matrix = [p.ndim >= 2 for p in params]
            if all(is_matrix) and params:
                algorithm = "muon"
            elif not any(is_matrix):
                algorithm = "adamw"
            else:
                raise ValueError(
                    f"{where}: mixes matrices and 1-D tensors without an 'algorithm'; "
                    "set 'algorithm' or pass a flat parameter list to split them by rule"
                )
        if algorithm not in ALGORITHMS:
            raise ValueError(f"{where}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        group["algorithm"] = algorithm
        for key, value in self._algorithm_defaults[algorithm].items():
            group.setdefault(key, value)
        _validate_hparams(group, algorithm, where=where)
        if algorithm == "muon":
            group["ns_dtype"] = _dtype_name(group["ns_dtype"])
            _resolve_split_parts(group, params, where)
            _validate_muon_params(group, params, where)
        elif algorithm == SCHEDULE_FREE:
            # What AdamWScheduleFree puts in a group of its own (step count k, weight_sum,
            # lr_max, train_mode, ...), taken from the package rather than copied here.
            knobs = {key: group[key] for key in self._algorithm_defaults[SCHEDULE_FREE]}
            own = _schedulefree().AdamWScheduleFree([{"params": params}], **knobs).param_groups[0]
            for key, value in own.items():
                group.setdefault(key, value)
            group["momentum"] = group["betas"][0]
        else:
            # A read-out of beta1 for loggers (LearningRateMonitor logs group["momentum"]);
            # the step reads ``betas`` and refreshes this copy.
            group["momentum"] = group["betas"][0]
        super().add_param_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict``, after checking the checkpoint was saved with this routing.

        torch matches saved state to parameters by position alone: after a routing change that
        keeps group sizes, Muon momentum would land on an AdamW parameter and the reverse, and
        after one that changes shapes the first step would fail far from the cause. Groups
        carry ``param_names`` and ``algorithm``; every name must sit in the same group, at the
        same place, with the same algorithm, and every saved tensor must have its parameter's
        shape. Without names (an older or hand-made checkpoint) positions are trusted, with a
        warning.
        """
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) == len(self.param_groups) and all("param_names" in g for g in saved_groups):
            self._check_routing(saved_groups, state_dict.get("state", {}))
        else:
            named_now = all("param_names" in g for g in self.param_groups)
            if named_now and not all("param_names" in g for g in saved_groups) and not Muon._warned_unnamed:
                Muon._warned_unnamed = True  # once per process: every resume of such a run says the same
                warnings.warn(
                    "Muon.load_state_dict: the checkpoint's param groups carry no param_names, so its state is "
                    "matched to parameters by position only (as torch.optim does)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if len(saved_groups) != len(self.param_groups):
                raise ValueError(
                    f"Muon.load_state_dict: the checkpoint has {len(saved_groups)} param groups "
                    f"({[g.get('name', g.get('algorithm')) for g in saved_groups]}), this optimizer "
                    f"{len(self.param_groups)} ({[g.get('name', g['algorithm']) for g in self.param_groups]}): "
                    "the routing changed since it was saved; resume with the rules it was saved with"
                )
        super().load_state_dict(state_dict)

    def _check_routing(self, saved_groups: list[dict], saved_state: dict) -> None:
        def where(groups: list[dict]) -> dict[str, tuple[int, int, str, str]]:
            return {
                name: (i, j, g.get("name", g.get("algorithm")), g.get("algorithm"))
                for i, g in enumerate(groups)
                for j, name in enumerate(g["param_names"])
            }

        then, now = where(saved_groups), where(self.param_groups)
        for i, group in enumerate(self.param_groups):
            saved = saved_groups[i]
            names = group.get("param_names") or [None] * len(group["params"])
            for j, (name, p) in enumerate(zip(names, group["params"])):
                here = f"{name!r}" if name else f"parameter {j} of param group {i}"
                if name is not None and then.get(name) != now[name]:
                    before = then.get(name)
                    was = "absent" if before is None else f"param group {before[0]} {before[2]!r} ({before[3]})"
                    raise ValueError(
                        f"Muon.load_state_dict: {here} was routed to {was} when the checkpoint was saved, and "
                        f"to param group {i} {now[name][2]!r} ({now[name][3]}) now; its optimizer state would "
                        "land on another parameter. Resume with the routing rules the checkpoint was saved with "
                        "(or load only the model weights)"
                    )
                if j >= len(saved["params"]):
                    continue
                for key, value in saved_state.get(saved["params"][j], {}).items():
                    if key in _PARAM_SHAPED and isinstance(value, Tensor) and tuple(value.shape) != tuple(p.shape):
                        raise ValueError(
                            f"Muon.load_state_dict: {here} has shape {tuple(p.shape)}, but the checkpoint's "
                            f"{key!r} for it has shape {tuple(value.shape)}: the model or its routing changed "
                            "since the checkpoint was saved"
                        )

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

    def train(self) -> None:
        """Schedule-free groups to train mode: their parameters hold ``y``, where gradients are taken.

        Call it before the training steps (``step`` refuses eval mode) and after every
        ``eval()``. A no-op for the other groups and for groups already in train mode.
        """
        inner = self._schedule_free_optimizer()
        if inner is not None:
            inner.train()

    def eval(self) -> None:
        """Schedule-free groups to eval mode: their parameters hold the averaged weights ``x``.

        Call it before validation, testing, inference and saving a checkpoint (the saved
        weights are then the averaged ones and the saved groups say eval; ``train()`` after
        loading brings back the training weights). A no-op for the other groups.
        """
        inner = self._schedule_free_optimizer()
        if inner is not None:
            inner.eval()

    @property
    def schedule_free_groups(self) -> list[dict[str, Any]]:
        """The ``"adamw_schedulefree"`` param groups (empty when there are none)."""
        return [g for g in self.param_groups if g["algorithm"] == SCHEDULE_FREE]

    @property
    def schedule_free_training(self) -> bool:
        """True when a schedule-free group is in train mode."""
        return any(g["train_mode"] for g in self.schedule_free_groups)

    def _schedule_free_optimizer(self) -> Optimizer | None:
        """``AdamWScheduleFree`` over this optimizer's schedule-free groups and state, or None.

        The groups and the state dict are this optimizer's own objects (rebound on every
        call, since ``load_state_dict`` replaces them), so what the package updates (step
        counts, mode flags, ``z``, ``exp_avg_sq``) is what ``state_dict()`` saves.
        """
        groups = self.schedule_free_groups
        if not groups:
            return None
        inner = self._schedule_free
        if inner is None:
            inner = self._schedule_free = _schedulefree().AdamWScheduleFree([{"params": g["params"]} for g in groups])
        inner.param_groups = groups
        inner.state = self.state
        return inner

    def _check_train_mode(self) -> None:
        for i, group in enumerate(self.param_groups):
            if group["algorithm"] == SCHEDULE_FREE and not group["train_mode"]:
                raise RuntimeError(
                    f"Muon: param group {i} ({group.get('name', SCHEDULE_FREE)!r}) is schedule-free and in eval mode "
                    "(its parameters hold the averaged weights); call optimizer.train() before step() and "
                    "optimizer.eval() before evaluating or saving (under Lightning, MuonModuleMixin adds "
                    "ScheduleFreeModeSwitch, which does both)"
                )

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

    def _grads_finite(self, work: list) -> bool:
        """True when the step may go on; False to skip it; raises for ``nonfinite="raise"``.

        Under a sharding every rank reaches the same answer: the verdict is the one the
        ranks agreed on (``Sharding.step_finite``), over every gradient any rank's step reads.
        """
        if self.nonfinite == "ignore":
            return True
        precheck = self._take_precheck()
        sharding = self._sharding
        if sharding is not None:
            verdict = sharding.step_finite()
            ok, local_ok, where = verdict.finite, verdict.local_finite, verdict.culprit
            culprit = precheck[1] if precheck is not None and not precheck[0] else None
        else:
            if precheck is not None:
                local_ok, culprit = precheck
            else:
                grads = [g for _, _, gs in work for g in gs]
                local_ok, culprit = (not grads or all_finite(grads)), None
            ok, where = local_ok, None
        if ok:
            return True
        if self.nonfinite == "skip":
            warnings.warn(
                "Muon: a gradient holds NaN or inf; the step was skipped for all groups", RuntimeWarning, stacklevel=3
            )
            return False
        if not local_ok:
            culprit = culprit or self.nonfinite_culprit()
            raise FloatingPointError(
                f"Muon: non-finite gradient in {culprit}; pass nonfinite='skip' to skip such steps"
            )
        raise FloatingPointError(
            "Muon: non-finite gradient on another rank"
            + (f", in {where}" if where else " (its error names the parameter)")
            + "; pass nonfinite='skip' to skip such steps"
        )

    def _local_grads(self) -> list[tuple[int, int, Tensor]]:
        """(group index, index in group, this rank's gradient) for every gradient a step here reads."""
        sharding = self._sharding
        out = []
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is None or p.numel() == 0:
                    continue
                if sharding is not None and not sharding.owns(p):
                    continue
                g = p.grad if sharding is None else sharding.local_shard(p.grad)
                if g.numel():
                    out.append((i, j, g))
        return out

    def param_label(self, i: int, j: int) -> str:
        """``param group i ('name'), parameter j 'param name' of shape (...)``, for messages."""
        group = self.param_groups[i]
        names = group.get("param_names") or ()
        name = names[j] if j < len(names) else None
        label = f" {name!r}" if name else ""
        shape = tuple(group["params"][j].shape)
        return f"param group {i} ({group.get('name', group['algorithm'])!r}), parameter {j}{label} of shape {shape}"

    def nonfinite_culprit_index(self) -> tuple[int, int] | None:
        """(group, index) of the first parameter whose gradient on this rank holds NaN or inf, or None."""
        for i, j, g in self._local_grads():
            if not bool(g.isfinite().all()):
                return i, j
        return None

    def nonfinite_culprit(self) -> str | None:
        """``param_label`` of ``nonfinite_culprit_index()``, or None."""
        index = self.nonfinite_culprit_index()
        return None if index is None else self.param_label(*index)

    def precheck_gradients(self) -> bool:
        """Check the gradients now, before something (clipping) rewrites them; the next step reuses the answer.

        Clipping by norm spreads one NaN to every gradient; called before it, the step's error
        names the parameter whose gradient went bad. Costs the one pass the step would make
        (the step then skips its own), and keeps its answer only for these same gradients.
        Returns True when every gradient is finite.
        """
        if self.nonfinite == "ignore":
            return True
        entries = self._local_grads()
        ok = not entries or all_finite([g for _, _, g in entries])
        self.record_precheck(ok, None if ok else self.nonfinite_culprit())
        return ok

    def record_precheck(self, ok: bool, culprit: str | None = None) -> None:
        """Remember that the current gradients are (not) all finite; a sharding that checked them calls it."""
        # Scaling by a finite factor (what clipping does) keeps finite values finite and
        # non-finite ones non-finite, so the answer holds until these gradients are replaced.
        self._precheck = (tuple((id(g), g.data_ptr()) for _, _, g in self._local_grads()), ok, culprit)

    _precheck = None
    _warned_unnamed = False

    def _take_precheck(self) -> tuple[bool, str | None] | None:
        precheck, self._precheck = self._precheck, None
        if precheck is None:
            return None
        key, ok, culprit = precheck
        if key != tuple((id(g), g.data_ptr()) for _, _, g in self._local_grads()):
            return None  # other gradients since: check again
        return ok, culprit

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
        # Without an observer or a sharding to hand the momentum to, the Nesterov update is a
        # temporary that Newton-Schulz may iterate in place. A matrix that runs alone gets it
        # made in the work dtype (the cast folded into the momentum kernel, no staging copy);
        # small ones are cast on their way into a batched stack, so theirs stays as it is.
        donate = group["nesterov"] and not self._update_hooks and self._sharding is None
        out_dtypes = None
        if donate:
            alone = group["split_sizes"] is None and not group["batched"]
            out_dtypes = [
                resolve_ns_dtype(group["ns_dtype"], g.device, g.dtype)
                if alone and g.ndim == 2 and g.numel() > BATCH_MAX_ELEMENTS
                else g.dtype
                for g in grads
            ]
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

    def _adamw_step(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        group["momentum"] = beta1
        adamw_(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    def _lion_step(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in params:
            if "exp_avg" not in self.state[p]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        group["momentum"] = beta1
        lion_(
            params,
            grads,
            [self.state[p]["exp_avg"] for p in params],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
        )


def _schedulefree() -> Any:
    """The ``schedulefree`` package, or an ImportError that says how to install it."""
    try:
        import schedulefree
    except ImportError as err:
        raise ImportError(
            f"algorithm {SCHEDULE_FREE!r} needs the schedulefree package (1.4.x), an optional extra: "
            "pip install 'lightning_muon[schedulefree]'"
        ) from err
    return schedulefree


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Param-group dicts from tensors, (name, tensor) pairs or dicts."""
    if isinstance(params, Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a single Tensor")
    items = list(params)
    if not items:
        raise ValueError("params is empty: Muon got no parameters to optimize")
    if all(isinstance(item, dict) for item in items):
        return items
    if any(isinstance(item, dict) for item in items):
        raise ValueError("params mixes dicts with tensors; pass one kind")
    named = [item if isinstance(item, tuple) else (None, item) for item in items]
    for name, p in named:
        if not isinstance(p, Tensor):
            raise TypeError(f"params must hold tensors, got {type(p).__name__} for {name or 'an item'}")
    groups = []
    for algorithm, keep in (("muon", lambda p: p.ndim >= 2), ("adamw", lambda p: p.ndim < 2)):
        chosen = [(n, p) for n, p in named if keep(p)]
        if chosen:
            group: dict[str, Any] = {"params": [p for _, p in chosen], "algorithm": algorithm, "name": algorithm}
            if all(n is not None for n, _ in chosen):
                group["param_names"] = [n for n, _ in chosen]
            groups.append(group)
    return groups


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    # Groups keep a plain string: checkpoints (torch.save and distributed) store it as is.
    resolved = check_ns_dtype(dtype)
    return None if resolved is None else dtype_name(resolved)


def _check_number(
    value: Any,
    name: str,
    where: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{where}: {name} must be a finite number in {lo}{low}, {high}{hi}, got {value!r}")


def _check_choice(value: Any, name: str, where: str, choices: tuple) -> None:
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        raise ValueError(f"{where}: {name} must be one of {choices}, got {value!r}")


def _validate_hparams(group: dict[str, Any], algorithm: str, where: str, prefix: str = "") -> None:
    _check_number(group["lr"], f"{prefix}lr", where, 0.0)
    _check_number(group["weight_decay"], f"{prefix}weight_decay", where, 0.0)
    if algorithm == "muon":
        _check_number(group["momentum"], "momentum", where, 0.0, 1.0, high_open=True)
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"{where}: nesterov must be a bool, got {group['nesterov']!r}")
        resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        check_ns_dtype(group["ns_dtype"])
        mode = group["adjust_lr"]
        if ADJUST_LR_ALIASES.get(mode, mode) not in ADJUST_LR_MODES:
            raise ValueError(
                f"{where}: adjust_lr must be one of {sorted(ADJUST_LR_MODES) + sorted(ADJUST_LR_ALIASES)}, got {mode!r}"
            )
        _check_number(group["extra_scale_factor"], "extra_scale_factor", where, 0.0, low_open=True)
        _check_choice(group["momentum_form"], "momentum_form", where, MOMENTUM_FORMS)
        _check_choice(group["second_moment"], "second_moment", where, (None, *SECOND_MOMENTS))
        _check_number(group["second_moment_beta2"], "second_moment_beta2", where, 0.0, 1.0, high_open=True)
        _check_number(group["second_moment_eps"], "second_moment_eps", where, 0.0, low_open=True)
        _check_choice(group["weight_decay_form"], "weight_decay_form", where, WEIGHT_DECAY_FORMS)
        _check_choice(group["tp_mode"], "tp_mode", where, TP_MODES)
        try:
            check_ns_method(group["ns_method"])
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if not isinstance(group["sign_momentum"], bool):
            raise ValueError(f"{where}: sign_momentum must be a bool, got {group['sign_momentum']!r}")
        if not isinstance(group["batched"], bool):
            raise ValueError(f"{where}: batched must be a bool, got {group['batched']!r}")
        return
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: {prefix}betas must be a pair (beta1, beta2), got {betas!r}")
    for k, beta in enumerate(betas):
        # Schedule-Free's eval() divides by beta1: 0 is out for it.
        low_open = k == 0 and algorithm == SCHEDULE_FREE
        _check_number(beta, f"{prefix}betas[{k}]", where, 0.0, 1.0, low_open=low_open, high_open=True)
    group["betas"] = tuple(betas)
    if algorithm in ("adamw", SCHEDULE_FREE):
        _check_number(group["eps"], f"{prefix}eps", where, 0.0, low_open=True)
    if algorithm == SCHEDULE_FREE:
        steps = group["warmup_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"{where}: {prefix}warmup_steps must be an int >= 0, got {steps!r}")
        _check_number(group["r"], f"{prefix}r", where, 0.0)
        _check_number(group["weight_lr_power"], f"{prefix}weight_lr_power", where, 0.0)


def _resolve_split_parts(group: dict[str, Any], params: list[Tensor], where: str) -> None:
    """``split_parts=k``: ``k`` equal blocks along the output axis, turned into ``split_sizes``.

    Per-head orthogonalization (a fused QKV of ``H`` heads: ``3 H`` parts; a ``q_proj``:
    ``H`` parts) and ``nn.MultiheadAttention``'s ``in_proj_weight`` (Q, K, V: 3 parts)
    without spelling the sizes. Every tensor of the group must have the same output size.
    """
    parts = group.pop("split_parts", None)
    if parts is None:
        return
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"{where}: split_parts must be a positive int, got {parts!r}")
    if group.get("split_sizes") is not None:
        raise ValueError(f"{where}: set split_parts or split_sizes, not both")
    axis = 1 if group.get("transposed") else 0
    sizes = {p.shape[axis] for p in params if p.ndim >= 2}
    if len(sizes) > 1:
        raise ValueError(f"{where}: split_parts={parts} needs one output size in the group, got {sorted(sizes)}")
    (size,) = sizes or {parts}
    if size % parts:
        names = group.get("param_names", [])
        raise ValueError(
            f"{where}{f' ({names[0]!r})' if names else ''}: split_parts={parts} does not divide the output axis "
            f"(dim {axis}, size {size})"
        )
    group["split_sizes"] = (size // parts,) * parts


def _validate_muon_params(group: dict[str, Any], params: list[Tensor], where: str) -> None:
    split_sizes, batched, transposed = group["split_sizes"], group["batched"], group["transposed"]
    if not isinstance(transposed, bool):
        raise ValueError(f"{where}: transposed must be a bool, got {transposed!r}")
    if transposed and (batched or group["second_moment"] == "normuon"):
        what = "batched=True" if batched else "second_moment='normuon' (per-row statistics)"
        raise ValueError(f"{where}: transposed=True cannot be combined with {what} yet")
    out_dim = 1 if transposed else 0
    if split_sizes is not None:
        if batched:
            raise ValueError(f"{where}: split_sizes and batched=True cannot be combined")
        if not split_sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in split_sizes):
            raise ValueError(f"{where}: split_sizes must be a non-empty list of positive ints, got {split_sizes!r}")
        group["split_sizes"] = tuple(split_sizes)
    for j, p in enumerate(params):
        label = f"{where}, parameter {j}" + (f" ({group['param_names'][j]!r})" if "param_names" in group else "")
        if p.is_complex():
            raise ValueError(f"{label}: complex parameters are not supported by Muon")
        if p.ndim < 2:
            raise ValueError(
                f"{label}: Muon needs a matrix, got a {p.ndim}-D tensor of shape {tuple(p.shape)}; "
                "route it to 'adamw', 'lion' or 'adamw_schedulefree'"
            )
        if batched and p.ndim < 3:
            raise ValueError(f"{label}: batched=True needs a tensor with 3+ dims, got shape {tuple(p.shape)}")
        if transposed and p.ndim != 2:
            raise ValueError(f"{label}: transposed=True needs a 2-D (fan_in, fan_out) weight, got {tuple(p.shape)}")
        if split_sizes is not None and p.shape[out_dim] % sum(split_sizes) != 0:
            layout = "a (fan_in, fan_out) weight, transposed=True" if transposed else "a (fan_out, ...) weight"
            raise ValueError(
                f"{label}: split_sizes {tuple(split_sizes)} sum to {sum(split_sizes)}, but dim {out_dim} has size "
                f"{p.shape[out_dim]}, not a multiple of it (dim {out_dim} is the output axis of {layout}, "
                f"shape {tuple(p.shape)})"
            )
