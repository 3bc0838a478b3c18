"""Lightning strategies for Muon, registered by name when the package is imported."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_muon.strategies.ddp import MuonDDPStrategy

if "muon_ddp" not in StrategyRegistry:
    MuonDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["MuonDDPStrategy"]
