"""benchmarks/bench_optimizer.py runs end to end and writes complete JSON (never a timing assertion)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("accuracy", "step", "roofline", "batching", "gram")


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def test_quick_benchmark_writes_every_table(tmp_path):
    out = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_optimizer.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())

    machine = report["machine"]
    for key in ("cpu", "cpu_cores", "torch", "cpu_capability", "device"):
        assert machine[key] not in (None, ""), key
    assert machine["cpu"] in proc.stdout  # the printed header names the same machine

    for name in SECTIONS:
        section = report["sections"][name]
        assert section["rows"], name
        leaves = list(_leaves(section["rows"]))
        # A diverged or skipped measurement is written as null: the quick run must have none.
        assert None not in leaves, name
        numbers = [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
        assert numbers, name
        assert all(math.isfinite(v) for v in numbers), name
        assert f"== {name}" in proc.stdout
