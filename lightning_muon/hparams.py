"""``OptimizerConfig``: each algorithm's settings, and the optimizer-wide ``StateSettings``, of one ``Muon``.

Each algorithm keeps its typed, checked settings in its own module (``algorithms.muon.MuonSettings``,
``algorithms.adamw.AdamWSettings``, ...; their families in ``algorithms.families``). An
``OptimizerConfig`` holds the settings new groups of each algorithm start from (an algorithm it
does not name takes its settings' defaults) and the ``StateSettings``: what the optimizer does
with a non-finite gradient, the dtypes its state is stored in (Megatron-Core's
``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``main_params_dtype``: ``algorithms.state_dtypes``) and
the step's memory cap. ``Muon(...)``'s keywords and ``MuonConfig``'s sections both make one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_muon.algorithms import HparamError, Settings, get_algorithm
from lightning_muon.algorithms.state_dtypes import (
    STATE_SETTINGS,
    MainParamsDtype,
    StateDtype,
    check_main_params_dtype,
    check_state_dtype,
)
from lightning_muon.step_memory import StepMemory, check_step_memory_mb

__all__ = ["NONFINITE", "NonFinite", "OptimizerConfig", "StateSettings", "settings_by_algorithm"]

NonFinite = Literal["raise", "skip", "ignore"]
NONFINITE: tuple[str, ...] = NonFinite.__args__


@dataclass(frozen=True, kw_only=True)
class StateSettings:
    """What the optimizer does with a non-finite gradient, the dtypes its state is stored in, its step's memory."""

    nonfinite: NonFinite = "raise"
    """On a NaN/inf gradient: "raise" (naming the parameter), "skip" the step with a warning, or "ignore" (no
    check, no host-device sync; a NaN reaches the weights)."""
    exp_avg_dtype: StateDtype = "float32"
    """Megatron's name: the dtype first moments (Muon's momentum, AdamW's and Lion's exp_avg) are stored in,
    "float32" or "bfloat16", where narrower than the parameter's; computed in float32, rounded once when stored."""
    exp_avg_sq_dtype: StateDtype = "float32"
    """Megatron's name: the same for second moments (AdamW's exp_avg_sq, NorMuon's and AdaMuon's)."""
    main_params_dtype: MainParamsDtype = None
    """Megatron's name: None, or "float32": bf16/fp16 parameters step on an fp32 master copy kept in the
    optimizer state (one process, not under a sharding); no effect on fp32 parameters."""
    step_memory_mb: StepMemory = "auto"
    """The most MiB of temporaries one Muon group's step holds at once: "auto" (32 on a CPU, 1024 on a GPU), a
    number, or None (no cap); larger groups step in rounds, with the same results."""

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE:
            raise HparamError(
                f"StateSettings.nonfinite must be one of {NONFINITE}, got {self.nonfinite!r}", "nonfinite"
            )
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            object.__setattr__(self, name, check_state_dtype(getattr(self, name), name))
        object.__setattr__(self, "main_params_dtype", check_main_params_dtype(self.main_params_dtype))
        object.__setattr__(self, "step_memory_mb", check_step_memory_mb(self.step_memory_mb))


def settings_by_algorithm(settings: Iterable[Settings], where: str = "settings") -> dict[str, Settings]:
    """``settings`` by the algorithm each is for; two for one algorithm, or one for no algorithm, raise."""
    out: dict[str, Settings] = {}
    for s in settings:
        name = getattr(s, "algorithm", "")
        if not isinstance(s, Settings) or not name:
            kind = type(s).__name__
            raise HparamError(
                f"{where}: expected the settings of an algorithm (MuonSettings, AdamWSettings, ...), got {kind}", where
            )
        if name in out:
            raise HparamError(f"{where}: two settings for {name!r}: {out[name]!r} and {s!r}", where)
        out[get_algorithm(name).name] = s
    return out


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Everything ``Muon`` takes besides its parameters: each algorithm's settings, and the state's."""

    settings: Mapping[str, Settings] = field(default_factory=dict)
    """The settings new groups of each algorithm start from, by algorithm name (one left out: its defaults)."""
    state: StateSettings = field(default_factory=StateSettings)
    """The non-finite policy, the state dtypes and the step's memory cap."""

    def non_default_state_settings(self) -> dict[str, Any]:
        """The state-dtype settings away from their defaults (``exp_avg_dtype``, ...): name -> value."""
        return {
            name: getattr(self.state, name)
            for name, default in STATE_SETTINGS.items()
            if getattr(self.state, name) != default
        }

    def settings_of(self, algorithm: str) -> Settings:
        """The settings new groups of ``algorithm`` start from (its settings' defaults if not set here)."""
        given = self.settings.get(algorithm)
        return given if given is not None else get_algorithm(algorithm).settings()

    def group_defaults(self, algorithm: str) -> dict[str, Any]:
        """The settings a new param group of ``algorithm`` starts from (Lion and Schedule-Free resolved)."""
        return get_algorithm(algorithm).group_defaults(self)
