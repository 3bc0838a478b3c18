"""Lightning strategies for Muon, for the Trainer and for Fabric, registered by name when this package is imported.

The Trainer's (``MuonDDPStrategy``, ``MuonFSDPStrategy``) and Fabric's
(``lightning_muon.fabric``) register under the same names, ``muon_ddp``, ``muon_ddp_spawn``
and ``muon_fsdp``, each in its framework's registry. ``import lightning_muon`` has this package
imported as soon as Lightning is (``lightning_muon.registration``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_muon.strategies import fabric_ddp, fabric_fsdp
from lightning_muon.strategies.ddp import MuonDDPStrategy
from lightning_muon.strategies.fsdp import MuonFSDPStrategy

for _registry, _ddp, _fsdp in (
    (StrategyRegistry, MuonDDPStrategy, MuonFSDPStrategy),
    (FABRIC_STRATEGY_REGISTRY, fabric_ddp.MuonDDPStrategy, fabric_fsdp.MuonFSDPStrategy),
):
    if "muon_ddp" not in _registry:
        _ddp.register_strategies(_registry)
    if "muon_fsdp" not in _registry:
        _fsdp.register_strategies(_registry)

__all__ = ["MuonDDPStrategy", "MuonFSDPStrategy"]
