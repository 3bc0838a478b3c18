"""Fixtures every test gets: no process group and no files left behind.

- Each test runs in its own ``tmp_path`` as the working directory, so whatever writes to
  the working directory by default (Lightning's ``lightning_logs/``, checkpoints, a
  CLI's saved ``config.yaml``) lands there and never in the repository. Tests name files
  of the repository by absolute path (``Path(__file__).parents[1]``).
- A test that leaves a default process group initialized in this process (a world of one
  set up by hand, or a run that raised before its own teardown) gets it destroyed, so
  the next test starts without one. Multi-process tests run their ranks in spawned
  processes (``dist_utils.run_distributed``), which tear down their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _work_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _teardown_process_group() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
