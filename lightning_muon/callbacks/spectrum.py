"""``UpdateSpectrumMonitor``: what Muon's updates look like, layer by layer, in your logger."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_muon.callbacks._spectra import MatrixSpectrum, SpectrumCollector, render_heatmap
from lightning_muon.metrics import DEFAULT_RTOL
from lightning_muon.muon import Muon

__all__ = ["UpdateSpectrumMonitor"]

UPDATE_METRICS = (
    "sigma_max",
    "sigma_min",
    "stable_rank",
    "effective_rank",
    "orthogonality_error",
    "update_rms",
    "weight_rms",
    "update_to_weight_rms",
)
"""Scalars logged for every watched matrix, as ``spectra/<param name>/<metric>``."""


class UpdateSpectrumMonitor(Callback):
    r"""Logs the singular-value spectrum of the update Muon applies to each watched matrix.

    Every ``every_n_steps`` optimizer steps (``trainer.global_step``, so gradient
    accumulation is counted once per step), for each watched Muon matrix with applied
    update ``Delta = lr * adjust(rows, cols) * O`` (``O`` the orthogonalized momentum, as
    applied; weight decay, decoupled or cautious, shrinks the weight itself and is not part
    of it), logs ``spectra/<param name>/<metric>`` to every attached logger (NaN for a
    matrix holding NaN or inf):

    - ``sigma_max``, ``sigma_min``: largest and smallest *kept* singular value of ``Delta``
      (kept: above ``rtol * sigma_max``);
    - ``stable_rank`` (``||Delta||_F^2 / ||Delta||_2^2``) and ``effective_rank``
      (exponential of the entropy of the normalised singular values);
    - ``orthogonality_error``: ``||O^T O - I||_F / sqrt(k)`` on the short side, for the
      direction ``O`` itself. ~0 for plain Muon (up to Newton-Schulz's own error, ~0.1-0.3
      with the 5-step schedules); variants that rescale the direction after
      orthogonalization (NorMuon's second-moment normalization) apply a non-orthogonal
      ``O`` by design, and this reads accordingly large;
    - ``update_rms``, ``weight_rms`` and ``update_to_weight_rms`` (RMS of ``Delta`` over the
      RMS of the weight before the step);
    - with ``log_momentum``: ``momentum_sigma_max``, ``momentum_sigma_min``,
      ``momentum_stable_rank``, ``momentum_effective_rank``, ``momentum_rms`` of the momentum
      fed to Newton-Schulz; with ``log_weights``: ``weight_sigma_max``, ``weight_sigma_min``,
      ``weight_stable_rank``, ``weight_effective_rank``.

    A fused parameter orthogonalized in blocks (``split_sizes``) or a batch of matrices
    (``batched=True``) logs each matrix as ``<param name>[i]``. With a ``TensorBoardLogger``
    it also writes a histogram of each matrix's singular values (``.../singular_values``,
    of ``O``; ``.../momentum_singular_values`` and ``.../weight_singular_values`` when those
    are logged) and one image per logging step, ``spectra/heatmap``: a row per matrix
    (listed in the text entry ``spectra/heatmap_rows``), its singular values divided by the
    largest, left to right. Other loggers get the scalars; without a logger the latest
    scalars stay in ``last_metrics`` (rank zero).

    Args:
        every_n_steps: log every this many optimizer steps, starting with the first step.
        names: which Muon parameters to watch, by name (the routing's ``param_names``, else
            the module's): glob patterns (``"*.attn.*"``) or regular expressions prefixed
            ``"re:"`` (``re.search``); one string counts as a list of one. None: all.
        max_matrices: watch only this many parameters, the largest by element count
            (after ``names``). None: no limit.
        log_momentum: also log the spectrum of the momentum before orthogonalization.
        log_weights: also log the spectrum of the weight (not under FSDP, where no rank
            holds the full weight; a warning says so).
        histograms: write singular-value histograms to TensorBoard.
        heatmap: write the heatmap image to TensorBoard.
        rtol: relative threshold of the smallest kept singular value, in (0, 1).

    Raises:
        ValueError: on a bad argument (naming it), or when ``names`` matches no Muon matrix.

    Example::

        trainer = Trainer(callbacks=[UpdateSpectrumMonitor(every_n_steps=100, names=["*.mlp.*"])])

    Notes:
        Cost: nothing on other steps (the observer is attached only for the logging
        step). On a logging step, one ``torch.linalg.svdvals`` per watched matrix
        (``O(m n min(m, n))`` FLOPs, in float32, on one CPU thread for matrices up to
        1024 x 1024; one more each for momentum and weights when logged), done by the rank
        that orthogonalized the matrix, so the work is split across ranks like
        Newton-Schulz; then one ``gather_object`` of a few floats and k singular values per
        matrix to rank zero. On the demo model (16 matrices up to 512 x 128) at the default
        interval that is about 0.2% of training time on a 2-core CPU (0.12-0.27% across
        runs, ``benchmarks/bench_spectra.py``); ``names`` and ``max_matrices`` bound it
        for large models.

        Distributed: under ``muon_ddp`` and ``muon_fsdp`` each spectrum is computed once,
        by the matrix's owner; FSDP weights (DTensors) contribute only the sums of squares
        of their local rows. Under plain DDP every rank has every update and rank zero
        alone measures them. Every rank must run this callback.
    """

    METRICS = UPDATE_METRICS

    def __init__(
        self,
        every_n_steps: int = 50,
        names: Sequence[str] | None = None,
        max_matrices: int | None = None,
        log_momentum: bool = False,
        log_weights: bool = False,
        histograms: bool = True,
        heatmap: bool = True,
        rtol: float = DEFAULT_RTOL,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"UpdateSpectrumMonitor: every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if names is not None:
            if isinstance(names, str):
                names = [names]
            names = list(names)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(
                    f"UpdateSpectrumMonitor: names must be None or a non-empty list of non-empty strings, got {names!r}"
                )
        if max_matrices is not None and (
            isinstance(max_matrices, bool) or not isinstance(max_matrices, int) or max_matrices < 1
        ):
            raise ValueError(f"UpdateSpectrumMonitor: max_matrices must be None or an int >= 1, got {max_matrices!r}")
        for flag, value in (
            ("log_momentum", log_momentum),
            ("log_weights", log_weights),
            ("histograms", histograms),
            ("heatmap", heatmap),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"UpdateSpectrumMonitor: {flag} must be a bool, got {value!r}")
        if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0.0 < rtol < 1.0:
            raise ValueError(f"UpdateSpectrumMonitor: rtol must be a number in (0, 1), got {rtol!r}")
        self.every_n_steps = every_n_steps
        self.names = names
        self.max_matrices = max_matrices
        self.log_momentum = log_momentum
        self.log_weights = log_weights
        self.histograms = histograms
        self.heatmap = heatmap
        self.rtol = float(rtol)

        self.last_metrics: dict[str, float] = {}
        self.last_logged_step: int | None = None  # trainer.global_step of the last logging step
        self.logged_steps = 0
        self._collector: SpectrumCollector | None = None
        self._optimizers: list[Muon] = []
        self._handles: list[RemovableHandle] = []  # update hooks registered for the step being logged
        self._due_step: int | None = None
        self._heatmap_rows: list[str] = []
        self._warned: set[str] = set()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, names=self.names)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.last_logged_step is not None and self.last_logged_step >= trainer.global_step:
            self.last_logged_step = None  # a new fit on a used callback, not a resumed one
        optimizers = [opt._optimizer if isinstance(opt, LightningOptimizer) else opt for opt in trainer.optimizers]
        self._optimizers = [opt for opt in optimizers if isinstance(opt, Muon)]
        keep_spectra = (self.histograms or self.heatmap) and any(
            isinstance(lg, TensorBoardLogger) for lg in trainer.loggers
        )
        self._collector = SpectrumCollector(
            self._optimizers,
            pl_module,
            names=self.names,
            max_matrices=self.max_matrices,
            rtol=self.rtol,
            log_momentum=self.log_momentum,
            log_weights=self.log_weights,
            keep_spectra=keep_spectra,
        )
        if not self._collector.targets:
            rank_zero_warn(
                "UpdateSpectrumMonitor: the trainer has no Muon optimizer with a 'muon' group; nothing will be logged",
                category=RuntimeWarning,
            )
        elif not trainer.loggers:
            rank_zero_warn(
                "UpdateSpectrumMonitor: the trainer has no logger; the latest spectra are kept in `last_metrics` only",
                category=RuntimeWarning,
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._collector is None or not self._collector.targets or self._due_step is not None:
            return
        step, last, n = trainer.global_step, self.last_logged_step, self.every_n_steps
        # Due at multiples of every_n_steps (0, n, 2n, ...); once the step count reaches a new
        # multiple, since with several optimizers (manual optimization) it can jump past one.
        due = step % n == 0 if last is None else step // n > last // n
        if not due:
            return
        self._due_step = step
        for opt in self._optimizers:
            if self._collector.observes_on(opt, trainer.global_rank):
                self._handles.append(opt.register_update_hook(self._collector.observe))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # FSDP weights: every rank adds up its rows before the step (a collective; the same
        # condition holds on every rank), so the weight RMS is the pre-step one, as elsewhere.
        collector = self._collector
        if self._due_step is None or collector is None or not collector.has_dtensors:
            return
        if not collector.dtensor_weights_measured:
            collector.measure_dtensor_weights()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Same condition on every rank (global_step is the same everywhere): the gather below
        # is a collective that ranks without any owned matrix join too.
        if self._due_step is None or trainer.global_step <= self._due_step:
            return  # accumulating: the optimizer has not stepped yet
        self._detach()
        step_index, self._due_step = self._due_step, None
        records = self._collector.collect() if self._collector is not None else None
        self.last_logged_step = step_index
        if self._collector is not None and self._collector.skipped_weight_spectra and "dtensor" not in self._warned:
            self._warned.add("dtensor")
            rank_zero_warn(
                "UpdateSpectrumMonitor: log_weights needs the full weight matrix, which no rank holds under FSDP; "
                "weight spectra are skipped (weight_rms is still logged)",
                category=RuntimeWarning,
            )
        if trainer.global_rank != 0 or not records:
            return
        self.logged_steps += 1
        log_step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", step_index)
        self._log(trainer, records, log_step)

    def _log(self, trainer: pl.Trainer, records: list[MatrixSpectrum], step: int) -> None:
        metrics = {f"spectra/{r.name}/{key}": value for r in records for key, value in r.scalars.items()}
        self.last_metrics = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger) and (self.histograms or self.heatmap):
                self._heatmap_rows = _write_pictures(
                    logger.experiment, records, step, self.histograms, self.heatmap, self._heatmap_rows
                )

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()
        self._due_step = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()
        self._collector = None
        self._optimizers = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_step": self.last_logged_step, "logged_steps": self.logged_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_logged_step = state_dict.get("last_logged_step")
        self.logged_steps = state_dict.get("logged_steps", 0)


def _write_pictures(
    writer: Any, records: list[MatrixSpectrum], step: int, histograms: bool, heatmap: bool, shown_rows: list[str]
) -> list[str]:
    """TensorBoard histograms of singular values and the heatmap; returns the heatmap rows (listed on change)."""
    if histograms:
        for r in records:
            for kind, sv in r.spectra.items():
                prefix = "" if kind == "update" else f"{kind}_"
                writer.add_histogram(f"spectra/{r.name}/{prefix}singular_values", sv, step)
    with_sv = [r for r in records if "update" in r.spectra]
    if not heatmap or not with_sv:
        return shown_rows
    rows = [r.name for r in with_sv]
    if rows != shown_rows:
        listing = "\n".join(f"{i}. `{name}`" for i, name in enumerate(rows))
        writer.add_text("spectra/heatmap_rows", listing, step)
    writer.add_image("spectra/heatmap", render_heatmap([r.spectra["update"] for r in with_sv]), step, dataformats="HWC")
    return rows
