"""benchmarks/bench_spectra.py runs end to end and writes complete JSON (never a timing assertion)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_the_overhead_line(tmp_path):
    out = tmp_path / "spectra.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_spectra.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"] in proc.stdout  # the table line names the machine
    assert "== spectra overhead" in proc.stdout and report["result"]["line"] in proc.stdout
    runs = report["runs"]
    assert [r["monitored"] for r in runs] == [False, True]
    monitored = runs[1]
    # 12 steps at interval 5: optimizer steps 0, 5 and 10 were logged, for all 8 Muon matrices.
    assert monitored["logged_steps"] == 3 and monitored["matrices"] == 8
    assert 0 < monitored["inside_seconds"] < monitored["seconds"]
    for key in ("baseline_s_per_step", "monitored_s_per_step", "ratio", "in_callback_share"):
        value = report["result"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key
