"""benchmarks/bench_lr_find.py runs end to end on a tiny model and its JSON adds up (never a timing assertion)."""

from __future__ import annotations

import pytest
from bench_runner import run_benchmark


def test_quick_lr_find_suggests_a_muon_lr_and_writes_the_curve(tmp_path):
    out, png = tmp_path / "lr_find.json", tmp_path / "lr_finder.png"
    report, stdout = run_benchmark("bench_lr_find.py", out, "--quick", "--plot", str(png), timeout=300)
    assert png.is_file() and png.stat().st_size > 0
    lrs = report["lr"]
    assert len(lrs) == len(report["loss"]) == report["num_training"] and lrs[0] == report["min_lr"]
    suggestion = report["suggestion"]
    assert suggestion == lrs[report["suggestion_index"]]
    # update_attr: the config took the suggestion as its Muon lr, AdamW's lr by the same factor.
    before, after = report["config_before"], report["config_after"]
    assert after["lr"] == suggestion
    assert after["adamw_lr"] == pytest.approx(before["adamw_lr"] * suggestion / before["lr"], rel=1e-12)
    assert f"lr finder's suggestion (Muon lr): {suggestion:.4g}" in stdout
    assert f"quality benchmark's best Muon lr: {report['quality_best_lr']:g}" in stdout
