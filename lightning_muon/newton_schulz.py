"""Newton-Schulz orthogonalization: coefficient schedules, dtype policy, batched kernels.

``orthogonalize(G)`` approximates the polar factor ``U V^T`` of ``G = U S V^T``
with a few quintic iterations on the short side of the matrix::

    X <- G / (||G||_F * safety + eps)          # every singular value now <= 1 (ns_eps: a floor instead)
    repeat for (a, b, c) in schedule:
        A <- X X^T                               # (m, m), m = short side
        B <- b A + c A A
        X <- a X + B X

Each step maps every singular value ``s`` of ``X`` to ``a s + b s^3 + c s^5``; a
schedule is a list of ``(a, b, c)`` chosen so that the composition pushes all of
``(0, 1]`` towards 1.

Gram Newton-Schulz (``method="gram"``) computes the same polynomial on the small
``m x m`` Gram matrix instead of the ``m x n`` iterate: every step's factor
``a I + b A + c A^2`` is a polynomial in ``R = X X^T``, so the iteration can carry
``R`` and the product ``Q`` of the factors and form ``Q X`` once at the end::

    R <- X X^T;  Q <- I
    repeat for (a, b, c) in schedule:
        Z <- b R + c R^2
        Q <- Q (a I + Z)
        R <- (a I + Z) R (a I + Z)            # the Gram matrix of the next iterate
    X <- Q X                                  # restarts: X <- Q X, R <- X X^T, Q <- I

Per step that is four m x m products instead of two m x n ones: for m x 4m
matrices, 60 m^3 FLOPs against 90 m^3 for five steps with one restart.

Symmetric products by row blocks (``SymmetricProduct``), for a matrix iterated alone: a step
makes two symmetric matrices, the Gram matrix ``A = S S^T`` of the short side (``S`` is ``X``
laid wide, ``k x n``, ``k <= n``) and the square ``A A`` of the symmetric ``A``. A general
matmul computes both triangles. Cut the rows of the left factor and the columns of the right
one in halves; three products give the whole::

    P_11 = S_1 S_1^T    P_12 = S_1 S_2^T    P_22 = S_2 S_2^T    P_21 = P_12^T      # (3/4) 2 k^2 n FLOPs
    (A A)_rc = A[r, :] A[:, c]   for (r, c) in (1, 1), (1, 2), (2, 2);   (A A)_21 = (A A)_12^T

Every block is the dense product's own sub-block, one whole dot product per entry rounded
once: the dense product's entries (bitwise equal on the CPUs measured), in any dtype.
``B = b A + c A A`` takes ``b A`` into the same three calls (``addmm``). The third product of
a step, ``B X``, has no symmetric output and stays whole. Halves run under the matmul kernel's
best rate at small sizes, so blocks are used only where they were measured faster, on the CPU
(benchmarks/bench_optimizer.py, section "symmetric"; AMD EPYC, 2 cores, AVX512-BF16, torch
2.13.0+cpu). Blocks over dense, bf16: 1.02-1.17 at 384 x 384, 0.91-1.08 at 384 x 768 (the
border), 0.88-0.98 at 384 x 1152 and 384 x 1536, 0.82-0.90 at 768 x 768 to 768 x 3072, 0.77-0.90
at 1024; float32: 0.68-0.92 from 384 x 384 on. Stacked matrices (bmm into block views: 1.3-1.6x
slower in bf16) keep the dense products; so does CUDA, where no GPU was at hand to measure them.

References:
    Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002, ch. 22
    (block algorithms for symmetric rank-k updates, BLAS ``syrk``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import typing
from collections.abc import Collection, Iterator, Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lightning_muon.coefficients import (
    COEFFICIENTS,
    DEFAULT_NORMALIZATION,
    NORMALIZATION,
    Coefficients,
    FlooredNormalization,
    Normalization,
    coefficient_list,
    is_number,
)

__all__ = [
    "SYMMETRIC_MIN_LONG_SIDE",
    "SYMMETRIC_MIN_SHORT_SIDE",
    "SymmetricProduct",
    "gram_",
    "square_",
    "symmetric_blocks",
    "BATCH_MAX_ELEMENTS",
    "CUDA_BATCH_MAX_ELEMENTS",
    "COEFFICIENTS",
    "DTYPES",
    "FAST_BF16_ENV",
    "GRAM_MIN_ASPECT",
    "GRAM_MIN_SHORT_SIDE",
    "HALF_BATCH_MAX_ELEMENTS",
    "HALF_BATCH_MAX_SHORT_SIDE",
    "NORMALIZATION",
    "NS_METHODS",
    "bf16_matmul_is_fast",
    "check_ns_method",
    "coefficient_list",
    "MatrixSpec",
    "NSPlan",
    "dtype_name",
    "matmul_precision",
    "gram_restarts",
    "ns_flops",
    "ns_flops_as_run",
    "ns_wire_dtype",
    "orthogonalize",
    "orthogonalize_many",
    "plan_matrices",
    "resolve_coefficients",
    "resolve_ns_dtype",
    "resolve_ns_method",
    "runs_alone",
    "stack_bytes",
    "stacks",
    "NSMethod",
]

# Same-shape matrices with at most this many elements are stacked and run through
# one batched matmul; larger ones run one by one (no stacking copy, less memory).
# Measured with benchmarks/bench_optimizer.py (table "batching", 12 matrices, fp32,
# 2-core AVX2 CPU): batched was 7x faster at 16x64, 1.7x at 64x256, 1.2x at
# 256x256 (65,536 elements) and 0.9x at 256x1024 (262,144 elements).
BATCH_MAX_ELEMENTS = 1 << 17
# In bf16 or fp16 on a CPU, stacks pay further: up to a short side of 512 and 384 x 1536
# elements. Measured on a 2-core AVX512-BF16 EPYC (torch 2.13.0+cpu), stacked over one by
# one, the median of 15 paired runs of ``orthogonalize_many``: 0.57 at 192 x 768, 0.70 at
# 256 x 1024, 0.79 at 128 x 2048, 0.86 at 384 x 384, 0.88 at 512 x 512, 0.87 at 384 x 1152,
# 0.92 at 384 x 1536, 0.97-0.99 at 512 x 1024 and 256 x 2048; past the bounds stacks lose:
# 1.03 at 448 x 1792, 1.11 at 768 x 768 and 512 x 2048, 1.15 at 384 x 3072 (one by one,
# those run their symmetric products by blocks, see ``symmetric``). float32 gains nothing
# there (0.97-1.11 from 192 x 768 to 384 x 1536): it keeps ``BATCH_MAX_ELEMENTS``.
HALF_BATCH_MAX_ELEMENTS = 384 * 1536
HALF_BATCH_MAX_SHORT_SIDE = 512
# On a GPU a step of small matrices one by one is bound by kernel launches (each ~5-10 us;
# torch.optim.Muon's loop took 17.7 ms for GPT-2 small's 48 matrices on an H100, whose
# Newton-Schulz arithmetic is ~2.5 ms there), and a batched product of same-shape matrices
# keeps the tensor cores busy: stacks reach up to 2^24 elements (4096 x 4096, 2048 x 8192).
CUDA_BATCH_MAX_ELEMENTS = 1 << 24

NSMethod = Literal["standard", "gram", "auto"]
NS_METHODS: tuple[str, ...] = typing.get_args(NSMethod)
# ``method="auto"`` picks Gram Newton-Schulz for a matrix whose long side is at least
# GRAM_MIN_ASPECT times its short side, and whose short side is at least GRAM_MIN_SHORT_SIDE,
# when the iteration runs in float32 or float64. Measured with benchmarks/bench_optimizer.py
# (section "gram", fp32, 5 polar_express steps, AVX2 CPU, 1 thread): standard / gram time
# follows the FLOP ratio, 0.8 on square matrices, 1.02-1.17 at 1:2 (FLOP ratio 1.14, within
# a shared machine's noise), 1.30-1.92 at 1:3 and 1.46-2.4 at 1:4 for short sides 128-1024;
# at 64 x 256 only 1.11 (per-call overhead). The errors against the SVD polar factor agree
# to 3e-6 relative at every shape.
GRAM_MIN_ASPECT = 3.0
GRAM_MIN_SHORT_SIDE = 128


def resolve_coefficients(
    coefficients: str | Sequence[float] | Sequence[Sequence[float]], steps: int, eps: float | None = None
) -> tuple[list[Coefficients], Normalization | FlooredNormalization]:
    """Return ``steps`` (a, b, c) tuples and the pre-scaling for a schedule.

    A named schedule (a key of ``COEFFICIENTS``), an explicit list of (a, b, c) tuples, or
    one ``(a, b, c)`` for every step (torch.optim.Muon's ``ns_coefficients``) is accepted; a
    list shorter than ``steps`` repeats its last tuple. ``eps`` (``ns_eps``): None keeps the
    schedule's pre-scaling, ``X = G / (||G||_F * safety + eps_schedule)``; a number
    replaces it with ``X = G / max(||G||_F * safety, eps)`` (``FlooredNormalization``).

    Raises:
        ValueError: ``steps`` is not a positive int, the name is unknown, the list is
            empty or holds something other than three finite numbers, or ``eps`` is not
            a finite number > 0.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {steps!r}")
    if eps is not None and not (is_number(eps) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"ns_eps must be None or a finite number > 0, got {eps!r}")
    if isinstance(coefficients, str):
        schedule, norm = _named_schedule(coefficients, steps)
        return schedule, norm if eps is None else FlooredNormalization(norm.safety, float(eps))
    schedule = coefficient_list(coefficients)
    return _extend(schedule, steps), DEFAULT_NORMALIZATION if eps is None else FlooredNormalization(1.0, float(eps))


@functools.lru_cache(maxsize=64)
def _named_schedule(name: str, steps: int) -> tuple[list[Coefficients], Normalization]:
    if name not in COEFFICIENTS:
        raise ValueError(
            f"ns_coefficients: unknown schedule {name!r}; choose one of {sorted(COEFFICIENTS)} "
            "or pass a list of (a, b, c) tuples"
        )
    return _extend(COEFFICIENTS[name], steps), NORMALIZATION.get(name, DEFAULT_NORMALIZATION)


def _extend(schedule: list, steps: int) -> list[Coefficients]:
    return [tuple(abc) for abc in schedule[:steps]] + [tuple(schedule[-1])] * max(0, steps - len(schedule))


_HOST: dict[str, bool] = {}  # the host's answers, read once


@torch.compiler.assume_constant_result  # the host's answer: a constant to torch.compile, not a graph break
def _cpu_has_fast_bf16() -> bool:
    # torch reads CPUID itself; AVX512-BF16 and AMX-BF16 have native bf16 dot products.
    # On AVX2-only CPUs bf16 matmul falls back to a path about 100x slower than fp32.
    if "fast_bf16" not in _HOST:
        try:
            caps = torch._C._cpu._get_cpu_capability()
        except AttributeError:  # pragma: no cover - older torch builds
            caps = {}
        _HOST["fast_bf16"] = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return _HOST["fast_bf16"]


# Environment variable that overrides the hardware answer of ``bf16_matmul_is_fast``:
# "1" (bf16 is fast), "0" (it is not), unset or empty (detect). It lets a user reproduce a
# run's Newton-Schulz dtype on another machine, and lets tests run either policy on any host.
FAST_BF16_ENV = "LIGHTNING_MUON_FAST_BF16"


def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """True where bf16 matmul is faster than fp32 (CUDA with bf16; CPUs with AVX512-BF16/AMX).

    The environment variable ``LIGHTNING_MUON_FAST_BF16`` overrides the detection: ``"1"``
    answers True and ``"0"`` False on every device; unset, the hardware decides.
    """
    forced = os.environ.get(FAST_BF16_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(
                f"{FAST_BF16_ENV} must be '1' (bf16 matmul is fast), '0' (it is not) or unset, got {forced!r}"
            )
        return forced == "1"
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_has_fast_bf16()
    return False


# The one table of dtype names: param groups keep ``ns_dtype`` as one of these strings
# (checkpoints, torch.save and distributed alike, store it as is), and the DDP sharding
# describes the state entries it sends by them.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
}
# Short names accepted for ``ns_dtype``.
_DTYPE_ALIASES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_NS_DTYPE_NAMES = {**{n: d for n, d in DTYPES.items() if d.is_floating_point}, **_DTYPE_ALIASES}


def dtype_name(dtype: torch.dtype) -> str:
    """The name of ``dtype`` in ``DTYPES`` (``"float32"``, ...); other dtypes by their torch name."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def resolve_ns_dtype(
    dtype: torch.dtype | str | None, device: torch.device | str, input_dtype: torch.dtype
) -> torch.dtype:
    """The dtype Newton-Schulz runs in.

    ``None`` is the automatic policy: float64 inputs stay float64 (precision was asked
    for); otherwise bf16 where this device does bf16 matmul fast, else float32. A
    name ("float32", "bfloat16", ...) or a torch floating dtype overrides it.
    """
    if dtype is None:
        if input_dtype == torch.float64:
            return torch.float64
        return torch.bfloat16 if bf16_matmul_is_fast(device) else torch.float32
    return check_ns_dtype(dtype)


@contextlib.contextmanager
def matmul_precision(precision: str | None, device: torch.device) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(precision)`` for the block on a CUDA ``device``, the previous one after.

    Emerging-Optimizers' ``fp32_matmul_prec``: "high" allows TF32, "medium" bf16 passes. It
    is process-wide; on a CPU (or with None) nothing changes, so that a float32 matmul there
    stays exact whatever the host's bf16 support. Where precision was set per backend with
    torch's newer API (``torch.backends.cuda.matmul.fp32_precision``), the legacy setting
    cannot be read back without an error, and the block runs under the user's settings.
    """
    if precision is None or device.type != "cuda":
        yield
        return
    try:
        previous = torch.get_float32_matmul_precision()
    except RuntimeError:  # "a mix of the legacy and new APIs": not ours to override
        previous = precision
    if previous == precision:
        yield
        return
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def check_ns_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """Validate a user's ``ns_dtype`` and return it as a torch dtype (or None)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in _NS_DTYPE_NAMES:
            raise ValueError(f"ns_dtype must be None, a torch dtype or one of {sorted(_NS_DTYPE_NAMES)}, got {dtype!r}")
        return _NS_DTYPE_NAMES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"ns_dtype must be a floating torch dtype, got {dtype!r}")
    return dtype


def check_ns_method(method: str) -> str:
    """Validate a user's ``ns_method``."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {method!r}")
    return method


def resolve_ns_method(method: str, rows: int, cols: int, work_dtype: torch.dtype) -> str:
    """``"standard"`` or ``"gram"``: the iteration ``orthogonalize`` runs for a rows x cols matrix.

    ``"auto"`` picks Gram Newton-Schulz only where the "gram" benchmark measured it both
    faster and as accurate: long side >= ``GRAM_MIN_ASPECT`` x short side, short side >=
    ``GRAM_MIN_SHORT_SIDE``, and a float32 or float64 iteration (in bf16 the standard
    iteration is the fast one, and Gram in bf16 is unstable).
    """
    if method != "auto":
        return check_ns_method(method)
    m, n = min(rows, cols), max(rows, cols)
    wide_enough = n >= GRAM_MIN_ASPECT * m and m >= GRAM_MIN_SHORT_SIDE
    return "gram" if wide_enough and work_dtype in (torch.float32, torch.float64) else "standard"


def gram_restarts(steps: int) -> frozenset[int]:
    """Iterations (0-based) before which Gram Newton-Schulz rebuilds ``X <- Q X`` and ``R <- X X^T``.

    Zhang, Amsel, Chen, Dao (2026) restart once, after the 2nd of 5 iterations, and advise more
    restarts for longer schedules. We restart before iteration 2, 4, 6, ...: in float32 on
    256 x 1024 matrices (singular values 1 to 1e-3) that keeps Gram within 1e-7 (5 steps) and
    1e-5 (8-12 steps) of the standard iteration's error against the exact polar factor, where
    a single restart drifts by 3e-5 at 8 steps and 9e-4 at 12.
    """
    return frozenset(range(2, steps, 2)) if steps > 5 else frozenset({2} if steps > 2 else ())


def ns_flops(rows: int, cols: int, steps: int, cubic: bool = False, method: str = "standard") -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on one rows x cols matrix (``method`` resolved)."""
    m, n = min(rows, cols), max(rows, cols)
    if method != "gram":
        per_step = 4 * n * m * m + (0 if cubic else 2 * m**3)
        return steps * per_step
    restarts = gram_restarts(steps)
    flops = 2 * n * m * m * (2 + 2 * len(restarts))  # R <- X X^T and Q X, once per restart and at the ends
    fresh = True  # Q = a I + Z needs no product right after a (re)start
    for i in range(steps):
        flops += 0 if cubic else 2 * m**3  # Z = b R + c R^2
        flops += 0 if fresh else 2 * m**3  # Q (a I + Z)
        fresh = i + 1 in restarts
        if i + 1 < steps and not fresh:
            flops += 4 * m**3  # R <- (a I + Z) R (a I + Z)
    return flops


def ns_flops_as_run(M: Tensor, steps: int, method: str = "standard", dtype: torch.dtype | str | None = None) -> int:
    """``ns_flops`` of a (..., rows, cols) tensor with the iteration ``orthogonalize`` runs for it.

    ``method`` and ``dtype`` are ``orthogonalize``'s arguments: "auto" resolves per shape and
    work dtype, as there. Counts every matrix of a batch.
    """
    rows, cols = M.shape[-2:]
    work_dtype = resolve_ns_dtype(dtype, M.device, M.dtype)
    resolved = resolve_ns_method(method, rows, cols, work_dtype)
    return (M.numel() // max(1, rows * cols)) * ns_flops(rows, cols, steps, method=resolved)


def orthogonalize(
    G: Tensor,
    steps: int = 5,
    coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "polar_express",
    dtype: torch.dtype | str | None = None,
    method: str = "standard",
    eps: float | None = None,
) -> Tensor:
    """Approximate the polar factor of every matrix in ``G`` (shape ``(..., m, n)``).

    Args:
        G: a tensor with at least two dims; leading dims are a batch.
        steps: Newton-Schulz iterations.
        coefficients: a name in ``COEFFICIENTS``, a list of (a, b, c) tuples (a list
            shorter than ``steps`` repeats its last tuple), or one (a, b, c) for every step.
        dtype: the dtype to iterate in; ``None`` applies the automatic policy of
            ``resolve_ns_dtype``.
        method: ``"standard"`` iterates on the matrix; ``"gram"`` runs Gram Newton-Schulz (the
            same polynomial, iterated on the short side's Gram matrix; always in float32 or
            float64: a bf16 or fp16 ``dtype`` is raised to float32 for it); ``"auto"`` picks
            per matrix by ``resolve_ns_method``.
        eps: None divides ``G`` by ``||G||_F * safety + eps_schedule`` (``NORMALIZATION``);
            a number divides it by ``max(||G||_F * safety, eps)``, torch.optim.Muon's form
            (a matrix whose scaled norm is below ``eps`` is left unnormalized).

    Returns:
        A tensor of ``G``'s shape and dtype whose singular values lie near 1 (how
        near depends on the schedule) with ``G``'s singular vectors. A zero matrix
        gives zeros.

    References:
        Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024.
        Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods
        and Their Application to the Muon Algorithm", arXiv 2505.16932, 2025.
        Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz: A Fast, Hardware-Aware Newton-Schulz
        Algorithm for Muon", 2026 (dao-ailab.github.io/blog/2026/gram-newton-schulz).
    """
    return _orthogonalize(G, steps, coefficients, dtype, method, eps=eps).to(G.dtype)


def _orthogonalize(
    G: Tensor,
    steps: int,
    coefficients: str | Sequence[float] | Sequence[Sequence[float]],
    dtype: torch.dtype | str | None,
    method: str,
    eps: float | None = None,
) -> Tensor:
    """``orthogonalize`` with the result left in the iteration's dtype (no cast back)."""
    if not isinstance(G, Tensor) or G.ndim < 2:
        raise ValueError(f"G must be a tensor with at least 2 dims, got shape {getattr(G, 'shape', G)}")
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(f"G must be a real floating tensor, got dtype {G.dtype}")
    check_ns_dtype(dtype)
    plan = plan_matrices([G], steps, coefficients, dtype, method, eps=eps, batch=True)
    if plan.how[0] is None:  # an empty matrix
        return torch.zeros_like(G)
    X, wide = _iterand(G, *plan.how[0], donate=False)
    X = _newton_schulz_(X, plan.schedule, plan.norm, plan.how[0][0])  # (K, m, n)
    return (X.mT if wide else X).reshape(G.shape)


