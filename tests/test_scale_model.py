"""benchmarks/scale_model.py: its counts equal what bench_ddp.py and bench_fsdp.py measure, and its H100 targets."""

from __future__ import annotations

import json

import bench_ddp
import bench_fsdp
import pytest
import scale_model as sm
import torch
from benchlib import scale_counts as sc
from benchlib import scale_designs as sd
from benchlib import scale_profiles as sp
from benchlib.ranks import char_gpt
from dist_utils import run_distributed

from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.newton_schulz import resolve_ns_dtype

TINY = dict(quick=True, threads=1, n_layer=1, n_embd=16, n_head=2, block_size=8, batch=1, warmup=0, steps=1)


def _ddp_settings(world: int) -> bench_ddp.Settings:
    return bench_ddp.Settings(world_size=world, count_steps=1, wide_budget_s=0.0, **TINY)


def _fsdp_settings(world: int) -> bench_fsdp.Settings:
    return bench_fsdp.Settings(world_size=world, ns_dtype="float32", **TINY)


def _both_benches(rank: int, world: int) -> tuple[dict, dict]:
    """One rank of bench_ddp.py, then of bench_fsdp.py, in the same gloo group (one launch for both)."""
    ddp = bench_ddp._rank_main(rank, world, _ddp_settings(world))
    fsdp = bench_fsdp._rank_main(rank, world, _fsdp_settings(world))
    return ddp["configs"], fsdp["configs"]


def assert_ddp_counts(s: bench_ddp.Settings, ranks: list[dict]) -> None:
    """bench_ddp.py's counted bytes and FLOPs per rank (``configs`` of each rank) equal the scale model's."""
    world = s.world_size
    model = char_gpt(s)
    shapes = sc.shapes_from_optimizer("CharGPT", model, bench_ddp._optimizer(model))
    dtype = resolve_ns_dtype(None, "cpu", torch.float32)  # the benchmark's automatic dtype
    # One node of `world` ranks: every byte is intra-node, as on the benchmark's host.
    counts = sc.ddp_counts(shapes, world, world, world, ns_dtype=dtype)["ranks"]
    total_flops = sum(sc.ns_flops_of(m, 5, "auto", dtype) for m in shapes.muon)
    assert len(ranks) == len(counts) == world
    for rank, (d, mod) in enumerate(zip(ranks, counts)):
        rs = d["reduce_scatter"]
        # muon_ddp today: MuonDDPSharding's own counts and DDP's bucket hook, one by one; the
        # same with the gradients sent in buckets from backward's hooks.
        for op in ("reduce_scatter", "all_gather", "nonfinite_flag"):
            assert rs["muon_path_bytes_per_step"].get(op, 0.0) == pytest.approx(mod["bytes"].get(op, 0.0)), (rank, op)
            overlap = d["overlap"]["muon_path_bytes_per_step"].get(op, 0.0)
            assert overlap == pytest.approx(mod["bytes"].get(op, 0.0)), (rank, op)
        assert rs["ddp_bucket_bytes_per_step"] == pytest.approx(mod["bytes"]["ddp_buckets"])
        assert sum(rs["wire_bytes_per_step"].values()) == pytest.approx(mod["intra"] + mod["inter"])
        assert mod["inter"] == 0.0
        assert rs["ns_flops_per_step"] == mod["ns_flops"]
        # Plain DDP: one all-reduce of every gradient, every matrix orthogonalized on every rank.
        assert sum(d["ddp"]["wire_bytes_per_step"].values()) == pytest.approx(
            all_reduce_bytes(shapes.total_numel, 4, world)
        )
        assert d["ddp"]["ns_flops_per_step"] == total_flops
    assert sum(r["ns_flops"] for r in counts) == total_flops


