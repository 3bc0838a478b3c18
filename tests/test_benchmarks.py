"""benchmarks/bench_optimizer.py runs end to end and writes complete JSON (never a timing assertion);
every entry script prints its ``--help`` as ``python benchmarks/X.py --help`` and takes ``--device cuda``."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_runner import run_benchmark

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("accuracy", "step", "roofline", "batching", "gram")
# Every top-level file of benchmarks/ is an entry script; what they share is the package benchlib/.
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


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
    report, stdout = run_benchmark("bench_optimizer.py", out, "--quick", timeout=120)

    machine = report["machine"]
    for key in ("cpu", "cpu_cores", "torch", "cpu_capability", "device"):
        assert machine[key] not in (None, ""), key
    assert machine["cpu"] in stdout  # the printed header names the same machine

    for name in SECTIONS:
        section = report["sections"][name]
        assert section["rows"], name
        leaves = list(_leaves(section["rows"]))
        # A diverged or skipped measurement is written as null: the quick run must have none.
        assert None not in leaves, name
        numbers = [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
        assert numbers, name
        assert all(math.isfinite(v) for v in numbers), name
        assert f"== {name}" in stdout


def test_step_table_in_fresh_processes_reports_the_median_ratio_and_its_range(tmp_path, monkeypatch):
    out = tmp_path / "x.json"
    report, stdout = run_benchmark(
        "bench_optimizer.py", out, "--quick", "--sections", "step", "--step-processes", "2", timeout=300
    )
    step = report["sections"]["step"]
    assert step["processes"] == 2 and "2 fresh processes" in stdout
    timed = [row for row in step["rows"] if "ms_per_step" in row]
    assert {row["variant"] for row in timed} >= {"torch", "keller", "polar_express"}
    for row in timed:
        runs = row["processes"]
        assert len(runs) == 2 and row["reps"].startswith("2x")
        ratios = sorted(r["ratio_vs_torch"] for r in runs)
        # The median of two is their mean; the range is theirs.
        assert row["ratio_vs_torch"] == pytest.approx(sum(ratios) / 2)
        assert row["range_vs_torch"] == ratios
        assert row["ms_per_step"] == pytest.approx(sum(r["ms_per_step"] for r in runs) / 2)
    targets = {t["name"]: t["value"] for t in step["targets"]}
    for row in timed:
        if row["variant"] in ("keller", "polar_express"):
            assert targets[f"step: {row['optimizer']} / torch, d=32 x 2"] == row["ratio_vs_torch"]
    module = _load(ROOT / "benchmarks" / "bench_optimizer.py", monkeypatch)
    with pytest.raises(SystemExit):
        module.parse_args(["--step-processes", "0"])


def _load(path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# Runs each script as ``python benchmarks/X.py --help`` does (its folder first on sys.path, run as
# __main__), all in one interpreter so that torch and Lightning are imported once.
HELP = """
import contextlib, io, json, os, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.path[0], sys.argv[:] = os.path.dirname(path), [path, "--help"]
    text, code = io.StringIO(), "no SystemExit"
    with contextlib.redirect_stdout(text):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit:
            code = exit.code
    out[os.path.basename(path)] = [code, text.getvalue()]
print(json.dumps(out))
"""


def test_every_entry_script_prints_its_help():
    assert len(BENCHMARKS) >= 12 and (ROOT / "benchmarks" / "benchlib" / "__init__.py").is_file()
    for path in BENCHMARKS:
        assert 'if __name__ == "__main__":' in path.read_text(), f"{path.name}: not an entry script"
    proc = subprocess.run(
        [sys.executable, "-c", HELP, *map(str, BENCHMARKS)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    helps = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(helps) == [p.name for p in BENCHMARKS]
    for name, (code, text) in helps.items():
        assert code == 0, f"{name} --help: exit {code}"
        assert text.startswith(f"usage: {name} ") and "--device" in text, f"{name} --help:\n{text}"


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_every_benchmark_takes_device_cuda(path, monkeypatch):
    module = _load(path, monkeypatch)
    # Parsing only: pretend there are GPUs, one per rank, since parse_args checks for them.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert module.parse_args(["--device", "cuda"]).device == "cuda"
    if path.stem not in ("bench_optimizer", "bench_train_step"):  # the ones that pick cuda when there is one
        assert module.parse_args([]).device == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 GPUs")
@pytest.mark.parametrize("name", ["bench_ddp", "bench_fsdp"])
def test_distributed_benchmarks_refuse_more_ranks_than_gpus(name, monkeypatch, capsys):
    # The script's main() in this process (a subprocess would only add the start-up of
    # Python and torch): an argparse error before any process is spawned, naming both numbers.
    module = _load(ROOT / "benchmarks" / f"{name}.py", monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--device", "cuda", "--world-size", "2"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr[-3000:]
    assert "one GPU per rank" in stderr and "--world-size 2" in stderr
    assert f"torch.cuda.device_count() is {torch.cuda.device_count()}" in stderr


def test_interleaved_rounds_mix_the_order_so_every_call_follows_every_other():
    from benchlib.timing import Settings, measure_interleaved

    keys = "abcde"
    settings = Settings(torch.device("cpu"), quick=False, budget_s=60.0, max_reps=40, step_budget_s=60.0)
    runs = []
    for _ in range(2):
        calls: list[str] = []
        fns = {key: (lambda key=key, calls=calls: calls.append(key)) for key in keys}
        timings = measure_interleaved(fns, settings, budget_s=60.0)
        assert {key: t.reps for key, t in timings.items()} == dict.fromkeys(keys, 40)
        runs.append(calls)
    assert runs[0] == runs[1]  # a fixed seed: two runs step in the same order
    rounds = [runs[0][i : i + 5] for i in range(5, len(runs[0]), 5)]  # after one warm-up call each
    assert all(sorted(r) == list(keys) for r in rounds)
    # Within rounds, every call directly follows every other (a turning order would give
    # only the 5 pairs of one cycle), and every call opens some round.
    neighbours = {(x, y) for r in rounds for x, y in zip(r, r[1:])}
    assert neighbours == {(x, y) for x in keys for y in keys if x != y}
    assert {r[0] for r in rounds} == set(keys)


def test_train_step_benchmark_times_both_optimizers_on_the_same_steps(tmp_path, monkeypatch):
    """bench_train_step --quick: a tiny GPT-2's step in two parts, ours and torch.optim.Muon's, shares in (0, 1)."""
    module = _load(ROOT / "benchmarks" / "bench_train_step.py", monkeypatch)
    out = tmp_path / "train_step.json"
    assert module.main(["--quick", "--device", "cpu", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    ours, unchecked, reference = report["rows"]
    assert ours["optimizer"].startswith("ours") and "ignore" in unchecked["optimizer"]
    assert reference["optimizer"].startswith("torch.optim.Muon")
    for row in (ours, unchecked, reference):
        assert 0 < row["step_share"] < 1 and row["fwd_bwd_ms"] > 0 and row["step_ms"] > 0
    for row in (ours, unchecked):
        assert row["step_ratio_vs_torch"] == pytest.approx(row["step_ms"] / reference["step_ms"])
    assert report["targets"] == []  # the 3% target is a GPU's
    assert report["model"]["n_layer"] == 2
