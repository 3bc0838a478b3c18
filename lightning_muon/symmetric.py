r"""Symmetric products of Newton-Schulz by row blocks: the same entries for 3/4 of the FLOPs.

A Newton-Schulz step makes two symmetric matrices: the Gram matrix ``A = S S^T`` of the
short side (``S`` is ``X`` laid wide, ``k x n``, ``k <= n``) and the square ``A A`` of the
symmetric ``A``. A general matmul computes both triangles. Cut the rows of the left factor
and the columns of the right one in halves; three products give the whole::

    P_11 = S_1 S_1^T    P_12 = S_1 S_2^T    P_22 = S_2 S_2^T    P_21 = P_12^T      # (3/4) 2 k^2 n FLOPs
    (A A)_rc = A[r, :] A[:, c]   for (r, c) in (1, 1), (1, 2), (2, 2);   (A A)_21 = (A A)_12^T

Every block is the dense product's own sub-block, one whole dot product per entry rounded
once: the dense product's entries (bitwise equal on the CPUs measured), in any dtype.
``B = b A + c A A`` takes ``b A`` into the same three calls (``addmm``). The third product
of a step, ``B X``, has no symmetric output and stays whole.

Halves run under the matmul kernel's best rate at small sizes, so blocks are used only
where they were measured faster, on the CPU (benchmarks/bench_optimizer.py, section
"symmetric"; AMD EPYC, 2 cores, AVX512-BF16, torch 2.13.0+cpu). Blocks over dense, bf16:
1.02-1.17 at 384 x 384, 0.91-1.08 at 384 x 768 (the border), 0.88-0.98 at 384 x 1152 and
384 x 1536, 0.82-0.90 at 768 x 768 to 768 x 3072, 0.77-0.90 at 1024; float32: 0.68-0.92
from 384 x 384 on. Stacked matrices
(bmm into block views: 1.3-1.6x slower in bf16) keep the dense products; so does CUDA,
where no GPU was at hand to measure them.

References:
    Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002, ch. 22
    (block algorithms for symmetric rank-k updates, BLAS ``syrk``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "SYMMETRIC_MIN_LONG_SIDE",
    "SYMMETRIC_MIN_SHORT_SIDE",
    "SymmetricProduct",
    "gram_",
    "square_",
    "symmetric_blocks",
]

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
    if device.type != "cpu":
        return False, False
    min_long = SYMMETRIC_MIN_SHORT_SIDE if dtype in _FULL_PRECISION else SYMMETRIC_MIN_LONG_SIDE

    def pays(k: int, n: int) -> bool:
        return k >= SYMMETRIC_MIN_SHORT_SIDE and n >= min_long

    return pays(short, long), pays(short, short)


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