def prescale_divisor_(fro: Tensor, norm: Normalization | FlooredNormalization) -> Tensor:
    """``fro`` (the Frobenius norms) turned in place into what the iterate is divided by: ``fro * safety + eps``,
    or ``max(fro * safety, eps)`` for a floor (``ns_eps``)."""
    if norm.safety != 1.0:  # x * 1.0 is x: one pass less for most schedules
        fro.mul_(norm.safety)
    return fro.clamp_(min=norm.eps) if isinstance(norm, FlooredNormalization) else fro.add_(norm.eps)


def _iterand(M: Tensor, method: str, work_dtype: torch.dtype, donate: bool) -> tuple[Tensor, bool]:
    """``M`` (``(..., rows, cols)``) as the ``(K, m, n)`` buffer its iteration runs in, and whether that is ``M``
    laid wide (its result then comes back transposed).

    ``donate``: ``M`` is a temporary the caller gives up; when it is already contiguous and in
    the work dtype, the iteration runs in it, a tall one on its short side (``X^T X``: the wide
    iteration on its transpose, up to rounding). Otherwise the one full-size copy, laid wide
    and cast to the work dtype in the same pass, so that ``orthogonalize(G^T)`` is exactly
    ``orthogonalize(G)^T``.
    """
    rows, cols = M.shape[-2:]
    X = M.reshape(-1, rows, cols)  # (K, rows, cols)
    if donate and method == "standard" and X.dtype == work_dtype and X.is_contiguous():
        return X, False
    tall = rows > cols
    return (X.mT if tall else X).to(work_dtype, memory_format=torch.contiguous_format, copy=True), tall


