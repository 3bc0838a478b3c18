"""The machinery behind ``UpdateSpectrumMonitor``, free of Lightning: which matrices to watch,
the observer ``Muon`` calls after Newton-Schulz, the gather to rank zero, and the heatmap.

Where the work happens:

* ``SpectrumCollector.observe`` runs inside ``Muon.step`` on the rank that orthogonalized
  the matrices (every rank under ``muon_ddp`` / ``muon_fsdp``, each for the matrices it
  owns; rank zero alone when every rank steps everything, as under plain DDP). It turns
  each watched matrix into a few floats and, when asked, its singular values (k floats).
* ``SpectrumCollector.measure_dtensor_weights`` is called by every rank before the step:
  DTensor weights contribute the sums of squares of their local rows (gathered as a vector
  of one value per row or per matrix, never the matrix).
* ``SpectrumCollector.collect`` is called by every rank at the same point after the step:
  the small records go to rank zero with one ``gather_object``. A rank that owns nothing
  sends an empty list.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_muon.algorithms import get_algorithm, orthogonalizes
from lightning_muon.layout import MatrixLayout, layout_of
from lightning_muon.metrics import rms, singular_values, spectrum_stats

__all__ = ["MatrixSpectrum", "SpectrumCollector", "Target", "render_heatmap"]

try:  # torch >= 2.5; older builds have no DTensor and so no FSDP2 parameters to meet
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, DTensor) if DTensor else False


@dataclass
class Target:
    """One watched Muon parameter."""

    order: int
    """Position among the watched parameters (model order): the heatmap's row order."""
    name: str
    param: Tensor
    group: dict[str, Any]


@dataclass
class MatrixSpectrum:
    """What one matrix contributes at one logging step (small: travels to rank zero)."""

    name: str
    order: tuple[int, int]
    """(target order, matrix index within the parameter): a stable sort key."""
    scalars: dict[str, float]
    spectra: dict[str, Tensor] = field(default_factory=dict)
    """Singular values, descending, on the CPU: ``"update"`` (of the direction O), and
    ``"momentum"`` / ``"weight"`` when those are logged."""
    numel: int = 0


SMALL_SVD_ELEMENTS = 1 << 20
"""CPU matrices up to this size (1024 x 1024) are decomposed on one thread (``_svd_threads``)."""


@contextlib.contextmanager
def _svd_threads(matrix: Tensor) -> Iterator[None]:
    """One intra-op thread for the SVD of a small CPU matrix.

    LAPACK's SVD of a few-hundred-wide matrix is latency bound and gains nothing from more
    threads; on a busy machine the threads wait for each other: measured 190 ms on 2
    threads against 1.5 ms on one for a 128 x 128 ``svdvals`` on a loaded 2-core CPU.
    """
    threads = torch.get_num_threads()
    if matrix.device.type != "cpu" or threads == 1 or matrix.shape[-2] * matrix.shape[-1] > SMALL_SVD_ELEMENTS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _svdvals(matrix: Tensor) -> Tensor:
    """``singular_values``, with NaNs for each matrix that holds NaN or inf.

    LAPACK raises on non-finite input; raising inside one rank's optimizer step would leave
    the other ranks waiting in the gather, so such a matrix logs NaN instead.
    """
    finite = matrix.isfinite().all(dim=-1).all(dim=-1)  # (...,): one flag per matrix
    if bool(finite.all()):
        return singular_values(matrix)
    sv = singular_values(torch.where(finite[..., None, None], matrix, torch.zeros_like(matrix)))
    return sv.masked_fill(~finite[..., None], float("nan"))


