"""lightning_muon_demo: the bundled demo, apart from the library.

A byte-level GPT (``CharGPT``, and ``CharGPTModule`` training it with Muon), its data
(``CharTextDataModule``: the Python standard library's source as bytes), scikit-learn's
digits for the small examples (``DigitsDataModule``) and the Muon-vs-AdamW runs of the main
job and the quality benchmark (``lightning_muon_demo.experiment``). ``lightning_muon``
never imports this package; it uses only the library's public API.

Importing it registers ``CharTextDataModule`` as the demo data of ``CharGPTModule`` with the
CLI (``lightning_muon.cli.register_demo_data``), so that ``python -m lightning_muon fit
--config muon`` gives the demo model its data and keeps it from a model of
yours that has its own loaders.
"""

from lightning_muon.cli import register_demo_data
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.digits import DigitsDataModule
from lightning_muon_demo.models import CharGPT
from lightning_muon_demo.module import CharGPTModule

__all__ = ["CharGPT", "CharGPTModule", "CharTextDataModule", "DigitsDataModule"]

DEMO_MODEL = "lightning_muon_demo.module.CharGPTModule"
DEMO_DATA = "lightning_muon_demo.data.CharTextDataModule"

register_demo_data(DEMO_MODEL, DEMO_DATA)
