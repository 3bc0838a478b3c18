"""The benchmarks' memory measurements (``benchlib.memory``): their byte counts add up.

Never a memory or timing target asserted.

Two ``--quick`` runs: ``bench_optimizer.py --sections memory`` (one process) and
``bench_fsdp.py --memory`` (2 gloo ranks). Per row, the transient is the peak less params,
grads and state; the tracker saw exactly params, grads, state and kept buffers when the
step began; and the state of each optimizer is what its algorithm keeps, to the byte:
``torch.optim.Muon`` one momentum per matrix, AdamW two moments per tensor and a 4-byte step
counter (a float32 scalar), ours the same.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from bench_runner import run_benchmark

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
COUNTER = 4  # bytes of one AdamW step counter: torch.tensor(0.0), float32


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "single.json"
    return run_benchmark("bench_optimizer.py", out, "--quick", "--device", "cpu", "--sections", "memory", timeout=300)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "fsdp.json"
    return run_benchmark("bench_fsdp.py", out, "--quick", "--memory", timeout=300)


def _load(name: str, monkeypatch: pytest.MonkeyPatch):
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _check_row(row: dict) -> None:
    """What every row must satisfy, whatever the optimizer."""
    params, grads, state = row["params_bytes"], row["grads_bytes"], row["state_bytes"]
    assert row["transient_bytes"] == row["peak_bytes"] - params - grads - state
    # MemTracker was told of exactly these storages before the step (CPU: exact bytes).
    assert row["tracked_at_start_bytes"] == params + grads + state + row["kept_bytes"]
    assert row["distinct_bytes"] == params + grads + state + row["kept_bytes"]  # no storage counted twice
    assert row["peak_bytes"] >= params + grads + state
    assert grads == params  # fp32 gradients of every parameter
    assert row["peak_at"]  # the tracker saw the step allocate


@pytest.mark.slow
def test_single_state_is_what_each_optimizer_keeps(single):
    report, stdout = single
    assert report["machine"]["cpu"] in stdout and "== single" in stdout
    assert "Muon's step_memory_mb: step_memory_mb=auto, the default" in stdout
    section = report["sections"]["memory"]
    assert section["model"] == [64, 2]
    rows = {r["variant"]: r for r in section["rows"]}
    assert {"ours", "ours_unbounded", "torch", "adamw"} <= set(rows)
    for row in rows.values():
        _check_row(row)
    first = rows["torch"]
    params, hidden, n_other = first["params_bytes"], first["hidden_param_bytes"], first["other_tensors"]
    other = params - hidden
    # GPT-like d=64 x 2 (step_table.gpt_shapes), fp32: the same parameters in every row.
    d, vocab = 64, 256
    assert hidden == 4 * 2 * (3 * d * d + d * d + 4 * d * d + 4 * d * d)
    assert other == 4 * (2 * vocab * d + (2 * 4 + 2) * d) and n_other == 2 + 2 * 4 + 2
    for row in rows.values():
        assert (row["params_bytes"], row["hidden_param_bytes"]) == (params, hidden)

    # torch.optim.Muon: one momentum per matrix; AdamW: two moments and a counter per tensor.
    torch_state = hidden + 2 * other + COUNTER * n_other
    assert first["state_bytes"] == torch_state
    assert first["state_counter_bytes"] == COUNTER * n_other
    adamw = rows["adamw"]
    assert adamw["state_bytes"] == 2 * params + COUNTER * (n_other + 2 * 4)  # 4 hidden matrices per layer
    assert adamw["state_bytes"] - adamw["state_counter_bytes"] == 2 * params
    # Ours keeps what the torch pair keeps: a momentum per matrix, AdamW's moments and counters.
    for key in ("ours", "ours_unbounded"):
        assert rows[key]["state_bytes"] == torch_state
        assert rows[key]["state_counter_bytes"] == COUNTER * n_other

    # The ratios printed are those of the bytes.
    for row in rows.values():
        assert row["state_per_params"] == pytest.approx(row["state_bytes"] / params)
        assert row["state_per_adamw_state"] == pytest.approx(row["state_bytes"] / adamw["state_bytes"])
        assert row["transient_per_torch"] == pytest.approx(row["transient_bytes"] / first["transient_bytes"])
    names = {t["name"] for t in section["targets"]}
    assert names == {
        "single: ours' transient / torch.optim.Muon + AdamW's, d=64 x 2",
        "single: ours' state / AdamW's, d=64 x 2",
    }
    assert report["targets_total"] == 2 and report["settings"]["sections"] == ["memory"]


@pytest.mark.slow
def test_fsdp_rows_add_up_on_every_rank(fsdp):
    report, stdout = fsdp
    assert report["machine"]["cpu"] in stdout and "== fsdp: FSDP2 on 2 gloo ranks" in stdout
    section = report["sections"]["fsdp"]
    assert section["world_size"] == 2
    rows = section["rows"]
    assert {(r["config"], r["rank"]) for r in rows} == {
        (c, r) for c in ("adamw", "adamw_loop", "owner") for r in range(2)
    }
    for row in rows:
        _check_row(row)
    for rank in range(2):
        by = {r["config"]: r for r in rows if r["rank"] == rank}
        params = by["adamw"]["params_bytes"]
        assert all(r["params_bytes"] == params for r in by.values())  # the same shards in every config
        # Each rank holds half of every (evenly split) tensor: AdamW's moments are two copies of it.
        for key in ("adamw", "adamw_loop"):
            assert by[key]["state_bytes"] - by[key]["state_counter_bytes"] == 2 * params
        # muon_fsdp: a momentum shard per Muon matrix, AdamW's two moments for the rest.
        owner, muon = by["owner"], by["owner"]["muon_param_bytes"]
        assert 0 < muon < params
        assert owner["state_bytes"] - owner["state_counter_bytes"] == muon + 2 * (params - muon)
        assert owner["peak_per_ref"] == pytest.approx(owner["peak_bytes"] / by["adamw"]["peak_bytes"])
    (fsdp_target,) = section["targets"]
    worst = max(r["peak_per_ref"] for r in rows if r["config"] == "owner")
    assert fsdp_target["value"] == pytest.approx(worst)
    assert report["targets_total"] == 1
    assert report["settings"]["step_memory_default"] == "auto" and not report["settings"]["step_memory_given"]


def test_step_memory_flag_is_parsed_and_passed_to_muon(monkeypatch):
    from benchlib.memory import memory_settings, our_kwargs

    ddp = _load("bench_ddp", monkeypatch)
    args = ddp.parse_args(["--memory"])
    assert args.memory and args.out.name == "bench_ddp_memory.json"
    assert our_kwargs(memory_settings(args)) == {}
    args = ddp.parse_args(["--memory", "--step-memory-mb", "64"])
    assert our_kwargs(memory_settings(args)) == {"step_memory_mb": 64.0}
    assert our_kwargs(memory_settings(ddp.parse_args(["--memory", "--step-memory-mb", "none"]))) == {
        "step_memory_mb": None
    }
    assert ddp.parse_args([]).out.name == "bench_ddp.json" and not ddp.parse_args([]).memory
    for bad in ("0", "-1", "lots"):
        with pytest.raises(SystemExit):
            ddp.parse_args(["--memory", "--step-memory-mb", bad])


@pytest.mark.parametrize(
    "name, flags",
    [
        ("bench_ddp", ["--steps", "3"]),
        ("bench_fsdp", ["--ns-dtype", "float32"]),
        ("bench_tp", ["--steps", "3"]),
        ("bench_spectra", ["--repeats", "2"]),
    ],
)
def test_memory_refuses_the_timing_flags(name, flags, monkeypatch, capsys):
    module = _load(name, monkeypatch)
    module.parse_args(flags)  # taken without --memory
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--memory", *flags])
    assert exit_info.value.code == 2 and "do not apply" in capsys.readouterr().err


def test_cuda_refuses_a_mesh_with_more_ranks_than_gpus(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # The one-process measurements need one GPU.
    assert _load("bench_optimizer", monkeypatch).parse_args(["--device", "cuda", "--sections", "memory"]).device
    assert _load("bench_spectra", monkeypatch).parse_args(["--device", "cuda", "--memory"]).memory
    with pytest.raises(SystemExit) as exit_info:
        _load("bench_tp", monkeypatch).parse_args(["--device", "cuda", "--memory"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "one GPU per rank" in err and "--dp 2 x --tp 2" in err and "device_count() is 1" in err
