"""The optimizer imports no Lightning, and the strategies are registered with Lightning whenever it loads.

``from lightning_muon import Muon``, and the core it steps with (the algorithms, ``functional``,
``newton_schulz``, ``layout``, ``distributed``), need nothing of Lightning; neither does routing a
model or building a ``MuonConfig``'s optimizer. The Lightning-facing names (``MuonModuleMixin``,
the callbacks, the strategies) load on first use, and ``"muon_ddp"``/``"muon_fsdp"`` are in the
Trainer's and Fabric's registries once Lightning is imported, after the package or before it.
Each order runs in a fresh interpreter, where nothing else imported Lightning first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CORE_FIRST = """
import sys
import torch
from torch import nn

from lightning_muon import Muon, MuonConfig, route_parameters
import lightning_muon.algorithms, lightning_muon.distributed, lightning_muon.functional
import lightning_muon.layout, lightning_muon.newton_schulz

model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16))
route_parameters(model)
optimizer, _ = MuonConfig().build(model, total_steps=4)
model(torch.arange(4)).sum().backward()
optimizer.step()
Muon(nn.Linear(4, 4).parameters()).step()
loaded = sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")))
assert not loaded, loaded

import lightning
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

assert {"muon_ddp", "muon_ddp_spawn", "muon_fsdp"} <= set(StrategyRegistry), sorted(StrategyRegistry)
assert {"muon_ddp", "muon_fsdp"} <= set(STRATEGY_REGISTRY), sorted(STRATEGY_REGISTRY)
from lightning_muon import MuonDDPStrategy, MuonModuleMixin, UpdateSpectrumMonitor
assert MuonDDPStrategy is StrategyRegistry["muon_ddp"]["strategy"]
"""

LIGHTNING_FIRST = """
import lightning
import lightning_muon
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

assert "muon_ddp" in StrategyRegistry and "muon_fsdp" in STRATEGY_REGISTRY
"""


@pytest.mark.parametrize("script", [CORE_FIRST, LIGHTNING_FIRST], ids=["core_first", "lightning_first"])
def test_the_core_imports_no_lightning_and_the_strategies_register_when_it_loads(script):
    env = {**os.environ, "LIGHTNING_MUON_FAST_BF16": "0"}  # the steps' Newton-Schulz dtype, pinned: float32
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_name_the_package_does_not_have_is_an_attribute_error():
    import lightning_muon

    with pytest.raises(AttributeError, match="has no attribute 'MuonOptimizer'"):
        lightning_muon.MuonOptimizer  # noqa: B018
    assert {"Muon", "MuonModuleMixin", "QKClip"} <= set(dir(lightning_muon))
