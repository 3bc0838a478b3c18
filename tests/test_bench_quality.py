"""benchmarks/bench_quality.py runs end to end and its JSON adds up (never a timing assertion)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from bench_runner import run_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _load(monkeypatch: pytest.MonkeyPatch):
    path = ROOT / "benchmarks" / "bench_quality.py"
    spec = importlib.util.spec_from_file_location("_bench_bench_quality", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run, every row once (13 tiny runs): its report, stdout and JSON path."""
    out = tmp_path_factory.mktemp("quality") / "q.json"
    report, stdout = run_benchmark("bench_quality.py", out, "--quick", timeout=600)
    return report, stdout, out


def test_quick_quality_benchmark_reports_steps_to_adamws_best(quick):
    report, stdout, _ = quick
    assert report["machine"] in stdout and "Muon steps / AdamW steps" in stdout
    curves = report["mean_curves"]
    assert set(curves) == set(report["rows"]) and len(curves) == 13
    assert {"muon", "adamw", "muon_keller", "muon_schedulefree", "muon_bf16_state"} <= set(curves)
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


def test_each_new_matrix_algorithm_has_a_row_at_its_own_lr(quick, monkeypatch):
    report, stdout, _ = quick
    bench = _load(monkeypatch)
    assert report["settings"]["lr_grids"]["scion"] == [bench.EMERGING_LRS["scion"][1]]  # quick: the middle lr
    for name in bench.EMERGING:
        row = bench.ROWS[name]
        (run,) = [r for r in report["runs"] if r["spec"]["matrix_optimizer"] == row.spec["matrix_optimizer"]]
        assert run["spec"]["matrix_options"] == row.spec["matrix_options"]
        assert run["spec"]["lr"] == report["chosen_lr"][name] == bench.EMERGING_LRS[name][1]
        assert report["final_val_loss_by_seed"][name] == [run["val_loss"][-1]]
        assert report["diverged"][name] == [] and row.label in stdout
    (adaptive,) = [r for r in report["runs"] if r["spec"]["matrix_optimizer"] == "adaptive_muon"]
    assert adaptive["spec"]["matrix_options"] == {"moment2_method": "normuon"}
    (sinkhorn,) = [r for r in report["runs"] if r["spec"]["matrix_optimizer"] == "sinkhorn_muon"]
    assert "Sinkhorn-normalized init" in sinkhorn["label"]


def test_only_reads_the_baseline_back_from_a_report_with_the_same_settings(quick, tmp_path, monkeypatch, capsys):
    report, _, path = quick
    bench = _load(monkeypatch)
    out = tmp_path / "only.json"
    # Every run it needs is in the report, so nothing trains: main() in this process.
    assert bench.main(["--quick", "--only", "scion", "soap", "--baseline", str(path), "--out", str(out)]) == 0
    assert "read back from the baseline" in capsys.readouterr().out
    only = json.loads(out.read_text())
    assert list(only["rows"]) == ["muon", "adamw", "scion", "soap"]
    assert only["reused_runs"] == len(only["runs"]) == 4
    assert only["baseline"]["path"] == str(path)
    for name in only["rows"]:
        assert only["final_mean_val_loss"][name] == report["final_mean_val_loss"][name]
    assert bench.rows_for(["emerging"]) == (*bench.BASELINE, *bench.EMERGING)


def test_a_baseline_with_other_settings_is_refused(quick, tmp_path, monkeypatch, capsys):
    report, _, _ = quick
    bench = _load(monkeypatch)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**report, "settings": {**report["settings"], "steps": 5}}))
    assert bench.main(["--quick", "--only", "emerging", "--baseline", str(other), "--out", str(tmp_path / "x")]) == 2
    assert "steps 5 there, 6 here" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_diverged_run_loses_its_sweep_and_a_row_that_always_diverges_is_reported(monkeypatch, capsys):
    bench = _load(monkeypatch)

    def fake_train(spec, device="cpu"):  # no training: a higher lr does better, unless it diverges
        if spec.matrix_optimizer == "spel" or (spec.matrix_optimizer == "scion" and spec.lr == 0.1):
            raise FloatingPointError("Muon: non-finite gradient")
        loss = 3.0 - spec.lr + 0.01 * spec.seed
        return {"spec": asdict(spec), "label": spec.label, "steps": [1, 2], "val_loss": [loss + 1, loss], "seconds": 0}

    monkeypatch.setattr(bench, "train", fake_train)
    grids = {"muon": (0.01, 0.02), "adamw": (1e-3,), "scion": (0.05, 0.1), "spel": (0.1, 0.2)}
    result = bench.run_benchmark(2, 1, grids, (0, 1), {}, rows=("muon", "adamw", "scion", "spel"))
    assert result["sweep_final_val_loss"]["scion"] == {"0.05": pytest.approx(2.95), "0.1": None}
    assert result["chosen_lr"] == {"muon": 0.02, "adamw": 1e-3, "scion": 0.05, "spel": None}
    assert result["final_val_loss_by_seed"]["scion"] == [pytest.approx(2.95), pytest.approx(2.96)]
    assert result["final_mean_val_loss"]["spel"] is None and "spel" not in result["mean_curves"]
    json.dumps(result, allow_nan=False)  # strict JSON: a diverged run is null, not NaN
    bench.print_table(result, "machine", "budget")
    table = capsys.readouterr().out
    assert "DIVERGED (FloatingPointError)" in table and "diverged at every lr" in table
    with pytest.raises(ValueError, match="must include the baseline"):
        bench.run_benchmark(2, 1, grids, (0,), {}, rows=("muon", "scion"))
