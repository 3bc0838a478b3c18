"""Lightning callbacks for Muon training."""

from lightning_muon.callbacks.checkpoint_checks import CheckpointChecks
from lightning_muon.callbacks.progress import MaxStepsProgressBar
from lightning_muon.callbacks.qk_clip import QKClip
from lightning_muon.callbacks.save_config import MuonSaveConfigCallback
from lightning_muon.callbacks.schedule_free import ScheduleFreeModeSwitch
from lightning_muon.callbacks.spectrum import UpdateSpectrumMonitor

__all__ = [
    "CheckpointChecks",
    "MaxStepsProgressBar",
    "MuonSaveConfigCallback",
    "QKClip",
    "ScheduleFreeModeSwitch",
    "UpdateSpectrumMonitor",
]
