"""The strategies' names in Lightning's registries, registered when Lightning loads, not when this package does.

``Trainer(strategy="muon_ddp")`` and ``L.Fabric(strategy="muon_fsdp")`` look the name up in
Lightning's strategy registries, which only know what was registered there. Importing
``lightning_muon.strategies`` registers ours (``MuonDDPStrategy``, ``MuonFSDPStrategy`` and
Fabric's), and that module imports Lightning, which the optimizer needs nothing of. So
``register_when_lightning_loads`` imports it at once where Lightning is loaded already, and
otherwise waits for Lightning's own import: a finder on ``sys.meta_path`` that lets the import
of ``lightning`` run as it would, then registers, then takes itself off. Either order of
``import lightning`` and ``import lightning_muon`` ends with the names registered.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

__all__ = ["register_when_lightning_loads"]

_STRATEGIES = "lightning_muon.strategies"


def register_when_lightning_loads() -> None:
    """Register the Muon strategies with Lightning now if it is imported, else right after it is."""
    if "lightning" in sys.modules:
        importlib.import_module(_STRATEGIES)
    elif not any(isinstance(finder, _AfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning`` as the other finders do, and registers the strategies once its module has run."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != "lightning":
            return None
        sys.meta_path.remove(self)  # one import: Lightning's own finders answer from here on
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            importlib.import_module(_STRATEGIES)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
