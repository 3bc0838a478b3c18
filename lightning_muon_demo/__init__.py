"""lightning_muon_demo: the bundled demo, apart from the library.

A byte-level GPT (``CharGPT``, and ``CharGPTModule`` training it with Muon), its data
(``CharTextDataModule``: the Python standard library's source as bytes), scikit-learn's
digits for the small examples (``DigitsDataModule``) and the Muon-vs-AdamW runs of the main
job and the quality benchmark (``lightning_muon_demo.experiment``). ``lightning_muon``
never imports this package; it uses only the library's public API.

Importing it adds ``lightning_muon_demo.cli``'s two functions to the CLI's ``lightning_muon.cli.CONFIG_HOOKS``, so
that ``python -m lightning_muon fit --config muon`` gives the demo model its data, keeps it from a model of yours
that has its own loaders, and says what such a model keeps of the demo model's arguments.
"""

from lightning_muon.cli import CONFIG_HOOKS
from lightning_muon_demo.cli import choose_data, note_kept_arguments
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.digits import DigitsDataModule
from lightning_muon_demo.models import CharGPT
from lightning_muon_demo.module import CharGPTModule

__all__ = ["CharGPT", "CharGPTModule", "CharTextDataModule", "DigitsDataModule"]

# The model `python -m lightning_muon_demo` trains when the command line names none.
DEMO_MODEL = "lightning_muon_demo.module.CharGPTModule"

CONFIG_HOOKS.extend([note_kept_arguments, choose_data])
