"""The benchmarks still run, as a user runs them (never a timing assertion).

Every entry script of ``benchmarks/`` prints its ``--help`` and refuses what its README says
it refuses, all in one interpreter; ``--quick`` runs only for the two whose JSON is read
again: ``bench_optimizer.py``'s report (every table's rows) and ``bench_quality.py``'s (its
``--baseline`` reads an earlier report back). Nothing here imports from ``benchmarks/``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Every .py at the top of benchmarks/ is an entry script; what they share is the package benchlib/.
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

# Each case run as ``python benchmarks/X.py ARGS`` runs it (its folder first on sys.path, as
# __main__), all in one interpreter so that torch and Lightning are imported once.
RUN_ALL = """
import contextlib, io, json, os, runpy, sys
out = []
for path, args in json.loads(sys.argv[1]):
    sys.path[0], sys.argv[:] = os.path.dirname(path), [path, *args]
    stdout, stderr, code = io.StringIO(), io.StringIO(), "no SystemExit"
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit:
            code = exit.code
    out.append([code, stdout.getvalue(), stderr.getvalue()])
print(json.dumps(out))
"""

# (script, arguments, exit code, what stderr says): refused before any process or measurement starts.
REFUSED = [
    ("bench_ddp.py", ["--memory", "--steps", "3"], "do not apply"),
    ("bench_fsdp.py", ["--memory", "--ns-dtype", "float32"], "do not apply"),
    ("bench_tp.py", ["--memory", "--steps", "3"], "do not apply"),
    ("bench_spectra.py", ["--memory", "--repeats", "2"], "do not apply"),
    ("bench_ddp.py", ["--memory", "--step-memory-mb", "lots"], "--step-memory-mb"),
]
if torch.cuda.device_count() < 2:  # a GPU per rank: an argparse error naming both numbers
    for name in ("bench_ddp.py", "bench_fsdp.py"):
        REFUSED.append((name, ["--device", "cuda", "--world-size", "2"], "one GPU per rank (NCCL): --world-size 2"))


def _run(script: str, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """``python benchmarks/<script> *args --out <out>``: the report it wrote and its stdout."""
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)  # the timeout: a hang only
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_entry_script_prints_its_help_and_refuses_bad_flags():
    assert len(SCRIPTS) >= 10 and (ROOT / "benchmarks" / "benchlib" / "__init__.py").is_file()
    for path in SCRIPTS:
        assert 'if __name__ == "__main__":' in path.read_text(), f"{path.name}: not an entry script"
    cases = [(str(p), ["--help"]) for p in SCRIPTS] + [(str(ROOT / "benchmarks" / n), a) for n, a, _ in REFUSED]
    proc = subprocess.run(
        [sys.executable, "-c", RUN_ALL, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    for path, (code, stdout, _) in zip(SCRIPTS, results):
        assert code == 0, f"{path.name} --help: exit {code}"
        assert stdout.startswith(f"usage: {path.name} ") and "--device" in stdout, f"{path.name} --help:\n{stdout}"
    for (name, args, says), (code, _, stderr) in zip(REFUSED, results[len(SCRIPTS) :], strict=True):
        assert code == 2 and says in stderr, f"{name} {' '.join(args)}: exit {code}\n{stderr[-2000:]}"


def _leaves(value: Any) -> Any:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def test_quick_optimizer_benchmark_writes_every_table(tmp_path):
    report, stdout = _run("bench_optimizer.py", tmp_path / "x.json", "--quick")
    machine = report["machine"]
    for key in ("cpu", "cpu_cores", "torch", "cpu_capability", "device"):
        assert machine[key] not in (None, ""), key
    assert machine["cpu"] in stdout  # the printed header names the same machine
    for name in ("accuracy", "step", "roofline", "batching", "gram", "symmetric"):
        section = report["sections"][name]
        leaves = list(_leaves(section["rows"]))
        # A diverged or skipped measurement is written as null: the quick run must have none.
        assert leaves and None not in leaves, name
        numbers = [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
        assert numbers and all(math.isfinite(v) for v in numbers), name
        assert f"== {name}" in stdout


@pytest.fixture(scope="module")
def quality(tmp_path_factory):
    """One ``bench_quality.py --quick`` run, every row once (13 tiny runs): its report, stdout and JSON path."""
    out = tmp_path_factory.mktemp("quality") / "q.json"
    return (*_run("bench_quality.py", out, "--quick"), out)


def test_quick_quality_benchmark_reports_steps_to_adamws_best(quality):
    report, stdout, _ = quality
    assert report["machine"] in stdout and "Muon steps / AdamW steps" in stdout
    curves, target = report["mean_curves"], report["target_val_loss"]
    assert set(curves) == set(report["rows"]) and len(curves) == 13
    assert target == min(curves["adamw"]["val_loss"])
    for name, curve in curves.items():
        assert all(math.isfinite(v) for v in curve["val_loss"]) and report["diverged"][name] == [], name
        # The reported step is the first evaluated step at or below the target.
        expected = next((s for s, v in zip(curve["steps"], curve["val_loss"]) if v <= target), None)
        assert report["steps_to_target"][name] == expected, name
    # Each row trained once at its chosen lr (a quick grid holds one), with what the row asks for.
    for name, row in report["rows"].items():
        assert report["chosen_lr"][row["sweep"]] == report["settings"]["lr_grids"][row["sweep"]][0], name
        spec = {**report["runs"][0]["spec"], **row["spec"], "lr": report["chosen_lr"][row["sweep"]]}
        (run,) = [r for r in report["runs"] if r["spec"] == spec]
        assert report["final_val_loss_by_seed"][name] == [run["val_loss"][-1]]
        assert row["label"] in stdout


def test_quality_only_reads_its_baseline_back(quality, tmp_path):
    """``--only`` with ``--baseline``: every run it needs is in the earlier report, so nothing trains."""
    report, _, path = quality
    args = ("--quick", "--only", "scion", "--baseline", str(path))
    only, stdout = _run("bench_quality.py", tmp_path / "only.json", *args)
    assert "read back from the baseline" in stdout
    assert list(only["rows"]) == ["muon", "adamw", "scion"] and only["reused_runs"] == len(only["runs"]) == 3
    for name in only["rows"]:
        assert only["final_mean_val_loss"][name] == report["final_mean_val_loss"][name]
