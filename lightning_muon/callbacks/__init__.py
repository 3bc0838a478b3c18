"""Lightning callbacks for Muon training."""

from lightning_muon.callbacks.spectrum import UpdateSpectrumMonitor

__all__ = ["UpdateSpectrumMonitor"]
