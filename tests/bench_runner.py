"""Run a benchmark script as a user would, from the repository root, and read its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, out: Path, *args: str, timeout: int) -> tuple[dict[str, Any], str]:
    """``python benchmarks/<script> *args --out <out>``: the report it wrote and its stdout.

    Asserts the script exited 0 (showing the end of its stderr when not). ``timeout`` only
    guards against a hang.
    """
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout
