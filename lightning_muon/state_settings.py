"""``StateSettings``: what one ``Muon`` does with a non-finite gradient, the dtypes of its state, its step's memory.

Optimizer-wide, beside each algorithm's settings (``algorithms``: ``MuonSettings``,
``AdamWSettings``, ...): Megatron-Core's ``exp_avg_dtype``, ``exp_avg_sq_dtype`` and
``main_params_dtype`` (``algorithms.state_dtypes``) and the step's memory cap
(``step_memory``). ``Muon(...)``'s keywords and ``MuonConfig``'s ``state`` section both make one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.state_dtypes import (
    STATE_SETTINGS,
    MainParamsDtype,
    StateDtype,
    check_main_params_dtype,
    check_state_dtype,
)
from lightning_muon.step_memory import StepMemory, check_step_memory_mb

__all__ = ["NONFINITE", "NonFinite", "StateSettings"]

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

    def non_default_dtypes(self) -> dict[str, Any]:
        """The state-dtype settings away from their defaults (``exp_avg_dtype``, ...): name -> value."""
        return {name: getattr(self, name) for name, default in STATE_SETTINGS.items() if getattr(self, name) != default}
