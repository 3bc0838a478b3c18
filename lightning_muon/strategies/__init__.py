"""Lightning strategies for Muon, registered by name when the package is imported."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_muon.strategies.ddp import MuonDDPStrategy
from lightning_muon.strategies.fsdp import MuonFSDPStrategy

if "muon_ddp" not in StrategyRegistry:
    MuonDDPStrategy.register_strategies(StrategyRegistry)
if "muon_fsdp" not in StrategyRegistry:
    MuonFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["MuonDDPStrategy", "MuonFSDPStrategy"]
