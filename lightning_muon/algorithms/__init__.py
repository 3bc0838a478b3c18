"""The update rules of ``Muon``'s param groups, one module each, found by name in a registry.

Importing this package registers the built-in algorithms, in this order: ``muon``,
``adamw``, ``lion``, ``adamw_schedulefree``, ``muon_hyperball``. ``register_algorithm`` adds
one of your own.
"""

# ruff: noqa: I001  (imported in registration order, which error messages and build_optimizers list)
from lightning_muon.algorithms.base import (
    Algorithm,
    algorithm_names,
    get_algorithm,
    get_algorithm_of_kind,
    orthogonalizes,
    register_algorithm,
)
from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.muon import MuonAlgorithm, MuonHparams
from lightning_muon.algorithms.adamw import AdamW, AdamWHparams
from lightning_muon.algorithms.lion import Lion, LionHparams
from lightning_muon.algorithms.adamw_schedulefree import SCHEDULE_FREE, ScheduleFreeAdamW, ScheduleFreeHparams
from lightning_muon.algorithms.muon_hyperball import HyperballHparams, MuonHyperball

__all__ = [
    "SCHEDULE_FREE",
    "AdamW",
    "AdamWHparams",
    "Algorithm",
    "HparamError",
    "HyperballHparams",
    "Lion",
    "LionHparams",
    "MuonAlgorithm",
    "MuonHparams",
    "MuonHyperball",
    "ScheduleFreeAdamW",
    "ScheduleFreeHparams",
    "algorithm_names",
    "get_algorithm",
    "get_algorithm_of_kind",
    "orthogonalizes",
    "register_algorithm",
]
