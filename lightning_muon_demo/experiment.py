"""Muon against AdamW on the bundled character-level GPT: the runs behind the main job and the quality benchmark.

One ``RunSpec`` describes one training run of ``CharGPTModule`` on the default corpus (the
Python standard library's source, see ``lightning_muon_demo.data``); ``train`` runs it with a
Lightning ``Trainer`` and returns the validation loss measured every ``eval_every`` steps.
The two optimizers share everything but the optimizer: model, data order (``seed``),
schedule (linear warmup, stable, linear cooldown) and gradient clipping. The Muon run
routes hidden matrices to Muon and embeddings, head and vectors to AdamW (or, with
``scalar_optimizer="adamw_schedulefree"``, to Schedule-Free AdamW); the AdamW run sends
every parameter to AdamW.

``matrix_optimizer`` swaps Muon on the hidden matrices for another registered matrix
algorithm (``"adaptive_muon"``, ``"scion"``, ``"polargrad"``, ``"mop"``, ``"spel"``,
``"sinkhorn_muon"``, ``"soap"``, ``"rekls"``; ``algorithm_names(matrix=True)``): the config's
``matrix`` section becomes that algorithm's settings, with ``matrix_options`` among them; the
rest of the run stays the Muon run's.
``"sinkhorn_muon"`` needs Sinkhorn-normalized weights before its first step, so its hidden
matrices start as ``sinkhorn_knopp`` of the GPT-2 initialization
(``sinkhorn_normalize_matrices_``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_muon import (
    AdamWSettings,
    MomentumWarmup,
    MuonConfig,
    MuonSettings,
    RoutingSettings,
    Rule,
    ScheduleFreeSettings,
    ScheduleSettings,
    StateSettings,
)
from lightning_muon.algorithms import MatrixSettings, get_algorithm, get_algorithm_of_kind, sinkhorn_knopp
from lightning_muon.aliases import aliases_of, canonical, settings_from
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.module import CharGPTModule

__all__ = [
    "DEFAULT_LR",
    "OPTIMIZERS",
    "RunSpec",
    "ValLossRecorder",
    "build_run",
    "machine_name",
    "matrix_settings",
    "muon_config_for",
    "plot_curves",
    "shares_muon_settings",
    "sinkhorn_normalize_matrices_",
    "steps_to_reach",
    "train",
]

OPTIMIZERS = ("muon", "adamw")
SCALAR_OPTIMIZERS = ("adamw", "adamw_schedulefree")
SCHEDULES = ("wsd", "constant")
STATE_DTYPES = ("float32", "bfloat16")
# The best lr of each in benchmarks/bench_quality.py's sweep at the default model size
# (seed 0, 300 steps): Muon (match_rms_adamw scaling) over 0.0025, 0.005, 0.01 (0.02 and 0.04
# did worse in a first sweep), AdamW over 1e-3, 3e-3, 1e-2.
DEFAULT_LR = {"muon": 0.01, "adamw": 3e-3}
# The Muon run's Muon settings (its lr is ``RunSpec.lr``, its coefficients ``RunSpec.ns_coefficients``);
# Moonlight's scale: the Muon update has AdamW's RMS, so weight decay and lr transfer.
MUON_RUN = {"momentum": 0.95, "weight_decay": 0.01, "adjust_lr": "match_rms_adamw"}


@dataclass(kw_only=True)
class RunSpec:
    """One training run of the demo GPT."""

    optimizer: str = "muon"
    """``"muon"`` (hidden matrices to Muon, the rest to AdamW) or ``"adamw"`` (everything to AdamW)."""
    steps: int = 300
    """Optimizer steps."""
    lr: float | None = None
    """The hidden matrices' lr: the ``matrix`` section's for ``"muon"`` (Muon's, or ``matrix_optimizer``'s), the
    ``scalar`` section's (AdamW's) for ``"adamw"``; None: ``DEFAULT_LR`` (the best of the quality sweep), or the
    default lr of ``matrix_optimizer``'s settings where they are not Muon's (``shares_muon_settings``)."""
    matrix_optimizer: str = "muon"
    """The Muon run's hidden matrices: ``"muon"`` or another registered matrix algorithm (``"adaptive_muon"``,
    ``"scion"``, ``"polargrad"``, ``"mop"``, ``"spel"``, ``"sinkhorn_muon"``, ``"soap"``, ``"rekls"``, ...)."""
    matrix_options: dict[str, Any] = field(default_factory=dict)
    """Settings of ``matrix_optimizer`` (fields of its settings class, or other projects' names for them, e.g.
    ``{"moment2_method": "normuon"}``): the ``init_args`` of the config's ``matrix`` section. Not ``lr``: that is
    ``lr``."""
    adamw_lr: float = 3e-3
    """The Muon run's ``scalar`` lr (AdamW's, or Schedule-Free's): its embeddings, head and vectors."""
    ns_coefficients: str = "polar_express"
    """Newton-Schulz coefficient schedule of the Muon run."""
    scalar_optimizer: str = "adamw"
    """The Muon run's embeddings, head and vectors: ``"adamw"`` (``AdamWSettings``) or ``"adamw_schedulefree"``
    (``ScheduleFreeSettings``), at lr ``adamw_lr``."""
    schedule: str = "wsd"
    """``"wsd"`` (5% warmup, stable, linear cooldown over the last 30%) or ``"constant"`` (5% warmup, then flat)."""
    state_dtype: str = "float32"
    """The optimizer's moments (the ``state`` section's ``exp_avg_dtype`` and ``exp_avg_sq_dtype``): ``"float32"``
    or ``"bfloat16"``."""
    seed: int = 0
    """Model initialisation and training-window order."""
    eval_every: int = 25
    """Validation every this many steps (and after the last)."""
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 32
    val_samples: int = 64
    """Fixed validation windows (the same for every run)."""
    max_chars: int = 2_000_000
    """Characters of the corpus read."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("steps", "eval_every", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "val_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number or None, got {self.lr!r}")
        self._check_matrix_optimizer()
        if self.scalar_optimizer not in SCALAR_OPTIMIZERS:
            raise ValueError(f"scalar_optimizer must be one of {SCALAR_OPTIMIZERS}, got {self.scalar_optimizer!r}")
        if self.scalar_optimizer != "adamw" and self.optimizer != "muon":
            raise ValueError(
                f"scalar_optimizer={self.scalar_optimizer!r} needs optimizer='muon' (the AdamW run has no Muon)"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        if self.state_dtype != "float32" and self.scalar_optimizer == "adamw_schedulefree":
            raise ValueError("state_dtype='bfloat16' needs scalar_optimizer='adamw' (Schedule-Free keeps its state)")
        if self.matrix_options:
            try:  # the values: the settings check each and name it as written
                matrix_settings(self)
            except ValueError as err:
                raise ValueError(f"matrix_options of {self.matrix_optimizer!r}: {err}") from None

    def _check_matrix_optimizer(self) -> None:
        # get_algorithm_of_kind names the field and lists the registered matrix algorithms.
        get_algorithm_of_kind(self.matrix_optimizer, True, "matrix_optimizer")
        if self.matrix_optimizer != "muon" and self.optimizer != "muon":
            raise ValueError(
                f"matrix_optimizer={self.matrix_optimizer!r} needs optimizer='muon' (the AdamW run sends every "
                "parameter to AdamW)"
            )
        if not isinstance(self.matrix_options, dict) or not all(isinstance(k, str) for k in self.matrix_options):
            raise ValueError(f"matrix_options must be a dict with str keys, got {self.matrix_options!r}")
        if "lr" in self.matrix_options:
            raise ValueError(f"matrix_options must not set 'lr': RunSpec.lr is the lr of {self.matrix_optimizer!r}")
        known = _setting_names(self.matrix_optimizer)
        fixed = {f.name for f in dataclasses.fields(get_algorithm(self.matrix_optimizer).settings) if not f.init}
        unknown = sorted(set(self.matrix_options) - known - fixed)  # a fixed one: the settings say it is fixed
        if unknown:
            raise ValueError(
                f"matrix_options has keys {unknown} that {self.matrix_optimizer!r} does not take; its keys are "
                f"{sorted(known - {'lr'})}"
            )
        if self.ns_coefficients != "polar_express" and not shares_muon_settings(self.matrix_optimizer):
            raise ValueError(
                f"ns_coefficients is Muon's; {self.matrix_optimizer!r} takes its own coefficients "
                "(matrix_options={'ns_coefficients': ...}), so leave ns_coefficients at 'polar_express'"
            )

    @property
    def resolved_lr(self) -> float:
        """``lr``, or the default it stands for: ``DEFAULT_LR``, or ``matrix_optimizer``'s settings' default lr."""
        if self.lr is not None:
            return self.lr
        if self.optimizer != "muon" or shares_muon_settings(self.matrix_optimizer):
            return DEFAULT_LR[self.optimizer]
        return get_algorithm(self.matrix_optimizer).settings().lr

    @property
    def label(self) -> str:
        name = self.optimizer if self.matrix_optimizer == "muon" else self.matrix_optimizer
        # Muon's Newton-Schulz schedule names the runs that use it (Muon, and the variants on Muon's settings).
        muon_keys = self.optimizer == "muon" and shares_muon_settings(self.matrix_optimizer)
        extra = f", {self.ns_coefficients}" if muon_keys else ""
        extra += "".join(f", {k}={v}" for k, v in self.matrix_options.items())
        if self.matrix_optimizer == "sinkhorn_muon":
            extra += ", Sinkhorn-normalized init"
        if self.scalar_optimizer != "adamw":
            extra += f", {self.scalar_optimizer}"
        if self.schedule != "wsd":
            extra += f", {self.schedule}"
        if self.state_dtype != "float32":
            extra += f", {self.state_dtype} state"
        return f"{name} (lr {self.resolved_lr:g}{extra})"


def _setting_names(algorithm: str) -> frozenset[str]:
    """The settings a registered algorithm takes: its settings' fields and other projects' names for them."""
    cls = get_algorithm(algorithm).settings
    return frozenset({*cls.field_names(), *aliases_of(cls)})


def shares_muon_settings(algorithm: str) -> bool:
    """Whether ``algorithm``'s settings are Muon's and more (``"muon"``, ``"adaptive_muon"``, ``"muon_hyperball"``).

    Such a run takes the Muon run's settings (``DEFAULT_LR``, ``MUON_RUN``, ``ns_coefficients``); any other
    matrix algorithm starts from its own settings' defaults (Emerging-Optimizers' for the built-ins).
    """
    return issubclass(get_algorithm(algorithm).settings, MuonSettings)


def matrix_settings(spec: RunSpec) -> MatrixSettings:
    """The ``matrix`` section of ``spec``'s Muon run: ``spec.matrix_optimizer``'s settings at ``spec.resolved_lr``.

    An algorithm on Muon's settings starts from the Muon run's (``MUON_RUN``, ``spec.ns_coefficients``), any
    other from its own defaults; ``spec.matrix_options`` go on top (other projects' names renamed).
    """
    name = spec.matrix_optimizer
    cls = get_algorithm(name).settings
    where = cls.__name__
    base = {**MUON_RUN, "ns_coefficients": spec.ns_coefficients} if shares_muon_settings(name) else {}
    for field_name in canonical(cls, spec.matrix_options, where):  # the options win over the run's settings
        base.pop(field_name, None)
    # The options go in as written, so that a bad value is named by the name the user gave.
    return settings_from(cls, {**base, **spec.matrix_options, "lr": spec.resolved_lr}, where)


def muon_config_for(spec: RunSpec) -> MuonConfig:
    """The optimizer and schedule of ``spec``: warmup 5%, stable, linear cooldown over the last 30% (``wsd``).

    ``schedule="constant"`` keeps the warmup and drops the cooldown; ``state_dtype`` is the dtype the moments
    are stored in (the ``state`` section's ``exp_avg_dtype`` and ``exp_avg_sq_dtype``). The Muon run's
    ``matrix`` section is ``matrix_settings(spec)``, its ``scalar`` section AdamW (or Schedule-Free AdamW) at
    ``spec.adamw_lr``; the AdamW run routes every parameter to its ``scalar`` section, AdamW at ``spec.lr``.
    """
    schedule = ScheduleSettings(falloff="wsd", warmup=0.05, cooldown=0.3, total_steps=spec.steps)
    if spec.schedule == "constant":
        schedule = ScheduleSettings(falloff="constant", warmup=0.05, total_steps=spec.steps)
    state = StateSettings(exp_avg_dtype=spec.state_dtype, exp_avg_sq_dtype=spec.state_dtype)
    if spec.optimizer == "muon":
        scalar = AdamWSettings if spec.scalar_optimizer == "adamw" else ScheduleFreeSettings
        return MuonConfig(
            matrix=matrix_settings(spec),
            scalar=scalar(lr=spec.adamw_lr, weight_decay=0.01),
            state=state,
            schedule=dataclasses.replace(schedule, momentum_warmup=MomentumWarmup(steps=min(100, spec.steps // 4))),
        )
    return MuonConfig(
        scalar=AdamWSettings(lr=spec.resolved_lr, weight_decay=0.01),
        routing=RoutingSettings(
            default_rules=False,
            rules=[
                Rule(name="matrices", algorithm="adamw", group="adamw", min_ndim=2),
                Rule(name="vectors", algorithm="adamw", group="adamw_no_decay", options={"weight_decay": 0.0}),
            ],
        ),
        state=state,
        schedule=schedule,
    )


class ValLossRecorder(Callback):
    """Keeps ``(global_step, val_loss)`` after every validation run (not the sanity check)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.val_loss: list[float] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        step = trainer.global_step
        if self.steps and self.steps[-1] == step:  # the end-of-fit validation may repeat a step
            return
        self.steps.append(step)
        self.val_loss.append(float(trainer.callback_metrics["val_loss"]))


@torch.no_grad()
def sinkhorn_normalize_matrices_(module: torch.nn.Module, config: MuonConfig) -> list[str]:
    """Replace every weight ``config`` routes to ``"sinkhorn_muon"`` by its ``sinkhorn_knopp`` map; their names.

    ``"sinkhorn_muon"`` refuses weights that are not Sinkhorn-normalized (non-negative, rows
    and columns summing to their targets) when its group is made, so this runs between the
    model's initialization and the optimizer's construction.
    """
    params = dict(module.named_parameters())
    names = [
        name for group in config.route(module) if group["algorithm"] == "sinkhorn_muon" for name in group["param_names"]
    ]
    for name in names:
        params[name].copy_(sinkhorn_knopp(params[name]))
    return names


def build_run(spec: RunSpec) -> tuple[CharGPTModule, CharTextDataModule]:
    """The module and data of ``spec``, the model initialised at ``spec.seed`` (``train`` fits them).

    With ``matrix_optimizer="sinkhorn_muon"`` the hidden matrices then start Sinkhorn-normalized
    (``sinkhorn_normalize_matrices_``): the only start that algorithm accepts.
    """
    pl.seed_everything(spec.seed, verbose=False)
    config = muon_config_for(spec)
    module = CharGPTModule(
        block_size=spec.block_size,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        n_embd=spec.n_embd,
        muon_config=config,
    )
    if spec.matrix_optimizer == "sinkhorn_muon":
        sinkhorn_normalize_matrices_(module, config)
    data = CharTextDataModule(
        block_size=spec.block_size,
        batch_size=spec.batch_size,
        val_samples=spec.val_samples,
        max_chars=spec.max_chars,
        train_samples_per_epoch=spec.steps * spec.batch_size,
        seed=spec.seed,
    )
    return module, data


def train(
    spec: RunSpec,
    *,
    progress_bar: bool = False,
    callbacks: Sequence[Callback] = (),
    logger: Any = False,
    root_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Train ``spec`` and return ``{"spec", "label", "steps", "val_loss", "seconds"}``.

    ``device``: ``"cpu"`` or ``"cuda[:i]"`` (one GPU).
    """
    device = torch.device(device)
    module, data = build_run(spec)
    recorder = ValLossRecorder()
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=spec.steps,
        val_check_interval=spec.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=logger,
        callbacks=[recorder, *callbacks],
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root_dir,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    if not recorder.steps or recorder.steps[-1] != trainer.global_step:
        trainer.validate(module, datamodule=data, verbose=False)
    return {
        "spec": asdict(spec),
        "label": spec.label,
        "steps": recorder.steps,
        "val_loss": recorder.val_loss,
        "seconds": time.perf_counter() - start,
    }


def steps_to_reach(steps: Sequence[int], losses: Sequence[float], target: float) -> int | None:
    """The first evaluated step whose loss is at most ``target`` (None if never)."""
    return next((s for s, loss in zip(steps, losses) if loss <= target), None)


def plot_curves(runs: Sequence[dict[str, Any]], path: str | Path, title: str) -> Path:
    """A PNG of validation loss against step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for run in runs:
        ax.plot(run["steps"], run["val_loss"], marker="o", markersize=3, label=run["label"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def machine_name(device: str | torch.device | None = None) -> str:
    """``"<CPU model>, <cores> cores, <threads> torch threads, torch <version>[, GPU <name>]"``.

    The GPU named is ``device``'s when it is a CUDA device, else the current one.
    """
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cuda = device is not None and torch.device(device).type == "cuda"
    gpu = f", GPU {torch.cuda.get_device_name(device if cuda else None)}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}{gpu}"
