"""benchmarks/bench_fsdp.py runs on 2 gloo ranks and its counts add up (never a timing assertion)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from bench_runner import run_benchmark

from lightning_muon.distributed.comm import all_reduce_bytes

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("adamw", "owner", "gather_all", "blockwise")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_fsdp") / "report.json"
    return run_benchmark("bench_fsdp.py", out, "--quick", "--ns-dtype", "float32", timeout=300)


@pytest.mark.slow
def test_report_and_counts_add_up(run):
    report, stdout = run
    for key in ("machine", "settings", "bytes", "flops", "times", "projection", "targets", "ranks"):
        assert key in report, key
    assert report["machine"]["cpu"] in stdout and "gather_all" in stdout and "1 process" in stdout
    world, steps = report["settings"]["world_size"], report["settings"]["steps"]
    ranks, b = report["ranks"], report["bytes"]
    assert world == 2 and len(ranks) == world
    for rank in ranks:
        for config in CONFIGS:
            for series in rank["configs"][config]["times_s"].values():
                assert len(series) == steps and all(math.isfinite(v) and v >= 0 for v in series)

    # FSDP2's own traffic is the same whatever the optimizer; the shardings add theirs.
    for config in CONFIGS:
        assert b[config]["fsdp"] == pytest.approx(b["adamw"]["fsdp"])
    check = all_reduce_bytes(3, 8, world)  # the per-step agreement on finiteness (3 int64)
    muon = ranks[0]["numel"]["muon"]
    for r, rank in enumerate(ranks):
        owner = rank["configs"]["owner"]["sharding_bytes_per_step"]
        assert owner["to_owner"] + owner["from_owner"] == pytest.approx(rank["expected_owner_bytes"])
        assert owner["step_check"] == pytest.approx(check)
        # Gathering every matrix: each rank sends its half of every matrix (rows divide evenly).
        gathered = rank["configs"]["gather_all"]["sharding_bytes_per_step"]
        assert ranks[0]["wire_dtype"] == "float32"  # pinned: the counts below do not depend on the host
        assert gathered["all_gather"] == pytest.approx((world - 1) / world * muon * 4)
        assert b["blockwise"]["muon"][r] == pytest.approx(check)  # no Newton-Schulz traffic

    # Newton-Schulz work: each matrix once in all (owner), every matrix on every rank (gather_all).
    flops = report["flops"]
    assert sum(flops["owner"]) == pytest.approx(flops["single"]) and flops["single"] > 0
    assert flops["gather_all"] == pytest.approx([flops["single"]] * world)
    matrices = ranks[0]["muon_matrices"]
    assert sum(r["configs"]["owner"]["ns_matrices_per_step"] for r in ranks) == matrices
    assert all(r["configs"]["gather_all"]["ns_matrices_per_step"] == matrices for r in ranks)
    assert report["targets_total"] == 2 and all(t["passed"] for t in report["targets"])
    assert report["projection"][0]["owner_mb"] == pytest.approx(max(b["owner"]["muon"]) / 1e6, rel=0.01)

