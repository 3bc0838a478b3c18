"""Lightning glue: ``configure_muon_optimizers``, ``MuonModuleMixin`` and the list API.

One hybrid optimizer is the default because Lightning's automatic optimization
takes a single optimizer (and keeps gradient clipping and accumulation working).
The list API (``build_optimizers`` / ``build_schedulers``) returns one optimizer
per algorithm for manual optimization and plain PyTorch loops.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_muon.algorithms import algorithm_names
from lightning_muon.callbacks.checkpoint_checks import CheckpointChecks
from lightning_muon.callbacks.finetuning import UnfreezeOnResume
from lightning_muon.callbacks.progress import replaces_default_bar
from lightning_muon.callbacks.schedule_free import ScheduleFreeModeSwitch, save_in_eval_mode
from lightning_muon.config import MuonConfig
from lightning_muon.muon import Muon
from lightning_muon.one_lr import apply_one_lr, reapply_schedule, retune_running_schedule
from lightning_muon.routing import Rule
from lightning_muon.routing.param_groups import as_groups
from lightning_muon.schedules import MuonScheduler

__all__ = ["MuonModuleMixin", "build_optimizers", "build_schedulers", "configure_muon_optimizers"]

# Checkpoints hold hyperparameters; let torch.load(weights_only=True) (Lightning's
# default for local files) rebuild our plain-data config classes.
torch.serialization.add_safe_globals([MuonConfig, Rule])


def _total_steps(config: MuonConfig, module: nn.Module | None) -> int | None:
    """``config.schedule.total_steps``, else the trainer's estimate when the schedule needs one."""
    if config.schedule.total_steps is not None:
        return config.schedule.total_steps
    trainer = getattr(module, "_trainer", None)
    estimate = trainer.estimated_stepping_batches if trainer is not None else None
    known = estimate is not None and math.isfinite(estimate) and estimate >= 1
    if not config.schedule.needs_total_steps:
        # The schedule does not depend on the run's length (constant, inverse_sqrt), but a
        # warmup or stable phase longer than the run would never reach the peak lr: the same
        # error as for the falloffs that need the total.
        if known:
            config.schedule.check_fits(int(estimate))
        return None
    if not known:
        raise ValueError(
            f"MuonConfig.schedule.total_steps is needed by falloff={config.schedule.falloff!r} (or a fractional phase) "
            f"and could not be taken from the trainer (estimated_stepping_batches={estimate}); set total_steps or "
            "max_steps"
        )
    return int(estimate)


def configure_muon_optimizers(module: nn.Module, config: MuonConfig | dict[str, Any] | None = None) -> dict:
    """Build the hybrid ``Muon`` and its step-wise scheduler for ``module``.

    Returns Lightning's optimizer config: ``{"optimizer": Muon, "lr_scheduler": {"scheduler":
    MuonScheduler, "interval": "step", "frequency": 1, "name": "muon"}}``. The routing report
    is logged on rank zero. Groups added later without an ``"algorithm"`` (``BackboneFinetuning``
    unfreezing a backbone) are routed by the same rules (``added_groups.ModuleRouter``).
    """
    config = MuonConfig.from_any(config)
    groups = config.route(module)
    rank_zero_info(groups.report())
    optimizer = config.make_optimizer(groups)
    optimizer.attach_router(config.router(module))  # a backbone unfrozen later is routed alike
    schedule = config.schedule.build(_total_steps(config, module))
    scheduler = MuonScheduler(optimizer, schedule, config.schedule.momentum_warmup)
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": "muon"},
    }


def _config_given_to_init(module: nn.Module) -> MuonConfig | dict[str, Any] | None:
    """The ``MuonConfig`` (or a ``muon_config`` dict) given to the ``__init__`` of ``module`` that is running now.

    Read off the stack as Lightning's ``save_hyperparameters`` reads the arguments: the frames
    of ``__init__`` methods whose first argument is ``module`` (the class's and its bases');
    the outermost, the class made, wins.
    """
    given = None
    frame, seen = sys._getframe(2), False  # past __setattr__
    for _ in range(64):
        if frame is None:
            break
        code = frame.f_code
        own = code.co_name == "__init__" and code.co_argcount > 0 and frame.f_locals.get(code.co_varnames[0]) is module
        if not own and seen:
            break
        if own:
            seen = True
            arguments = inspect.getargvalues(frame)
            values = [(name, arguments.locals[name]) for name in arguments.args[1:]]
            values += [("", value) for value in arguments.locals.get(arguments.varargs) or ()]
            values += list((arguments.locals.get(arguments.keywords) or {}).items())
            for name, value in values:
                if isinstance(value, MuonConfig) or name in ("muon_config", "muon") and isinstance(value, dict):
                    given = value
        frame = frame.f_back
    return given


