"""Run a function on several gloo processes on CPU and collect what each rank returns.

The launcher is the benchmarks' (``benchmarks/harness.py``, on the test path through
pyproject's ``pythonpath``), so tests and benchmarks start ranks the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness import run_ranks


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in ranks]``, each in its own gloo process.

    One torch thread per rank: ``world_size`` processes share the CI's 2 cores. ``fn``
    must be importable (module level); a failure on any rank raises here.
    """
    return run_ranks(fn, world_size, *args, backend="gloo", threads=1)
