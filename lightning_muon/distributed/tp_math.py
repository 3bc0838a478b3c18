"""Newton-Schulz on tensor-parallel shards, and what each ``tp_mode`` costs: pure functions.

Tensor parallelism splits a weight ``W`` (rows x cols) along one dim over ``T`` ranks
(``ColwiseParallel``: dim 0, ``RowwiseParallel``: dim 1). Newton-Schulz runs on the wide
form ``X`` (m x n, m <= n: ``W`` itself, or ``W^T`` for a tall ``W``), whose every step is::

    A = X X^T                  # (m, m): the Gram matrix over the short side
    B = b A + c A A
    X = a X + B X

Split along the long side, ``X = [X_1 | ... | X_T]`` (each m x n_t), the Gram matrix is a
sum of the shards' Gram matrices and the rest of the step acts on each shard alone::

    A = sum_t X_t X_t^T        # one all-reduce of an m x m matrix
    X_t = a X_t + B X_t        # local: B is the same on every rank

and the Frobenius norm of the pre-scaling is a sum of the shards' squared norms (one
all-reduce of a scalar per matrix). No rank ever holds more than its shard of ``X``.

Split along the short side, ``X = [X_1; ...; X_T]`` (each m_t x n), ``A`` has the blocks
``X_s X_t^T``, which need other ranks' rows. Two exact ways out: iterate on the n x n
Gram ``X^T X = sum_t X_t^T X_t`` (an all-reduce of n^2 elements per step and 2 n^3
replicated FLOPs, both on the long side), or re-split once: an all-to-all turns the row
blocks into column blocks (m x n_t), the long-side iteration runs, and a second
all-to-all turns the result back. The re-split sends ``(T - 1) / T`` of a rank's shard
each way, ``2 (T - 1) / T^2 * m n`` elements per matrix in all, far less than
``steps * 2 (T - 1) / T * n^2``: ``MuonTPSharding`` re-splits.

``newton_schulz_on_shards`` takes the shards a process holds and an ``all_reduce``
callable: on a rank, its one shard and a sum over the tensor-parallel group; in a
simulation on one process, all the shards and no reduction at all (every sum is
already complete), which is how the unit test checks it against ``orthogonalize``.

References:
    Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024.
    NVIDIA Megatron-Core, ``TensorParallelMuon`` (``tp_mode`` "duplicated", "distributed",
    "blockwise").
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_muon.algorithms.families import TPMode
from lightning_muon.newton_schulz import FlooredNormalization, Normalization, ns_flops, prescale_divisor_

__all__ = [
    "TP_MODES",
    "long_side_split",
    "newton_schulz_on_shards",
    "tp_bytes",
    "tp_ns_flops",
    "TPMode",
]

TP_MODES: tuple[str, ...] = typing.get_args(TPMode)


def long_side_split(rows: int, cols: int, split_dim: int) -> bool:
    """True when splitting a rows x cols matrix along ``split_dim`` splits its wide form's long side.

    The wide form is the matrix itself when ``rows <= cols`` (long side: dim 1) and its
    transpose otherwise (long side: dim 0), as ``orthogonalize`` lays it out.
    """
    if split_dim not in (0, 1):
        raise ValueError(f"split_dim must be 0 or 1, got {split_dim!r}")
    return split_dim == (0 if rows > cols else 1)


@torch.no_grad()
def newton_schulz_on_shards(
    shards: Sequence[Tensor],
    schedule: Sequence[tuple[float, float, float]],
    norm: Normalization | FlooredNormalization,
    all_reduce: Callable[[Tensor], Tensor],
) -> list[Tensor]:
    """Newton-Schulz on column blocks of wide matrices; returns the blocks of the result.

    Args:
        shards: ``(K, m, n_j)`` blocks of ``K`` wide matrices (m <= n), split along the
            long side, in the dtype to iterate in. A rank passes its one block; a one-process
            simulation passes every block.
        schedule: ``(a, b, c)`` per step (``resolve_coefficients``).
        norm: the pre-scaling of the schedule (``X / (||X||_F * safety + eps)``; with ``ns_eps`` a floor,
            ``FlooredNormalization``).
        all_reduce: sums a tensor over the ranks holding the other blocks, in place, and
            returns it; the identity when ``shards`` are all the blocks.

    Each step all-reduces the ``(K, m, m)`` partial Gram matrices once, and the pre-scaling
    one ``(K,)`` vector of squared norms. Every product but ``A A`` is on a block; ``A A``
    (2 m^3 FLOPs) is repeated on every rank.
    """
    if not shards:
        raise ValueError("newton_schulz_on_shards needs at least one shard")
    K, m = shards[0].shape[:2]
    if any(s.shape[:2] != (K, m) for s in shards):
        raise ValueError(f"shards must share (K, m) = {(K, m)}, got {[tuple(s.shape) for s in shards]}")
    work = shards[0].dtype
    acc = torch.promote_types(work, torch.float32)
    # Squared norms summed in float32 at least, as ``orthogonalize``'s norm of a bf16 X is;
    # the norm is then rounded to the work dtype as there, so one process and T ranks agree.
    sq = torch.zeros(K, dtype=acc, device=shards[0].device)
    for s in shards:
        sq += s.to(acc).square().sum(dim=(-2, -1))
    fro = all_reduce(sq).sqrt().to(work).to(acc).view(K, 1, 1)
    scale = prescale_divisor_(fro, norm).to(work)
    X = [s.div(scale) for s in shards]  # (K, m, n_j) each
    for a, b, c in schedule:
        A = torch.bmm(X[0], X[0].mT)  # (K, m, m) partial Gram matrix
        for x in X[1:]:
            A.baddbmm_(x, x.mT)
        A = all_reduce(A)
        B = torch.mul(A, b) if c == 0.0 else torch.baddbmm(A, A, A, beta=b, alpha=c)  # (K, m, m)
        X = [torch.baddbmm(x, B, x, beta=a) for x in X]
    return X


def tp_ns_flops(rows: int, cols: int, steps: int, tp: int, mode: str, split_dim: int = 0) -> int:
    """Newton-Schulz FLOPs on each rank of the tensor-parallel group that orthogonalizes one matrix.

    - ``duplicated``: the whole matrix on every rank, ``steps (4 n m^2 + 2 m^3)``.
    - ``distributed``: ``steps (4 (n / T) m^2 + 2 m^3)``: the two products with a block,
      and ``A A`` repeated (n / T rounded up: the largest block).
    - ``blockwise``: the block's own iteration (its short side may differ from the matrix's).
    """
    _check_mode(mode)
    m, n = min(rows, cols), max(rows, cols)
    if mode == "duplicated" or tp == 1:
        return ns_flops(rows, cols, steps)
    if mode == "distributed":
        return steps * (4 * math.ceil(n / tp) * m * m + 2 * m**3)
    block = (math.ceil(rows / tp), cols) if split_dim == 0 else (rows, math.ceil(cols / tp))
    return ns_flops(*block, steps)


def tp_bytes(rows: int, cols: int, steps: int, tp: int, mode: str, split_dim: int, element_size: int) -> float:
    """Bytes one rank of the owning tensor-parallel group sends to orthogonalize one matrix.

    For ``P = rows * cols`` elements of ``e`` bytes, T ranks, short side ``m``:

    - ``duplicated``: the all-gather of the shards, ``(T - 1) / T * P * e``.
    - ``distributed``: per step an all-reduce of the ``m x m`` Gram matrix, plus one of
      the squared norm (float32), ``steps * 2 (T - 1) / T * m^2 * e + 2 (T - 1) / T * 4``;
      split along the short side, also the re-split there and back,
      ``2 (T - 1) / T^2 * P * e``.
    - ``blockwise``: nothing.
    """
    _check_mode(mode)
    if tp == 1 or mode == "blockwise":
        return 0.0
    ring = (tp - 1) / tp
    P, m = rows * cols, min(rows, cols)
    if mode == "duplicated":
        return ring * P * element_size
    sent = steps * 2 * ring * m * m * element_size + 2 * ring * 4
    if not long_side_split(rows, cols, split_dim):
        sent += 2 * ring * P / tp * element_size
    return sent


def _check_mode(mode: str) -> None:
    if mode not in TP_MODES:
        raise ValueError(f"tp_mode must be one of {TP_MODES}, got {mode!r}")