def _newton_schulz_(
    X: Tensor, schedule: list[Coefficients], norm: Normalization | FlooredNormalization, method: str = "standard"
) -> Tensor:
    """Iterate in place on ``X`` of shape (K, m, n); returns the result buffer.

    The standard iteration runs on the short side in either orientation: a wide ``X``
    (m <= n) takes ``A = X X^T`` and ``X <- a X + B X``, a tall one ``A = X^T X`` and
    ``X <- a X + X B`` (the same map: the transpose of the wide iteration on ``X^T``), so a
    tall temporary needs no transposed copy. Gram Newton-Schulz needs m <= n.
    """
    # The norm of a bf16 X is accumulated in float32 by torch's reduction kernels (CPU and
    # CUDA) and only the (K, 1, 1) result is rounded to bf16 (2^-9 relative, which the safety
    # factor absorbs, and what torch.optim.Muon does); asking for dtype=float32 instead would
    # convert the whole of X first, a full-size pass. The scalar arithmetic then runs in fp32.
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    fro = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).to(acc)
    X.div_(prescale_divisor_(fro, norm).to(X.dtype))
    if method == "gram":
        return _gram_newton_schulz(X, schedule)
    if X.shape[0] == 1:
        return _iterate_2d(X[0], schedule).unsqueeze(0)
    K, m, n = X.shape
    tall = m > n
    k = min(m, n)
    A = X.new_empty(K, k, k)  # (K, k, k) Gram matrices of the short side
    B = X.new_empty(K, k, k)
    Y = torch.empty_like(X)  # (K, m, n)
    for a, b, c in schedule:
        if tall:
            torch.bmm(X.mT, X, out=A)
        else:
            torch.bmm(X, X.mT, out=A)
        if c == 0.0:
            torch.mul(A, b, out=B)
        else:
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
        if tall:
            torch.baddbmm(X, X, B, beta=a, out=Y)  # a X + X B (B is symmetric)
        else:
            torch.baddbmm(X, B, X, beta=a, out=Y)
        X, Y = Y, X
    return X


