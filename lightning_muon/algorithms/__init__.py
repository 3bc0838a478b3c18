"""The update rules of ``Muon``'s param groups, one module each, found by name in a registry.

Importing this package registers the built-in algorithms, in this order: ``muon``,
``adamw``, ``lion``, ``adamw_schedulefree``, ``muon_hyperball``, then NVIDIA
Emerging-Optimizers' under its names (``adaptive_muon``, ``scion``, ``polargrad``, ``mop``,
``spel``, ``sinkhorn_muon``, ``laprop``, ``soap``, ``rekls``). ``register_algorithm`` adds one
of your own.
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
from lightning_muon.algorithms.muon import MuonAlgorithm, MuonHparams
from lightning_muon.algorithms.adamw import AdamW, AdamWHparams
from lightning_muon.algorithms.lion import Lion, LionHparams
from lightning_muon.algorithms.adamw_schedulefree import SCHEDULE_FREE, ScheduleFreeAdamW, ScheduleFreeHparams
from lightning_muon.algorithms.muon_hyperball import HyperballHparams, MuonHyperball
from lightning_muon.algorithms.adaptive_muon import AdaptiveMuon, AdaptiveMuonHparams
from lightning_muon.algorithms.scion import Scion, ScionHparams
from lightning_muon.algorithms.polargrad import PolarGrad, PolarGradHparams
from lightning_muon.algorithms.mop import MOP, MOPHparams
from lightning_muon.algorithms.spel import Spel, SpelHparams
from lightning_muon.algorithms.sinkhorn_muon import SinkhornHparams, SinkhornMuon, sinkhorn_knopp
from lightning_muon.algorithms.laprop import LaProp, LaPropHparams
from lightning_muon.algorithms.soap import SOAP, SOAPHparams
from lightning_muon.algorithms.rekls import REKLS, REKLSHparams

__all__ = [
    "MOP",
    "MOPHparams",
    "PolarGrad",
    "PolarGradHparams",
    "SCHEDULE_FREE",
    "Scion",
    "ScionHparams",
    "SinkhornHparams",
    "SinkhornMuon",
    "Spel",
    "SpelHparams",
    "sinkhorn_knopp",
    "AdaptiveMuon",
    "AdaptiveMuonHparams",
    "AdamW",
    "AdamWHparams",
    "Algorithm",
    "HparamError",
    "StepContext",
    "HyperballHparams",
    "LaProp",
    "LaPropHparams",
    "Lion",
    "LionHparams",
    "MuonAlgorithm",
    "MuonHparams",
    "MuonHyperball",
    "REKLS",
    "REKLSHparams",
    "SOAP",
    "SOAPHparams",
    "ScheduleFreeAdamW",
    "ScheduleFreeHparams",
    "algorithm_names",
    "get_algorithm",
    "get_algorithm_of_kind",
    "orthogonalizes",
    "per_matrix",
    "register_algorithm",
]
