"""benchmarks/bench_memory.py: its byte counts add up (never a memory or timing target asserted).

One ``--quick`` run of the ``single`` and ``fsdp`` sections (2 gloo ranks). Per row, the
transient is the peak less params, grads and state; the tracker saw exactly params, grads,
state and kept buffers when the step began; and the state of each optimizer is what its
algorithm keeps, to the byte: ``torch.optim.Muon`` one momentum per matrix, AdamW two
moments per tensor and a 4-byte step counter (a float32 scalar), ours the same.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from bench_runner import run_benchmark

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
COUNTER = 4  # bytes of one AdamW step counter: torch.tensor(0.0), float32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_memory") / "report.json"
    return run_benchmark("bench_memory.py", out, "--quick", "--sections", "single", "fsdp", timeout=300)


def _load(monkeypatch: pytest.MonkeyPatch):
    path = ROOT / "benchmarks" / "bench_memory.py"
    spec = importlib.util.spec_from_file_location("_bench_bench_memory", path)
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
def test_single_state_is_what_each_optimizer_keeps(run):
    report, stdout = run
    assert report["machine"]["cpu"] in stdout and "== single" in stdout and "== fsdp" in stdout
    section = report["sections"]["single"]
    assert section["model"] == [64, 2]
    rows = {r["variant"]: r for r in section["rows"]}
    assert {"ours", "torch", "adamw"} <= set(rows)
    assert ("ours_unbounded" in rows) == report["settings"]["step_memory_knob"]
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
        if key in rows:
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


@pytest.mark.slow
def test_fsdp_rows_add_up_on_every_rank(run):
    report, _ = run
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
    assert report["targets_total"] == 3


def test_step_memory_flag_is_parsed_and_passed_only_where_muon_takes_it(monkeypatch):
    module = _load(monkeypatch)
    args = module.parse_args([])
    assert args.device == "cpu" and args.sections == list(module.SECTIONS) and not args.step_memory_given
    assert module.our_kwargs(module.settings_from_args(args)) == {}
    args = module.parse_args(["--step-memory-mb", "64", "--sections", "fsdp", "single"])
    assert args.step_memory_mb == 64.0 and args.sections == ["single", "fsdp"]
    cfg = module.settings_from_args(args)
    monkeypatch.setattr(module, "knob_exists", lambda: True)
    assert module.our_kwargs(cfg) == {"step_memory_mb": 64.0}
    monkeypatch.setattr(module, "knob_exists", lambda: False)
    assert module.our_kwargs(cfg) == {}
    assert module.parse_args(["--step-memory-mb", "none"]).step_memory_mb is None
    for bad in ("0", "-1", "lots"):
        with pytest.raises(SystemExit):
            module.parse_args(["--step-memory-mb", bad])


def test_cuda_refuses_sections_with_more_ranks_than_gpus(monkeypatch, capsys):
    import torch

    module = _load(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert module.parse_args(["--device", "cuda", "--sections", "single", "callbacks"]).device == "cuda"
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--device", "cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "one GPU per rank" in err and "mesh runs 4" in err and "device_count() is 1" in err
