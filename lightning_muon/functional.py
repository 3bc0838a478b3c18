"""The math several algorithms share: Muon momentum (EMA or sum), Newton-Schulz over layouts, second moments
(NorMuon, AdaMuon, NAMO), apply (decoupled or cautious weight decay, the scale by shape), and the widening of
narrow state.

The math of one algorithm alone lives as pure functions beside it, in its module (AdamW's in
``algorithms/adamw.py``, Lion's, LaProp's, PolarGrad's, Sinkhorn-Knopp, Hyperball's, SOAP's in
``algorithms/soap_math.py``). The algorithm classes collect tensors and state; these functions do
the math on lists of tensors with ``torch._foreach_*`` kernels, and the distributed strategies
reuse them on whatever matrices their rank owns.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Collection, Sequence
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_muon.layout import MatrixLayout
from lightning_muon.newton_schulz import NSPlan, orthogonalize_many

__all__ = [
    "ADJUST_LR_MODES",
    "MOMENTUM_FORMS",
    "SECOND_MOMENTS",
    "WEIGHT_DECAY_FACTORS",
    "MomentumForm",
    "SecondMoment",
    "adjust_lr_ratio",
    "all_finite",
    "decay_weights_",
    "foreach_pays",
    "is_narrower",
    "map_matrices",
    "muon_apply_",
    "muon_momentum_",
    "muon_orthogonalize",
    "muon_second_moment_",
    "namo_norms",
    "namo_scale_",
    "second_moment_buffer",
    "second_moment_shape",
    "stat_axis",
    "store_widened",
    "widened",
    "widening_chunks",
]

# EMA: B <- mu B + (1 - mu) G (torch.optim.Muon, Keller Jordan); sum: B <- mu B + G (Moonlight, dion).
MomentumForm = Literal["ema", "sum"]
MOMENTUM_FORMS: tuple[str, ...] = typing.get_args(MomentumForm)
# The factor f of a weight decay W <- W - f W, by weight_decay_method (Emerging-Optimizers' WeightDecayMixin,
# and cautious decay, arXiv 2510.12402, decoupled where the update and W agree in sign). "l2" decays through
# the gradient instead (g + wd W), before the momentum: no factor here.
WEIGHT_DECAY_FACTORS = {
    "decoupled": lambda lr, wd: lr * wd,
    "independent": lambda lr, wd: wd,
    "palm": lambda lr, wd: lr * lr * wd,
    "cautious": lambda lr, wd: lr * wd,
    "l2": lambda lr, wd: 0.0,
}
# Second moments of the orthogonalized update, per row or column (NorMuon), per element (AdaMuon) or per
# matrix (NAMO): Emerging-Optimizers' (Megatron-Core's) forms, then ours that keep plain Muon's RMS
# (``muon_second_moment_``).
SecondMoment = Literal["normuon", "adamuon", "namo", "normuon_rms", "adamuon_rms"]
SECOND_MOMENTS: tuple[str, ...] = typing.get_args(SecondMoment)

# Update scale per matrix shape (rows, cols), times ``extra_scale_factor``.
ADJUST_LR_MODES = {
    # Keller Jordan / torch.optim.Muon: keep the RMS-to-RMS operator norm per unit lr.
    "original": lambda r, c: math.sqrt(max(1.0, r / c)),
    # Moonlight (Liu et al. 2025, arXiv 2502.16982): match AdamW's update RMS of ~0.2.
    "match_rms_adamw": lambda r, c: 0.2 * math.sqrt(max(r, c)),
    # Megatron's "spectral": sqrt(max(r, c)); with extra_scale_factor 0.2 it is Moonlight's.
    "spectral": lambda r, c: math.sqrt(max(r, c)),
    # Unit RMS-to-RMS spectral norm (Bernstein & Newhouse 2024): sqrt(fan_out / fan_in).
    "spectral_norm": lambda r, c: math.sqrt(r / c),
    "none": lambda r, c: 1.0,
}


def adjust_lr_ratio(mode: str, fan_out: int, fan_in: int, extra_scale_factor: float = 1.0) -> float:
    """The factor multiplying the Muon lr for a fan_out x fan_in matrix (``MatrixLayout.fans`` of a stored one)."""
    return ADJUST_LR_MODES[mode](fan_out, fan_in) * extra_scale_factor


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """True when no tensor holds a NaN or an inf; one host sync.

    One foreach reduction over every tensor (their 2-norms, each in its tensor's dtype: a NaN or
    an inf anywhere makes its tensor's norm non-finite), then one check of the norms. A norm
    can also overflow from finite entries (magnitudes near 1e19 in float32 or bf16, 256 in
    float16); only then each tensor is checked exactly (``isfinite``), so the answer is exact
    either way.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    norms = torch._foreach_norm(tensors, 2)
    if bool(torch.stack(norms).isfinite().all()):
        return True
    return all(bool(t.isfinite().all()) for t in tensors)


def muon_momentum_(
    grads: list[Tensor],
    bufs: list[Tensor],
    momentum: float,
    nesterov: bool,
    form: str = "ema",
    out_dtypes: Sequence[torch.dtype] | None = None,
) -> list[Tensor]:
    """Update the momentum buffers in place; returns the tensors to orthogonalize.

    - ``"ema"`` (torch.optim.Muon): ``B <- mu B + (1 - mu) G``; with Nesterov the update is
      ``(1 - mu) G + mu B`` (``G.lerp(B, mu)``), else ``B``.
    - ``"sum"`` (Moonlight, dion): ``B <- mu B + G``; with Nesterov ``G + mu B``, else ``B``.
      ``B`` is ``1 / (1 - mu)`` times larger than the EMA in steady state, which the
      orthogonalization (and a second moment's rescale) removes; only the relative weight
      of the current gradient in the Nesterov update differs (1 against ``1 - mu``).

    ``out_dtypes``: with Nesterov, each update is written as a new contiguous tensor of that
    dtype (the one Newton-Schulz runs in): the kernel computes in the inputs' dtype and rounds
    once on the way out, the same values as a cast afterwards, without the second full-size
    pass. Such updates are the caller's temporaries (``orthogonalize_many(donate=True)``).

    A buffer stored narrower than its gradient (``exp_avg_dtype="bfloat16"``) is read into
    the gradient's dtype, updated and used there (the update is made from the unrounded
    buffer), and rounded once on its way back (``widened``, ``store_widened``).
    """
    if is_narrower(bufs, grads):
        updates: list[Tensor] = []
        for part in widening_chunks(grads):
            work = widened(bufs[part], grads[part])
            dtypes = None if out_dtypes is None else out_dtypes[part]
            updates += muon_momentum_(grads[part], work, momentum, nesterov, form, out_dtypes=dtypes)
            store_widened(bufs[part], work)
        return updates
    if form == "sum":
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads)
    else:
        torch._foreach_lerp_(bufs, grads, 1.0 - momentum)
    if not nesterov:
        return list(bufs)
    if out_dtypes is not None and any(d != g.dtype for g, d in zip(grads, out_dtypes)):
        outs = [torch.empty_like(g, dtype=d, memory_format=torch.contiguous_format) for g, d in zip(grads, out_dtypes)]
        for g, b, out in zip(grads, bufs, outs):
            if form == "sum":
                torch.add(g, b, alpha=momentum, out=out)
            else:
                torch.lerp(g, b, momentum, out=out)
        return outs
    # Out-of-place foreach ops run at half the speed of a loop on CPU (measured: 29 ms against
    # 14 ms for the Nesterov lerp of a d=384 x 6 GPT's matrices on 2 cores), so the update is
    # made tensor by tensor there; CUDA's foreach kernels batch the launches.
    if grads and not foreach_pays(grads[0]):
        if form == "sum":
            return [g.add(b, alpha=momentum) for g, b in zip(grads, bufs)]
        return [g.lerp(b, momentum) for g, b in zip(grads, bufs)]
    if form == "sum":
        return list(torch._foreach_add(grads, bufs, alpha=momentum))
    return list(torch._foreach_lerp(grads, bufs, momentum))


