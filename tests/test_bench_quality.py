"""benchmarks/bench_quality.py runs end to end and its JSON adds up (never a timing assertion)."""

from __future__ import annotations

import math
from pathlib import Path

from bench_runner import run_benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_quick_quality_benchmark_reports_steps_to_adamws_best(tmp_path):
    out = tmp_path / "q.json"
    report, stdout = run_benchmark("bench_quality.py", out, "--quick", timeout=600)
    assert report["machine"] in stdout and "Muon steps / AdamW steps" in stdout
    curves = report["mean_curves"]
    assert set(curves) == {"muon", "adamw", "muon_keller", "muon_schedulefree", "muon_bf16_state"}
    # The Schedule-Free row: Muon's chosen lr, Schedule-Free AdamW on the rest, constant schedule.
    (sf_run,) = [r for r in report["runs"] if r["spec"]["scalar_optimizer"] == "adamw_schedulefree"]
    assert (sf_run["spec"]["optimizer"], sf_run["spec"]["schedule"]) == ("muon", "constant")
    assert sf_run["spec"]["lr"] == report["chosen_lr"]["muon"]
    assert report["final_val_loss_by_seed"]["muon_schedulefree"] == [sf_run["val_loss"][-1]]
    assert "Muon + SF-AdamW, constant" in stdout and "Muon + Schedule-Free AdamW (constant) -" in stdout
    # The bf16-state row: Muon's chosen lr, every moment stored in bf16.
    (bf16_run,) = [r for r in report["runs"] if r["spec"]["state_dtype"] == "bfloat16"]
    assert (bf16_run["spec"]["optimizer"], bf16_run["spec"]["lr"]) == ("muon", report["chosen_lr"]["muon"])
    assert report["final_val_loss_by_seed"]["muon_bf16_state"] == [bf16_run["val_loss"][-1]]
    assert "Muon, bf16 state" in stdout and "Muon bf16 state - float32 state final val loss" in stdout
    target = report["target_val_loss"]
    assert target == min(curves["adamw"]["val_loss"])
    for name, curve in curves.items():
        assert all(math.isfinite(v) for v in curve["val_loss"])
        reached = report["steps_to_target"][name]
        # The reported step is the first evaluated step at or below the target.
        expected = next((s for s, v in zip(curve["steps"], curve["val_loss"]) if v <= target), None)
        assert reached == expected, name
    assert report["steps_to_target"]["adamw"] is not None
    if report["steps_to_target"]["muon"] is not None:
        assert report["muon_step_ratio"] == report["steps_to_target"]["muon"] / report["steps_to_target"]["adamw"]
