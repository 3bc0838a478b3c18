"""Muon strategies for Lightning Fabric: ``L.Fabric(strategy="muon_ddp")`` and ``"muon_fsdp"``, or these classes.

Importing ``lightning_muon`` registers the names; the classes take the options of the
Trainer's strategies of the same names (``lightning_muon.MuonDDPStrategy``,
``lightning_muon.MuonFSDPStrategy``) and share their distributed logic.
"""

from lightning_muon.strategies.fabric_ddp import MuonDDPStrategy
from lightning_muon.strategies.fabric_fsdp import MuonFSDPStrategy

__all__ = ["MuonDDPStrategy", "MuonFSDPStrategy"]
