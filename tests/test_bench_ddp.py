"""benchmarks/bench_ddp.py runs on 2 gloo ranks and its counts add up (never a timing assertion)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from bench_runner import run_benchmark

from lightning_muon.distributed.comm import all_reduce_bytes

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("ddp", "reduce_scatter", "all_gather", "overlap")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_ddp") / "report.json"
    return run_benchmark("bench_ddp.py", out, "--quick", timeout=300)


@pytest.mark.slow
def test_report_has_every_part(run):
    report, stdout = run
    for key in ("machine", "settings", "model", "flops", "bytes", "times", "targets", "ranks"):
        assert key in report, key
    assert report["machine"]["cpu"] in stdout
    assert "quantity" in stdout and "plain DDP" in stdout
    world, steps = report["settings"]["world_size"], report["settings"]["steps"]
    assert world == 2 and len(report["ranks"]) == world
    assert [t["name"] for t in report["targets"]] and report["targets_total"] == 3
    for rank in report["ranks"]:
        for config in CONFIGS:
            for series in rank["configs"][config]["times_s"].values():
                assert len(series) == steps
                assert all(math.isfinite(v) and v >= 0 for v in series)
    single = report["ranks"][0]["single"]["times_s"]
    threads = report["settings"]["threads"]
    assert all(len(v) == steps for v in single[str(threads)].values())
    # The W-thread baseline stops when its time budget runs out, keeping at least one step.
    assert all(1 <= len(v) <= steps for v in single[str(world * threads)].values())


@pytest.mark.slow
def test_newton_schulz_work_is_split_once(run):
    report, _ = run
    flops, ranks = report["flops"], report["ranks"]
    matrices = report["model"]["muon_matrices"]
    # Counted from what each rank orthogonalized: every matrix once, on exactly one rank.
    assert sum(flops["per_rank"]) == flops["total"] > 0
    assert sum(r["configs"]["reduce_scatter"]["ns_matrices_per_step"] for r in ranks) == matrices
    assert ranks[0]["single"]["ns_matrices_per_step"] == matrices
    # Plain DDP: every rank orthogonalizes everything.
    assert flops["ddp_per_rank"] == [flops["total"]] * len(ranks)
    assert flops["max_share"] <= 1.1 / len(ranks)
    assert report["targets"][0]["passed"]


@pytest.mark.slow
def test_bytes_agree_between_counters(run):
    report, _ = run
    world = report["settings"]["world_size"]
    numel = report["model"]["numel"]
    conf = report["bytes"]["per_config"]
    # The wrapper around torch.distributed, DDP's comm hook and the analytic ring cost agree.
    assert report["bytes"]["ddp_measured"] == pytest.approx(all_reduce_bytes(numel["total"], 4, world))
    assert conf["ddp"]["per_rank_ddp_buckets"] == pytest.approx(conf["ddp"]["per_rank"])
    non_muon = all_reduce_bytes(numel["non_muon"], 4, world)
    for config in ("reduce_scatter", "all_gather", "overlap"):
        c = conf[config]
        for wire, buckets, muon in zip(c["per_rank"], c["per_rank_ddp_buckets"], c["per_rank_muon_path"]):
            assert wire == pytest.approx(buckets + sum(muon.values()))
    assert conf["reduce_scatter"]["per_rank_ddp_buckets"] == pytest.approx([non_muon] * world)
    assert conf["reduce_scatter"]["ratio_to_ddp"] <= 1.05
    assert report["targets"][1]["passed"]
    # all_gather mode: DDP's full all-reduce, then each owner sends its matrices to W - 1 ranks.
    for rank, muon in zip(report["ranks"], conf["all_gather"]["per_rank_muon_path"]):
        assert muon["all_gather"] == pytest.approx((world - 1) * 4 * rank["numel"]["owned"])
    assert conf["all_gather"]["ratio_to_ddp"] > 1.0