def _matches(name: str, patterns: Sequence[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.search(pattern[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


class SpectrumCollector:
    """Selects the watched matrices of some ``Muon`` optimizers and measures their updates.

    Args:
        optimizers: the ``Muon`` optimizers (unwrapped) whose Muon groups (and variants') are watched.
        module: used to name parameters whose group has no ``"param_names"``.
        names: glob patterns (``fnmatch``) or ``"re:<regex>"`` (``re.search``); None: all.
        max_matrices: keep only this many parameters, the largest by element count.
        rtol: relative threshold of the smallest kept singular value.
        log_momentum: also measure the momentum fed to Newton-Schulz.
        log_weights: also measure the weight's spectrum (skipped for DTensor weights).
        keep_spectra: keep singular-value vectors (for histograms and the heatmap).
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        module: nn.Module | None = None,
        names: Sequence[str] | None = None,
        max_matrices: int | None = None,
        rtol: float = 1e-3,
        log_momentum: bool = False,
        log_weights: bool = False,
        keep_spectra: bool = True,
    ) -> None:
        self.optimizers = list(optimizers)
        self.rtol = rtol
        self.log_momentum = log_momentum
        self.log_weights = log_weights
        self.keep_spectra = keep_spectra
        self.records: list[MatrixSpectrum] = []
        self._pending: dict[int, list[MatrixSpectrum]] = {}  # target order -> records awaiting weight RMS
        self._weight_sums: dict[int, Tensor] | None = None  # target order -> per-matrix sums of squares
        self.skipped_weight_spectra = False  # set when a DTensor weight's spectrum was asked for
        by_module = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        candidates: list[tuple[str, Tensor, dict]] = []
        seen: set[int] = set()
        for k, opt in enumerate(self.optimizers):
            for g, group in enumerate(opt.param_groups):
                if not orthogonalizes(group):
                    continue
                group_names = group.get("param_names")
                for j, p in enumerate(group["params"]):
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    name = group_names[j] if group_names and j < len(group_names) else by_module.get(id(p))
                    candidates.append((name or f"opt{k}.group{g}.param{j}", p, group))
        self.available = [n for n, _, _ in candidates]
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            candidates = [c for c in candidates if _matches(c[0], names)]
            if not candidates:
                shown = ", ".join(self.available[:8]) + (", ..." if len(self.available) > 8 else "")
                raise ValueError(
                    f"UpdateSpectrumMonitor: names={list(names)!r} match none of the Muon matrices ({shown})"
                )
        if max_matrices is not None and len(candidates) > max_matrices:
            ranked = sorted(range(len(candidates)), key=lambda i: (-candidates[i][1].numel(), i))
            keep = set(ranked[:max_matrices])
            candidates = [c for i, c in enumerate(candidates) if i in keep]
        self.targets: list[Target] = []
        used: dict[str, int] = {}
        for order, (name, p, group) in enumerate(candidates):
            if name in used:  # the same name in two optimizers: keep keys apart
                used[name] += 1
                name = f"{name}#{used[name]}"
            used.setdefault(name, 0)
            self.targets.append(Target(order, name, p, group))
        self._by_id = {id(t.param): t for t in self.targets}
        self.has_dtensors = any(_is_dtensor(t.param) for t in self.targets)

    # ------------------------------------------------------------------ on the stepping rank

    def observes_on(self, optimizer: torch.optim.Optimizer, rank: int) -> bool:
        """Whether ``optimizer`` needs the observer on ``rank``.

        With a sharding (``muon_ddp``, ``muon_fsdp``) or DTensor parameters each rank steps
        only what it owns, so every rank observes. Otherwise every rank steps every matrix
        with the same result: rank zero alone measures them.
        """
        if getattr(optimizer, "sharding", None) is not None or self.has_dtensors:
            return True
        return rank == 0

    @torch.no_grad()
    def observe(self, group: dict, params: list[Tensor], updates: list[Tensor], ortho: list[list[Tensor]]) -> None:
        """An update hook (``Muon.register_update_hook``): measure the watched matrices among ``params``."""
        for p, u, pieces in zip(params, updates, ortho):
            target = self._by_id.get(id(p))
            if target is not None:
                self.records.extend(self._measure(target, group, p, u, pieces))

    def _measure(self, target: Target, group: dict, p: Tensor, u: Tensor, pieces: list[Tensor]) -> list[MatrixSpectrum]:
        layout = layout_of(group)  # splits, expert batches, (fan_in, fan_out) storage
        shapes = [o.shape for o in pieces]

        def views(t: Tensor | None) -> list[Tensor] | None:
            # The same (dim 0, rest) flattening and split as Newton-Schulz saw; None where the
            # tensor is not a full local one (DTensor) or does not split like the pieces.
            if t is None or _is_dtensor(t) or t.shape != p.shape:
                return None
            vs = layout.views(t.detach().contiguous())
            return vs if [v.shape for v in vs] == shapes else None

        weights = views(p)
        momenta = views(u) if self.log_momentum else None
        if self.log_weights and weights is None:
            self.skipped_weight_spectra = True
        lr = float(group["lr"])
        out: list[MatrixSpectrum] = []
        total = sum(o.shape[0] if o.ndim == 3 else 1 for o in pieces)
        index = 0
        for i, o in enumerate(pieces):
            o3 = o if o.ndim == 3 else o.unsqueeze(0)  # (B, r, c)
            rows, cols = o3.shape[-2:]
            scale = lr * get_algorithm(group["algorithm"]).update_scale(group, *layout.fans(rows, cols))
            weight = weights[i] if weights is not None else None
            momentum = momenta[i] if momenta is not None else None
            with _svd_threads(o3):
                columns, spectra = self._columns(o3, scale, weight, momentum)
            keys = list(columns)
            sv = spectra["update"]
            table = torch.stack([columns[k].to(sv.dtype) for k in keys]).cpu().tolist()  # (keys, B): one sync
            spectra_cpu = {k: v.float().cpu() for k, v in spectra.items()} if self.keep_spectra else {}
            for b in range(o3.shape[0]):
                name = target.name if total == 1 else f"{target.name}[{index}]"
                scalars = {k: row[b] for k, row in zip(keys, table)}
                if "weight_rms" in scalars:
                    scalars["update_to_weight_rms"] = _ratio(scalars["update_rms"], scalars["weight_rms"])
                record = MatrixSpectrum(
                    name, (target.order, index), scalars, {k: v[b] for k, v in spectra_cpu.items()}, rows * cols
                )
                out.append(record)
                if weights is None:
                    self._pending.setdefault(target.order, []).append(record)
                index += 1
        return out

    def _columns(
        self, o3: Tensor, scale: float, weight: Tensor | None, momentum: Tensor | None
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-matrix scalars (each ``(B,)``) and singular values of one ``(B, r, c)`` piece."""
        rows, cols = o3.shape[-2:]
        sv = _svdvals(o3)  # (B, k) of the direction O
        columns = _stat_columns(sv, self.rtol, "", scale)
        # ||scale O||_F = scale sqrt(sum s_i^2): the RMS without another pass over O.
        columns["update_rms"] = scale * (sv.square().sum(dim=-1) / (rows * cols)).sqrt()
        spectra = {"update": sv}
        if weight is not None:
            w3 = weight.reshape(o3.shape)
            columns["weight_rms"] = rms(w3)
            if self.log_weights:
                spectra["weight"] = svw = _svdvals(w3)
                columns.update(_stat_columns(svw, self.rtol, "weight_"))
        if momentum is not None:
            u3 = momentum.reshape(o3.shape)
            spectra["momentum"] = svu = _svdvals(u3)
            columns.update(_stat_columns(svu, self.rtol, "momentum_"))
            columns["momentum_rms"] = rms(u3)
        return columns, spectra

    # ------------------------------------------------------------------ on every rank

    @property
    def dtensor_weights_measured(self) -> bool:
        """Whether ``measure_dtensor_weights`` ran since the last ``collect``."""
        return self._weight_sums is not None

    @torch.no_grad()
    def measure_dtensor_weights(self) -> None:
        """Sums of squares of every watched DTensor weight, per matrix (all ranks, same point).

        Call it before the optimizer step (the callback does, in ``on_before_optimizer_step``)
        so that the weight RMS is the one the update applies to, as for plain tensors. Each
        rank squares its local rows; what travels is one value per row or per matrix.
        """
        self._weight_sums = {t.order: _matrix_sums_of_squares(t) for t in self.targets if _is_dtensor(t.param)}

    @torch.no_grad()
    def collect(self, group: Any = None) -> list[MatrixSpectrum] | None:
        """Every rank calls this at the same point; rank zero gets every record, sorted.

        Returns None on other ranks. Clears the records of this logging step. DTensor weights
        not measured before the step are measured now (after it).
        """
        if self.has_dtensors:
            if self._weight_sums is None:
                self.measure_dtensor_weights()
            self._finish_dtensor_weights(self._weight_sums or {})
        records, self.records, self._pending, self._weight_sums = self.records, [], {}, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            rank = dist.get_rank(group)
            gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
            dist.gather_object(records, gathered, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
            if rank != 0:
                return None
            records = [r for part in gathered or [] for r in part]
        unique: dict[str, MatrixSpectrum] = {}
        for r in records:  # replicas of one matrix (several data-parallel copies) log once
            unique.setdefault(r.name, r)
        return sorted(unique.values(), key=lambda r: r.order)

    def _finish_dtensor_weights(self, sums: dict[int, Tensor]) -> None:
        for order, records in self._pending.items():
            if order not in sums:
                continue
            for record in records:
                weight_rms = math.sqrt(float(sums[order][record.order[1]]) / record.numel)
                record.scalars["weight_rms"] = weight_rms
                record.scalars["update_to_weight_rms"] = _ratio(record.scalars["update_rms"], weight_rms)


def _stat_columns(sv: Tensor, rtol: float, prefix: str, scale: float = 1.0) -> dict[str, Tensor]:
    """``spectrum_stats`` as named columns; singular values scaled by ``scale``; NaN rows stay NaN.

    The orthogonality error is kept only for the update (no prefix): a weight or a momentum
    is not meant to be orthogonal.
    """
    stats = spectrum_stats(sv, rtol)
    stats["sigma_max"] = scale * stats["sigma_max"]
    stats["sigma_min"] = scale * stats["sigma_min"]
    if prefix:
        del stats["orthogonality_error"]
    bad = sv.isnan().any(dim=-1)  # (B,): a non-finite matrix (see _svdvals)
    return {f"{prefix}{k}": torch.where(bad, torch.full_like(v, float("nan")), v) for k, v in stats.items()}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _matrix_sums_of_squares(target: Target) -> Tensor:
    """Sum of squares of each matrix Muon makes of the (DTensor) parameter, on the CPU, in ``views`` order."""
    layout = layout_of(target.group)
    w = layout.as_batch(target.param.detach()) if layout.blocks is not None else target.param.detach()
    if layout.split_sizes is None:
        # One value per matrix; Shard(0) stays sharded over the leading dims (rows or experts).
        per = (w * w).sum(dim=(-2, -1)) if layout.batched else (w * w).sum()
        full = per.full_tensor() if _is_dtensor(per) else per
        return full.reshape(-1).float().cpu()
    # With splits, sums per output (a vector, never the matrix), then cut like the pieces.
    axis = layout.out_axis(w.ndim)
    keep = (*range(w.ndim - 2), axis) if layout.batched else (axis,)
    per_out = (w * w).sum(dim=tuple(d for d in range(w.ndim) if d not in keep))  # (B?, outputs)
    full = (per_out.full_tensor() if _is_dtensor(per_out) else per_out).float().cpu()
    # (B, 1, outputs) cut as a transposed split cuts its columns: per piece, (B, 1, groups, size_i)
    cut = MatrixLayout(layout.split_sizes, batched=True, transposed=True)
    pieces = cut.slots(full.reshape(-1, 1, full.shape[-1]).contiguous())
    return torch.cat([part.reshape(part.shape[0], -1).sum(dim=1) for part in pieces])  # piece-major, as logged


# ---------------------------------------------------------------------- heatmap

# A dark-to-light ramp (indigo, purple, red, orange, pale yellow): brightness grows
# monotonically with the value, so the image also reads in grey scale.
_RAMP = torch.tensor([[13, 8, 46], [84, 25, 122], [180, 55, 100], [245, 140, 45], [252, 250, 170]], dtype=torch.float32)
HEATMAP_WIDTH = 128
"""Columns of the heatmap: column j shows singular value number floor(j k / width)."""
HEATMAP_MAX_HEIGHT = 1024


def render_heatmap(spectra: Sequence[Tensor], width: int = HEATMAP_WIDTH, col_px: int = 2) -> np.ndarray:
    """An RGB image ``(H, W, 3)`` uint8: one row band per matrix, its normalised spectrum left to right.

    Row ``i`` shows ``s_j / s_1`` of matrix ``i`` (descending, so bright on the left), with
    the singular-value index stretched to ``width`` columns so that matrices of different
    sizes line up: a flat row (all bright) is an orthogonal update, a quick fade to dark a
    low-rank one. Bands are 8 pixels tall, fewer when there are many matrices.
    """
    if not spectra:
        raise ValueError("render_heatmap: no spectra to draw")
    rows = []
    for sv in spectra:
        sv = sv.float().reshape(-1)
        top = float(sv[0]) if sv.numel() else 0.0
        normed = sv / top if top > 0 else torch.zeros_like(sv)
        index = (torch.arange(width) * sv.numel()) // width  # (width,) into the k values
        rows.append(normed.clamp(0, 1)[index])
    values = torch.stack(rows)  # (matrices, width) in [0, 1]
    position = values * (len(_RAMP) - 1)
    low = position.floor().long().clamp(max=len(_RAMP) - 2)
    frac = (position - low).unsqueeze(-1)
    rgb = _RAMP[low] * (1 - frac) + _RAMP[low + 1] * frac  # (matrices, width, 3)
    row_px = max(1, min(8, HEATMAP_MAX_HEIGHT // len(spectra)))
    rgb = rgb.repeat_interleave(row_px, dim=0).repeat_interleave(col_px, dim=1)
    return rgb.round().clamp(0, 255).to(torch.uint8).numpy()
