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
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import typing
from collections.abc import Collection, Iterator, Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lightning_muon.symmetric import SymmetricProduct, symmetric_blocks

__all__ = [
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
    "donated_dtypes",
    "dtype_name",
    "matmul_precision",
    "gram_restarts",
    "ns_flops",
    "ns_flops_as_run",
    "orthogonalize",
    "orthogonalize_many",
    "resolve_coefficients",
    "resolve_ns_dtype",
    "resolve_ns_method",
    "runs_alone",
    "stack_bytes",
    "stacks",
    "NSMethod",
]

Coefficients = tuple[float, float, float]


def _paper_schedule() -> list[Coefficients]:
    # Amsel et al. 2025 (arXiv 2505.16932), their released 8-step list. Every tuple
    # but the last is divided by (1.01, 1.01^3, 1.01^5): evaluating p(x / 1.01) keeps
    # the iteration stable when bf16 rounding pushes a singular value slightly above 1.
    raw = [
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    ]
    safety = 1.01
    scaled = [(a / safety, b / safety**3, c / safety**5) for a, b, c in raw[:-1]]
    return scaled + [raw[-1]]


COEFFICIENTS: dict[str, list[Coefficients]] = {
    # Keller Jordan's quintic, torch.optim.Muon's default (torch/optim/_muon.py).
    # Maximises the slope at 0; converges to singular values in roughly [0.7, 1.2].
    "keller": [(3.4445, -4.7750, 2.0315)] * 5,
    # You Jiacheng's per-step tuning (modded-nanogpt, 2024).
    "you": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    # Polar Express tuned for exactly 5 steps (karpathy/nanochat, nanochat/optim.py),
    # the minimax-optimal composition of Amsel et al. 2025, arXiv 2505.16932.
    "polar_express": [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        # Not used at 5 steps. Repeating the 5th tuple would settle singular values at 1.035
        # (its p(1) = 1.06); (1.875, -1.25, 0.375) has p(1) = 1 and p'(1) = 0, so extra steps
        # converge to the exact polar factor (the paper schedule's own tail).
        (1.875, -1.25, 0.375),
    ],
    "polar_express_paper": _paper_schedule(),
    # Megatron-Core's "polar_express" (NVIDIA Emerging-Optimizers 0.3.0 ``muon_utils``): the
    # paper's 8 tuples with the 1.01 safety folded in, as that library lists them (4 digits),
    # pre-scaled by ||X||_F without a further safety: its results to float32 rounding.
    "polar_express_megatron": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    # CANS, Chebyshev-type polynomials accelerating Newton-Schulz (Grishina, Smirnov, Rakhuba,
    # arXiv 2506.10935), as NVIDIA Emerging-Optimizers 0.3.0 lists them (``muon_utils``,
    # coefficient type "cans", pre-scaled by ||X||_F): 5 steps, the last repeated for more.
    "cans": [
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ],
    # The schedule Emerging-Optimizers 0.3.0 names coefficient type "deepseekv4": Keller
    # Jordan's quintic 8 times, then (2, -1.5, 0.5) twice (p(1) = 1, p'(1) = 0: it settles the
    # singular values at 1); 10 steps, the last repeated for more.
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
    # Classic cubic Newton-Schulz (Higham, "Functions of Matrices", 2008, eq. 8.20):
    # converges to the exact polar factor, slowly (a gain of 1.5 per step near 0).
    "cubic": [(1.5, -0.5, 0.0)],
}


class Normalization(NamedTuple):
    """Pre-scaling ``X = G / (||G||_F * safety + eps)`` used with a schedule."""

    safety: float
    eps: float

    def with_eps(self, eps: float | None) -> Normalization | FlooredNormalization:
        """This pre-scaling with ``eps`` as a floor instead (``ns_eps``); None: unchanged, the schedule's own."""
        return self if eps is None else FlooredNormalization(self.safety, float(eps))

    def divisor_(self, fro: Tensor) -> Tensor:
        """``fro`` (the Frobenius norms) turned in place into what ``X`` is divided by."""
        return fro.mul_(self.safety).add_(self.eps)


class FlooredNormalization(NamedTuple):
    """Pre-scaling ``X = G / max(||G||_F * safety, eps)``: torch.optim.Muon's form, which ``ns_eps`` selects.

    A matrix whose scaled norm is below ``eps`` (a vanishing gradient) is divided by ``eps`` and
    stays small, where ``Normalization`` scales it up to norm about 1.
    """

    safety: float
    eps: float

    def divisor_(self, fro: Tensor) -> Tensor:
        """``fro`` (the Frobenius norms) turned in place into what ``X`` is divided by."""
        return fro.mul_(self.safety).clamp_(min=self.eps)


