r"""``"muon"`` groups: Muon's settings, its state and its step.

For a matrix ``W`` with gradient ``G`` (torch.optim.Muon's form, the defaults)::

    B <- mu B + (1 - mu) G                       # EMA momentum ("sum": B <- mu B + G)
    U <- (1 - mu) G + mu B   if nesterov else B
    O <- orthogonalize(U)                        # Newton-Schulz, short side first
    W <- W (1 - lr wd)                           # decoupled decay, base lr
    W <- W - lr * adjust(rows, cols) * extra_scale_factor * O

A group's step (``MuonAlgorithm.step_group``) reads the group's settings once
(``MuonHparams``), makes the state a parameter lacks (``init_state``), cuts the parameters into
rounds that fit the step's memory cap (``step_memory``) and runs each round top to bottom::

    plan           Newton-Schulz's plan of the round's matrices (stacks, methods, work dtypes,
                   donation; ``newton_schulz.plan_matrices``), made once from the gradients
    momentum       grads -> updates (EMA or sum, Nesterov), made in the plan's donated dtypes
    orthogonalize  updates -> ortho: Newton-Schulz here, or where each matrix is whole under a
                   sharding (``Sharding.map_whole``)
    normalize      ortho -> ortho: a second moment (NorMuon, AdaMuon, NAMO), a variant's scale
    update hooks   ``Muon.register_update_hook``'s, on updates and ortho
    apply_update   the weights from ortho: decay, then ``lr * scale * O``
    after_update   the weights after the update (a variant's projection)

A variant (``muon_hyperball``, ``scion``, ``spel``, ...) overrides the stages it changes; every
stage reads what it needs from the ``MuonRound``. The math lives in ``functional``.

References:
    Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024.
    Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982, 2025.
    Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491, 2025.
    Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005, 2025.
    Chen et al., "Cautious Weight Decay", arXiv 2510.12402, 2025.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from lightning_muon.algorithms.base import Algorithm, StepContext, register_algorithm
from lightning_muon.algorithms.checks import check_bool
from lightning_muon.algorithms.families import NewtonSchulzSettings
from lightning_muon.algorithms.settings import Settings, setting
from lightning_muon.algorithms.state_dtypes import STATE_SETTINGS, state_dtype
from lightning_muon.functional import (
    adjust_lr_ratio,
    map_matrices,
    muon_apply_,
    muon_momentum_,
    muon_orthogonalize,
    muon_second_moment_,
    namo_norms,
    namo_scale_,
    second_moment_buffer,
    second_moment_shape,
)
from lightning_muon.layout import (
    LAYOUT_KEYS,
    MatrixLayout,
    check_muon_params,
    layout_of,
    resolve_split_parts,
)
from lightning_muon.newton_schulz import (
    MatrixSpec,
    NSPlan,
    check_ns_dtype,
    matmul_precision,
    ns_wire_dtype,
    plan_matrices,
)
from lightning_muon.step_memory import plan_rounds, step_memory_bytes

__all__ = ["MUON", "MuonAlgorithm", "MuonHparams", "MuonRound", "MuonSettings", "check_layout", "matrix_working_bytes"]

# Options of a Muon group besides its settings: the layout of its tensors.
MUON_LAYOUT = frozenset({*LAYOUT_KEYS, "split_parts"})


@dataclass(frozen=True, kw_only=True)
class MuonSettings(NewtonSchulzSettings, algorithm="muon"):
    """Muon groups (module docstring): the shared Newton-Schulz settings, and Muon's own momentum and second moment."""

    momentum_form: Literal["ema", "sum"] = "ema"
    """"ema" (B <- mu B + (1 - mu) G) or "sum" (B <- mu B + G; Moonlight, dion)."""
    second_moment: Literal["normuon", "adamuon", "namo", "normuon_rms", "adamuon_rms"] | None = None
    """None, or a second moment of the orthogonalized update: Emerging-Optimizers' "normuon" (per row or
    column, arXiv 2510.05491), "adamuon" (per element, arXiv 2507.11005) or "namo" (per matrix, arXiv
    2602.17080), or ours that keep plain Muon's RMS, "normuon_rms" (per output) and "adamuon_rms"."""
    second_moment_beta2: float = setting(0.95, low=0.0, high=1.0, high_open=True)
    """Decay of the second moment, in [0, 1)."""
    second_moment_eps: float = setting(1e-8, low=0.0, low_open=True)
    """Added to the root of the second moment; > 0."""
    sign_momentum: bool = False
    """Orthogonalize sign(momentum) (AdaMuon's sign-stabilized update)."""