# A product S S^T of a k x n matrix S is cut in blocks from k = 384 and, in bf16 or fp16,
# n = 768 (measured in bf16: 384 x 384 loses 2-17%, 384 x 768 moves between -8% and +9%,
# 384 x 1152 on gains 2-12%, 768 x 768 10-15%; float32 gains 8-32% from 384 x 384 on).
SYMMETRIC_MIN_SHORT_SIDE = 384
SYMMETRIC_MIN_LONG_SIDE = 768  # half precision only; float32 and float64 from 384

_FULL_PRECISION = (torch.float32, torch.float64)


def symmetric_blocks(short: int, long: int, dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """``(Gram product by blocks, square by blocks)`` for a ``short x long`` matrix iterated alone.

    On the CPU, a product ``S S^T`` of a ``k x n`` ``S`` is cut where ``k >=
    SYMMETRIC_MIN_SHORT_SIDE`` and, in half precision, ``n >= SYMMETRIC_MIN_LONG_SIDE``:
    the Gram product is ``short x long``, the square ``short x short``.
    """
    if device.type != "cpu" or short < SYMMETRIC_MIN_SHORT_SIDE:
        return False, False
    min_long = SYMMETRIC_MIN_SHORT_SIDE if dtype in _FULL_PRECISION else SYMMETRIC_MIN_LONG_SIDE
    return long >= min_long, short >= min_long


class SymmetricProduct:
    """``out <- beta C + alpha L R`` for a product ``L R`` known to be symmetric, block views cut once.

    ``L R`` is ``S S^T`` (the Gram matrix: ``L = S``, ``R = S^T``) or ``A A`` (the square of a
    symmetric ``A``: ``L = R = A``); ``C`` is symmetric, or None for ``beta = 0``. With
    ``blocks`` the product is made as its three blocks ``L[r] R[:, c]`` (rows ``r``, columns
    ``c`` of the two halves) and the lower one mirrored: each block is the dense product's
    own sub-block, the same operands in the same order. Without, one dense call, exactly
    what the batched iteration runs (so a matrix rounds alike whether stacked or alone).

    Newton-Schulz repeats the same products on the same buffers at every step: the views
    are cut here once (a view costs microseconds of Python; a step's products on a
    384-wide matrix take a few hundred) and each call only runs the matmuls.
    """

    def __init__(self, L: Tensor, R: Tensor, out: Tensor, blocks: bool, C: Tensor | None = None) -> None:
        whole = slice(None)
        h = L.shape[0] // 2
        top, bottom = slice(None, h), slice(h, None)
        pairs = [(top, top), (top, bottom), (bottom, bottom)] if blocks else [(whole, whole)]
        # (L_r, R_c, out_rc, C_rc): (h, n), (n, h), (h, h), (h, h) for the top-left block
        self._calls = [(L[r], R[:, c], out[r, c], None if C is None else C[r, c]) for r, c in pairs]
        self._mirror = (out[bottom, top], out[top, bottom].mT) if blocks else None

    def __call__(self, beta: float = 0.0, alpha: float = 1.0) -> None:
        for Lr, Rc, out, C in self._calls:
            if C is None:
                torch.mm(Lr, Rc, out=out)
            else:
                torch.addmm(C, Lr, Rc, beta=beta, alpha=alpha, out=out)
        if self._mirror is not None:
            self._mirror[0].copy_(self._mirror[1])


def gram_(S: Tensor, out: Tensor, blocks: bool) -> Tensor:
    """``out <- S S^T`` for a ``(k, n)`` matrix ``S`` (any strides); with ``blocks``, three row-block products."""
    SymmetricProduct(S, S.mT, out, blocks)()
    return out


def square_(A: Tensor, out: Tensor, b: float, c: float, blocks: bool) -> Tensor:
    """``out <- b A + c A A`` for a symmetric ``(k, k)`` ``A``; blocks as ``gram_``."""
    SymmetricProduct(A, A, out, blocks, C=A)(b, c)
    return out


def _iterate_2d(X: Tensor, schedule: list[Coefficients]) -> Tensor:
    """One matrix: the batched iteration's products, the symmetric ones by blocks where that pays."""
    m, n = X.shape
    tall = m > n
    k = min(m, n)
    gram_blocks, square_blocks = symmetric_blocks(k, max(m, n), X.dtype, X.device)
    A = X.new_empty(k, k)  # (k, k) Gram matrix of the short side
    B = X.new_empty(k, k)
    Y = torch.empty_like(X)  # (m, n)
    # X and Y trade places every step: one Gram product for each, the short side laid wide.
    grams = [
        SymmetricProduct(Z.mT, Z, A, gram_blocks) if tall else SymmetricProduct(Z, Z.mT, A, gram_blocks) for Z in (X, Y)
    ]
    square = SymmetricProduct(A, A, B, square_blocks, C=A)  # B <- b A + c A A
    for step, (a, b, c) in enumerate(schedule):
        grams[step % 2]()
        if c == 0.0:
            torch.mul(A, b, out=B)
        else:
            square(b, c)
        if tall:
            torch.addmm(X, X, B, beta=a, out=Y)  # a X + X B (B is symmetric)
        else:
            torch.addmm(X, B, X, beta=a, out=Y)
        X, Y = Y, X
    return X


def _gram_newton_schulz(X: Tensor, schedule: list[Coefficients]) -> Tensor:
    """Gram Newton-Schulz on a normalized ``X`` of shape (K, m, n), m <= n; returns ``Q X``."""
    K, m, _ = X.shape
    restarts = gram_restarts(len(schedule))
    R = torch.bmm(X, X.mT)  # (K, m, m) Gram matrix of the current iterate
    Z = torch.empty_like(R)  # (K, m, m) b R + c R^2
    Q = None  # (K, m, m) product of the factors (a I + Z) since the last (re)start
    for i, (a, b, c) in enumerate(schedule):
        if i in restarts:
            X = torch.bmm(Q, X)  # (K, m, n): refresh the iterate, drop the accumulated rounding
            torch.bmm(X, X.mT, out=R)
            Q = None
        if c == 0.0:
            torch.mul(R, b, out=Z)
        else:
            torch.baddbmm(R, R, R, beta=b, alpha=c, out=Z)
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a)  # Q (a I + Z)
        if i + 1 < len(schedule) and i + 1 not in restarts:
            RZ = torch.baddbmm(R, R, Z, beta=a)  # R (a I + Z)
            R = torch.baddbmm(RZ, Z, RZ, beta=a)  # (a I + Z) R (a I + Z): all polynomials in R commute
    return torch.bmm(Q, X) if Q is not None else X