def foreach_pays(t: Tensor) -> bool:
    """Whether an out-of-place foreach op beats a loop over tensors like ``t``: on a GPU, for plain tensors.

    DTensors go tensor by tensor: torch 2.11 registers no sharding rule for the out-of-place
    ``_foreach_lerp`` (FSDP2's gradients and buffers on a GPU failed there), and the loop is
    what every version supports.
    """
    return t.device.type != "cpu" and not isinstance(t, DTensor)


# Elements per round of a narrow state's wider copies (64 MiB per buffer in float32): the
# copies of a whole model's state at once would cost more than the narrow storage saves.
_WIDEN_ELEMENTS = 1 << 24


def is_narrower(bufs: Sequence[Tensor], like: Sequence[Tensor]) -> bool:
    """Whether a buffer is stored in another dtype than its partner in ``like`` (a narrower state dtype)."""
    return any(b.dtype != t.dtype for b, t in zip(bufs, like))


def widening_chunks(tensors: Sequence[Tensor]) -> list[slice]:
    """Consecutive slices of ``tensors`` of at most ``_WIDEN_ELEMENTS`` elements each (one tensor at least): the
    parts a step over narrow state (bf16 moments, bf16 parameters) widens to float32 one at a time."""
    out, start, total = [], 0, 0
    for i, t in enumerate(tensors):
        if i > start and total + t.numel() > _WIDEN_ELEMENTS:
            out.append(slice(start, i))
            start, total = i, 0
        total += t.numel()
    if start < len(tensors):
        out.append(slice(start, len(tensors)))
    return out