def check_layout(group: dict[str, Any], where: str) -> None:
    """The layout keys a group sets itself (``batched``, ``transposed``) are bools; the rest: ``check_muon_params``."""
    for key in ("batched", "transposed"):
        if key in group:
            check_bool(group, key, where)


class MuonHparams(NamedTuple):
    """A Muon group's settings as its step reads them, read once per step (``MuonHparams.of``).

    A variant whose settings lack one (MOP has no Newton-Schulz keys, Scion no choice of
    momentum form) reads Muon's default for it.
    """

    lr: float
    weight_decay: float
    weight_decay_method: str
    momentum: float
    nesterov: bool
    momentum_form: str
    sign_momentum: bool
    adjust_lr: str
    """The scale by shape; MOP's "nuclear_norm" reads "none" here (it scales in its ``normalize``)."""
    extra_scale_factor: float
    second_moment: str | None
    second_moment_beta2: float
    second_moment_eps: float
    ns: dict[str, Any]
    """Newton-Schulz's settings by their group keys (``ns_steps``, ``ns_coefficients``, ``ns_dtype``, ``ns_method``,
    ``ns_eps``; ``functional.muon_orthogonalize``'s keywords): ``ns_dtype`` is float32 where ``fp32_matmul_prec``
    asks for "highest" or "high" and no ``ns_dtype`` is set."""
    matmul_precision: str
    """torch's float32 matmul precision for the step on a GPU: "highest" where ``ns_dtype`` is float32 or wider."""

    @classmethod
    def of(cls, group: dict[str, Any]) -> MuonHparams:
        lr = group["lr"]
        ns_dtype = group.get("ns_dtype")
        precision = group.get("fp32_matmul_prec", "highest")
        if ns_dtype is None and precision in ("highest", "high"):
            ns_dtype = "float32"
        adjust = group["adjust_lr"]
        return cls(
            lr=lr.item() if isinstance(lr, Tensor) else lr,  # a Tensor lr steps as the same float
            weight_decay=group["weight_decay"],
            weight_decay_method=group["weight_decay_method"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            momentum_form=group.get("momentum_form", "ema"),
            sign_momentum=group.get("sign_momentum", False),
            adjust_lr="none" if adjust == "nuclear_norm" else adjust,
            extra_scale_factor=group["extra_scale_factor"],
            second_moment=group.get("second_moment"),
            second_moment_beta2=group.get("second_moment_beta2", 0.95),
            second_moment_eps=group.get("second_moment_eps", 1e-8),
            ns=dict(
                ns_steps=group.get("ns_steps", 5),
                ns_coefficients=group.get("ns_coefficients", "polar_express"),
                ns_dtype=ns_dtype,
                ns_method=group.get("ns_method", "standard"),
                ns_eps=group.get("ns_eps"),  # absent from a group pickled before it existed: the schedule's own
            ),
            matmul_precision="highest" if ns_dtype in ("float32", "float64") else precision,
        )


@dataclass(eq=False)
class MuonRound:
    """One round of a Muon group's step: what its stages read and write, in group order.

    ``plan`` is Newton-Schulz's plan of the round's matrices (None under a sharding, whose
    owners plan the matrices they hold whole, and for an algorithm without Newton-Schulz);
    ``updates`` (what Newton-Schulz is fed) and ``ortho`` (per parameter its orthogonalized
    pieces, ``MatrixLayout.views``) are filled by the stages; ``extras`` carries what a
    variant's stages hand each other (NAMO's norms).
    """

    group: dict[str, Any]
    hp: MuonHparams
    layout: MatrixLayout
    params: list[Tensor]
    grads: list[Tensor]
    bufs: list[Tensor]
    cap: int | None
    """The step's memory cap in bytes: Newton-Schulz's stacks hold at most this much."""
    multi_shapes: frozenset[tuple[int, int]]
    """The ``(short side, long side)`` this rank orthogonalizes more than one of in the step
    (``orthogonalize_many``): a matrix whose shape is stacked in the whole step stays a stack in a round of its own,
    so its result does not depend on the rounds."""
    plan: NSPlan | None = None
    updates: list[Tensor] = field(default_factory=list)
    ortho: list[list[Tensor]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)


class MuonAlgorithm(Algorithm):
    """Muon: momentum, orthogonalization, an optional second moment, and the update scaled by shape.

    The stages of a round (module docstring) are methods a variant overrides without
    copying the rest (rounds, donation and sharding stay here): ``orthogonalize``,
    ``normalize``, ``apply_update`` and, where it projects, ``after_update``; ``plan`` for one
    whose orthogonalization is not Newton-Schulz, ``keeps_updates`` for one whose later stage
    reads the updates Newton-Schulz would otherwise use up.
    """

    name = "muon"
    settings = MuonSettings
    orthogonalizes = True
    per_matrix = True
    layout_options = MUON_LAYOUT
    state_dtype_settings = frozenset(STATE_SETTINGS)
    keeps_updates: ClassVar[bool] = False
    """True when a stage after the orthogonalization reads ``round.updates`` (PolarGrad's, MOP's ``<O, U>``), which
    Newton-Schulz must then not use up (no buffer donation)."""
    after_update: ClassVar[Any] = None
    """None, or ``after_update(ctx, round)``: the weights after the update (a variant's projection: Spel's matrix
    sign, Sinkhorn-Knopp)."""

    def check(self, values: dict[str, Any], where: str) -> dict[str, Any]:
        check_layout(values, where)
        return super().check(values, where)

    def group_defaults(self, settings: Settings) -> dict[str, Any]:
        return {
            **settings.asdict(),
            "split_sizes": None,
            "batched": False,
            "transposed": False,
            "blocks": None,
        }

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        resolve_split_parts(group, params, where)
        check_muon_params(group, params, where)

    def update_scale(self, group: dict, fan_out: int, fan_in: int) -> float:
        """The factor on a ``fan_out x fan_in`` orthogonalized piece before the lr, as the update hooks see it."""
        adjust = group["adjust_lr"]
        return adjust_lr_ratio(
            "none" if adjust == "nuclear_norm" else adjust, fan_out, fan_in, group["extra_scale_factor"]
        )

    def work_dtype(self, hp: MuonHparams) -> torch.dtype | None:
        """The dtype the group's per-matrix work runs in, for the rounds' memory estimate (None: automatic)."""
        return check_ns_dtype(hp.ns["ns_dtype"])

    # ------------------------------------------------------------------ state

    def init_state(self, ctx: StepContext, group: dict[str, Any], params: list[Tensor]) -> list[Tensor]:
        """The momentum buffers of ``params``, made zero where missing (``exp_avg_dtype``), and the second moment's
        buffers where the group has one (``exp_avg_sq_dtype``); returns the momentum buffers."""
        state = ctx.state
        method = group.get("second_moment")
        bufs = []
        for p in params:
            entry = state[p]
            if "momentum_buffer" not in entry:
                dtype = state_dtype(ctx, "exp_avg_dtype", p)
                entry["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if method is not None and "second_moment" not in entry:
                dtype = state_dtype(ctx, "exp_avg_sq_dtype", p)
                entry["second_moment"] = second_moment_buffer(p, method, layout_of(group), dtype=dtype)
            bufs.append(entry["momentum_buffer"])
        return bufs

    # ------------------------------------------------------------------ the step

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        hp = MuonHparams.of(group)
        layout = layout_of(group)
        bufs = self.init_state(ctx, group, params)
        device = params[0].device
        cap = ctx.caps.get(device.type, -1)
        if cap == -1:  # resolved once per device type
            cap = ctx.caps[device.type] = step_memory_bytes(ctx.state_settings.step_memory_mb, device)
        sharding = ctx.sharding
        # Who orthogonalizes each parameter (None: this rank, every one it steps).
        owners = sharding.round_owners(group, params) if sharding is not None else None
        rounds = self.rounds(hp, layout, params, cap, owners, 1 if sharding is None else sharding.world_size)
        # A matrix whose shape this rank stacks in another round stays a stack in its own (``multi_shapes``).
        multi = frozenset() if len(rounds) == 1 else _multi_shapes(layout, params, owners, getattr(sharding, "rank", 0))
        # Without a hook, a sharding or a later stage to hand the momentum to, the Nesterov update is a
        # temporary that Newton-Schulz may use up, made in the dtype the plan names (the cast folded into
        # the momentum kernel). Splits and batches keep theirs: their pieces are cut and copied first.
        hooks = ctx.update_hooks
        donate = hp.nesterov and not hooks and sharding is None and not self.keeps_updates
        plain = layout.split_sizes is None and not layout.batched
        # fp32_matmul_prec: torch's float32 matmul precision for the step, on a GPU (a CPU's float32 is exact).
        precision = matmul_precision(hp.matmul_precision, device) if device.type == "cuda" else contextlib.nullcontext()
        with precision:
            for idx in rounds:
                round_params, round_grads, round_bufs = ([ts[i] for i in idx] for ts in (params, grads, bufs))
                rnd = MuonRound(group, hp, layout, round_params, round_grads, round_bufs, cap, multi)
                if sharding is None:
                    rnd.plan = self.plan(rnd)
                # The momentum: grads -> updates (``weight_decay_method="l2"``: G + wd W, a copy: the user's
                # ``.grad`` stays what backward made), made in the plan's donated dtypes.
                donated = rnd.plan.donated if donate and plain and rnd.plan is not None else None
                if hp.weight_decay_method == "l2" and hp.weight_decay != 0.0:
                    rnd.grads = torch._foreach_add(rnd.grads, rnd.params, alpha=hp.weight_decay)
                rnd.updates = muon_momentum_(
                    rnd.grads, rnd.bufs, hp.momentum, hp.nesterov, hp.momentum_form, out_dtypes=donated
                )
                if hp.sign_momentum:
                    rnd.updates = list(torch._foreach_sign(rnd.updates))
                if hp.second_moment == "namo":  # its norms read the updates before Newton-Schulz uses them up
                    sums = namo_norms(rnd.grads, rnd.updates, layout, ctx.local_shard)  # (K, 2) this rank's part
                    if sharding is not None:
                        sums = sharding.reduce_matrix_sums(rnd.params, sums, layout)  # whole-matrix sums
                    rnd.extras["namo"] = sums
                observed = list(rnd.updates) if hooks else None  # the hooks' view (no hooks: no donation either)
                rnd.ortho = self.orthogonalize(ctx, rnd, donate=donate)
                rnd.ortho = self.normalize(ctx, rnd)
                # A sharding that holds the full matrices only on owner ranks runs the hooks itself.
                if observed is not None and (sharding is None or not sharding.observes_updates):
                    ctx.run_update_hooks(group, rnd.params, observed, rnd.ortho)
                del observed
                self.apply_update(ctx, rnd)
                if self.after_update is not None:
                    self.after_update(ctx, rnd)

    def rounds(
        self,
        hp: MuonHparams,
        layout: MatrixLayout,
        params: list[Tensor],
        cap: int | None,
        owners: list[int | None] | None,
        world: int,
    ) -> list[list[int]]:
        """The group's parameters in rounds of at most ``cap`` working bytes (``step_memory.plan_rounds``).

        Planned from the global shapes and, under a sharding, its ``owners`` among ``world``
        ranks, so that every rank of a sharding plans the same rounds. A group whose whole
        working set fits the cap, even in float64 work, is one round, in group order (every
        matrix gets the same bits in any round). The estimate takes float32 work for the
        automatic Newton-Schulz dtype, so that it does not depend on the host.
        """
        everything = [list(range(len(params)))]
        if cap is None or len(params) == 1:
            return everything
        if sum(matrix_working_bytes(p.shape, layout, p.dtype, torch.float64) for p in params) <= cap:
            return everything  # the widest work dtype bounds every estimate
        work_dtype = self.work_dtype(hp)
        costs = []
        for p in params:
            work = work_dtype or (torch.float64 if p.dtype == torch.float64 else torch.float32)
            costs.append(matrix_working_bytes(p.shape, layout, p.dtype, work))
        kinds = [(tuple(layout.piece_shapes(tuple(p.shape))), str(p.dtype)) for p in params]
        return plan_rounds(costs, kinds, cap, owners, world)

    # ------------------------------------------------------------------ the stages

    def plan(self, rnd: MuonRound) -> NSPlan | None:
        """Newton-Schulz's plan of the round's matrices, from the gradients (whose shapes the updates share)."""
        specs = [MatrixSpec(shape, g.dtype, g.device) for g in rnd.grads for shape in rnd.layout.piece_shapes(g.shape)]
        ns = rnd.hp.ns
        return plan_matrices(
            specs,
            ns["ns_steps"],
            ns["ns_coefficients"],
            ns["ns_dtype"],
            ns["ns_method"],
            rnd.multi_shapes,
            ns["ns_eps"],
        )

    def orthogonalize(
        self,
        ctx: StepContext,
        rnd: MuonRound,
        tensors: list[Tensor] | None = None,
        donate: bool = False,
        observe: bool = True,
    ) -> list[list[Tensor]]:
        """Per tensor (default: the round's updates; one per parameter), its orthogonalized pieces
        (``MatrixLayout.views``), with the group's settings, across ranks too.

        Also for a stage that orthogonalizes something else (Spel's weight projection;
        ``observe=False`` keeps the update hooks out). Here the pieces stay in Newton-Schulz's
        dtype (``muon_apply_`` adds them into the parameters in one pass); under a sharding
        Newton-Schulz runs where each matrix is whole (``Sharding.map_whole``) and this rank
        gets its part back (a DTensor: its rows).
        """
        ns = {**rnd.hp.ns, "max_stack_bytes": rnd.cap, "multi_shapes": rnd.multi_shapes}
        sharding = ctx.sharding
        if tensors is None:
            tensors, plan = rnd.updates, rnd.plan
        else:
            plan = None  # other tensors: planned as they are
        if sharding is None:
            return muon_orthogonalize(tensors, layout=rnd.layout, **ns, keep_work_dtype=True, donate=donate, plan=plan)

        def work(indices: list[int], wholes: list[list[Tensor]]) -> list[list[Tensor]]:
            return muon_orthogonalize([w[0] for w in wholes], layout=rnd.layout, **ns, keep_work_dtype=True)

        return sharding.map_whole(
            rnd.params,
            [[t] for t in tensors],
            work,
            layout=rnd.layout,
            wire_dtype=ns_wire_dtype(tensors, ns["ns_dtype"]),
            observe=self._observer(ctx, rnd, tensors) if observe else None,
            newton_schulz=ns,
        )

    def map_tensors(
        self,
        ctx: StepContext,
        rnd: MuonRound,
        tensors: list[Tensor],
        fn: Callable[[Tensor], Tensor],
        donate: bool = False,
        observe: bool = True,
    ) -> list[list[Tensor]]:
        """``fn`` on every matrix of ``tensors`` (one per parameter of the round), each whole, across ranks too.

        For per-matrix work that is not Newton-Schulz (MOP's polar factor by SVD, Sinkhorn-Knopp
        on a weight): ``fn`` takes one stored ``(rows, cols)`` matrix in float32 at least and
        returns its result (``functional.map_matrices``). A sharding runs it where each matrix
        is whole (``Sharding.map_whole``); ``observe`` as in ``orthogonalize``.
        """
        sharding = ctx.sharding
        if sharding is None:
            return map_matrices(tensors, fn, layout=rnd.layout, donate=donate)

        def work(indices: list[int], wholes: list[list[Tensor]]) -> list[list[Tensor]]:
            return map_matrices([w[0] for w in wholes], fn, layout=rnd.layout)

        observer = self._observer(ctx, rnd, tensors) if observe else None
        return sharding.map_whole(rnd.params, [[t] for t in tensors], work, layout=rnd.layout, observe=observer)

    def _observer(self, ctx: StepContext, rnd: MuonRound, updates: list[Tensor]) -> Callable | None:
        """The update hooks as ``map_whole``'s ``observe``: where only owners hold whole matrices (a sharding that
        ``observes_updates``), they see the owners' whole updates and results; None where ``step_group`` runs them
        (or none are registered)."""
        if not ctx.update_hooks or not ctx.sharding.observes_updates:
            return None
        params, group = rnd.params, rnd.group

        def observe(indices: list[int], wholes: list[list[Tensor]], results: list[list[Tensor]]) -> None:
            if not indices:
                return
            dtypes = [updates[i].dtype for i in indices]
            ctx.run_update_hooks(
                group,
                [params[i] for i in indices],
                [w[0].reshape(params[i].shape).to(d) for i, w, d in zip(indices, wholes, dtypes)],
                [[o.to(d) for o in pieces] for pieces, d in zip(results, dtypes)],
            )

        return observe

    def normalize(self, ctx: StepContext, rnd: MuonRound) -> list[list[Tensor]]:
        """NorMuon / AdaMuon / NAMO normalization of ``rnd.ortho``; the buffer lives in ``state[p]["second_moment"]``.

        It is stored in ``exp_avg_sq_dtype`` (``state_dtypes``) and computed in float32 at least.
        """
        hp = rnd.hp
        method = hp.second_moment
        if method is None:
            return rnd.ortho
        layout = rnd.layout
        buffers = []
        for p in rnd.params:
            buffer = ctx.state[p]["second_moment"]
            expected = second_moment_shape(p.shape, method, layout)
            if tuple(buffer.shape) != expected:
                group = rnd.group
                raise ValueError(
                    f"param group {ctx.group_index(group)} ({group.get('name', group['algorithm'])!r}): a parameter of "
                    f"shape {tuple(p.shape)} has a second-moment buffer of shape {tuple(buffer.shape)} in its state, "
                    f"where second_moment={method!r} keeps {expected}: it was made for another form (one per output "
                    "is second_moment='normuon_rms')"
                )
            buffers.append(buffer)
        beta2, eps = hp.second_moment_beta2, hp.second_moment_eps
        if method == "namo":
            return namo_scale_(rnd.ortho, buffers, rnd.extras.pop("namo"), beta2=beta2, eps=eps, batched=layout.batched)
        return muon_second_moment_(rnd.ortho, buffers, layout=layout, method=method, beta2=beta2, eps=eps)

    def apply_update(self, ctx: StepContext, rnd: MuonRound, extra: float = 1.0) -> None:
        """``W <- decay(W) - lr adjust(fan_out, fan_in) extra_scale_factor extra O`` (``functional.muon_apply_``)."""
        hp = rnd.hp
        muon_apply_(
            rnd.params,
            rnd.ortho,
            layout=rnd.layout,
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            adjust_lr=hp.adjust_lr,
            extra_scale_factor=hp.extra_scale_factor * extra,
            weight_decay_method=hp.weight_decay_method,
        )


def _multi_shapes(
    layout: MatrixLayout, params: list[Tensor], owners: list[int | None] | None, rank: int | None
) -> frozenset[tuple[int, int]]:
    """The ``(short side, long side)`` of matrices this rank orthogonalizes more than one of in this step."""
    if layout.batched:
        return frozenset()
    counts: Counter[tuple[int, int]] = Counter()
    for i, p in enumerate(params):
        if owners is not None and owners[i] is not None and owners[i] != rank:
            continue  # another rank orthogonalizes it
        for rows, cols in layout.piece_shapes(tuple(p.shape)):
            counts[(min(rows, cols), max(rows, cols))] += 1
    return frozenset(shape for shape, count in counts.items() if count > 1)


def matrix_working_bytes(shape: Sequence[int], layout: MatrixLayout, dtype: torch.dtype, work: torch.dtype) -> int:
    """Estimated bytes one parameter of ``shape`` holds during a step: update, result and Newton-Schulz workspace.

    The Nesterov update in the parameter's dtype, the result in the work dtype, and per
    matrix the iterate (``m n``) and the two Gram-sized buffers (``2 k^2``, k the short side).
    """
    numel = math.prod(shape)
    workspace = 0
    for piece in layout.piece_shapes(tuple(shape)):
        *batch, rows, cols = piece
        k = min(rows, cols)
        workspace += math.prod(batch) * (rows * cols + 2 * k * k) * work.itemsize
    return numel * (dtype.itemsize + work.itemsize) + workspace


MUON = register_algorithm(MuonAlgorithm())
