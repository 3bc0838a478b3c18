"""benchmarks/bench_moe.py runs on 2 gloo ranks, and what it measures is what the scale model counts."""

from __future__ import annotations

import pytest
from bench_runner import run_benchmark

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_measured_bytes_and_flops_equal_the_scale_models(tmp_path):
    report, stdout = run_benchmark("bench_moe.py", tmp_path / "report.json", "--quick", timeout=300)
    assert report["machine"]["cpu"] in stdout and "busiest/fair" in stdout
    summary = report["summary"]
    assert sorted(summary) == ["muon_ddp/E=64", "muon_ddp/E=8", "muon_fsdp/E=64", "muon_fsdp/E=8"]
    for phase, entry in summary.items():
        for measured, predicted in zip(entry["measured"], entry["predicted"], strict=True):
            assert measured["ns_flops"] == predicted["ns_flops"], phase
            for op, sent in measured["sharding_bytes"].items():
                assert sent == predicted["bytes"][op], (phase, op)
    # muon_fsdp: the expert stacks stay where their experts are; only the dense (32, 32) matrix
    # travels: its other rank's 16 rows to the owner and back, 16 x 32 fp32 each way.
    for experts in (8, 64):
        for rank in summary[f"muon_fsdp/E={experts}"]["measured"]:
            moved = {k: v for k, v in rank["sharding_bytes"].items() if k in ("to_owner", "from_owner")}
            assert sum(moved.values()) == 16 * 32 * 4
    # Every rank runs Newton-Schulz on experts: the work splits, with no rank idle.
    assert all(r["ns_flops"] > 0 for r in summary["muon_fsdp/E=64"]["measured"])
