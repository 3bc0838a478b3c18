"""lightning_muon: train PyTorch Lightning models with the Muon optimizer."""

from lightning_muon.muon import Muon
from lightning_muon.newton_schulz import COEFFICIENTS, orthogonalize

__all__ = ["COEFFICIENTS", "Muon", "orthogonalize"]
__version__ = "0.1.0"