NORMALIZATION: dict[str, Normalization] = {
    "keller": Normalization(1.0, 1e-7),  # torch.optim.Muon: EPS = 1e-7
    "you": Normalization(1.0, 1e-7),
    "polar_express": Normalization(1.02, 1e-6),  # nanochat's 5-step schedule
    "polar_express_paper": Normalization(1.01, 1e-7),
    "polar_express_megatron": Normalization(1.0, 1e-7),
    "cans": Normalization(1.0, 1e-7),  # Emerging-Optimizers: X / max(||X||_F, 1e-7)
    "deepseekv4": Normalization(1.0, 1e-7),
    "cubic": Normalization(1.0, 1e-7),
}
_DEFAULT_NORMALIZATION = Normalization(1.0, 1e-7)

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
    if eps is not None and not (_is_number(eps) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"ns_eps must be None or a finite number > 0, got {eps!r}")
    if isinstance(coefficients, str):
        schedule, norm = _named_schedule(coefficients, steps)
        return schedule, norm.with_eps(eps)
    schedule = coefficient_list(coefficients)
    return _extend(schedule, steps), _DEFAULT_NORMALIZATION.with_eps(eps)


def coefficient_list(coefficients: Sequence[float] | Sequence[Sequence[float]]) -> list[Coefficients]:
    """An explicit schedule as a list of (a, b, c) float tuples: one ``(a, b, c)`` becomes a list of one.

    Raises:
        ValueError: empty, or something other than three finite numbers per step.
    """
    if isinstance(coefficients, Sequence) and len(coefficients) == 3 and all(map(_is_number, coefficients)):
        coefficients = [coefficients]  # torch.optim.Muon's form: one triple, used at every step
    try:
        schedule = [tuple(float(v) for v in abc) for abc in coefficients]
    except (TypeError, ValueError):
        raise ValueError(
            f"ns_coefficients must be a name in {sorted(COEFFICIENTS)}, a list of (a, b, c) tuples "
            f"or one (a, b, c), got {coefficients!r}"
        ) from None
    if not schedule or any(len(abc) != 3 for abc in schedule):
        raise ValueError(f"ns_coefficients must be a non-empty list of (a, b, c) tuples, got {coefficients!r}")
    if not all(math.isfinite(v) for abc in schedule for v in abc):
        raise ValueError(f"ns_coefficients must be finite numbers, got {coefficients!r}")
    return schedule


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@functools.lru_cache(maxsize=64)
def _named_schedule(name: str, steps: int) -> tuple[list[Coefficients], Normalization]:
    if name not in COEFFICIENTS:
        raise ValueError(
            f"ns_coefficients: unknown schedule {name!r}; choose one of {sorted(COEFFICIENTS)} "
            "or pass a list of (a, b, c) tuples"
        )
    return _extend(COEFFICIENTS[name], steps), NORMALIZATION.get(name, _DEFAULT_NORMALIZATION)


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


def _forced_fast_bf16() -> bool | None:
    value = os.environ.get(FAST_BF16_ENV, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{FAST_BF16_ENV} must be '1' (bf16 matmul is fast), '0' (it is not) or unset, got {value!r}")
    return value == "1"


def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """True where bf16 matmul is faster than fp32 (CUDA with bf16; CPUs with AVX512-BF16/AMX).

    The environment variable ``LIGHTNING_MUON_FAST_BF16`` overrides the detection: ``"1"``
    answers True and ``"0"`` False on every device; unset, the hardware decides.
    """
    forced = _forced_fast_bf16()
    if forced is not None:
        return forced
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
    check_ns_method(method)
    if method != "auto":
        return method
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
    donate: bool = False,
    eps: float | None = None,
) -> Tensor:
    """``orthogonalize`` with the result left in the iteration's dtype (no cast back).

    ``donate=True``: ``G`` is a temporary the caller gives up; when it is already contiguous
    and in the work dtype, the iteration runs in it rather than in a copy.
    """
    if not isinstance(G, Tensor) or G.ndim < 2:
        raise ValueError(f"G must be a tensor with at least 2 dims, got shape {getattr(G, 'shape', G)}")
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(f"G must be a real floating tensor, got dtype {G.dtype}")
    schedule, norm = resolve_coefficients(coefficients, steps, eps)
    batch_shape, (rows, cols) = G.shape[:-2], G.shape[-2:]
    method, work_dtype = _method_and_dtype(method, rows, cols, dtype, G)
    if G.numel() == 0:
        return torch.zeros_like(G)
    X = G.reshape(-1, rows, cols)  # (K, rows, cols)
    if donate and method == "standard" and X.dtype == work_dtype and X.is_contiguous():
        # A temporary already in place: iterated as it lies, a tall one on its short side
        # (X^T X), which equals the wide iteration on its transpose up to rounding.
        return _newton_schulz_(X, schedule, norm, method).reshape(*batch_shape, rows, cols)
    tall = rows > cols
    # The one full-size copy: laid wide and cast to the work dtype in the same pass, so that
    # orthogonalize(G^T) is exactly orthogonalize(G)^T.
    X = (X.mT if tall else X).to(work_dtype, memory_format=torch.contiguous_format, copy=True)
    X = _newton_schulz_(X, schedule, norm, method)  # (K, m, n), m <= n
    if tall:
        X = X.mT
    return X.reshape(*batch_shape, rows, cols)


