"""lightning_muon: train PyTorch Lightning models with the Muon optimizer."""

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
from lightning_muon.callbacks import QKClip, ScheduleFreeModeSwitch, UpdateSpectrumMonitor
from lightning_muon.config import MuonConfig
from lightning_muon.module import MuonModuleMixin, build_optimizers, build_schedulers, configure_muon_optimizers
from lightning_muon.muon import Muon
from lightning_muon.newton_schulz import COEFFICIENTS, orthogonalize
from lightning_muon.routing import ParamGroups, RoutingSettings, Rule, route_parameters
from lightning_muon.schedules import LRSchedule, MomentumWarmup, MuonScheduler, ScheduleSettings
from lightning_muon.state_settings import StateSettings
from lightning_muon.strategies import MuonDDPStrategy, MuonFSDPStrategy

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
