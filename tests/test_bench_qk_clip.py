"""benchmarks/bench_qk_clip.py runs end to end and writes complete JSON (never a timing assertion)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_the_overhead_lines(tmp_path):
    out = tmp_path / "qk_clip.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_qk_clip.py"), "--quick", "--steps", "3", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"] in report["result"]["line"]  # the table line names the machine
    for key in ("line", "maxima_line"):
        assert report["result"][key] in proc.stdout
    assert [(r["clipped"], r["log_every_n_steps"]) for r in report["runs"]] == [(False, 50), (True, 50), (True, 1)]
    for clipped in report["runs"][1:]:
        assert 0 < clipped["measure_seconds"] < clipped["seconds"] and 0 < clipped["hook_seconds"] < clipped["seconds"]
    for key in ("baseline_s_per_step", "clipped_s_per_step", "ratio", "inside_share", "inside_share_every_step_exact"):
        value = report["result"][key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key
    assert report["attention"]["sdpa_plus_maxima_s"] > 0
