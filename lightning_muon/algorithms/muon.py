r"""``"muon"`` groups: Muon's hyperparameters, their checks, the layout of a group's tensors, and its step.

For a matrix ``W`` with gradient ``G`` (torch.optim.Muon's form, the defaults)::

    B <- mu B + (1 - mu) G                       # EMA momentum ("sum": B <- mu B + G)
    U <- (1 - mu) G + mu B   if nesterov else B
    O <- orthogonalize(U)                        # Newton-Schulz, short side first
    W <- W (1 - lr wd)                           # decoupled decay, base lr
    W <- W - lr * adjust(rows, cols) * extra_scale_factor * O

The step runs in stages, each one place to extend (``MuonAlgorithm``): the momentum
(``muon_momentum_``), the orthogonalization (Newton-Schulz here, or across ranks by an
attached ``Sharding``), a second moment (NorMuon, AdaMuon, NAMO), the update hooks
(``Muon.register_update_hook``), the weight update (``apply_update``) and what follows it
(``after_update``), which variants override (``muon_hyperball``, ``scion``, ``spel``, ...).
The math lives in ``functional``.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_muon.algorithms.base import Algorithm, SettingsSource, StepContext, group_lr, register_algorithm
from lightning_muon.algorithms.checks import check_bool
from lightning_muon.algorithms.families import NewtonSchulzSettings, matmul_precision_of, ns_dtype_for
from lightning_muon.algorithms.settings import setting
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
from lightning_muon.layout import LAYOUT_KEYS, MatrixLayout, layout_of
from lightning_muon.newton_schulz import check_ns_dtype, donated_dtypes, matmul_precision
from lightning_muon.step_memory import matrix_working_bytes, plan_rounds, step_memory_bytes

__all__ = [
    "MUON",
    "MuonAlgorithm",
    "MuonRound",
    "MuonSettings",
    "check_layout",
    "check_muon_params",
    "resolve_split_parts",
]

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
    layout = MatrixLayout(
        batched=bool(group.get("batched")), transposed=bool(group.get("transposed")), blocks=group.get("blocks")
    )
    axes = {layout.out_axis(p.ndim) for p in params if p.ndim >= 2} or {0}
    axis = min(axes)
    sizes = {layout.batch_view_shape(p.shape)[layout.out_axis(p.ndim)] for p in params if p.ndim >= 2}
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


@dataclass(eq=False)
class MuonRound:
    """One round of a Muon group's step (``MuonAlgorithm.step_round``): what its stages read and write.

    ``params``, ``grads`` and ``bufs`` (the momentum buffers) are the round's, in group
    order; ``updates`` (what Newton-Schulz is fed) and ``ortho`` (per parameter its
    orthogonalized pieces, ``MatrixLayout.views``) are filled by the stages; ``extras`` carries
    what a variant's stages hand each other (NAMO's norms).
    """

    params: list[Tensor]
    grads: list[Tensor]
    bufs: list[Tensor]
    cap: int | None = None
    multi_shapes: frozenset[tuple[int, int]] = frozenset()
    updates: list[Tensor] = dataclasses.field(default_factory=list)
    ortho: list[list[Tensor]] = dataclasses.field(default_factory=list)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)


class MuonAlgorithm(Algorithm):
    """Muon: momentum, orthogonalization, an optional second moment, and the update scaled by shape.

    A round of a group's step runs these stages (``step_round``), each a method a variant
    overrides without copying the rest (buffer donation, rounds and sharding stay here)::

        momentum             grads -> updates (EMA or sum, Nesterov; ``momentum_options``)
        before_orthogonalize what needs the updates whole before Newton-Schulz may use them up (NAMO)
        orthogonalize        updates -> ortho (``ns_options``; a sharding across ranks)
        normalize            ortho -> ortho (a second moment)
        apply_update         the weights from ortho (decay, then ``lr * scale * O``)
        after_update         the weights after the update (a projection, a renormalization)

    Variants extend ``hparams``, ``check`` and ``group_defaults`` with their own keys;
    one with keys of other names (Emerging-Optimizers') maps them in ``ns_options`` and
    ``momentum_options``. ``keeps_updates`` says a later stage reads ``round.updates``, which
    Newton-Schulz must then not overwrite.
    """

    name = "muon"
    settings = MuonSettings
    orthogonalizes = True
    per_matrix = True
    layout_options = MUON_LAYOUT
    state_dtype_settings = frozenset(STATE_SETTINGS)

    def check(self, values: dict[str, Any], where: str) -> dict[str, Any]:
        check_layout(values, where)
        return super().check(values, where)

    def group_defaults(self, config: SettingsSource) -> dict[str, Any]:
        return {
            **config.settings_of(self.name).asdict(),
            "split_sizes": None,
            "batched": False,
            "transposed": False,
            "blocks": None,
        }

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        resolve_split_parts(group, params, where)
        check_muon_params(group, params, where)

    # ------------------------------------------------------------------ what the stages read

    def ns_options(self, group: dict) -> dict[str, Any]:
        """``muon_orthogonalize``'s Newton-Schulz keywords for this group."""
        return {
            "ns_steps": group["ns_steps"],
            "ns_coefficients": group["ns_coefficients"],
            "ns_dtype": ns_dtype_for(group),
            "ns_method": group["ns_method"],
            "ns_eps": group.get("ns_eps"),  # absent from a group pickled before it existed: the schedule's own
        }

    def work_dtype(self, group: dict) -> torch.dtype | None:
        """The dtype the group's per-matrix work runs in, for the rounds' memory estimate (None: automatic)."""
        return check_ns_dtype(self.ns_options(group)["ns_dtype"])

    def donation_dtypes(
        self, group: dict, matrices: list[Tensor], multi_shapes: frozenset[tuple[int, int]]
    ) -> list[torch.dtype]:
        """Per matrix, the dtype to make a donated update in (``newton_schulz.donated_dtypes``)."""
        ns = self.ns_options(group)
        return donated_dtypes(matrices, ns["ns_dtype"], ns["ns_method"], multi_shapes)

    def momentum_options(self, group: dict) -> tuple[float, bool, str]:
        """``(momentum, nesterov, momentum_form)`` of this group."""
        return group["momentum"], group["nesterov"], group.get("momentum_form", "ema")  # a variant's: EMA

    def second_moment_method(self, group: dict) -> str | None:
        """The group's second moment (``SECOND_MOMENTS``), or None; its decay and eps: ``second_moment_options``."""
        return group.get("second_moment")  # a variant without the setting has none

    def second_moment_options(self, group: dict) -> tuple[float, float]:
        """``(beta2, eps)`` of the group's second moment."""
        return group["second_moment_beta2"], group["second_moment_eps"]

    def update_scale(self, group: dict, fan_out: int, fan_in: int) -> float:
        """The factor on a ``fan_out x fan_in`` orthogonalized piece before the lr, as the update hooks see it."""
        adjust = group["adjust_lr"]
        return adjust_lr_ratio(
            "none" if adjust == "nuclear_norm" else adjust, fan_out, fan_in, group["extra_scale_factor"]
        )

    def keeps_updates(self, group: dict) -> bool:
        """True when a stage after Newton-Schulz reads ``round.updates`` (no buffer donation then)."""
        return False

    # ------------------------------------------------------------------ the step

    def step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        # fp32_matmul_prec: torch's float32 matmul precision for the step, on a GPU (a CPU's float32 is exact).
        with matmul_precision(matmul_precision_of(group), params[0].device):
            self._step_group(ctx, group, params, grads)

    def _step_group(self, ctx: StepContext, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        state = ctx.state
        bufs = []
        for p in params:
            entry = state[p]
            if "momentum_buffer" not in entry:
                dtype = state_dtype(ctx, "exp_avg_dtype", p)  # exp_avg_dtype: stored narrower
                entry["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            bufs.append(entry["momentum_buffer"])
        # In rounds that fit the step's memory cap (``step_memory``): each round makes its
        # updates, orthogonalizes them and updates its weights before the next one starts.
        cap = step_memory_bytes(ctx.config.state.step_memory_mb, params[0].device)
        sharding = ctx.sharding
        # Who orthogonalizes each parameter (None: this rank, every one it steps).
        owners = sharding.round_owners(group, params) if sharding is not None else None
        multi = self.multi_shapes(group, params, owners, None if sharding is None else sharding.rank)
        world = 1 if sharding is None else sharding.world_size
        for idx in self.rounds(group, params, cap, owners, world):
            rnd = MuonRound([params[i] for i in idx], [grads[i] for i in idx], [bufs[i] for i in idx], cap, multi)
            self.step_round(ctx, group, rnd)

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
        ns_dtype = self.work_dtype(group)
        costs, kinds = [], []
        for p in params:
            work = ns_dtype if ns_dtype is not None else torch.promote_types(p.dtype, torch.float32)
            costs.append(matrix_working_bytes(p.shape, layout, p.dtype, work))
            kinds.append((tuple(layout.piece_shapes(tuple(p.shape))), str(p.dtype)))
        return plan_rounds(costs, kinds, cap, owners, world)

    def step_round(self, ctx: StepContext, group: dict, rnd: MuonRound) -> None:
        """One round of the group's step: the stages in order (class docstring)."""
        sharding = ctx.sharding
        # Without a hook, a sharding or a later stage to hand the momentum to, the Nesterov
        # update is a temporary that Newton-Schulz may use up, made in the dtype
        # ``donated_dtypes`` names (the cast folded into the momentum kernel). Splits and
        # batches keep theirs: their pieces are cut and copied first.
        hooks = ctx.has_update_hooks
        _, nesterov, _ = self.momentum_options(group)
        donate = nesterov and not hooks and sharding is None and not self.keeps_updates(group)
        out_dtypes = None
        layout = layout_of(group)
        if donate and layout.split_sizes is None and not layout.batched:
            flat = [g.reshape(g.shape[0], -1) for g in rnd.grads]  # the matrices Newton-Schulz will see
            out_dtypes = self.donation_dtypes(group, flat, rnd.multi_shapes)
        rnd.updates = self.momentum(ctx, group, rnd, out_dtypes)
        self.before_orthogonalize(ctx, group, rnd)
        observed = list(rnd.updates) if hooks else None  # the hooks' view (no hooks: no donation either)
        rnd.ortho = self.orthogonalize(ctx, group, rnd, donate=donate)
        rnd.ortho = self.normalize(ctx, group, rnd)
        # A sharding that holds the full matrices only on owner ranks runs the hooks itself.
        if observed is not None and (sharding is None or not sharding.observes_updates):
            ctx.run_update_hooks(group, rnd.params, observed, rnd.ortho)
        del observed
        self.apply_update(ctx, group, rnd)
        self.after_update(ctx, group, rnd)

    # ------------------------------------------------------------------ the stages

    def momentum(
        self, ctx: StepContext, group: dict, rnd: MuonRound, out_dtypes: list[torch.dtype] | None = None
    ) -> list[Tensor]:
        """The updates Newton-Schulz is fed, from the gradients; the momentum buffers advance in place.

        ``weight_decay_method="l2"``: the decay joins the gradient the momentum sees, ``G + wd W`` (a copy:
        the user's ``.grad`` stays what backward made).
        """
        if group["weight_decay_method"] == "l2" and group["weight_decay"] != 0.0:
            rnd.grads = torch._foreach_add(rnd.grads, rnd.params, alpha=group["weight_decay"])
        momentum, nesterov, form = self.momentum_options(group)
        updates = muon_momentum_(rnd.grads, rnd.bufs, momentum, nesterov, form, out_dtypes=out_dtypes)
        if group.get("sign_momentum"):
            updates = list(torch._foreach_sign(updates))
        return updates

    def before_orthogonalize(self, ctx: StepContext, group: dict, rnd: MuonRound) -> None:
        """What must read the updates before Newton-Schulz may use them up: NAMO's norms (``rnd.extras``)."""
        if self.second_moment_method(group) != "namo":
            return
        layout = layout_of(group)
        sharding = ctx.sharding
        sums = namo_norms(rnd.grads, rnd.updates, layout, ctx.local_shard)  # (K, 2) this rank's part
        if sharding is not None:
            sums = sharding.reduce_matrix_sums(rnd.params, sums, layout)  # whole matrices (as they are where whole)
        rnd.extras["namo"] = sums

    def orthogonalize(self, ctx: StepContext, group: dict, rnd: MuonRound, donate: bool = False) -> list[list[Tensor]]:
        """Per update, its orthogonalized pieces (``MatrixLayout.views``); a sharding does it across ranks."""
        return self.orthogonalize_tensors(ctx, group, rnd.params, rnd.updates, rnd.cap, rnd.multi_shapes, donate)

    def orthogonalize_tensors(
        self,
        ctx: StepContext,
        group: dict,
        params: list[Tensor],
        tensors: list[Tensor],
        cap: int | None = None,
        multi_shapes: frozenset[tuple[int, int]] = frozenset(),
        donate: bool = False,
        observe: bool = True,
    ) -> list[list[Tensor]]:
        """``tensors`` (one per parameter of ``params``) orthogonalized with the group's settings, across ranks too.

        The primitive of ``orthogonalize``, also for a stage that orthogonalizes something else
        (a weight projected back onto its manifold; ``observe=False`` then keeps the update
        hooks out): a sharding runs Newton-Schulz where each matrix is whole
        (``Sharding.orthogonalize``, a ``map_whole``) and returns this rank's part of the
        result. A DTensor result (FSDP2) is this rank's rows of it.
        """
        kwargs = dict(
            layout=layout_of(group),
            **self.ns_options(group),
            max_stack_bytes=cap,
            multi_shapes=multi_shapes,
        )
        sharding = ctx.sharding
        if sharding is not None:
            return sharding.orthogonalize(params, tensors, observe=observe, **kwargs)
        # Pieces stay in Newton-Schulz's dtype: muon_apply_ adds them into the parameters in one pass.
        return muon_orthogonalize(tensors, **kwargs, keep_work_dtype=True, donate=donate)

    def map_tensors(
        self,
        ctx: StepContext,
        group: dict,
        params: list[Tensor],
        tensors: list[Tensor],
        fn: Callable[[Tensor], Tensor],
        donate: bool = False,
        observe: bool = True,
    ) -> list[list[Tensor]]:
        """``fn`` on every matrix of ``tensors`` (one per parameter of ``params``), each whole, across ranks too.

        For per-matrix work that is not Newton-Schulz (MOP's polar factor by SVD, Sinkhorn-Knopp
        on a weight): ``fn`` takes one stored ``(rows, cols)`` matrix in float32 at least and
        returns its result (``functional.map_matrices``). A sharding runs it where each matrix
        is whole (``Sharding.map_whole``); ``observe`` as in ``orthogonalize_tensors``.
        """
        layout = layout_of(group)
        sharding = ctx.sharding
        if sharding is None:
            return map_matrices(tensors, fn, layout=layout, donate=donate)

        def work(indices: list[int], wholes: list[list[Tensor]]) -> list[list[Tensor]]:
            return map_matrices([w[0] for w in wholes], fn, layout=layout)

        observer = sharding.update_observer(params, tensors) if observe else None
        return sharding.map_whole(params, [[t] for t in tensors], work, layout=layout, observe=observer)

    def normalize(self, ctx: StepContext, group: dict, rnd: MuonRound) -> list[list[Tensor]]:
        """NorMuon / AdaMuon / NAMO normalization of ``rnd.ortho``; the buffer lives in ``state[p]["second_moment"]``.

        It is stored in ``ctx.config.state.exp_avg_sq_dtype`` (``state_dtypes``) and computed in
        float32 at least.
        """
        method = self.second_moment_method(group)
        if method is None:
            return rnd.ortho
        layout = layout_of(group)
        buffers = []
        for p in rnd.params:
            entry = ctx.state[p]
            if "second_moment" not in entry:
                dtype = state_dtype(ctx, "exp_avg_sq_dtype", p)
                entry["second_moment"] = second_moment_buffer(p, method, layout, dtype=dtype)
            buffer = entry["second_moment"]
            expected = second_moment_shape(p.shape, method, layout)
            if tuple(buffer.shape) != expected:
                raise ValueError(
                    f"param group {ctx.group_index(group)} ({group.get('name', group['algorithm'])!r}): a parameter of "
                    f"shape {tuple(p.shape)} has a second-moment buffer of shape {tuple(buffer.shape)} in its state, "
                    f"where second_moment={method!r} keeps {expected}: it was made for another form (one per output "
                    "is second_moment='normuon_rms')"
                )
            buffers.append(buffer)
        beta2, eps = self.second_moment_options(group)
        if method == "namo":
            return namo_scale_(rnd.ortho, buffers, rnd.extras.pop("namo"), beta2=beta2, eps=eps, batched=layout.batched)
        return muon_second_moment_(rnd.ortho, buffers, layout=layout, method=method, beta2=beta2, eps=eps)

    def apply_update(self, ctx: StepContext, group: dict, rnd: MuonRound) -> None:
        """The weight update from the orthogonalized pieces: decay, then ``lr * adjust(shape) * O``."""
        self.apply(rnd.params, rnd.ortho, group)

    def apply(self, params: list[Tensor], ortho: list[list[Tensor]], group: dict, extra: float = 1.0) -> None:
        """``W <- decay(W) - lr adjust(fan_out, fan_in) extra_scale_factor extra O`` (``functional.muon_apply_``)."""
        adjust = group["adjust_lr"]
        muon_apply_(
            params,
            ortho,
            layout=layout_of(group),
            lr=group_lr(group),
            weight_decay=group["weight_decay"],
            adjust_lr="none" if adjust == "nuclear_norm" else adjust,  # MOP's: applied in its normalize
            extra_scale_factor=group["extra_scale_factor"] * extra,
            weight_decay_method=group["weight_decay_method"],
        )

    def after_update(self, ctx: StepContext, group: dict, rnd: MuonRound) -> None:
        """After the weights moved (a no-op here): a variant projects them back onto its set."""


MUON = register_algorithm(MuonAlgorithm())