def _method_and_dtype(
    method: str, rows: int, cols: int, dtype: torch.dtype | str | None, like: Tensor
) -> tuple[str, torch.dtype]:
    work_dtype = resolve_ns_dtype(dtype, like.device, like.dtype)
    method = resolve_ns_method(method, rows, cols, work_dtype)
    if method == "gram" and work_dtype not in (torch.float32, torch.float64):
        # Half precision breaks Gram Newton-Schulz: rounding gives R spurious negative
        # eigenvalues that the polynomial then amplifies (Zhang et al. 2026, who restart
        # to contain it in fp16); float32 needs no such care at 5 steps.
        work_dtype = torch.float32
    return method, work_dtype


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
    acc = torch.promote_types(X.dtype, torch.float32)
    fro = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).to(acc)
    X.div_(norm.divisor_(fro).to(X.dtype))
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


class _Plan(NamedTuple):
    """``orthogonalize_many``'s plan for a list of matrices."""

    alone: list[int]
    """Indices iterated one by one, in order."""
    stacks: dict[tuple, list[int]]
    """Indices per stack, keyed ``(short side, long side, device, dtype, method, work dtype)``."""
    resolved: list[tuple[str, torch.dtype] | None]
    """Per matrix, ``(method, work dtype)``; None for what is not a non-empty 2-D matrix."""


def _plan(
    matrices: Sequence[Tensor],
    dtype: torch.dtype | str | None,
    method: str,
    multi_shapes: Collection[tuple[int, int]] = (),
) -> _Plan:
    check_ns_method(method)
    buckets: dict[tuple, list[int]] = {}
    alone: list[int] = []
    resolved: list[tuple[str, torch.dtype] | None] = []
    # (shape, device, dtype) -> ((method, work dtype), stack key or None): one answer per kind
    kinds: dict[tuple, tuple[tuple[str, torch.dtype], tuple | None]] = {}
    for i, M in enumerate(matrices):
        if M.ndim != 2 or M.numel() == 0:
            alone.append(i)
            resolved.append(None)
            continue
        kind = (*M.shape, M.device, M.dtype)
        if kind not in kinds:
            rows, cols = M.shape
            bucket_method, work_dtype = _method_and_dtype(method, rows, cols, dtype, M)
            stacked = stacks(rows, cols, work_dtype, M.device)
            key = (min(rows, cols), max(rows, cols), *kind[2:], bucket_method, work_dtype) if stacked else None
            kinds[kind] = ((bucket_method, work_dtype), key)
        how, key = kinds[kind]
        resolved.append(how)
        if key is None:
            alone.append(i)
        else:
            buckets.setdefault(key, []).append(i)
    # A stack of one past ``BATCH_MAX_ELEMENTS`` runs alone: the same iteration without the
    # copy, in place when donated. Not where its shape has company elsewhere in the step
    # (``multi_shapes``): there it stays a stack, as in the step's other rounds.
    lone = [key for key, idx in buckets.items() if len(idx) == 1 and key[0] * key[1] > BATCH_MAX_ELEMENTS]
    for key in lone:
        if (key[0], key[1]) not in multi_shapes:
            alone += buckets.pop(key)
    return _Plan(sorted(alone), buckets, resolved)


def runs_alone(
    matrices: Sequence[Tensor],
    dtype: torch.dtype | str | None = None,
    method: str = "standard",
    multi_shapes: Collection[tuple[int, int]] = (),
) -> list[bool]:
    """Per matrix, whether ``orthogonalize_many`` iterates it alone rather than in a stack.

    Only the shapes, dtypes and devices are read, so a caller can ask before the matrices exist.
    """
    flags = [False] * len(matrices)
    for i in _plan(matrices, dtype, method, multi_shapes).alone:
        flags[i] = True
    return flags


def donated_dtypes(
    matrices: Sequence[Tensor],
    dtype: torch.dtype | str | None = None,
    method: str = "standard",
    multi_shapes: Collection[tuple[int, int]] = (),
) -> list[torch.dtype]:
    """Per matrix, the dtype to make a temporary in that ``orthogonalize_many(donate=True)`` will take.

    The work dtype for a matrix that runs alone with the standard iteration: it is iterated
    in place, with no staging copy. Its own dtype otherwise: a stacked matrix is cast by the
    copy into its stack (made in the work dtype, it would cost a pass more), and Gram
    Newton-Schulz raises half precision to float32, so its input keeps full precision. Only
    the shapes, dtypes and devices are read (``Muon`` asks with the gradients, then makes the
    Nesterov updates).
    """
    out = [M.dtype for M in matrices]
    plan = _plan(matrices, dtype, method, multi_shapes)
    for i in plan.alone:
        how = plan.resolved[i]
        if how is not None and how[0] == "standard":
            out[i] = how[1]
    return out


