"""lightning_muon: train PyTorch Lightning models with the Muon optimizer.

The optimizer and everything it steps with (``Muon``, the algorithms, ``orthogonalize``, the
settings, routing and schedules) import no Lightning. The Lightning-facing names (the mixin, the
callbacks, the strategies) are loaded on first use, and the strategies register their names
(``"muon_ddp"``, ``"muon_fsdp"``) in Lightning's registries as soon as Lightning is imported,
before or after this package (``lightning_muon.strategies.registration``).
"""

import importlib

from lightning_muon.algorithms import (
    AdamWSettings,
    AdaptiveMuonSettings,
    Algorithm,
    LaPropSettings,
    LionSettings,
    MOPSettings,
    MuonHyperballSettings,
    MuonSettings,
    PolarGradSettings,
    REKLSSettings,
    ScheduleFreeSettings,
    ScionSettings,
    Settings,
    SinkhornMuonSettings,
    SOAPSettings,
    SpelSettings,
    register_algorithm,
)
from lightning_muon.config import MuonConfig
from lightning_muon.muon import Muon
from lightning_muon.newton_schulz import COEFFICIENTS, orthogonalize
from lightning_muon.registration import register_when_lightning_loads
from lightning_muon.routing import ParamGroups, RoutingSettings, Rule, route_parameters
from lightning_muon.schedules import LRSchedule, MomentumWarmup, MuonScheduler, ScheduleSettings
from lightning_muon.state_settings import StateSettings

__all__ = [
    "AdamWSettings",
    "AdaptiveMuonSettings",
    "LaPropSettings",
    "LionSettings",
    "MOPSettings",
    "MuonHyperballSettings",
    "MuonSettings",
    "PolarGradSettings",
    "REKLSSettings",
    "ScheduleFreeSettings",
    "ScionSettings",
    "Settings",
    "SinkhornMuonSettings",
    "SOAPSettings",
    "SpelSettings",
    "StateSettings",
    "RoutingSettings",
    "MomentumWarmup",
    "ScheduleSettings",
    "COEFFICIENTS",
    "Algorithm",
    "LRSchedule",
    "Muon",
    "MuonConfig",
    "MuonDDPStrategy",
    "MuonFSDPStrategy",
    "MuonModuleMixin",
    "MuonScheduler",
    "ParamGroups",
    "QKClip",
    "Rule",
    "ScheduleFreeModeSwitch",
    "UpdateSpectrumMonitor",
    "build_optimizers",
    "build_schedulers",
    "configure_muon_optimizers",
    "orthogonalize",
    "register_algorithm",
    "route_parameters",
]
__version__ = "0.1.0"

# Names whose modules import Lightning: loaded on first use (``__getattr__``).
_LIGHTNING = {
    "MuonDDPStrategy": "lightning_muon.strategies",
    "MuonFSDPStrategy": "lightning_muon.strategies",
    "MuonModuleMixin": "lightning_muon.module",
    "QKClip": "lightning_muon.callbacks",
    "ScheduleFreeModeSwitch": "lightning_muon.callbacks",
    "UpdateSpectrumMonitor": "lightning_muon.callbacks",
    "build_optimizers": "lightning_muon.module",
    "build_schedulers": "lightning_muon.module",
    "configure_muon_optimizers": "lightning_muon.module",
}


def __getattr__(name: str) -> object:
    module = _LIGHTNING.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_muon' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


register_when_lightning_loads()
