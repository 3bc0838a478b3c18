"""``Muon``: a hybrid optimizer, Muon on hidden matrices and AdamW, Lion or Schedule-Free AdamW on the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_muon._warn import warn_user
from lightning_muon.algorithms import (
    AdamWSettings,
    Algorithm,
    MuonSettings,
    Settings,
    algorithm_names,
    get_algorithm,
)
from lightning_muon.algorithms.adamw_schedulefree import eval_mode_error
from lightning_muon.algorithms.base import ALGORITHMS, StepContext, settings_by_algorithm
from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.families import (
    AdjustLR,
    CoefficientName,
    FP32MatmulPrec,
    NSDtype,
    TPMode,
    WeightDecayMethod,
)
from lightning_muon.algorithms.state_dtypes import (
    MAIN_PARAM,
    MainParamsDtype,
    StateDtype,
    has_main_param,
    restore_state_dtypes,
)
from lightning_muon.aliases import canonical_with_aliases, named_as_written, settings_from
from lightning_muon.distributed.comm import all_reduce_
from lightning_muon.functional import MomentumForm, SecondMoment
from lightning_muon.newton_schulz import NSMethod
from lightning_muon.nonfinite import FiniteChecks
from lightning_muon.routing.added_groups import split_added_group
from lightning_muon.routing.checkpoint import check_checkpoint_routing
from lightning_muon.routing.param_groups import algorithm_of, as_groups, group_label, option_names, split_named_params
from lightning_muon.state_settings import NonFinite, StateSettings
from lightning_muon.step_memory import StepMemory

# ``hook(group, params, updates, ortho)``: see ``Muon.register_update_hook``.
UpdateHook = Callable[[dict, list, list, list], None]

if TYPE_CHECKING:
    from lightning_muon.distributed.protocol import Sharding
    from lightning_muon.routing.added_groups import Router

__all__ = ["Muon", "UpdateHook"]

# The keywords' defaults are the settings' own (written once, there; tests/test_config.py checks the match).
_MUON, _ADAMW, _STATE = MuonSettings(), AdamWSettings(), StateSettings()
_MUON_FIELDS = frozenset(MuonSettings.field_names())
# Keys a param group holds beside its algorithm's options: torch's and its LR schedulers' (``initial_lr``), and the
# optimizer-wide default torch copies into every group (``momentum``, read by Lightning's LearningRateMonitor).
_TORCH_GROUP_KEYS = frozenset({"params", "algorithm", "initial_lr", "momentum", "differentiable"})


class Muon(Optimizer):
    r"""Muon for hidden weight matrices, AdamW (or another algorithm) for everything else, in one optimizer.

    Each param group has an ``"algorithm"``, the name of a registered ``Algorithm``
    (``algorithms``): ``"muon"``, ``"adamw"``, ``"lion"``, ``"adamw_schedulefree"``, ``"laprop"``,
    ``"muon_hyperball"``, Emerging-Optimizers' ``"adaptive_muon"``, ``"scion"``, ``"polargrad"``,
    ``"mop"``, ``"spel"``, ``"sinkhorn_muon"``, ``"soap"``, ``"rekls"``, or one added with
    ``register_algorithm``. For a Muon matrix ``W`` with gradient ``G`` (torch.optim.Muon's form,
    the defaults)::

        B <- mu B + (1 - mu) G                       # EMA momentum
        U <- (1 - mu) G + mu B   if nesterov else B
        O <- orthogonalize(U)                        # Newton-Schulz, short side first
        W <- W (1 - lr wd)                           # decoupled decay, base lr
        W <- W - lr * adjust(rows, cols) * extra_scale_factor * O

    Tensors with more than two dims are flattened to ``(dim 0, rest)``; a group with
    ``split_sizes`` orthogonalizes blocks along dim 0 separately (fused QKV; sizes summing
    to a divisor of dim 0 repeat per group of rows, Megatron's GQA layout), and a group
    with ``batched=True`` treats a ``(..., rows, cols)`` tensor as a batch of matrices
    (experts). Every update scales with the group's lr, so a step at lr = 0 changes nothing.

    ``"adamw_schedulefree"`` groups are stepped by ``schedulefree.AdamWScheduleFree`` over
    this optimizer's groups and state: ``train()`` and ``eval()`` switch their parameters
    between the training and the averaged weights. Param groups are made from what
    ``params`` holds as ``param_groups.as_groups`` says (a flat list: matrices to Muon, the
    rest to AdamW); a group given without an ``"algorithm"``, here or later by
    ``add_param_group`` (``BackboneFinetuning``), is routed and split by algorithm
    (``added_groups``, by the rules of ``attach_router``); a sharding (``attach_sharding``)
    splits the Newton-Schulz work across ranks, and ``register_update_hook`` observes the
    applied updates. A group's own keys override the defaults below, in our names or other
    projects' (``aliases``).

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            torch.optim.Muon's arguments, in its order and with its meanings, so that this is a
            drop-in for it (our defaults differ: docs/update_rule.md lists them, and the line that
            takes torch's). ``eps`` and ``adjust_lr_fn`` are its names for ``ns_eps`` and
            ``adjust_lr`` (``aliases``; None: not given); ``ns_coefficients`` is one ``(a, b, c)``
            there, and here also a schedule name or a list of them; ``lr`` may be a 1-element
            Tensor, which the groups keep as given (an LR scheduler ``fill_``s it).
        ns_eps, adjust_lr, weight_decay_method, ...: with the above, the defaults of Muon's
            groups, ``MuonSettings``' fields (each documented there, with its range;
            ``python -m lightning_muon options muon`` prints them).
            ``momentum_form="sum"``, ``sign_momentum``, ``second_moment`` and
            ``weight_decay_method="cautious"`` are Muon's variants (``algorithms.muon``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the defaults of AdamW's groups
            (``AdamWSettings``' fields).
        settings: the defaults of other algorithms' groups, one ``Settings`` per algorithm
            (``[LionSettings(lr=1e-4), SOAPSettings(shampoo_beta=0.9)]``); an algorithm left out
            takes its settings' defaults.
        nonfinite, exp_avg_dtype, exp_avg_sq_dtype, main_params_dtype, step_memory_mb: what the
            optimizer does with a non-finite gradient, the dtypes its state is stored in and
            its step's memory cap (``StateSettings``' fields).

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
        lr: float | Tensor = _MUON.lr,
        weight_decay: float = _MUON.weight_decay,
        momentum: float = _MUON.momentum,
        nesterov: bool = _MUON.nesterov,
        ns_coefficients: CoefficientName | Sequence[float] | Sequence[Sequence[float]] = _MUON.ns_coefficients,
        eps: float | None = None,
        ns_steps: int = _MUON.ns_steps,
        adjust_lr_fn: str | None = None,
        *,
        ns_eps: float | None = _MUON.ns_eps,
        adjust_lr: AdjustLR = _MUON.adjust_lr,
        weight_decay_method: WeightDecayMethod = _MUON.weight_decay_method,
        fp32_matmul_prec: FP32MatmulPrec = _MUON.fp32_matmul_prec,
        extra_scale_factor: float = _MUON.extra_scale_factor,
        ns_dtype: NSDtype | torch.dtype | None = _MUON.ns_dtype,
        ns_method: NSMethod = _MUON.ns_method,
        tp_mode: TPMode = _MUON.tp_mode,
        momentum_form: MomentumForm = _MUON.momentum_form,
        second_moment: SecondMoment | None = _MUON.second_moment,
        second_moment_beta2: float = _MUON.second_moment_beta2,
        second_moment_eps: float = _MUON.second_moment_eps,
        sign_momentum: bool = _MUON.sign_momentum,
        adamw_lr: float = _ADAMW.lr,
        adamw_betas: tuple[float, float] = _ADAMW.betas,
        adamw_eps: float = _ADAMW.eps,
        adamw_weight_decay: float = _ADAMW.weight_decay,
        settings: Iterable[Settings] = (),
        nonfinite: NonFinite = _STATE.nonfinite,
        exp_avg_dtype: StateDtype | torch.dtype = _STATE.exp_avg_dtype,
        exp_avg_sq_dtype: StateDtype | torch.dtype = _STATE.exp_avg_sq_dtype,
        main_params_dtype: MainParamsDtype | torch.dtype = _STATE.main_params_dtype,
        step_memory_mb: StepMemory = _STATE.step_memory_mb,
    ) -> None:
        arguments = dict(locals())
        self.settings: dict[str, Settings] = _settings_from_keywords(arguments)
        """The settings new groups start from, by algorithm (one not given: its settings' defaults)."""
        self.state_settings = StateSettings(**{f.name: arguments[f.name] for f in dataclasses.fields(StateSettings)})
        """The non-finite policy, the state dtypes and the step's memory cap."""
        self.fresh = True
        """True until the first step or ``load_state_dict``: a step at lr 0 may then be torch's state creation."""
        self._attach_runtime(lost_sharding=None)
        # Only keys every group has live in ``defaults``: Optimizer copies them into each
        # group, and LearningRateMonitor would read ``betas`` from every group if it were here.
        self._constructing = True
        try:
            super().__init__(as_groups(params), {"momentum": self.settings_of("muon").momentum})
        finally:
            del self._constructing

    def _attach_runtime(self, lost_sharding: str | None) -> None:
        """What a step works with and a copy does not carry: sharding, router, update hooks, checks, caches."""
        self.nonfinite = self.state_settings.nonfinite
        self._sharding: Sharding | None = None
        self._lost_sharding = lost_sharding  # the class of the sharding the original had, in a copy
        self._mesh_checked = False  # whether the first step looked for DTensors without a sharding
        self._update_hooks: OrderedDict[int, UpdateHook] = OrderedDict()
        self._router: Router | None = None
        self.finite_checks = FiniteChecks(self)
        """The non-finite gradient checks: ``precheck()`` before clipping, ``label(i, j)`` of a parameter."""
        self._defaults: dict[str, dict[str, Any]] = {}  # per algorithm, made on first use
        self._lrs_differ = False  # the groups have had different lrs, and no one lr was set on all yet
        self._ctx = StepContext()
        self._ctx.update_hooks = self._update_hooks

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param groups) and the settings: what ``copy.deepcopy``, ``pickle``
        and ``torch.save`` of the optimizer carry.

        Update hooks, an attached sharding (its process group) and the router of added groups do not
        travel: a copy starts without them (a copy that had a sharding says so when it steps with
        several processes).
        """
        state = super().__getstate__()
        state["settings"], state["state_settings"] = self.settings, self.state_settings
        state["fresh"] = self.fresh
        sharding = self._sharding
        state["_lost_sharding"] = type(sharding).__name__ if sharding is not None else self._lost_sharding
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        lost_sharding = state.pop("_lost_sharding", None)
        runtime = "finite_checks" in self.__dict__  # torch's load_state_dict sets state and groups of a live one
        super().__setstate__(state)
        if not runtime:  # a copy or an unpickled optimizer: made without __init__
            self._attach_runtime(lost_sharding)
            self._lrs_differ = _several_lrs(self.param_groups)

    # ------------------------------------------------------------------ param groups

    @classmethod
    def option_names(cls, algorithm: str) -> frozenset[str]:
        """The keys a param group of ``algorithm`` may set (``param_groups.option_names``)."""
        return option_names(algorithm)

    def settings_of(self, algorithm: str) -> Settings:
        """The settings new groups of ``algorithm`` start from: this optimizer's for it, or its settings' defaults."""
        given = self.settings.get(algorithm)
        return given if given is not None else get_algorithm(algorithm).settings()

    def group_defaults(self, algorithm: str) -> dict[str, Any]:
        """What a new group of ``algorithm`` starts from: its settings as group keys (checked)."""
        if algorithm not in self._defaults:
            self._defaults[algorithm] = get_algorithm(algorithm).group_defaults(self.settings_of(algorithm))
        return self._defaults[algorithm]

    @property
    def router(self) -> Router | None:
        """Where ``add_param_group`` sends the tensors of a group given without an algorithm; None: the flat rule."""
        return self._router

    def attach_router(self, router: Router | None) -> None:
        """Route groups added without an ``"algorithm"`` by ``router`` (``added_groups``); None: the flat rule.

        ``configure_muon_optimizers`` attaches an ``added_groups.ModuleRouter``, so that a
        backbone unfrozen later (``BackboneFinetuning``) is routed by the config's rules.
        """
        self._router = router

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; one without an ``"algorithm"`` is routed, and split by algorithm (``added_groups``)."""
        if param_group.get("algorithm") is None:
            explain_lr = self.__dict__.get("_constructing", False)  # the groups given to Muon(...)
            parts = split_added_group(param_group, self.param_groups, self.group_defaults, self._router, explain_lr)
            for part in parts:
                self.add_param_group(part)
            return
        group, params = split_named_params(param_group)
        where = group_label(len(self.param_groups), group)
        algorithm = algorithm_of(group, where)
        group["algorithm"] = algorithm.name
        for setting, value in self.state_settings.non_default_dtypes().items():
            if setting not in algorithm.state_dtype_settings:
                raise HparamError(
                    f"{where}: {setting}={value!r} does not apply to {algorithm.name!r} groups, which keep their "
                    f"state in their own dtypes; leave {setting} at its default or route these parameters to an "
                    "algorithm that takes it ('muon', 'adamw', 'lion')",
                    setting,
                )
        # Other projects' names for its keys, renamed; an error about one names it as written.
        group, aliased = canonical_with_aliases(algorithm.settings, group, where)
        # A setting of another algorithm would be ignored silently; a key no algorithm has is the user's own
        # (torch keeps any key in a group: a layer id, a tag) and stays.
        foreign = sorted((set(group) & _all_option_names()) - algorithm.option_names() - _TORCH_GROUP_KEYS)
        if foreign:
            near = difflib.get_close_matches(foreign[0], algorithm.option_names(), n=1)
            raise HparamError(
                f"{where}: {foreign} are settings of other algorithms, not of {algorithm.name!r}"
                + (f"; did you mean {near[0]!r}?" if near else "")
                + f" (python -m lightning_muon options {algorithm.name} lists its settings)",
                foreign[0],
            )
        defaults = self.group_defaults(algorithm.name)
        overrides = [key for key in defaults if key in group]
        for key, value in defaults.items():
            group.setdefault(key, value)
        if overrides:  # the defaults were checked (and normalized) with the config: only the group's own values now
            try:
                group.update(algorithm.check(group, where))
            except HparamError as err:
                raise named_as_written(err, aliased, where) from None
        algorithm.init_group(group, params, where)
        super().add_param_group(group)
        self._lrs_differ = self._lrs_differ or _several_lrs(self.param_groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict``, after checking the checkpoint was saved with this routing.

        torch matches saved state to parameters by position alone: after a routing change that
        keeps group sizes, Muon momentum would land on an AdamW parameter and the reverse, and
        after one that changes shapes the first step would fail far from the cause
        (``checkpoint_routing``). A group saved without a setting takes the optimizer's default for it.
        """
        check_checkpoint_routing(self.param_groups, state_dict)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.group_defaults(group["algorithm"]).items():
                group.setdefault(key, value)
        restore_state_dtypes(self, state_dict)  # torch cast the state to each parameter's dtype
        self.fresh = False

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every group; ``closure`` re-evaluates the loss.

        torch's distributed checkpoint asks a new optimizer for its state with a step at zero
        gradients and lr 0 (no closure): that step makes each group's state (``init_state``)
        and moves nothing.
        """
        if not self._mesh_checked:
            self._first_step_checks()
        if self.fresh and closure is None and _is_state_creation(self):
            self._create_state()
            return None
        self.fresh = False
        checks = self.finite_checks
        if checks.pending and not torch.compiler.is_compiling():
            checks.raise_pending()  # a compiled step's verdict, read where a sync costs nothing new
        for i, group in enumerate(self.param_groups):
            if group.get("train_mode") is False:  # Schedule-Free: no gradients at the averaged weights
                raise eval_mode_error(i, group)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._lrs_differ and not torch.compiler.is_compiling() and not _several_lrs(self.param_groups):
            self._lrs_differ = False  # once
            warn_user(_ONE_LR)
        sharding = self._sharding
        work = [(group, *_collect(sharding, i, group)) for i, group in enumerate(self.param_groups)]
        compiled = torch.compiler.is_compiling() and checks.can_mask(work)
        if compiled:  # decided on the device, no host sync (``FiniteChecks.snapshot``)
            snapshot = checks.snapshot(work)
        elif not checks.passes(work, sharding):
            return loss
        masters: list[tuple[Tensor, Tensor]] = []
        if self.state_settings.main_params_dtype is not None:
            work, masters = _main_params(self, work)  # bf16 parameters step on their fp32 master copies
        ctx = self._ctx  # what the step reads now: load_state_dict replaces the state
        ctx.state, ctx.state_settings, ctx.sharding = self.state, self.state_settings, sharding
        ctx.groups = self.param_groups
        finishing: dict[Algorithm, list[dict[str, Any]]] = {}  # Schedule-Free: steps all its groups at once
        try:
            with sharding.lent_state() if sharding is not None else contextlib.nullcontext():
                for group, params, grads in work:
                    algorithm = ALGORITHMS[group["algorithm"]]
                    if params:
                        algorithm.step_group(ctx, group, params, grads)
                    if algorithm.finish_step is not None:
                        finishing.setdefault(algorithm, []).append(group)
            for p, master in masters:
                p.copy_(master)  # rounded to the parameter's dtype
        finally:
            for _, master in masters:
                self.state.pop(master, None)
        for algorithm, groups in finishing.items():
            algorithm.finish_step(ctx, groups)
        if sharding is not None:
            sharding.gather_parameters()  # every rank calls it, owner of matrices or not
        if compiled:
            checks.restore(snapshot)
        return loss

    def _create_state(self) -> None:
        """The step torch's distributed checkpoint takes to make a new optimizer's state (``_is_state_creation``):
        every group's state, as a first step would find it (``Algorithm.init_state``), and nothing moved."""
        sharding = self._sharding
        work = [(group, *_collect(sharding, i, group)) for i, group in enumerate(self.param_groups)]
        masters: list[tuple[Tensor, Tensor]] = []
        if self.state_settings.main_params_dtype is not None:
            work, masters = _main_params(self, work)  # the fp32 master copies, made as a first step makes them
        ctx = self._context()
        try:
            with sharding.lent_state() if sharding is not None else contextlib.nullcontext():
                for group, params, _ in work:
                    if params:
                        ALGORITHMS[group["algorithm"]].init_state(ctx, group, params)
        finally:
            for _, master in masters:
                self.state.pop(master, None)

    def _context(self) -> StepContext:
        """The ``StepContext`` with what the step reads now (``load_state_dict`` replaces the state)."""
        ctx = self._ctx
        ctx.state, ctx.state_settings, ctx.sharding = self.state, self.state_settings, self._sharding
        ctx.groups = self.param_groups
        return ctx

    def _first_step_checks(self) -> None:
        """At the first step: DTensor Muon matrices without a sharding get ``MuonTPSharding``; a copy that lost its
        sharding says so."""
        self._mesh_checked = True
        if self._sharding is None:
            self._attach_mesh_sharding()
            if self._sharding is None and self._lost_sharding is not None:
                _warn_lost_sharding(self._lost_sharding)

    # ------------------------------------------------------------------ train / eval (Schedule-Free)

    def _algorithms(self) -> dict[str, tuple[Algorithm, list[dict[str, Any]]]]:
        """Each algorithm in use, with its groups, in the order of its first group (the same on every rank)."""
        out: dict[str, tuple[Algorithm, list[dict[str, Any]]]] = {}
        for group in self.param_groups:
            name = group["algorithm"]
            if name not in out:
                out[name] = (ALGORITHMS[name], [])
            out[name][1].append(group)
        return out

    def train(self) -> None:
        """Every group to train mode: Schedule-Free groups' parameters hold ``y``, where gradients are taken.

        Call it before the training steps (``step`` refuses schedule-free groups in eval mode)
        and after every ``eval()``. A no-op for groups of other algorithms and for groups
        already in train mode.
        """
        for algorithm, groups in self._algorithms().values():
            algorithm.train(self._context(), groups)

    def eval(self) -> None:
        """Every group to eval mode: Schedule-Free groups' parameters hold the averaged weights ``x``.

        Call it before validation, testing, inference and saving a checkpoint (the saved
        weights are then the averaged ones and the saved groups say eval; ``train()`` after
        loading brings back the training weights). A no-op for the other groups.
        """
        for algorithm, groups in self._algorithms().values():
            algorithm.eval(self._context(), groups)

    # ------------------------------------------------------------------ sharding and update hooks

    @property
    def sharding(self) -> Sharding | None:
        """The ``distributed.Sharding`` that splits Newton-Schulz across ranks, or None (one process)."""
        return self._sharding

    def attach_sharding(self, sharding: Sharding | None) -> None:
        """Let ``sharding`` split this optimizer's Muon work across ranks (None: detach).

        A ``Sharding`` calls this from its constructor; ``step`` then asks it what of each
        parameter this rank steps (``stepped``), what part of a tensor it holds
        (``local_shard``), to run per-matrix work where each matrix is whole (``map_whole``)
        and to share the results (``gather_parameters``); the non-finite check agrees through
        its process group (``FiniteChecks``).
        """
        if sharding is not None and sharding.optimizer is not self:
            raise ValueError("Muon.attach_sharding: the sharding was built for another optimizer")
        self._sharding = sharding
        if sharding is not None:
            self._lost_sharding = None

    def _attach_mesh_sharding(self) -> None:
        """Muon matrices that are DTensors and no sharding: attach ``MuonTPSharding`` (exact, owners per mesh).

        That is Lightning's own ``ModelParallelStrategy``, or a loop of one's own around
        ``fully_shard`` (with or without tensor or expert parallelism): Newton-Schulz needs
        whole matrices, which a DTensor's local shard is not. Every rank takes its first
        step together, so every rank attaches it at the same point.
        """
        from torch.distributed.tensor import DTensor

        self._mesh_checked = True
        muon = [p for g in self.param_groups if get_algorithm(g["algorithm"]).per_matrix for p in g["params"]]
        if not any(isinstance(p, DTensor) for p in muon):
            return
        from lightning_muon.distributed.tensor_parallel import MuonTPSharding

        MuonTPSharding(self)

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(group, params, updates, ortho)`` on every Muon update; returns a handle to remove it.

        Called after orthogonalization (and any second moment), before the update is
        applied, on the rank that steps the matrices: ``updates`` are the momentum tensors
        fed to Newton-Schulz, ``ortho`` per parameter its list of pieces (shaped like
        ``MatrixLayout.views``), as they are applied before the lr scale. Under a
        sharding that holds whole matrices only on owners (FSDP2) the hooks run there,
        with the whole matrices, before any second moment. Hooks must not modify their
        arguments. ``handle.remove()`` unregisters it, as for torch's hooks.
        """
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    @property
    def has_update_hooks(self) -> bool:
        """True when an update hook is registered."""
        return bool(self._update_hooks)


def _main_params(optimizer: Muon, work: list) -> tuple[list, list[tuple[Tensor, Tensor]]]:
    """``work`` with each bf16/fp16 parameter's fp32 master copy (``main_params_dtype``) in its place.

    The copy lives in ``state[p]["main_param"]`` (made from ``p`` on its first step) and
    steps with ``p``'s state, under its own key for the step (``step`` drops that key and
    writes the copy back into ``p``); its gradient is ``p``'s, in fp32. Returns the new
    work and the (parameter, master copy) pairs.
    """
    if optimizer.state_settings.main_params_dtype is None:
        return work, []
    narrow = next((p for _, params, _ in work for p in params if has_main_param(optimizer.state_settings, p)), None)
    if narrow is None:
        return work, []
    if optimizer._sharding is not None:
        raise HparamError(
            f"Muon: main_params_dtype={optimizer.state_settings.main_params_dtype!r} keeps fp32 master copies in one "
            f"process only, and {narrow.dtype} parameters step under a sharding "
            f"({type(optimizer._sharding).__name__}); "
            "keep float32 parameters there (bf16-mixed precision) or leave main_params_dtype at None",
            "main_params_dtype",
        )
    out, masters = [], []
    for group, params, grads in work:
        stepped, upcast = [], []
        for p, g in zip(params, grads):
            if has_main_param(optimizer.state_settings, p):
                entry = optimizer.state[p]
                if MAIN_PARAM not in entry:
                    entry[MAIN_PARAM] = p.detach().to(torch.float32, copy=True)
                master = entry[MAIN_PARAM]
                optimizer.state[master] = entry  # the algorithm finds p's state under the copy
                masters.append((p, master))
                p, g = master, g.to(torch.float32)
            stepped.append(p)
            upcast.append(g)
        out.append((group, stepped, upcast))
    return out, masters


def _collect(sharding: Sharding | None, index: int, group: dict) -> tuple[list[Tensor], list[Tensor]]:
    """The parameters of ``group`` a step here updates (with a gradient; under a sharding, the part it steps)
    and their gradients."""
    params, grads = [], []
    for j, p in enumerate(group["params"]):
        if sharding is not None:
            p = sharding.stepped(p)  # p, the part of it this rank steps (experts), or None
            if p is None:
                continue  # another rank orthogonalizes it and sends the result
        # An empty tensor (a zero-width layer) has nothing to update; skipping it also keeps
        # it out of the finite check and the adjust_lr ratio, which both fail on size 0.
        if p.grad is None or p.numel() == 0:
            continue
        if p.grad.is_sparse:
            raise ValueError(f"param group {index}, parameter {j}: sparse gradients are not supported")
        if p.grad.is_complex():
            raise ValueError(f"param group {index}, parameter {j}: complex gradients are not supported")
        params.append(p)
        grads.append(p.grad)
    return params, grads


def _is_state_creation(optimizer: Muon) -> bool:
    """Whether the step a new ``optimizer`` is about to take is torch's distributed checkpoint asking for its state.

    To load a saved optimizer state into an optimizer that has none,
    ``torch.distributed.checkpoint.state_dict`` (``get_optimizer_state_dict``,
    ``set_optimizer_state_dict``: every ``muon_fsdp`` and ``ModelParallelStrategy`` resume) gives
    every parameter a zero gradient, sets every group's lr to 0 and calls ``step()`` once. It is
    that step when the optimizer has neither stepped nor loaded a state since it was made, every
    group's lr is 0, and every parameter that requires a gradient has one, all zeros, on every
    rank of its sharding (one all-reduce, which every rank runs alike: the first two conditions
    are the same on every rank). A step there would move weights that do not scale with the lr
    (Spel's projection, Sinkhorn-Muon's map, a fixed hyperball radius, "independent" decay) and
    refuse Schedule-Free groups in eval mode, as a new optimizer's are.
    """
    lrs = [g["lr"] for g in optimizer.param_groups if "lr" in g]
    if not lrs or any(lr is None or float(lr) != 0.0 for lr in lrs):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    zero = all(p.grad is not None and not bool(_local(p.grad).any()) for p in params)
    sharding = optimizer.sharding
    if sharding is not None and sharding.world_size > 1:
        device = params[0].device if params else torch.device("cpu")  # NCCL takes no CPU tensors
        flag = torch.tensor([int(zero)], dtype=torch.int32, device=device)
        all_reduce_(flag, dist.ReduceOp.MIN, sharding.group, sharding.stats, name="state_creation")
        zero = bool(flag.item())
    return zero


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _settings_from_keywords(arguments: dict[str, Any]) -> dict[str, Settings]:
    """The settings of ``Muon``'s keywords (``arguments``: its ``locals()``) and of its ``settings``, by algorithm.

    A keyword at its default is left to the settings' default, so that one of torch.optim.Muon's
    names (``eps``, ``adjust_lr_fn``: ``aliases``) may set its field; keywords that set Muon's (or
    AdamW's) settings beside a ``MuonSettings`` (``AdamWSettings``) in ``settings`` are refused.
    """
    given = {n: v for n, v in arguments.items() if n in _MUON_FIELDS and not _is_default(v, getattr(_MUON, n))}
    for alias in ("eps", "adjust_lr_fn"):  # torch.optim.Muon's names (``aliases``)
        if arguments[alias] is not None:
            given[alias] = arguments[alias]
    muon = settings_from(MuonSettings, given, "Muon()")
    adamw = _adamw_settings(*(arguments[f"adamw_{name}"] for name in ("lr", "betas", "eps", "weight_decay")))
    chosen = settings_by_algorithm(arguments["settings"], "Muon(settings=...)")
    for own in (muon, adamw):
        other = chosen.get(own.algorithm)
        if other is not None and own != type(own)():
            keywords = "lr, momentum, ..." if own.algorithm == "muon" else "adamw_lr, adamw_betas, ..."
            raise HparamError(
                f"Muon: settings holds {type(other).__name__} and the keywords ({keywords}) set "
                f"{own.algorithm}'s settings too; give them one way",
                "settings",
            )
        chosen.setdefault(own.algorithm, own)
    return chosen


def _is_default(value: Any, default: Any) -> bool:
    """Whether a keyword holds its default: the same value of the same type (a Tensor lr is never a default)."""
    return type(value) is type(default) and value == default


def _all_option_names() -> frozenset[str]:
    """Every key a group of some registered algorithm takes."""
    return frozenset().union(*(get_algorithm(name).option_names() for name in algorithm_names()))


def _adamw_settings(lr: float, betas: Any, eps: float, weight_decay: float) -> AdamWSettings:
    """``AdamWSettings`` from ``Muon``'s ``adamw_*`` keywords; an error names the keyword."""
    try:
        return AdamWSettings(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    except HparamError as err:
        raise HparamError(f"Muon(): adamw_{err.detail}", f"adamw_{err.field}", f"adamw_{err.detail}") from None


def _warn_lost_sharding(kind: str) -> None:
    """A copy (deepcopy, pickle) of an optimizer that had a ``kind`` sharding steps without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"Muon: this optimizer is a copy (deepcopy or pickle) of one that had a {kind}, which does not travel "
            "with it (its process group cannot); it steps every matrix on every rank. Give the copy to the "
            "strategy (muon_ddp, muon_fsdp attach one in setup) or attach a sharding to it yourself",
            RuntimeWarning,
            stacklevel=3,
        )


_ONE_LR = (
    "Muon: every param group steps at one lr now, though their lrs differed (Muon's and AdamW's are "
    "apart by design): a scheduler or tool set one lr for all of them, as OneCycleLR and CyclicLR do given one "
    "max_lr, SWALR given one swa_lr, and Lightning's lr_find and StochasticWeightAveraging do without "
    'MuonModuleMixin. Give each group its own: max_lr=[g["lr"] for g in optimizer.param_groups] (swa_lr '
    "likewise); under Lightning, MuonModuleMixin spreads one lr over the groups by their configured ratios"
)


def _several_lrs(groups: list[dict[str, Any]]) -> bool:
    """Whether the groups' lrs (floats; a Tensor lr is left out, read only on the device) are not all one."""
    return len({g["lr"] for g in groups if not isinstance(g["lr"], Tensor)}) > 1