def _stacks_of(idx: list[int], max_bytes: int | None, per_matrix: int) -> list[list[int]]:
    """``idx`` cut into stacks of at most ``max_bytes`` (None: one stack), none of one matrix unless ``idx`` is.

    A last stack of one joins the one before it (a stack of two takes the batched products'
    kernel of every larger stack; one alone would take another, see ``orthogonalize_many``).
    """
    size = len(idx) if max_bytes is None else max(2, max_bytes // per_matrix)
    parts = [idx[start : start + size] for start in range(0, len(idx), size)]
    if len(parts) > 1 and len(parts[-1]) == 1:
        last = parts.pop()
        parts[-1] += last
    return parts


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
) -> list[Tensor]:
    """``[orthogonalize(M) for M in matrices]``, with same-shape matrices batched where that pays.

    Matrices are bucketed by (short side, long side, device, dtype, method, work dtype); a
    tall matrix joins the bucket of its transpose. Matrices of the kinds ``stacks`` admits
    (up to ``BATCH_MAX_ELEMENTS`` elements, more on a GPU and in half precision on a CPU)
    run the batched iteration, stacked with their bucket in stacks of at most
    ``max_stack_bytes`` (``stack_bytes`` per matrix; None: one stack per bucket), but at
    least two. A matrix alone in its bucket runs the 2-D iteration (in place when donated and
    past ``BATCH_MAX_ELEMENTS``), unless its ``(short side, long side)`` is in
    ``multi_shapes`` (the caller's other calls hold more of its shape): then it runs as a
    stack of one beside a zero matrix. Batched products give a matrix the same bits in any
    stack of two or more, so every result is then the same however a step cuts its matrices
    into calls (``step_memory``). Other matrices run one by one (``runs_alone`` says which).
    Inputs with batch dims are treated as one item. ``method`` is resolved per matrix, as ``orthogonalize`` does.
    ``keep_work_dtype=True`` returns each result in the dtype it was computed in (bf16 on
    a fast-bf16 device) instead of casting it back: the caller adds it into the parameter
    in one pass (``muon_apply_``), where a cast would be a second full-size pass.
    ``donate=True``: the matrices are temporaries the caller gives up (``Muon``'s Nesterov
    update, made in the work dtype); one that runs alone and is already contiguous in that
    dtype is iterated in place, with no copy; a list's
    entries are set to None as they are consumed (copied into a stack, or iterated), so that
    each temporary is freed as soon as nothing needs it. ``eps``: the pre-scaling's floor, as in ``orthogonalize``.
    """
    schedule, norm = resolve_coefficients(coefficients, steps, eps)
    check_ns_method(method)
    out: list[Tensor | None] = [None] * len(matrices)
    release = donate and isinstance(matrices, list)
    alone, buckets, _ = _plan(matrices, dtype, method, multi_shapes)
    for i in alone:
        M = matrices[i]
        result = _orthogonalize(M, steps, coefficients, dtype, method, donate, eps)
        out[i] = result if keep_work_dtype else result.to(M.dtype)
        if release:
            matrices[i] = None  # released: its memory can serve the next matrix
    for (m, n, _, _, bucket_method, work_dtype), idx in buckets.items():
        for part in _stacks_of(idx, max_stack_bytes, stack_bytes(m, n, work_dtype)):
            device, out_dtype = matrices[part[0]].device, matrices[part[0]].dtype
            # One copy into the stack, cast to the work dtype and laid wide on the way. A stack
            # of one that stands for a larger one gets a zero partner (it stays zero): a batched
            # product of one matrix takes another kernel than of several (on a CPU, with other
            # last bits), and the partner keeps the kernel of its shape's other stacks.
            partner = len(part) == 1 and (m, n) in multi_shapes
            X = torch.empty(len(part) + partner, m, n, dtype=work_dtype, device=device)
            if partner:
                X[1].zero_()
            wide = []
            for k, i in enumerate(part):
                wide.append(matrices[i].shape[0] == m)
                X[k].copy_(matrices[i] if wide[-1] else matrices[i].mT)
                if release:
                    matrices[i] = None
            result = _newton_schulz_(X, schedule, norm, bucket_method)  # (K, m, n)
            if not keep_work_dtype:
                result = result.to(out_dtype)
            for k, i in enumerate(part):
                out[i] = result[k] if wide[k] else result[k].mT
    return out  # type: ignore[return-value]