def stacks(rows: int, cols: int, work_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether same-shape ``rows x cols`` matrices iterated in ``work_dtype`` run stacked (one batched iteration).

    Up to ``BATCH_MAX_ELEMENTS`` elements everywhere; on a GPU up to ``CUDA_BATCH_MAX_ELEMENTS``;
    in bf16 or fp16 on a CPU, up to ``HALF_BATCH_MAX_ELEMENTS`` with a short side of at most
    ``HALF_BATCH_MAX_SHORT_SIDE`` (where that was measured faster).
    """
    elements = rows * cols
    if elements <= BATCH_MAX_ELEMENTS:
        return True
    if device.type == "cuda":
        return elements <= CUDA_BATCH_MAX_ELEMENTS
    half = work_dtype in (torch.bfloat16, torch.float16)
    return (
        half
        and device.type == "cpu"
        and elements <= HALF_BATCH_MAX_ELEMENTS
        and min(rows, cols) <= HALF_BATCH_MAX_SHORT_SIDE
    )


class NSPlan(NamedTuple):
    """Newton-Schulz's plan for a list of matrices: made once (``plan_matrices``), read by every stage that needs it.

    A Muon round makes it from its gradients before the updates exist: the momentum stage
    reads ``donated`` (the dtype to make each update in), ``orthogonalize_many`` runs the
    stacks and the matrices alone, and nothing is worked out twice.
    """

    schedule: list[Coefficients]
    """The (a, b, c) of every step."""
    norm: Normalization | FlooredNormalization
    """The pre-scaling."""
    how: list[tuple[str, torch.dtype] | None]
    """Per matrix, ``(method, work dtype)``; None for what is not a non-empty matrix."""
    alone: list[int]
    """Indices iterated one by one, in order."""
    stacks: dict[tuple, list[int]]
    """Indices per stack, keyed ``(short side, long side, device, dtype, method, work dtype)``."""
    donated: list[torch.dtype]
    """Per matrix, the dtype to make a temporary in that ``orthogonalize_many(donate=True)`` will take: the work
    dtype for a matrix that runs alone with the standard iteration (iterated in place, no staging copy); its own
    dtype otherwise (a stacked matrix is cast by the copy into its stack, and Gram Newton-Schulz raises half
    precision to float32, so its input keeps full precision)."""
    multi_shapes: Collection[tuple[int, int]]
    """The ``(short side, long side)`` the caller's other calls hold more of: a stack of one of these shapes
    runs beside a zero partner, as a stack of several would."""


def plan_matrices(
    matrices: Sequence[Tensor | MatrixSpec],
    steps: int = 5,
    coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "polar_express",
    dtype: torch.dtype | str | None = None,
    method: str = "standard",
    multi_shapes: Collection[tuple[int, int]] = (),
    eps: float | None = None,
    batch: bool = False,
) -> NSPlan:
    """How ``orthogonalize_many`` will run ``matrices`` (tensors, or ``MatrixSpec``s: only shapes, dtypes and
    devices are read, so a caller can plan before the matrices exist).

    Matrices are bucketed by (short side, long side, device, dtype, method, work dtype); a tall
    matrix joins the bucket of its transpose. Those of the kinds ``stacks`` admits run stacked;
    a stack of one past ``BATCH_MAX_ELEMENTS`` runs alone (the same iteration without the copy,
    in place when donated), except where its ``(short side, long side)`` is in
    ``multi_shapes`` (the caller's other calls hold more of its shape): there it stays a stack,
    as in those calls. ``batch``: one ``(..., rows, cols)`` tensor, whose batch is its own stack.
    """
    schedule, norm = resolve_coefficients(coefficients, steps, eps)
    if method not in NS_METHODS:
        check_ns_method(method)  # the error
    stacked: dict[tuple, list[int]] = {}
    alone: list[int] = []
    how: list[tuple[str, torch.dtype] | None] = []
    donated: list[torch.dtype] = []
    # (shape, device, dtype) -> ((method, work dtype) or None, stack key or None): one answer per kind
    kinds: dict[tuple, tuple[tuple[str, torch.dtype] | None, tuple | None]] = {}
    for i, M in enumerate(matrices):
        shape = tuple(M.shape)
        donated.append(M.dtype)
        kind = (shape, M.device, M.dtype)
        if kind not in kinds:
            resolved = key = None  # not a non-empty matrix: nothing to iterate
            if len(shape) >= 2 and 0 not in shape:
                rows, cols = shape[-2:]
                work_dtype = resolve_ns_dtype(dtype, M.device, M.dtype)
                kind_method = resolve_ns_method(method, rows, cols, work_dtype)
                if kind_method == "gram" and work_dtype not in (torch.float32, torch.float64):
                    # Half precision breaks Gram Newton-Schulz: rounding gives R spurious negative
                    # eigenvalues that the polynomial then amplifies (Zhang et al. 2026, who restart
                    # to contain it in fp16); float32 needs no such care at 5 steps.
                    work_dtype = torch.float32
                resolved = (kind_method, work_dtype)
                # Inputs with batch dims are one item each; ``batch``'s one tensor is its own stack.
                if len(shape) == 2 and not batch and stacks(rows, cols, work_dtype, M.device):
                    key = (min(rows, cols), max(rows, cols), M.device, M.dtype, *resolved)
            kinds[kind] = (resolved, key)
        resolved, key = kinds[kind]
        how.append(resolved)
        if key is None:
            alone.append(i)
        else:
            stacked.setdefault(key, []).append(i)
    for key in [k for k, idx in stacked.items() if len(idx) == 1 and k[0] * k[1] > BATCH_MAX_ELEMENTS]:
        if (key[0], key[1]) not in multi_shapes:
            alone += stacked.pop(key)
    alone.sort()
    for i in alone:
        if how[i] is not None and how[i][0] == "standard":
            donated[i] = how[i][1]
    return NSPlan(schedule, norm, how, alone, stacked, donated, multi_shapes)


class MatrixSpec(NamedTuple):
    """What ``plan_matrices`` reads of a matrix that does not exist yet."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def runs_alone(
    matrices: Sequence[Tensor],
    dtype: torch.dtype | str | None = None,
    method: str = "standard",
    multi_shapes: Collection[tuple[int, int]] = (),
) -> list[bool]:
    """Per matrix, whether ``orthogonalize_many`` iterates it alone rather than in a stack (``plan_matrices``)."""
    alone = set(plan_matrices(matrices, dtype=dtype, method=method, multi_shapes=multi_shapes).alone)
    return [i in alone for i in range(len(matrices))]


def ns_wire_dtype(updates: Sequence[Tensor], dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype ``updates`` may travel in to Newton-Schulz without loss: its work dtype where narrower, else None.

    Newton-Schulz casts its input to the work dtype first and returns values of that dtype,
    so sending either in it rounds nothing more (a sharding's ``wire_dtype``).
    """
    if not updates:
        return None
    base = updates[0].dtype
    for u in updates[1:]:
        base = torch.promote_types(base, u.dtype)
    work = resolve_ns_dtype(dtype, updates[0].device, base)
    return work if work.itemsize < base.itemsize else None


def stack_bytes(rows: int, cols: int, work_dtype: torch.dtype) -> int:
    """Bytes one ``rows x cols`` matrix takes in a stack: itself and its iterate, and its two Gram-sized buffers."""
    m, n = min(rows, cols), max(rows, cols)
    return (2 * m * n + 2 * m * m) * work_dtype.itemsize


def orthogonalize_many(
    matrices: Sequence[Tensor],
    steps: int = 5,
    coefficients: str | Sequence[float] | Sequence[Sequence[float]] = "polar_express",
    dtype: torch.dtype | str | None = None,
    method: str = "standard",
    keep_work_dtype: bool = False,
    donate: bool = False,
    max_stack_bytes: int | None = None,
    multi_shapes: Collection[tuple[int, int]] = (),
    eps: float | None = None,
    plan: NSPlan | None = None,
) -> list[Tensor]:
    """``[orthogonalize(M) for M in matrices]``, with same-shape matrices batched where that pays.

    How is ``plan_matrices``' answer (``plan``, made by the caller from the same matrices, or
    made here from the other arguments). Stacks hold at most ``max_stack_bytes``
    (``stack_bytes`` per matrix; None: one stack per bucket), but at least two: batched
    products give a matrix the same bits in any stack of two or more, so every result is the
    same however a step cuts its matrices into calls (``step_memory``). A stack of one that
    stands for a larger one (``multi_shapes``) runs beside a zero matrix. Inputs with batch
    dims are one item each.

    ``keep_work_dtype=True`` returns each result in the dtype it was computed in (bf16 on a
    fast-bf16 device) instead of casting it back: the caller adds it into the parameter in one
    pass (``muon_apply_``), where a cast would be a second full-size pass. ``donate=True``: the
    matrices are temporaries the caller gives up (``Muon``'s Nesterov update, made in the
    plan's ``donated`` dtype); one that runs alone and is already contiguous in that dtype is
    iterated in place, with no copy; a list's entries are set to None as they are consumed, so
    that each temporary is freed as soon as nothing needs it. ``eps``: the pre-scaling's floor,
    as in ``orthogonalize``.
    """
    if plan is None:
        plan = plan_matrices(matrices, steps, coefficients, dtype, method, multi_shapes, eps)
    out: list[Tensor | None] = [None] * len(matrices)
    release = donate and isinstance(matrices, list)
    for i in plan.alone:
        M, how = matrices[i], plan.how[i]
        if how is None:  # an empty matrix
            result = torch.zeros_like(M)
        else:
            X, wide = _iterand(M, *how, donate)
            X = _newton_schulz_(X, plan.schedule, plan.norm, how[0])  # (K, m, n)
            result = (X.mT if wide else X).reshape(M.shape)
        out[i] = result if keep_work_dtype else result.to(M.dtype)
        if release:
            matrices[i] = None  # released: its memory can serve the next matrix
    for (m, n, device, out_dtype, bucket_method, work_dtype), idx in plan.stacks.items():
        size = len(idx)
        if max_stack_bytes is not None and size > 2:  # stacks of at least two: only a larger one is cut
            size = max(2, max_stack_bytes // stack_bytes(m, n, work_dtype))
        parts = [idx[start : start + size] for start in range(0, len(idx), size)]
        if len(parts) > 1 and len(parts[-1]) == 1:  # a last stack of one joins the one before it
            last = parts.pop()
            parts[-1] += last
        for part in parts:
            # One copy into the stack, cast to the work dtype and laid wide on the way. A stack
            # of one that stands for a larger one gets a zero partner (it stays zero): a batched
            # product of one matrix takes another kernel than of several (on a CPU, with other
            # last bits), and the partner keeps the kernel of its shape's other stacks.
            partner = len(part) == 1 and (m, n) in plan.multi_shapes
            X = torch.empty(len(part) + partner, m, n, dtype=work_dtype, device=device)  # (K, m, n)
            if partner:
                X[1].zero_()
            wide = []
            for k, i in enumerate(part):
                wide.append(matrices[i].shape[0] == m)
                X[k].copy_(matrices[i] if wide[-1] else matrices[i].mT)
                if release:
                    matrices[i] = None
            result = _newton_schulz_(X, plan.schedule, plan.norm, bucket_method)  # (K, m, n)
            if not keep_work_dtype:
                result = result.to(out_dtype)
            for k, i in enumerate(part):
                out[i] = result[k] if wide[k] else result[k].mT
    return out  # type: ignore[return-value]
