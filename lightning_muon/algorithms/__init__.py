"""The update rules of ``Muon``'s param groups, one module each, found by name in a registry.

Importing this package registers the built-in algorithms, in this order: ``muon``,
``adamw``, ``lion``, ``adamw_schedulefree``, ``muon_hyperball``, then NVIDIA
Emerging-Optimizers' under its names (``adaptive_muon``, ``scion``, ``polargrad``, ``mop``,
``spel``, ``sinkhorn_muon``, ``laprop``, ``soap``, ``rekls``). ``register_algorithm`` adds one
of your own. Each algorithm's settings (``MuonSettings``, ``AdamWSettings``, ...) derive from its
family's (``families``): the matrix algorithms' ``MatrixSettings``, the others' ``ScalarSettings``.
"""

# ruff: noqa: I001  (imported in registration order, which error messages and build_optimizers list)
from lightning_muon.algorithms.base import (
    Algorithm,
    StepContext,
    algorithm_names,
    get_algorithm,
    get_algorithm_of_kind,
    orthogonalizes,
    per_matrix,
    register_algorithm,
)
from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.settings import Settings
from lightning_muon.algorithms.families import (
    AdamLikeSettings,
    MatrixSettings,
    NewtonSchulzSettings,
    OrthogonalizedSettings,
    ScalarSettings,
)
from lightning_muon.algorithms.muon import MuonAlgorithm, MuonSettings
from lightning_muon.algorithms.adamw import AdamW, AdamWSettings
from lightning_muon.algorithms.lion import Lion, LionSettings
from lightning_muon.algorithms.adamw_schedulefree import SCHEDULE_FREE, ScheduleFreeAdamW, ScheduleFreeSettings
from lightning_muon.algorithms.muon_hyperball import MuonHyperball, MuonHyperballSettings
from lightning_muon.algorithms.adaptive_muon import AdaptiveMuon, AdaptiveMuonSettings
from lightning_muon.algorithms.scion import Scion, ScionSettings
from lightning_muon.algorithms.polargrad import PolarGrad, PolarGradSettings
from lightning_muon.algorithms.mop import MOP, MOPSettings
from lightning_muon.algorithms.spel import Spel, SpelSettings
from lightning_muon.algorithms.sinkhorn_muon import SinkhornMuon, SinkhornMuonSettings, sinkhorn_knopp
from lightning_muon.algorithms.laprop import LaProp, LaPropSettings
from lightning_muon.algorithms.soap import SOAP, SOAPSettings, ShampooSettings
from lightning_muon.algorithms.rekls import REKLS, REKLSSettings

__all__ = [
    "MOP",
    "REKLS",
    "SCHEDULE_FREE",
    "SOAP",
    "AdamLikeSettings",
    "AdamW",
    "AdamWSettings",
    "AdaptiveMuon",
    "AdaptiveMuonSettings",
    "Algorithm",
    "HparamError",
    "LaProp",
    "LaPropSettings",
    "Lion",
    "LionSettings",
    "MOPSettings",
    "MatrixSettings",
    "MuonAlgorithm",
    "MuonHyperball",
    "MuonHyperballSettings",
    "MuonSettings",
    "NewtonSchulzSettings",
    "OrthogonalizedSettings",
    "PolarGrad",
    "PolarGradSettings",
    "REKLSSettings",
    "SOAPSettings",
    "ScalarSettings",
    "ScheduleFreeAdamW",
    "ScheduleFreeSettings",
    "Scion",
    "ScionSettings",
    "Settings",
    "ShampooSettings",
    "SinkhornMuon",
    "SinkhornMuonSettings",
    "Spel",
    "SpelSettings",
    "StepContext",
    "algorithm_names",
    "get_algorithm",
    "get_algorithm_of_kind",
    "orthogonalizes",
    "per_matrix",
    "register_algorithm",
    "sinkhorn_knopp",
]