def widened(bufs: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
    """Each buffer in its partner's dtype: a copy where it is stored in another one, else itself."""
    return [b if b.dtype == t.dtype else b.to(t.dtype) for b, t in zip(bufs, like)]


def store_widened(bufs: Sequence[Tensor], work: Sequence[Tensor]) -> None:
    """Write the wider copies back into their buffers, rounding once (round to nearest even)."""
    for b, w in zip(bufs, work):
        if w is not b:
            b.copy_(w)


def muon_orthogonalize(
    updates: list[Tensor],
    *,
    layout: MatrixLayout,
    ns_steps: int,
    ns_coefficients,
    ns_dtype,
    ns_method: str = "standard",
    ns_eps: float | None = None,
    keep_work_dtype: bool = False,
    donate: bool = False,
    max_stack_bytes: int | None = None,
    multi_shapes: Collection[tuple[int, int]] = (),
    plan: NSPlan | None = None,
) -> list[list[Tensor]]:
    """Orthogonalize every matrix of every update (cut by ``layout``); returns, per update, its pieces.

    ``ns_steps``, ``ns_coefficients``, ``ns_dtype``, ``ns_method``, ``ns_eps``: Newton-Schulz's
    settings, as a group holds them (``orthogonalize_many``'s ``steps``, ...). ``plan``:
    Newton-Schulz's plan of the pieces, made by the caller from the same shapes
    (``plan_matrices``); None: made here. ``keep_work_dtype``: leave the
    pieces in Newton-Schulz's dtype (see ``orthogonalize_many``). ``max_stack_bytes``,
    ``multi_shapes``: how stacks are cut, and the shapes the step's other calls hold more of.
    ``donate``: the updates are temporaries Newton-Schulz may overwrite (see
    ``muon_momentum_``); the list ``updates`` is emptied, so that each is freed as soon as it is
    orthogonalized.
    """
    pieces = [layout.views(u.contiguous()) for u in updates]
    counts = [len(ms) for ms in pieces]
    flat = [m for ms in pieces for m in ms]
    if donate:
        # ``flat`` keeps the only references, which Newton-Schulz drops one by one: each
        # temporary is freed once its result exists, and its memory serves the next matrix
        # (otherwise every update stays alive to the end of the step: a second bf16 copy of
        # the hidden matrices at the step's peak).
        updates.clear()
        del pieces
    ortho = iter(
        orthogonalize_many(
            flat,
            ns_steps,
            ns_coefficients,
            ns_dtype,
            ns_method,
            keep_work_dtype=keep_work_dtype,
            donate=donate,
            max_stack_bytes=max_stack_bytes,
            multi_shapes=multi_shapes,
            eps=ns_eps,
            plan=plan,
        )
    )
    return [[next(ortho) for _ in range(n)] for n in counts]


def map_matrices(
    updates: list[Tensor], fn: Callable[[Tensor], Tensor], *, layout: MatrixLayout, donate: bool = False
) -> list[list[Tensor]]:
    """``fn`` on every matrix of every update (cut by ``layout``); returns, per update, its pieces in float32 at least.

    ``muon_orthogonalize``'s counterpart for per-matrix work that is not the Newton-Schulz
    iteration (MOP's polar factor by SVD, Sinkhorn-Knopp on a weight): ``fn`` takes one
    ``(rows, cols)`` matrix as stored, in float32 or float64, and returns its result of that
    shape; each matrix of a batch is mapped on its own. ``donate``: the updates are
    temporaries, released as they are read (the list ``updates`` is emptied).
    """
    pieces = [layout.views(u.contiguous()) for u in updates]
    counts = [len(ms) for ms in pieces]
    flat: list[Tensor | None] = [m for ms in pieces for m in ms]
    if donate:
        updates.clear()
        del pieces
    out = []
    for i in range(len(flat)):
        M = flat[i]
        X = M.to(torch.promote_types(M.dtype, torch.float32))  # (..., rows, cols)
        if X.ndim == 2:
            out.append(fn(X))
        else:  # each matrix of the batch
            batch = X.reshape(-1, *X.shape[-2:])
            out.append(torch.stack([fn(x) for x in batch]).reshape(X.shape) if batch.shape[0] else X.clone())
        if donate:
            flat[i] = None  # released: its memory can serve the next matrix
        del M, X
    results = iter(out)
    return [[next(results) for _ in range(n)] for n in counts]


def stat_axis(method: str, layout: MatrixLayout, shape: Sequence[int]) -> int:
    """The axis of every piece of a ``shape`` tensor that a NorMuon statistic averages over.

    ``"normuon_rms"``: the inputs (``layout.in_axis``), one statistic per output.
    ``"normuon"`` (Emerging-Optimizers): the matrix's longer axis as stored, its columns when
    it is square (``-1`` if rows >= cols, else ``-2``). A split tensor (fused QKV, gate/up),
    which Emerging-Optimizers does not cut, keeps one statistic per output: its pieces may
    differ in shape, and its buffer is cut by outputs.
    """
    if method != "normuon" or layout.split_sizes is not None:
        return layout.in_axis
    rows, cols = layout.matrix_shapes(shape)[0]  # every matrix of a batch has one shape
    return -1 if rows >= cols else -2


def second_moment_shape(shape: Sequence[int], method: str, layout: MatrixLayout) -> tuple[int, ...]:
    """The shape of ``second_moment_buffer`` for a parameter of ``shape`` (without making it)."""
    shape = tuple(shape)
    if method in ("adamuon", "adamuon_rms"):
        return shape
    if method == "namo":
        return layout.batch_shape(shape)
    m = list(layout.batch_view_shape(shape))
    m[stat_axis(method, layout, shape)] = 1
    return tuple(m)


def second_moment_buffer(p: Tensor, method: str, layout: MatrixLayout, dtype: torch.dtype | None = None) -> Tensor:
    """A zero second-moment buffer for parameter ``p``, made from ``p`` (a DTensor gives a DTensor), in ``p``'s
    dtype or ``dtype``.

    ``"adamuon"``, ``"adamuon_rms"``: shaped like ``p``. ``"normuon"``, ``"normuon_rms"``:
    shaped like ``p`` with every matrix's ``stat_axis`` reduced to 1: ``(rows, 1)`` for a
    ``(dim 0, rest)`` matrix averaged over its inputs, ``(1, cols)`` over its rows,
    ``(..., rows, 1)`` or ``(..., 1, cols)`` for a batch. With ``split_sizes`` every piece owns
    its outputs of the same buffer (``layout.slots(buffer)``), so one plain tensor per
    parameter serves fused QKV and fused gate/up too, and a row shard of an ``(out, in)``
    ``p`` (FSDP2, dim 0) holds the rows of the buffer it needs. ``"namo"``: one value per
    matrix of a batch (``p``'s batch shape), else a plain scalar per parameter, replicated on
    every rank (its norms span the whole parameter).
    """
    if method in ("adamuon", "adamuon_rms"):
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
    if method == "namo":
        if layout.batched:
            return torch.zeros_like(layout.as_batch(p)[..., 0, 0], dtype=dtype, memory_format=torch.contiguous_format)
        return torch.zeros((), dtype=dtype or p.dtype, device=p.device)
    m = layout.as_batch(p)
    first = m[..., :1, :] if stat_axis(method, layout, p.shape) == -2 else m[..., :1]
    return torch.zeros_like(first, dtype=dtype, memory_format=torch.contiguous_format)


def muon_second_moment_(
    ortho: list[list[Tensor]],
    buffers: list[Tensor],
    *,
    layout: MatrixLayout,
    method: str,
    beta2: float,
    eps: float,
) -> list[list[Tensor]]:
    """Normalize orthogonalized pieces by a second moment; returns the new pieces (``"namo"``: ``namo_scale_``).

    For each matrix ``O`` (buffers updated in place), Emerging-Optimizers' forms (Megatron-Core's
    ``adaptive_muon``)::

        "adamuon":  v <- beta2 v + (1 - beta2) O * O               # one v per element
                    O_hat <- O / (sqrt(v) + eps)
        "normuon":  v <- beta2 v + (1 - beta2) mean_long(O * O)    # one v per row or column
                    O_hat <- O * rsqrt(max(v, eps))
                    O_hat <- O_hat * ||O||_F / max(||O_hat||_F, eps)

    ``mean_long`` averages over the matrix's longer axis (its columns when square), and
    ``adamuon`` is not rescaled: its update grows as ``v`` is small (early steps, without
    bias correction). Ours keep plain Muon's size::

        "normuon_rms":  v <- beta2 v + (1 - beta2) mean_in(O * O)   # one v per output
        "adamuon_rms":  v <- beta2 v + (1 - beta2) O * O
                        O_hat <- O / (sqrt(v) + eps)
                        O_hat <- O_hat * ||O||_F / ||O_hat||_F

    ``mean_in`` averages over each matrix's inputs (its columns, or its rows when the
    layout is transposed), so a stored transpose gets the statistics of the ``nn.Linear``
    it stands for. The last line makes the update's Frobenius norm (and RMS) exactly plain
    Muon's, so a Muon lr (and ``adjust_lr``) carries over unchanged; no bias correction is
    needed, the rescale removes it. Both papers rescale to an RMS of 0.2 instead
    (``0.2 sqrt(m n) / ||O_hat||_F``): with ``adjust_lr="match_rms_adamw"`` the ``_rms`` forms
    equal that times ``||O||_F / sqrt(min(m, n))``, which is 1 for an exact polar factor. Each
    matrix is rescaled alone: every piece of a split, every matrix of a batch. The statistics
    are per output, per row or column, or per element; only the two norms span a matrix.

    References:
        Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable",
        arXiv 2510.05491, 2025.
        Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv 2507.11005, 2025.
        NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``AdaptiveMuon`` (``moment2_method``).
    """
    out = []
    elementwise = method in ("adamuon", "adamuon_rms")
    for pieces, buf in zip(ortho, buffers):
        normalized = []
        for o, slot in zip(pieces, layout.slots(buf)):
            axis = stat_axis(method, layout, o.shape)  # the axis the buffer was made for
            # Statistics in float32 at least: squares of bf16 entries lose digits.
            work = torch.promote_types(o.dtype, torch.float32)
            x = o.to(work)  # (B?, rows, cols)
            if elementwise:
                v_shape = x.shape
            else:
                v_shape = list(x.shape)
                v_shape[axis] = 1
            v = slot.reshape(v_shape)
            sq = x.square()
            stat = sq if elementwise else sq.mean(dim=axis, keepdim=True)
            if v.dtype.itemsize < work.itemsize:
                # Stored narrower (exp_avg_sq_dtype="bfloat16", a bf16 parameter): updated and
                # used in the work dtype, rounded once into the buffer.
                v = v.to(work).lerp_(stat, 1.0 - beta2)
                slot.copy_(v.view(slot.shape))
            else:
                v.lerp_(stat.to(v.dtype), 1.0 - beta2)
                if v.data_ptr() != slot.data_ptr():
                    slot.copy_(v.view(slot.shape))  # a grouped split's slot is strided: write the copy back
            v = v.to(work)
            if method == "normuon":
                x_hat = x * v.clamp_min(eps).rsqrt()
            else:
                x_hat = x / v.sqrt().add_(eps)
            if method != "adamuon":
                dims = (-2, -1)  # one norm per matrix: each of a batch, each piece of a split
                floor = eps if method == "normuon" else torch.finfo(work).tiny  # a zero update stays zero
                ratio = torch.linalg.vector_norm(x, dim=dims, keepdim=True) / torch.linalg.vector_norm(
                    x_hat, dim=dims, keepdim=True
                ).clamp_min(floor)
                x_hat = x_hat.mul_(ratio)
            # Kept in the work dtype (float32 at least): a bf16 piece is not rounded twice.
            normalized.append(x_hat)
        out.append(normalized)
    return out


def namo_norms(
    grads: list[Tensor], updates: list[Tensor], layout: MatrixLayout, local: Callable[[Tensor], Tensor]
) -> Tensor:
    """Per parameter ``[||G||^2, ||U||^2]`` over this rank's part of it, in float64 (``(K, 2)``); NAMO's inputs.

    ``G`` is the raw gradient, ``U`` the update Newton-Schulz is fed. A batch gives one row
    per matrix instead, flattened over the parameters' batches (``(sum B, 2)``): whole
    matrices are local under every sharding, so those need no reduction.
    """
    rows = []
    for g, u in zip(grads, updates):
        g, u = local(g), local(u)
        work = torch.promote_types(g.dtype, torch.float32)
        if layout.batched:
            dims = (-2, -1)
            gg = layout.as_batch(g).to(work).square().sum(dim=dims).reshape(-1)
            uu = layout.as_batch(u).to(work).square().sum(dim=dims).reshape(-1)
            rows.append(torch.stack([gg, uu], dim=1))
        else:
            gg = torch.linalg.vector_norm(g, dtype=work).square()
            uu = torch.linalg.vector_norm(u, dtype=work).square()
            rows.append(torch.stack([gg, uu]).unsqueeze(0))
    return torch.cat(rows).to(torch.float64)


def namo_scale_(
    ortho: list[list[Tensor]], buffers: list[Tensor], sums: Tensor, *, beta2: float, eps: float, batched: bool
) -> list[list[Tensor]]:
    """NAMO: every matrix's ``O`` times ``alpha = ||U||_F / (sqrt(v) + eps)``, ``v <- beta2 v + (1 - beta2) ||G||_F^2``.

    ``sums`` are ``namo_norms``'s whole-matrix ``[||G||^2, ||U||^2]`` rows (reduced over
    ranks where a matrix is split); ``buffers`` the EMAs ``v`` (updated in place). The scale
    is a scalar per parameter (per matrix of a batch), as Emerging-Optimizers takes it.

    References:
        NAMO, arXiv 2602.17080; NVIDIA-NeMo Emerging-Optimizers 0.3.0, ``AdaptiveMuon``.
    """
    out, row = [], 0
    for pieces, buf in zip(ortho, buffers):
        n = buf.numel() if batched else 1
        gg, uu = sums[row : row + n, 0], sums[row : row + n, 1]
        row += n
        local = buf.to_local() if isinstance(buf, DTensor) else buf  # a batch's experts on this rank
        work = torch.promote_types(local.dtype, torch.float32)
        v = local.to(work).reshape(-1).lerp_(gg.to(device=local.device, dtype=work), 1.0 - beta2)  # (n,)
        local.copy_(v.view(local.shape))
        alpha = uu.to(device=local.device, dtype=work).sqrt() / (v.sqrt() + eps)  # (n,)
        scaled = []
        for o in pieces:
            if not batched:
                scaled.append(o.to(torch.promote_types(o.dtype, torch.float32)) * float(alpha))
                continue
            x = o.to_local() if isinstance(o, DTensor) else o  # (B_local, rows, cols)
            x = x.to(torch.promote_types(x.dtype, torch.float32)) * alpha.view(*x.shape[:-2], 1, 1)
            if isinstance(o, DTensor):
                x = DTensor.from_local(
                    x, o.device_mesh, o.placements, run_check=False, shape=o.shape, stride=o.stride()
                )
            scaled.append(x)
        out.append(scaled)
    return out


def decay_weights_(
    params: list[Tensor], lr: float, weight_decay: float, method: str, *, multiply_decoupled: bool = True
) -> None:
    """``W <- W - f W`` with ``f = WEIGHT_DECAY_FACTORS[method](lr, weight_decay)`` (none for "l2", "cautious").

    "decoupled" multiplies by ``1 - f``, as torch's AdamW and Muon do (``multiply_decoupled=False``:
    adds ``-f W``, as Emerging-Optimizers' SOAP and LaProp do); "independent" and "palm" add ``-f W``,
    as Emerging-Optimizers does: "palm"'s ``lr^2 wd`` is often below float32's spacing near 1,
    where ``1 - f`` would round to 1 and the decay vanish.
    """
    if method in ("l2", "cautious") or weight_decay == 0.0:
        return
    factor = WEIGHT_DECAY_FACTORS[method](lr, weight_decay)
    if factor == 0.0:
        return
    if method == "decoupled" and multiply_decoupled:
        torch._foreach_mul_(params, 1.0 - factor)
    else:
        torch._foreach_add_(params, params, alpha=-factor)


def muon_apply_(
    params: list[Tensor],
    ortho: list[list[Tensor]],
    *,
    layout: MatrixLayout,
    lr: float,
    weight_decay: float,
    adjust_lr: str,
    extra_scale_factor: float,
    weight_decay_method: str = "decoupled",
) -> None:
    """``W <- decay(W) - lr * adjust(fan_out, fan_in) * O`` for every matrix piece (``decay_weights_``).

    For cautious weight decay the decay is ``W (1 - lr wd M)``, ``M`` 1 where ``O * W >= 0`` (the
    update, subtracted, moves ``W`` towards zero there, as the decay does) and 0 elsewhere (Chen et
    al., "Cautious Weight Decay", arXiv 2510.12402). The mask reads ``W`` before this step's update.
    The lr scale is each piece's own: its fan-out and fan-in (``layout.fans``), whatever the tensor
    it sits in.
    """
    decay = lr * weight_decay
    cautious = decay != 0.0 and weight_decay_method == "cautious"
    decay_weights_(params, lr, weight_decay, weight_decay_method)
    # Pieces may be in Newton-Schulz's dtype (bf16): ``W.add_(O, alpha=scale)`` reads them once
    # and accumulates in W's dtype, one pass per matrix, grouped by scale for foreach kernels.
    by_scale: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    copied = []  # (parameter, contiguous copy): applied like any other, then written back
    for p, pieces in zip(params, ortho):
        if not p.is_contiguous():  # channels_last convs, transposed storage
            copied.append((p, p.contiguous()))
            p = copied[-1][1]
        for w, o in zip(layout.slots(p), pieces):
            scale = -lr * (ADJUST_LR_MODES[adjust_lr](*layout.fans(*o.shape[-2:])) * extra_scale_factor)
            o = o.reshape(w.shape)  # the piece laid out like its slot (a no-op but for grouped splits)
            if cautious:
                w.mul_(torch.ones_like(w).masked_fill_(o * w >= 0, 1.0 - decay))
            targets, deltas = by_scale.setdefault(scale, ([], []))
            targets.append(w)
            deltas.append(o)
    for scale, (targets, deltas) in by_scale.items():
        if all(d.dtype == t.dtype for d, t in zip(deltas, targets)):
            # Same dtype: scale the temporary pieces, then add, as earlier versions did, so fp32
            # runs reproduce bit for bit. A bf16 piece goes in with alpha: its cast is a pass anyway.
            torch._foreach_mul_(deltas, scale)
            torch._foreach_add_(targets, deltas)
        else:
            torch._foreach_add_(targets, deltas, alpha=scale)
    for p, contiguous in copied:
        p.copy_(contiguous)