class MuonModuleMixin:
    """Gives a LightningModule ``configure_optimizers`` with Muon; list it before LightningModule.

    The config is read from, in order: ``self.muon_config`` (a ``MuonConfig`` or a dict of its
    fields), ``self.hparams["muon_config"]``, ``self.hparams["muon"]``, the ``MuonConfig`` given
    to ``__init__`` (or a dict given as its ``muon_config`` argument) when the module kept it
    nowhere (no ``save_hyperparameters()``); otherwise defaults.

    When the config routes parameters to ``"adamw_schedulefree"``, ``configure_callbacks``
    adds ``ScheduleFreeModeSwitch`` (validation, test and checkpoints at the averaged
    weights, training at the training ones) and ``on_save_checkpoint`` does the same for
    weights-only checkpoints. When ``max_steps`` is set, it puts ``MaxStepsProgressBar`` in
    place of Lightning's default ``RichProgressBar`` (which would read ``Epoch 0/-2``), and with a
    ``BaseFinetuning`` it adds ``UnfreezeOnResume`` (a backbone unfrozen before a checkpoint
    trains again after a resume). It always adds ``CheckpointChecks``: a ``muon_fsdp``
    checkpoint folder given to a strategy that reads files raises an error naming the ways
    out, checkpoints record the strategy that saved them, and a resume that changes the data
    sampler (a ``muon_ddp`` checkpoint on one device) warns.

    Lightning's tools that set one lr for every group (the lr finder, SWA's ``swa_lrs``) see
    it read as the Muon lr, each group taking its configured share (``on_before_optimizer_step``,
    ``one_lr``), and the lr finder tunes ``lr``, the config's Muon lr. A subclass overriding
    ``configure_callbacks``, ``on_save_checkpoint`` or ``on_before_optimizer_step`` calls ``super()``.

    Example::

        class MyModel(MuonModuleMixin, L.LightningModule):
            def __init__(self, muon_config: MuonConfig | None = None):
                super().__init__()
                self.save_hyperparameters()
    """

    muon_config: MuonConfig | dict[str, Any] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if pl.LightningModule in mro and mro.index(pl.LightningModule) < mro.index(MuonModuleMixin):
            owner = next(c for c in mro if "configure_optimizers" in vars(c))
            if owner is pl.LightningModule:
                raise TypeError(
                    f"{cls.__name__}: list MuonModuleMixin before LightningModule in the bases, "
                    "or LightningModule.configure_optimizers hides the mixin's"
                )

    def __setattr__(self, name: str, value: Any) -> None:
        # The first attribute set is set while __init__ runs: the config it was given, read off its frames.
        if "_muon_config_given" not in self.__dict__:
            self.__dict__["_muon_config_given"] = _config_given_to_init(self)
        super().__setattr__(name, value)

    def resolve_muon_config(self) -> MuonConfig:
        """The ``MuonConfig`` this module trains with."""
        if self.muon_config is not None:
            return MuonConfig.from_any(self.muon_config)
        hparams = getattr(self, "hparams", {})
        for key in ("muon_config", "muon"):
            if key in hparams and hparams[key] is not None:
                return MuonConfig.from_any(hparams[key])
        return MuonConfig.from_any(self.__dict__.get("_muon_config_given"))

    @property
    def lr(self) -> float:
        """The matrix lr of this module's config (``MuonConfig.matrix.lr``): the lr Lightning's lr finder tunes.

        ``Tuner.lr_find`` and ``LearningRateFinder`` look for an attribute ``lr``; during their
        sweep every group takes its configured share of the swept lr (``one_lr``), so the
        suggestion is a Muon lr. Setting ``lr`` (the finder does with ``update_attr=True``)
        makes the config ``MuonConfig.with_lr(lr)``: every other lr moves by the same factor.
        The new config goes where it was read from (``muon_config``, else the hparams, where
        checkpoints keep it), and a fit in progress goes on at the new lrs from its next step.
        """
        return self.resolve_muon_config().matrix.lr

    @lr.setter
    def lr(self, value: float) -> None:
        config = self.resolve_muon_config()
        tuned = config.with_lr(value)
        self._keep_muon_config(tuned)
        # LearningRateFinder as a callback: this fit goes on with its scheduler. Lightning
        # then writes the suggestion into every group; the next step takes the schedule's lrs.
        trainer = getattr(self, "_trainer", None)
        if retune_running_schedule(trainer, value / config.matrix.lr) is not None:
            self._lrs_from_schedule = True

    def _keep_muon_config(self, config: MuonConfig) -> None:
        """Put ``config`` where ``resolve_muon_config`` reads it (a dict stays a dict); by default the hparams."""
        hparams = getattr(self, "hparams", None)
        key = None
        if self.muon_config is None and hparams is not None:
            key = next((k for k in ("muon_config", "muon") if hparams.get(k) is not None), "muon_config")
        old = self.muon_config if key is None else hparams.get(key)
        if isinstance(old, dict):
            before, after = MuonConfig.from_any(old).to_dict(), config.to_dict()
            config = {**old, **{k: v for k, v in after.items() if v != before[k]}}
        if key is None:
            self.muon_config = config
        else:
            hparams[key] = config  # checkpoints keep the hparams

    def configure_optimizers(self) -> dict:
        self._lrs_from_schedule = False
        return configure_muon_optimizers(self, self.resolve_muon_config())  # type: ignore[arg-type]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Spreads a single lr that a Lightning tool set over the groups by their configured ratios (``one_lr``).

        The lr finder's sweep and SWA with one ``swa_lrs`` value; after ``lr`` was set during a
        fit, the schedule's lrs. A subclass overriding this hook calls ``super()``.
        """
        parent = getattr(super(), "on_before_optimizer_step", None)
        if parent is not None:
            parent(optimizer)
        trainer = self.trainer  # type: ignore[attr-defined]
        if self.__dict__.pop("_lrs_from_schedule", False):
            reapply_schedule(trainer)
        apply_one_lr(trainer, self.resolve_muon_config)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:
        """Lightning's clipping, after ``Muon`` has looked for NaN/inf in the gradients it was given.

        Clipping by norm spreads one non-finite gradient to all of them; checked first, the
        step's error names the parameter whose gradient went bad (and skips its own check).
        """
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        if gradient_clip_val and isinstance(inner, Muon):
            inner.finite_checks.precheck()
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[misc]

    def configure_callbacks(self) -> Any:
        parent = getattr(super(), "configure_callbacks", None)
        callbacks = list(parent() or []) if parent is not None else []
        if self.resolve_muon_config().uses_schedule_free:
            callbacks.append(ScheduleFreeModeSwitch())
        trainer = getattr(self, "_trainer", None)
        bar = replaces_default_bar(trainer)
        if bar is not None:  # max_steps: Rich's bar would read "Epoch 0/-2"
            # Swapped in place, with the bar's settings: returned, it would make Lightning log that
            # the model's callbacks override the trainer's, about a bar nobody passed.
            trainer.callbacks[trainer.callbacks.index(trainer.progress_bar_callback)] = bar
        present = trainer.callbacks if trainer is not None else []
        if trainer is not None and any(isinstance(c, BaseFinetuning) for c in present):
            callbacks.append(UnfreezeOnResume())  # lightning 2.6 resumes it with the backbone frozen
        if not any(isinstance(c, CheckpointChecks) for c in present):  # a second fit keeps the first one's
            callbacks.append(CheckpointChecks())
        return callbacks

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        parent = getattr(super(), "on_save_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        trainer = getattr(self, "_trainer", None)
        # Full checkpoints went through ScheduleFreeModeSwitch; weights-only ones skip callbacks.
        if trainer is not None and "optimizer_states" not in checkpoint:
            save_in_eval_mode(trainer, self, checkpoint)  # type: ignore[arg-type]


def build_optimizers(
    params: nn.Module | Iterable[Tensor] | Iterable[dict[str, Any]], config: MuonConfig | dict[str, Any] | None = None
) -> list[Muon]:
    """One optimizer per algorithm (Muon, AdamW, Lion, Schedule-Free AdamW, in that order), for manual optimization.

    ``params`` is a module (routed by the config's rules), a flat parameter list (matrices to
    Muon, the rest to AdamW) or param-group dicts. Each optimizer is a ``Muon`` holding only
    groups of one algorithm; an AdamW-only one steps exactly like ``torch.optim.AdamW``, a
    Schedule-Free one like ``schedulefree.AdamWScheduleFree`` (call its ``train()`` before
    stepping and ``eval()`` before evaluating or saving).
    """
    config = MuonConfig.from_any(config)
    groups = list(config.route(params)) if isinstance(params, nn.Module) else as_groups(params)
    optimizers = []
    for algorithm in algorithm_names():
        chosen = [g for g in groups if g.get("algorithm", algorithm) == algorithm]
        if chosen:
            optimizers.append(config.make_optimizer(chosen))
    return optimizers


def build_schedulers(
    optimizers: Iterable[torch.optim.Optimizer],
    config: MuonConfig | dict[str, Any] | None = None,
    total_steps: int | None = None,
) -> list[MuonScheduler]:
    """One ``MuonScheduler`` per optimizer, all following the same lr schedule and momentum warmup."""
    config = MuonConfig.from_any(config)
    schedule = config.schedule.build(total_steps if total_steps is not None else config.schedule.total_steps)
    return [MuonScheduler(opt, schedule, config.schedule.momentum_warmup) for opt in optimizers]
