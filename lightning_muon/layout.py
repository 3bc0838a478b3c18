"""Which matrices a tensor holds: one frozen ``MatrixLayout`` per Muon param group.

Muon orthogonalizes matrices, and a parameter is not always one. A layout says how to cut
a tensor into the matrices Newton-Schulz sees, and which way each of them faces:

- ``batched``: a ``(..., rows, cols)`` tensor is a batch of matrices, one per index of the
  leading dims (mixture-of-experts stacks: ``(E, out, in)``). Otherwise the tensor is one
  ``(dim 0, rest)`` matrix (a conv kernel: ``(out, in * kh * kw)``).
- ``blocks``: with ``batched``, a 2-D tensor whose dim 0 holds that many matrices one after
  another: DBRX stores its experts as ``(E * F, H)``, a batch of ``E`` matrices of ``F`` rows
  (``as_batch`` views it ``(E, F, H)``, no copy).
- ``transposed``: each matrix is stored ``(fan_in, fan_out)``, the transpose of
  ``nn.Linear``'s weight (transformers' ``Conv1D``, GPT-OSS's experts). The output axis is
  then the last one. The matrices keep the stored layout (the polar factor of a transpose is
  the transpose of the polar factor); only the split axis, the lr scale and the per-output
  statistics (NorMuon) read the orientation.
- ``split_sizes``: each matrix's output axis holds several matrices side by side (a fused
  QKV, a fused gate/up). When the sizes sum to a proper divisor ``S`` of the output size
  ``n``, the axis is ``groups = n / S`` consecutive blocks laid out alike (Megatron's GQA
  ``[q | k | v]`` per query group), and piece ``i`` gathers block ``i`` of every group:
  a ``(groups * split_sizes[i], cols)`` matrix. ``split_sizes=(1, 1)`` is therefore an
  interleaved pair (GPT-OSS's gate/up: output ``2j`` is gate ``j``, ``2j + 1`` is up ``j``),
  and ``(I, I)`` the concatenated halves of Mixtral's ``gate_up_proj``.

Everything that needs the matrices asks the layout: the optimizer's step (views and
writable slots, the lr scale by fan-out and fan-in, NorMuon's per-output statistics), the
owner plan (Newton-Schulz FLOPs per matrix), the shardings (whether a rank's row block
holds whole matrices, and whether it holds row blocks of each piece: the distribution facts
no sharding or algorithm works out for itself), the spectrum monitor and the routing
report. A param group stores the layout as plain data (the ``split_sizes``, ``batched`` and
``transposed`` keys, which checkpoints and YAML carry); ``layout_of(group)``
turns them into the object.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["LAYOUT_KEYS", "MatrixLayout", "check_muon_params", "layout_of", "resolve_split_parts"]

# The param-group keys that hold a layout (``split_parts`` is resolved into ``split_sizes``).
LAYOUT_KEYS = ("split_sizes", "batched", "transposed", "blocks")


@dataclass(frozen=True)
class MatrixLayout:
    """How a tensor is cut into the matrices Muon orthogonalizes (module docstring)."""

    split_sizes: tuple[int, ...] | None = None
    """Pieces along each matrix's output axis, or None for one piece."""
    batched: bool = False
    """The leading dims index a batch of matrices (expert stacks)."""
    transposed: bool = False
    """Each matrix is stored ``(fan_in, fan_out)``."""
    blocks: int | None = None
    """With ``batched``: the matrices of a 2-D tensor, one after another along dim 0 (``(E * F, H)``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.batched, bool):
            raise ValueError(f"batched must be a bool, got {self.batched!r}")
        if not isinstance(self.transposed, bool):
            raise ValueError(f"transposed must be a bool, got {self.transposed!r}")
        if self.blocks is not None:
            if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 1:
                raise ValueError(f"blocks must be a positive int or None, got {self.blocks!r}")
            if not self.batched:
                raise ValueError(f"blocks={self.blocks} needs batched=True (the blocks are a batch of matrices)")
        sizes = self.split_sizes
        if sizes is not None:
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
                raise ValueError(f"split_sizes must be a non-empty list of positive ints, got {sizes!r}")
            if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
                raise ValueError(f"split_sizes must be a non-empty list of positive ints, got {sizes!r}")
            object.__setattr__(self, "split_sizes", tuple(sizes))

    # ------------------------------------------------------------------ shapes

    def out_axis(self, ndim: int) -> int:
        """The axis of the batch view (``as_batch``; the tensor itself unless ``blocks``) that holds outputs."""
        if self.blocks is not None:
            ndim = 3
        if self.batched:
            return ndim - 1 if self.transposed else ndim - 2
        return 1 if self.transposed else 0

    def batch_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The batch dims of a tensor of ``shape``: ``(E,)`` for a stack ``(E, rows, cols)``, ``()`` if not batched."""
        shape = tuple(shape)
        if self.blocks is not None:
            return (self.blocks,)
        return shape[:-2] if self.batched else ()

    def batch_view_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape ``as_batch`` gives: ``(*batch_shape, rows, cols)``, or the ``(dim 0, rest)`` matrix."""
        shape = tuple(shape)
        if self.blocks is not None:
            return (self.blocks, shape[0] // self.blocks, *shape[1:])
        if self.batched:
            return shape
        return (shape[0], math.prod(shape[1:]))

    def as_batch(self, t: Tensor) -> Tensor:
        """``t`` as its batch of matrices ``(..., rows, cols)`` (a stack as it is, DBRX's ``(E * F, H)`` as
        ``(E, F, H)``), or as its one ``(dim 0, rest)`` matrix: a view of a contiguous tensor."""
        if self.batched and self.blocks is None:
            return t
        return (
            t.view(self.batch_view_shape(t.shape)) if t.is_contiguous() else t.reshape(self.batch_view_shape(t.shape))
        )

    def matrix_form(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """``(B, rows, cols)``: the tensor as a batch of stored matrices (``B = 1`` unless batched)."""
        shape = self.batch_view_shape(shape) if self.blocks is not None else tuple(shape)
        if self.batched:
            return math.prod(shape[:-2]), shape[-2], shape[-1]
        return 1, shape[0], math.prod(shape[1:])

    def piece_shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
        """The shapes of ``views``' pieces for a tensor of ``shape``, without a tensor.

        ``(rows, cols)`` per piece, ``(B, rows, cols)`` when batched; with ``split_sizes``
        summing to ``S``, piece ``i`` has ``groups * split_sizes[i]`` outputs
        (``groups = outputs / S``).
        """
        b, rows, cols = self.matrix_form(shape)
        if self.split_sizes is None:
            pieces = [(rows, cols)]
        elif self.transposed:
            groups = cols // sum(self.split_sizes)
            pieces = [(rows, groups * s) for s in self.split_sizes]
        else:
            groups = rows // sum(self.split_sizes)
            pieces = [(groups * s, cols) for s in self.split_sizes]
        return [(b, *piece) for piece in pieces] if self.batched else pieces

    def matrix_shapes(self, shape: Sequence[int]) -> list[tuple[int, int]]:
        """The ``(rows, cols)`` of every matrix Newton-Schulz sees, a batch of ``B`` counted as ``B``."""
        out: list[tuple[int, int]] = []
        for piece in self.piece_shapes(shape):
            out += [piece[-2:]] * (piece[0] if len(piece) == 3 else 1)
        return out

    def fans(self, rows: int, cols: int) -> tuple[int, int]:
        """``(fan_out, fan_in)`` of a stored ``rows x cols`` matrix."""
        return (cols, rows) if self.transposed else (rows, cols)

    def matrices_per_tensor(self, shape: Sequence[int]) -> int:
        """How many matrices a tensor of ``shape`` holds (experts times pieces)."""
        return len(self.matrix_shapes(shape))

    # ------------------------------------------------------------------ distribution facts

    @property
    def row_blocks_hold_whole_matrices(self) -> bool:
        """Whether a block of dim 0 (``Shard(0)``, a rank's experts) holds whole matrices.

        True for a stack whose dim 0 indexes its matrices (an expert stack ``(E, out, in)``):
        per-matrix work then runs on any rank's block of it, and nothing moves. False for
        one matrix (a row block cuts it) and for ``blocks`` (dim 0 runs through each matrix's rows).
        """
        return self.batched and self.blocks is None

    @property
    def row_blocks_hold_piece_rows(self) -> bool:
        """Whether a block of dim 0 of a tensor is, piece by piece, a block of dim 0 of each piece of ``views``.

        True unless ``split_sizes`` cut dim 0 itself (a fused QKV stored ``(out, in)``): a split
        along the columns (a ``Conv1D``'s fused QKV) leaves every piece all the rows, and a
        stack's block of matrices is a block of each piece's. Then a rank's rows of a piece
        are the pieces of its rows, and a sharding can cut and place them locally.
        """
        return self.split_sizes is None or self.batched or self.transposed

    # ------------------------------------------------------------------ tensors

    def slots(self, t: Tensor) -> list[Tensor]:
        """Writable views of a contiguous tensor, one per piece of ``views``.

        Each slot holds its piece's elements in the piece's element order: the piece itself,
        or for a grouped split a strided view with one more dim (``(B?, groups, size_i,
        cols)``; transposed ``(B?, rows, groups, size_i)``), so that
        ``slot.copy_(piece.view(slot.shape))`` writes a piece back.
        """
        b, rows, cols = self.matrix_form(t.shape)
        m = t.view(b, rows, cols)  # (B, rows, cols)
        if self.split_sizes is None:
            parts = [m]
        else:
            sizes = list(self.split_sizes)
            if self.transposed:  # outputs are the columns
                groups = cols // sum(sizes)
                if groups == 1:
                    parts = list(m.split(sizes, dim=2))
                else:
                    parts = list(m.view(b, rows, groups, sum(sizes)).split(sizes, dim=3))  # (B, rows, groups, size_i)
            else:
                groups = rows // sum(sizes)
                if groups == 1:
                    parts = list(m.split(sizes, dim=1))
                else:
                    parts = list(m.view(b, groups, sum(sizes), cols).split(sizes, dim=2))  # (B, groups, size_i, cols)
        return parts if self.batched else [part.squeeze(0) for part in parts]

    def views(self, t: Tensor) -> list[Tensor]:
        """The matrices Muon orthogonalizes in a contiguous tensor (views, but grouped splits are copies)."""
        return [s.reshape(shape) for s, shape in zip(self.slots(t), self.piece_shapes(t.shape))]

    def stat_shape(self, piece_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of a per-output statistic of a piece (NorMuon): its input axis reduced to 1."""
        shape = list(piece_shape)
        shape[-2 if self.transposed else -1] = 1
        return tuple(shape)

    @property
    def in_axis(self) -> int:
        """The axis of a piece (``(..., rows, cols)``) that runs over its inputs."""
        return -2 if self.transposed else -1

    # ------------------------------------------------------------------ checks and words

    def check(self, p: Tensor, label: str) -> None:
        """Raise ``ValueError`` (naming ``label``) when ``p`` cannot hold this layout."""
        shape = tuple(p.shape)
        if p.ndim < 2:
            raise ValueError(
                f"{label}: Muon needs a matrix, got a {p.ndim}-D tensor of shape {shape}; "
                "route it to 'adamw', 'lion' or 'adamw_schedulefree'"
            )
        if self.blocks is not None:
            if p.ndim != 2 or shape[0] % self.blocks:
                raise ValueError(
                    f"{label}: blocks={self.blocks} needs a 2-D tensor whose dim 0 is a multiple of it, got shape "
                    f"{shape}"
                )
        elif self.batched and p.ndim < 3:
            raise ValueError(f"{label}: batched=True needs a tensor with 3+ dims, got shape {shape}")
        if self.transposed and not self.batched and p.ndim != 2:
            raise ValueError(
                f"{label}: transposed=True needs a 2-D (fan_in, fan_out) weight (or batched=True for a stack "
                f"of them), got {shape}"
            )
        if self.split_sizes is not None:
            axis = self.out_axis(p.ndim)
            total = sum(self.split_sizes)
            if self.batch_view_shape(shape)[axis] % total != 0:
                what = "a (fan_in, fan_out) weight, transposed=True" if self.transposed else "a (fan_out, ...) weight"
                size = self.batch_view_shape(shape)[axis]
                raise ValueError(
                    f"{label}: split_sizes {self.split_sizes} sum to {total}, but dim {axis} has size "
                    f"{size}, not a multiple of it (dim {axis} is the output axis of {what}, shape {shape})"
                )

    def describe(self, shape: Sequence[int] | None = None) -> str:
        """A short, space-free form for the routing report: ``out,in``, ``in,out(T)``, ``4x(out,in)/2``."""
        face = "in,out(T)" if self.transposed else "out,in"
        if self.batched:
            count = self.matrix_form(shape)[0] if shape is not None else "B"
            face = f"{count}x({face})"
        if self.split_sizes is not None:
            face += f"/{len(self.split_sizes)}"
        return face

    def options(self) -> dict[str, Any]:
        """The param-group keys that store this layout (``blocks`` only where it is set)."""
        options = {"split_sizes": self.split_sizes, "batched": self.batched, "transposed": self.transposed}
        return options if self.blocks is None else {**options, "blocks": self.blocks}


@functools.lru_cache(maxsize=256)
def _cached(split_sizes: tuple[int, ...] | None, batched: bool, transposed: bool, blocks: int | None) -> MatrixLayout:
    return MatrixLayout(split_sizes, batched, transposed, blocks)


def layout_of(group: Mapping[str, Any]) -> MatrixLayout:
    """The layout a Muon param group stores (its ``split_sizes``, ``batched``, ``transposed`` and ``blocks`` keys)."""
    sizes = group.get("split_sizes")
    batched, transposed, blocks = group.get("batched", False), group.get("transposed", False), group.get("blocks")
    try:
        return _cached(tuple(sizes) if sizes is not None else None, batched, transposed, blocks)
    except (TypeError, ValueError):  # a malformed value: build it uncached, so the error shows it as given
        return MatrixLayout(sizes, batched, transposed, blocks)


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