def assert_fsdp_counts(s: bench_fsdp.Settings, ranks: list[dict]) -> None:
    """bench_fsdp.py's counted Muon bytes and FLOPs per rank, both modes, equal the scale model's."""
    model = char_gpt(s)
    shapes = sc.shapes_from_optimizer("CharGPT", model, bench_ddp._optimizer(model))
    itemsize = torch.float32.itemsize if s.ns_dtype == "float32" else None
    assert itemsize is not None, "the counts are compared with Newton-Schulz pinned to float32"
    counts = sc.fsdp_counts(shapes, s.world_size, s.world_size, wire_bytes=itemsize, ns_dtype=torch.float32)["ranks"]
    assert len(ranks) == len(counts) == s.world_size
    for rank, (f, mod) in enumerate(zip(ranks, counts)):
        owner = f["owner"]["sharding_bytes_per_step"]
        for op in ("to_owner", "from_owner", "step_check"):
            assert owner.get(op, 0.0) == pytest.approx(mod["bytes"][op]), (rank, op)
        assert f["blockwise"]["sharding_bytes_per_step"] == pytest.approx({"step_check": mod["bytes"]["step_check"]})
        assert f["owner"]["ns_flops_per_step"] == mod["ns_flops_owner"]
        assert f["blockwise"]["ns_flops_per_step"] == mod["ns_flops_blockwise"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_counts_equal_the_benchmarks(world):
    """W = 3 and 4 here, one launch running both benchmarks; W = 2 in test_bench_ddp.py / test_bench_fsdp.py."""
    measured = run_distributed(_both_benches, world)
    assert_ddp_counts(_ddp_settings(world), [d for d, _ in measured])
    assert_fsdp_counts(_fsdp_settings(world), [f for _, f in measured])


@pytest.mark.parametrize(
    ("preset", "expected"),
    [  # busiest rank's Newton-Schulz FLOPs / (total / W), and idle ranks, at W = 8, 32, 64, 128, 256, 1024
        ("gpt2-small", [(1.02, 0), (1.33, 0), (1.71, 16), (3.43, 80), (6.86, 208), (27.43, 976)]),
        ("1.3b", [(1.0, 0), (1.1, 0), (1.33, 0), (1.71, 32), (3.43, 160), (13.71, 928)]),
        ("7b", [(1.0, 0), (1.0, 0), (1.14, 0), (1.29, 0), (2.57, 128), (10.29, 896)]),
    ],
)
def test_presets_reproduce_the_owner_ceiling(preset, expected):
    shapes = sc.PRESETS[preset]()
    assert len(shapes.muon) == {"gpt2-small": 48, "1.3b": 96, "7b": 128}[preset]
    for world, (share, idle) in zip((8, 32, 64, 128, 256, 1024), expected):
        plan = sc.plan_for(shapes, world)
        busiest = max(plan.load(r) for r in range(world))
        assert busiest / (sum(plan.flops) / world) == pytest.approx(share, abs=0.005)
        assert sum(1 for r in range(world) if not plan.owned(r)) == idle


def test_collective_split_adds_up_to_the_ring():
    for world, per_node in ((8, 8), (16, 8), (24, 8), (64, 8), (12, 4), (6, 1)):
        topo = sc.Topology(world, per_node)
        for factor, flat in ((2.0, all_reduce_bytes(1000, 4, world)), (1.0, all_reduce_bytes(1000, 4, world) / 2)):
            intra, inter = sc.collective_split(list(range(world)), 3, topo, 4000.0, factor)
            assert intra + inter == pytest.approx(flat)
            assert (inter == 0.0) == (world == per_node)


def test_h100_targets_and_owner_groups():
    """Item 4: muon_ddp (groups of 8 + overlap) <= plain DDP with replicated Muon, all presets, W = 8..1024."""
    profile = sp.h100_profile()
    presets = {k: f() for k, f in sc.PRESETS.items()}
    results = sm.run_model(presets, profile, sm.WORLDS, None)
    for key, res in results.items():
        for world, rows in res["worlds"].items():
            assert rows["target"]["passed"], (key, world, rows["target"])
            ours, ddp = rows["muon_ddp_groups"], rows["ddp_replicated"]
            # Inter-node bytes <= plain DDP's, but for the flags: one fp32 element per owned unit
            # (a matrix, or an expert stack's block of experts: which gradients exist) and the
            # finiteness bit, all-reduced across groups.
            size = min(8, world)
            group = sc.ddp_counts(presets[key], size, size, 8)["ranks"]
            flags = all_reduce_bytes(max(e["owned_matrices"] for e in group) + 2, 4, world)
            if not res["expert_stacks"]:
                assert ours["inter_bytes"] <= ddp["inter_bytes"] + flags, (key, world)
            else:
                # Expert stacks are split evenly by experts; the other matrices are balanced by
                # Newton-Schulz FLOPs, not elements, so the busiest rank sends its share of the
                # elements over the mean (DeepSeek-V3: 1.005) times plain DDP's per-rank bytes.
                elements = [e["owned_elements"] for e in group]
                imbalance = max(elements) / (sum(elements) / size)
                assert imbalance < 1.01, (key, world, imbalance)
                assert ours["inter_bytes"] <= ddp["inter_bytes"] * imbalance + flags, (key, world)
            # Overlap never makes it worse; today's design is what grows with W.
            assert rows["muon_ddp_groups_overlap"]["overhead_s"] <= ours["overhead_s"] + 1e-12
    gpt2 = results["gpt2-small"]["worlds"]
    assert gpt2[1024]["muon_ddp_today"]["overhead_s"] > 10 * gpt2[8]["muon_ddp_today"]["overhead_s"]
    # Busiest rank's Newton-Schulz <= 1.25 x total / S while S <= matrices / 2.
    for key, make in sc.PRESETS.items():
        shapes = make()
        total = sum(sc.ns_flops_of(m, 5, "auto", torch.bfloat16) for m in shapes.muon)
        for size in (2, 4, 8, 16, 32, 64):
            if size <= len(shapes.muon) // 2:
                ranks = sc.ddp_counts(shapes, size, size, 8)["ranks"]
                assert max(r["ns_flops"] for r in ranks) <= 1.25 * total / size, (key, size)


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "scale.json"
    args = ["--module", "lightning_muon_demo.models.CharGPT", "--init-args", '{"n_embd": 64, "n_layer": 2}']
    assert sm.main([*args, "--worlds", "8", "16", "--set", "inter_gbps=25", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["profile"]["values"]["inter_gbps"] == 25.0
    assert "set on the command line" in report["profile"]["sources"]["inter_gbps"]
    assert set(report["results"]["lightning_muon_demo.models.CharGPT"]["worlds"]) == {"8", "16"}
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "muon_ddp, owner groups of S + overlap" in printed and "target" in printed
    with pytest.raises(SystemExit, match="unknown profile constant"):
        sm.main(["--preset", "gpt2-small", "--worlds", "8", "--set", "nvlink=1", "--out", str(out)])
    with pytest.raises(ValueError, match="group_size must divide"):
        sc.ddp_counts(sc.PRESETS["gpt2-small"](), 8, 3, 8)


def test_tensor_parallel_rows_follow_tp_math():
    """muon_fsdp with tensor_parallel_size T: per owner, tp_math's bytes and FLOPs, Megatron's layout."""
    from lightning_muon.distributed.planning import plan_ownership
    from lightning_muon.distributed.tp_math import TP_MODES, tp_bytes, tp_ns_flops

    shapes = sc.gpt_preset("tiny", 64, 2, 1000, 128, tied=True)
    assert [sd.tp_split_dim(m) for m in shapes.muon[:4]] == [0, 1, 0, 1]  # qkv, fc1 colwise; proj, fc2 rowwise
    profile = sp.h100_profile()
    assert sd.predict_tp(shapes, profile, 32, 16, "duplicated") is None  # wider than a node of 8
    plan = plan_ownership([m.stored for m in shapes.muon], 4)  # W = 16, T = 4: D = 4 data-parallel ranks
    rows = {mode: sd.predict_tp(shapes, profile, 16, 4, mode) for mode in TP_MODES}
    for mode, row in rows.items():
        sent, flops = [0.0] * 4, [0] * 4
        for m, owner in zip(shapes.muon, plan.owners):
            split = sd.tp_split_dim(m)
            sent[owner] += tp_bytes(*m.stored, 5, 4, mode, split, 2)
            flops[owner] += tp_ns_flops(*m.stored, 5, 4, mode, split)
        assert row["tp_bytes_busiest"] == max(sent) and row["ns_flops_busiest"] == max(flops)
    assert rows["blockwise"]["tp_bytes_busiest"] == 0 and not rows["blockwise"]["exact"]
    # Distributed cuts the busiest rank's Newton-Schulz work and sends more for these shapes (10 m / n).
    assert rows["distributed"]["ns_flops_busiest"] < rows["duplicated"]["ns_flops_busiest"]
    assert rows["distributed"]["tp_bytes_busiest"] > rows["duplicated"]["tp_bytes_busiest"]
    # The CLI's second table: every degree that fits a node, every mode.
    results = sm.run_model({"tiny": shapes}, profile, (16,), None, sd.TP_DEGREES)
    assert [(r["tp"], r["tp_mode"]) for r in results["tiny"]["worlds"][16]["tp"]] == [
        (T, mode) for T in sd.TP_DEGREES for mode in TP_MODES
    ]
