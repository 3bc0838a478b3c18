r"""``"muon"`` groups: Muon's hyperparameters, their checks, the layout of a group's tensors, and its step.

For a matrix ``W`` with gradient ``G`` (torch.optim.Muon's form, the defaults)::

    B <- mu B + (1 - mu) G                       # EMA momentum ("sum": B <- mu B + G)
    U <- (1 - mu) G + mu B   if nesterov else B
    O <- orthogonalize(U)                        # Newton-Schulz, short side first
    W <- W (1 - lr wd)                           # decoupled decay, base lr
    W <- W - lr * adjust(rows, cols) * extra_scale_factor * O

The step runs in stages, each one place to extend: the momentum (``muon_momentum_``), the
orthogonalization (Newton-Schulz here, or across ranks by an attached ``Sharding``), a
second moment (NorMuon, AdaMuon), the update hooks (``Muon.register_update_hook``) and the
weight update (``apply_update``), which a variant overrides with its own pre- and
post-update work (``muon_hyperball``). The math lives in ``functional``.

References:
    Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024.
    Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982, 2025.
    Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491, 2025.
    Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005, 2025.
    Chen et al., "Cautious Weight Decay", arXiv 2510.12402, 2025.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_muon.algorithms.base import Algorithm, HparamsSource, register_algorithm
from lightning_muon.algorithms.checks import HparamError, check_bool, check_choice, check_number, normalize
from lightning_muon.algorithms.state_dtypes import STATE_SETTINGS, state_dtype
from lightning_muon.distributed.tp_math import TP_MODES
from lightning_muon.functional import (
    ADJUST_LR_ALIASES,
    ADJUST_LR_MODES,
    MOMENTUM_FORMS,
    SECOND_MOMENTS,
    WEIGHT_DECAY_FORMS,
    muon_apply_,
    muon_momentum_,
    muon_orthogonalize,
    muon_second_moment_,
    second_moment_buffer,
)
from lightning_muon.layout import LAYOUT_KEYS, MatrixLayout, layout_of
from lightning_muon.newton_schulz import (
    check_ns_dtype,
    check_ns_method,
    donated_dtypes,
    dtype_name,
    resolve_coefficients,
)
from lightning_muon.step_memory import matrix_working_bytes, plan_rounds, step_memory_bytes

__all__ = [
    "AdjustLR",
    "CoefficientName",
    "MUON",
    "MuonAlgorithm",
    "MuonHparams",
    "NSDtype",
    "check_muon",
    "check_muon_params",
    "resolve_split_parts",
]

AdjustLR = Literal["original", "match_rms_adamw", "spectral", "spectral_norm", "none", "shape_scaling", "unit_rms_norm"]
CoefficientName = Literal["polar_express", "polar_express_paper", "keller", "you", "cubic", "cans", "deepseekv4"]
NSDtype = Literal["float32", "bfloat16", "float64", "float16", "fp32", "bf16"]

# Options of a Muon group besides its hyperparameters: the layout of its tensors.
MUON_LAYOUT = frozenset({*LAYOUT_KEYS, "split_parts"})


@dataclass(frozen=True, kw_only=True)
class MuonHparams:
    """Muon groups: the update rule's knobs (``Muon``'s unprefixed keywords)."""

    lr: float = 0.02
    """Muon learning rate (peak, before the schedule)."""
    momentum: float = 0.95
    """Muon momentum ``mu`` in [0, 1) (after any momentum warmup)."""
    nesterov: bool = True
    """Nesterov form of the momentum."""
    weight_decay: float = 0.0
    """Decoupled weight decay, multiplied by the base lr."""
    ns_steps: int = 5
    """Newton-Schulz iterations."""
    ns_coefficients: CoefficientName | list[tuple[float, float, float]] = "polar_express"
    """A schedule name in ``COEFFICIENTS`` or a list of (a, b, c)."""
    ns_dtype: NSDtype | None = None
    """Newton-Schulz dtype: None (automatic: bf16 where its matmul is fast), "float32", "bfloat16", ..."""
    adjust_lr: AdjustLR = "original"
    """Update scale by shape: original, match_rms_adamw, spectral, spectral_norm, none (+ Megatron aliases)."""
    extra_scale_factor: float = 1.0
    """Multiplies the adjusted Muon lr; > 0."""
    momentum_form: Literal["ema", "sum"] = "ema"
    """"ema" (B <- mu B + (1 - mu) G) or "sum" (B <- mu B + G)."""
    second_moment: Literal["normuon", "adamuon"] | None = None
    """None, "normuon" (per-row second moment, arXiv 2510.05491) or "adamuon" (per element, arXiv 2507.11005)."""
    second_moment_beta2: float = 0.95
    """Decay of the second moment, in [0, 1)."""
    second_moment_eps: float = 1e-8
    """Added to the root of the second moment; > 0."""
    sign_momentum: bool = False
    """Orthogonalize sign(momentum) (AdaMuon's sign-stabilized update)."""
    weight_decay_form: Literal["decoupled", "cautious"] = "decoupled"
    """"decoupled", or "cautious": decay only where the update and the weight agree in sign."""
    ns_method: Literal["auto", "standard", "gram"] = "auto"
    """Newton-Schulz iteration: "auto", "standard" or "gram" (Gram Newton-Schulz)."""
    tp_mode: Literal["duplicated", "distributed", "blockwise"] = "duplicated"
    """Matrices split by tensor parallelism (``MuonFSDPStrategy`` with ``tensor_parallel_size > 1``;
    ignored elsewhere): "duplicated" (gathered whole in the group; exact), "distributed" (Gram
    matrices all-reduced, no whole matrix; exact) or "blockwise" (each block alone; approximate)."""

    prefix = ""  # not a field: the prefix of these knobs among Muon's keywords

    def __post_init__(self) -> None:
        normalize(self, check_muon(dataclasses.asdict(self), "Muon()", self.prefix))


def check_muon(group: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """Check Muon's hyperparameters in ``group``; returns the normalized values to store.

    ``ns_coefficients`` lists become lists of tuples and ``ns_dtype`` a plain name
    (checkpoints, torch.save and distributed, store it as is). Raises ``HparamError``.
    """
    out: dict[str, Any] = {}

    def number(name: str, low: float, high: float = float("inf"), low_open: bool = False, high_open: bool = False):
        check_number(group[name], prefix + name, where, low, high, low_open, high_open)

    number("lr", 0.0)
    number("weight_decay", 0.0)
    number("momentum", 0.0, 1.0, high_open=True)
    check_bool(group, "nesterov", where)
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HparamError(f"ns_steps must be a positive int, got {steps!r}", "ns_steps")
    coefficients = group["ns_coefficients"]
    try:
        resolve_coefficients(coefficients, steps)
    except ValueError as err:
        raise HparamError(str(err), "ns_coefficients") from None
    if not isinstance(coefficients, str):
        out["ns_coefficients"] = [tuple(abc) for abc in coefficients]
    try:
        dtype = check_ns_dtype(group["ns_dtype"])
    except ValueError as err:
        raise HparamError(str(err), "ns_dtype") from None
    out["ns_dtype"] = None if dtype is None else dtype_name(dtype)
    mode = group["adjust_lr"]
    if ADJUST_LR_ALIASES.get(mode, mode) not in ADJUST_LR_MODES:
        modes = sorted(ADJUST_LR_MODES) + sorted(ADJUST_LR_ALIASES)
        raise HparamError(f"{where}: adjust_lr must be one of {modes}, got {mode!r}", "adjust_lr")
    number("extra_scale_factor", 0.0, low_open=True)
    check_choice(group, "momentum_form", where, MOMENTUM_FORMS)
    check_choice(group, "second_moment", where, (None, *SECOND_MOMENTS))
    number("second_moment_beta2", 0.0, 1.0, high_open=True)
    number("second_moment_eps", 0.0, low_open=True)
    check_choice(group, "weight_decay_form", where, WEIGHT_DECAY_FORMS)
    check_choice(group, "tp_mode", where, TP_MODES)
    try:
        check_ns_method(group["ns_method"])
    except ValueError as err:
        raise HparamError(f"{where}: {err}", "ns_method") from None
    check_bool(group, "sign_momentum", where)
    for key in ("batched", "transposed"):
        if key in group:
            check_bool(group, key, where)
    return out


def resolve_split_parts(group: dict[str, Any], params: list[Tensor], where: str) -> None:
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
    layout = MatrixLayout(batched=bool(group.get("batched")), transposed=bool(group.get("transposed")))
    axes = {layout.out_axis(p.ndim) for p in params if p.ndim >= 2} or {0}
    axis = min(axes)
    sizes = {p.shape[layout.out_axis(p.ndim)] for p in params if p.ndim >= 2}
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


def check_muon_params(group: dict[str, Any], params: list[Tensor], where: str) -> None:
    """The group's layout (``split_sizes``, ``batched``, ``transposed``) against its tensors."""
    try:
        layout = layout_of(group)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    group["split_sizes"] = layout.split_sizes
    for j, p in enumerate(params):
        label = f"{where}, parameter {j}" + (f" ({group['param_names'][j]!r})" if "param_names" in group else "")
        if p.is_complex():
            raise ValueError(f"{label}: complex parameters are not supported by Muon")
        layout.check(p, label)


class MuonAlgorithm(Algorithm):
    """Muon: momentum, orthogonalization, an optional second moment, and the update scaled by shape.

    A variant subclasses it and overrides ``apply_update`` (the weight update, where NVIDIA's
    Emerging-Optimizers put their pre- and post-update hooks) and extends ``hparams``,
    ``check`` and ``group_defaults`` with its own keys; everything before the update (and the
    sharding of Newton-Schulz across ranks) it inherits.
    """

    name = "muon"
    hparams = MuonHparams
    orthogonalizes = True
    layout_options = MUON_LAYOUT
    state_dtype_settings = frozenset(STATE_SETTINGS)

    def check(self, values: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
        return check_muon(values, where, prefix)

    def group_defaults(self, config: HparamsSource) -> dict[str, Any]:
        return {
            **dataclasses.asdict(config.hparams_of("muon")),
            "split_sizes": None,
            "batched": False,
            "transposed": False,
        }

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        resolve_split_parts(group, params, where)
        check_muon_params(group, params, where)

    def step_group(self, optimizer: Any, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        state = optimizer.state
        bufs = []
        for p in params:
            entry = state[p]
            if "momentum_buffer" not in entry:
                dtype = state_dtype(optimizer, "exp_avg_dtype", p)  # exp_avg_dtype: stored narrower
                entry["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            bufs.append(entry["momentum_buffer"])
        # In rounds that fit the step's memory cap (``step_memory``): each round makes its
        # updates, orthogonalizes them and updates its weights before the next one starts.
        cap = step_memory_bytes(optimizer.config.step_memory_mb, params[0].device)
        sharding = optimizer.sharding
        # Who orthogonalizes each parameter (None: this rank, every one it steps).
        owners = sharding.round_owners(group, params) if sharding is not None else None
        multi = self.multi_shapes(group, params, owners, None if sharding is None else sharding.rank)
        world = 1 if sharding is None else sharding.world_size
        for idx in self.rounds(group, params, cap, owners, world):
            round_params, round_grads = [params[i] for i in idx], [grads[i] for i in idx]
            self.step_round(optimizer, group, round_params, round_grads, [bufs[i] for i in idx], cap, multi)

    def multi_shapes(
        self, group: dict, params: list[Tensor], owners: list[int | None] | None, rank: int | None
    ) -> frozenset[tuple[int, int]]:
        """The ``(short side, long side)`` of matrices this rank orthogonalizes more than one of in this step.

        Handed to every round (``orthogonalize_many``'s ``multi_shapes``), so that a matrix
        whose shape is stacked in the whole step stays a stack in a round of its own: its
        result does not depend on the rounds.
        """
        layout = layout_of(group)
        if layout.batched:
            return frozenset()
        counts: Counter[tuple[int, int]] = Counter()
        for i, p in enumerate(params):
            if owners is not None and owners[i] is not None and owners[i] != rank:
                continue  # another rank orthogonalizes it
            for rows, cols in layout.piece_shapes(tuple(p.shape)):
                counts[(min(rows, cols), max(rows, cols))] += 1
        return frozenset(shape for shape, count in counts.items() if count > 1)

    def rounds(
        self, group: dict, params: list[Tensor], cap: int | None, owners: list[int | None] | None, world: int
    ) -> list[list[int]]:
        """The group's parameters in rounds of at most ``cap`` working bytes (``step_memory.plan_rounds``).

        Planned from the global shapes and, under a sharding, its ``owners`` among ``world``
        ranks, so that every rank of a sharding plans the same rounds. The estimate takes float32 work for the automatic
        Newton-Schulz dtype, so that it does not depend on the host.
        """
        if cap is None or len(params) == 1:
            return [list(range(len(params)))]
        layout = layout_of(group)
        ns_dtype = check_ns_dtype(group["ns_dtype"])
        costs, kinds = [], []
        for p in params:
            work = ns_dtype if ns_dtype is not None else torch.promote_types(p.dtype, torch.float32)
            costs.append(matrix_working_bytes(p.shape, layout, p.dtype, work))
            kinds.append((tuple(layout.piece_shapes(tuple(p.shape))), str(p.dtype)))
        return plan_rounds(costs, kinds, cap, owners, world)

    def step_round(
        self,
        optimizer: Any,
        group: dict,
        params: list[Tensor],
        grads: list[Tensor],
        bufs: list[Tensor],
        cap: int | None = None,
        multi_shapes: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        """One round of the group's step: momentum, Newton-Schulz, second moment, hooks and the weight update."""
        state, sharding = optimizer.state, optimizer.sharding
        # Without a hook or a sharding to hand the momentum to, the Nesterov update is a
        # temporary that Newton-Schulz may use up, made in the dtype ``donated_dtypes`` names
        # (the cast folded into the momentum kernel). Splits and batches keep theirs: their
        # pieces are cut and copied first.
        hooks = optimizer.has_update_hooks
        donate = group["nesterov"] and not hooks and sharding is None
        out_dtypes = None
        layout = layout_of(group)
        if donate and layout.split_sizes is None and not layout.batched:
            flat = [g.reshape(g.shape[0], -1) for g in grads]  # the matrices Newton-Schulz will see
            out_dtypes = donated_dtypes(flat, group["ns_dtype"], group["ns_method"], multi_shapes)
        updates = muon_momentum_(
            grads, bufs, group["momentum"], group["nesterov"], group["momentum_form"], out_dtypes=out_dtypes
        )
        if group["sign_momentum"]:
            updates = list(torch._foreach_sign(updates))
        ortho = self.orthogonalize(
            sharding, group, updates, params, donate=donate, max_stack_bytes=cap, multi_shapes=multi_shapes
        )
        if group["second_moment"] is not None:
            ortho = self.second_moment(state, group, params, ortho, optimizer=optimizer)
        # A sharding that holds the full matrices only on owner ranks runs the hooks itself.
        if hooks and (sharding is None or not sharding.observes_updates):
            optimizer.run_update_hooks(group, params, updates, ortho)
        self.apply_update(optimizer, group, params, ortho)

    def orthogonalize(
        self,
        sharding: Any,
        group: dict,
        updates: list[Tensor],
        params: list[Tensor],
        donate: bool = False,
        max_stack_bytes: int | None = None,
        multi_shapes: frozenset[tuple[int, int]] = frozenset(),
    ) -> list[list[Tensor]]:
        """Per update, its orthogonalized pieces (``MatrixLayout.views``); a sharding does it across ranks."""
        kwargs = dict(
            layout=layout_of(group),
            ns_steps=group["ns_steps"],
            ns_coefficients=group["ns_coefficients"],
            ns_dtype=group["ns_dtype"],
            ns_method=group["ns_method"],
            max_stack_bytes=max_stack_bytes,
            multi_shapes=multi_shapes,
        )
        if sharding is not None:
            return sharding.orthogonalize(params, updates, **kwargs)
        # Pieces stay in Newton-Schulz's dtype: muon_apply_ adds them into the parameters in one pass.
        return muon_orthogonalize(updates, **kwargs, keep_work_dtype=True, donate=donate)

    def second_moment(
        self, state: Any, group: dict, params: list[Tensor], ortho: list[list[Tensor]], optimizer: Any = None
    ) -> list:
        """NorMuon / AdaMuon normalization; the buffer lives in ``state[p]["second_moment"]``.

        It is stored in ``optimizer.config.exp_avg_sq_dtype`` (``state_dtypes``; without an
        ``optimizer``, in the parameter's dtype) and computed in float32 at least.
        """
        method, buffers = group["second_moment"], []
        for p in params:
            entry = state[p]
            if "second_moment" not in entry:
                dtype = state_dtype(optimizer, "exp_avg_sq_dtype", p)
                entry["second_moment"] = second_moment_buffer(p, method, layout_of(group), dtype=dtype)
            buffers.append(entry["second_moment"])
        return muon_second_moment_(
            ortho,
            buffers,
            layout=layout_of(group),
            method=method,
            beta2=group["second_moment_beta2"],
            eps=group["second_moment_eps"],
        )

    def apply_update(self, optimizer: Any, group: dict, params: list[Tensor], ortho: list[list[Tensor]]) -> None:
        """The weight update from the orthogonalized pieces: decay, then ``lr * adjust(shape) * O``."""
        muon_apply_(
            params,
            ortho,
            layout=layout_of(group),
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            adjust_lr=group["adjust_lr"],
            extra_scale_factor=group["extra_scale_factor"],
            weight_decay_form=group["weight_decay_form"],
        )


MUON = register_algorithm(MuonAlgorithm())
