"""benchmarks/bench_spectra.py runs end to end and writes complete JSON (never a timing assertion)."""

from __future__ import annotations

import math
from pathlib import Path

from bench_runner import run_benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_the_overhead_line(tmp_path):
    out = tmp_path / "spectra.json"
    report, stdout = run_benchmark("bench_spectra.py", out, "--quick", timeout=300)
    assert report["machine"]["cpu"] in stdout  # the table line names the machine
    assert "== spectra overhead" in stdout and report["result"]["line"] in stdout
    runs = report["runs"]
    assert [r["monitored"] for r in runs] == [False, True]
    monitored = runs[1]
    # 12 steps at interval 5: optimizer steps 0, 5 and 10 were logged, for all 8 Muon matrices.
    assert monitored["logged_steps"] == 3 and monitored["matrices"] == 8
    assert 0 < monitored["inside_seconds"] < monitored["seconds"]
    for key in ("baseline_s_per_step", "monitored_s_per_step", "ratio", "in_callback_share"):
        value = report["result"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key
