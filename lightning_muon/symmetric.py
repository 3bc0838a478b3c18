r"""Symmetric products of Newton-Schulz by 2 x 2 blocks: the same values for fewer FLOPs.

Two of a Newton-Schulz step's three products make symmetric matrices: the Gram matrix
``A = S S^T`` of the short side (``S`` is ``X`` laid wide, ``k x n``, ``k <= n``) and the
square ``A A`` of a symmetric ``A``. A general matmul computes both triangles. Cut the
short side in halves, ``S = [S_1; S_2]``, and three block products give the whole::

    A_11 = S_1 S_1^T    A_12 = S_1 S_2^T    A_22 = S_2 S_2^T    A_21 = A_12^T   # (3/4) 2 k^2 n FLOPs

Every entry is still one whole dot product over ``n``, rounded once, so the result is the
full product's (the same entries; exactly symmetric). For ``B = b A + c A A``::

    B_11 = b A_11 + c (A_11 A_11 + A_12 A_12^T)
    B_12 = b A_12 + c (A_11 A_12 + A_12 A_22)       B_21 = B_12^T
    B_22 = b A_22 + c (A_12^T A_12 + A_22 A_22)                                     # (3/4) 2 k^3 FLOPs

where each block is accumulated in two products: its partial sum is rounded once more,
which float32 absorbs and bf16 would not, so the square is cut in blocks in float32 and
float64 only. The third product, ``B X``, has no symmetric output and stays whole.

Halves run under the matmul kernel's best rate at small sizes, so blocks are used only
where they were measured faster, on the CPU (benchmarks/bench_optimizer.py, section
"symmetric": AMD EPYC, 2 cores, AVX512-BF16, torch 2.13.0+cpu). Block products of bf16
``S S^T`` over dense ones: 0.91 at 384 x 768, 0.88 at 384 x 1536, 0.83-0.88 from 512 x 1024
to 768 x 1536, 0.79-0.82 at 1024 and 1536; 1.00-1.02 at 384 x 384. In float32 the Gram
product gains 0.79-0.87 and the square 0.82-0.93 from a short side of 384. Batched (stacked)
products lose (bmm into block views: 1.3-1.6x slower in bf16) and keep the dense ones; so
does CUDA, where no GPU was at hand to measure them.

References:
    Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002, ch. 22
    (block algorithms for symmetric rank-k updates, BLAS ``syrk``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SYMMETRIC_MIN_LONG_SIDE", "SYMMETRIC_MIN_SHORT_SIDE", "gram_", "square_", "symmetric_blocks"]

# Smallest short and long side from which the block products run faster (see the module
# docstring for the measurements): 384 x 384 in bf16 gains nothing, 384 x 768 gains 9%.
SYMMETRIC_MIN_SHORT_SIDE = 384
SYMMETRIC_MIN_LONG_SIDE = 768

_FULL_PRECISION = (torch.float32, torch.float64)


def symmetric_blocks(short: int, long: int, dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """``(Gram product by blocks, square by blocks)`` for one ``short x long`` matrix iterated alone.

    Blocks where they were measured faster: on the CPU, from a short side of
    ``SYMMETRIC_MIN_SHORT_SIDE`` and a long side of ``SYMMETRIC_MIN_LONG_SIDE`` for the Gram
    product in any dtype; the square (whose blocks round a partial sum) in float32 and
    float64 only, from a short side of ``SYMMETRIC_MIN_SHORT_SIDE``.
    """
    if device.type != "cpu" or short < SYMMETRIC_MIN_SHORT_SIDE:
        return False, False
    return long >= SYMMETRIC_MIN_LONG_SIDE, dtype in _FULL_PRECISION


def gram_(S: Tensor, out: Tensor, blocks: bool) -> Tensor:
    """``out <- S S^T`` for a ``(k, n)`` matrix ``S`` (any strides); with ``blocks``, three block products."""
    if not blocks:
        return torch.mm(S, S.mT, out=out)
    h = S.shape[0] // 2
    S1, S2 = S[:h], S[h:]  # (h, n), (k - h, n)
    torch.mm(S1, S1.mT, out=out[:h, :h])
    torch.mm(S1, S2.mT, out=out[:h, h:])
    torch.mm(S2, S2.mT, out=out[h:, h:])
    out[h:, :h].copy_(out[:h, h:].mT)
    return out


def square_(A: Tensor, out: Tensor, b: float, c: float, blocks: bool) -> Tensor:
    """``out <- b A + c A A`` for a symmetric ``(k, k)`` ``A``; with ``blocks``, six half-size products."""
    if not blocks:
        return torch.addmm(A, A, A, beta=b, alpha=c, out=out)
    h = A.shape[0] // 2
    A11, A12, A22 = A[:h, :h], A[:h, h:], A[h:, h:]
    torch.addmm(A11, A11, A11, beta=b, alpha=c, out=out[:h, :h]).addmm_(A12, A12.mT, alpha=c)
    torch.addmm(A12, A11, A12, beta=b, alpha=c, out=out[:h, h:]).addmm_(A12, A22, alpha=c)
    torch.addmm(A22, A22, A22, beta=b, alpha=c, out=out[h:, h:]).addmm_(A12.mT, A12, alpha=c)
    out[h:, :h].copy_(out[:h, h:].mT)
    return out
