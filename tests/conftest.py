"""Fixtures every test gets: no process group and no files left behind.

- Each test runs in its own ``tmp_path`` as the working directory, so whatever writes to
  the working directory by default (Lightning's ``lightning_logs/``, checkpoints, a
  CLI's saved ``config.yaml``) lands there and never in the repository. Tests name files
  of the repository by absolute path (``Path(__file__).parents[1]``).
- Environment variables are restored after every test: Lightning's launchers write
  ``MASTER_PORT``, ``LOCAL_RANK`` and the like into ``os.environ`` of the process that
  launches (Fabric's ``launch()`` in a test's own process), and a later Trainer would take
  them for processes started outside it.
- A test that leaves a default process group initialized in this process (a world of one
  set up by hand, or a run that raised before its own teardown) gets it destroyed, so
  the next test starts without one. Multi-process tests run their ranks in spawned
  processes (``dist_utils.run_distributed``), which tear down their own.
- A test that registers an algorithm (``register_algorithm``) leaves the registry as it
  found it: the next test sees the built-in algorithms only, whatever ran before.
- A module marked ``policy_free`` (``pytestmark``) runs with ``LIGHTNING_MUON_FAST_BF16``
  set to a value the library refuses: a test of it, its module fixtures, or any process
  it starts (they inherit the environment) that consults the automatic bf16 policy raises.
  So its tests provably run alike under either policy, and CI's second pass, which only
  flips the policy, leaves them out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_muon.algorithms import base as algorithm_registry
from lightning_muon.newton_schulz import FAST_BF16_ENV

POLICY_FREE = "policy_free"
# Not "0", "1" or empty: bf16_matmul_is_fast raises a ValueError naming the variable.
POLICY_TRIPWIRE = "tripwire-of-a-policy-free-test-module"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(m.name == POLICY_FREE for m in item.own_markers):
            raise pytest.UsageError(
                f"{item.nodeid}: mark whole modules policy_free (pytestmark), not single tests: "
                "the guard must cover the module's fixtures too"
            )


@pytest.fixture(autouse=True, scope="module")
def _policy_free_module(request: pytest.FixtureRequest) -> Iterator[None]:
    # Module scope, autouse: set up before the module's other module-scoped fixtures.
    if request.node.get_closest_marker(POLICY_FREE) is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAST_BF16_ENV, POLICY_TRIPWIRE)
        yield


@pytest.fixture(autouse=True)
def _work_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _teardown_process_group() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _restore_algorithm_registry() -> Iterator[None]:
    registered = dict(algorithm_registry._REGISTRY)
    yield
    algorithm_registry._REGISTRY.clear()
    algorithm_registry._REGISTRY.update(registered)
