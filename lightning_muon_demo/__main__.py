"""``python -m lightning_muon_demo fit``: the library's CLI with the demo model as default.

The same CLI as ``python -m lightning_muon``; only a run that names no model differs: it
trains ``CharGPTModule`` on ``CharTextDataModule`` (e.g. ``python -m lightning_muon_demo fit
--trainer.max_steps=100``).
"""

from lightning_muon.cli import main
from lightning_muon_demo import DEMO_MODEL

if __name__ == "__main__":
    main(default_model=DEMO_MODEL, prog="python -m lightning_muon_demo")
