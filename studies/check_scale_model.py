"""The scale model's self-checks: its counts are what the benchmarks measure, its targets, its memory model.

Run (pytest runs the checks below, about 3 minutes on 2 cores)::

    python studies/check_scale_model.py            # every check
    python studies/check_scale_model.py -k memory  # some (pytest's -k, -x, -v ... pass through)

- Counts: ``bench_ddp.py``, ``bench_fsdp.py`` (W = 2, 3, 4) and ``bench_moe.py`` (W = 2) run
  ``--quick`` as a user runs them, on gloo ranks; every byte count per collective and every
  Newton-Schulz FLOP count per rank in their JSON must equal ``scale_counts``'s, and the
  benchmarks' own counters must agree with each other (the wire, ``CommStats``, DDP's hook).
- The model: the presets' owner ceilings, the ring split, the H100 targets with owner groups
  (``muon_ddp`` no slower than plain DDP at every W from 8 to 1024), the CLI, and the
  tensor-parallel rows against ``lightning_muon.distributed.tp_math``.
- Memory (``scale_memory``): exact byte counts of a tiny model, and the per-rank peak against
  one measured ``bench_fsdp.py --memory`` run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import scale_counts as sc
import scale_designs as sd
import scale_memory as smem
import scale_model as sm
import scale_profiles as sp
import torch

from lightning_muon import Muon, route_parameters
from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon_demo.models import CharGPT

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256  # the multi-process benchmarks' byte-level vocabulary; the model's numel is checked against their JSON


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``bench(script, world, *flags)``: the JSON of ``python benchmarks/<script> --quick --world-size W``, run once."""

    @functools.cache
    def run(script: str, world: int, *flags: str) -> dict[str, Any]:
        out = tmp_path_factory.mktemp(Path(script).stem) / "report.json"
        command = [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--world-size", str(world), *flags]
        proc = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())

    return run


def _tuple(sizes: list[int] | None) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(sizes)


def _char_gpt_shapes(settings: dict[str, Any]) -> sc.ModelShapes:
    """The CharGPT a multi-process benchmark trained (its report's settings), routed as ``Muon`` routes it."""
    model = CharGPT(
        VOCAB, settings["block_size"], n_layer=settings["n_layer"], n_head=settings["n_head"], n_embd=settings["n_embd"]
    )
    return sc.shapes_from_optimizer("CharGPT", model, Muon(route_parameters(model), lr=0.02))


# ---------------------------------------------------------------- counts: the benchmarks against the model


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_counts_equal_bench_ddp(bench, world):
    report = bench("bench_ddp.py", world, "--steps", "1", "--warmup", "0")
    shapes = _char_gpt_shapes(report["settings"])
    assert shapes.total_numel == report["model"]["numel"]["total"]
    dtype = getattr(torch, report["model"]["ns_dtype"])  # the benchmark's automatic dtype
    # One node of `world` ranks: every byte is intra-node, as on the benchmark's host.
    counts = sc.ddp_counts(shapes, world, world, world, ns_dtype=dtype)["ranks"]
    total_flops = sum(sc.ns_flops_of(m, 5, "auto", dtype) for m in shapes.muon)
    ranks = [r["configs"] for r in report["ranks"]]
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


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp_counts_equal_bench_fsdp(bench, world):
    # Newton-Schulz pinned to float32: the wire bytes do not depend on the host's bf16 policy.
    report = bench("bench_fsdp.py", world, "--steps", "1", "--ns-dtype", "float32")
    shapes = _char_gpt_shapes(report["settings"])
    assert shapes.muon_numel == report["ranks"][0]["numel"]["muon"]
    counts = sc.fsdp_counts(shapes, world, world, wire_bytes=4, ns_dtype=torch.float32)["ranks"]
    assert len(report["ranks"]) == len(counts) == world
    for rank, (r, mod) in enumerate(zip(report["ranks"], counts)):
        f = r["configs"]
        owner = f["owner"]["sharding_bytes_per_step"]
        for op in ("to_owner", "from_owner", "step_check"):
            assert owner.get(op, 0.0) == pytest.approx(mod["bytes"][op]), (rank, op)
        assert f["blockwise"]["sharding_bytes_per_step"] == pytest.approx({"step_check": mod["bytes"]["step_check"]})
        assert f["owner"]["ns_flops_per_step"] == mod["ns_flops_owner"]
        assert f["blockwise"]["ns_flops_per_step"] == mod["ns_flops_blockwise"]


def test_moe_counts_equal_bench_moe(bench):
    report = bench("bench_moe.py", 2)
    world, summary = report["settings"]["world_size"], report["summary"]
    assert sorted(summary) == ["muon_ddp/E=64", "muon_ddp/E=8", "muon_fsdp/E=64", "muon_fsdp/E=8"]
    for experts, tensors in report["tensors"].items():
        muon = [
            sc.Matrix(n, tuple(shape), _tuple(keys.get("split_sizes")), bool(keys.get("batched")))
            for n, shape, keys in tensors
        ]
        shapes = sc.ModelShapes(f"MoE E={experts}", muon, [], [(m.name, math.prod(m.shape), True) for m in muon])
        ddp = sc.ddp_counts(shapes, world, world, world, ns_dtype=torch.float32)["ranks"]
        fsdp = sc.fsdp_counts(shapes, world, world, wire_bytes=4, ns_dtype=torch.float32)["ranks"]
        predicted = {
            "muon_ddp": [(r["bytes"], r["ns_flops"]) for r in ddp],
            "muon_fsdp": [(r["bytes"], r["ns_flops_owner"]) for r in fsdp],
        }
        for config, model in predicted.items():
            phase = f"{config}/E={experts}"
            for measured, (nbytes, flops) in zip(summary[phase]["measured"], model, strict=True):
                assert measured["ns_flops"] == flops, phase
                for op, sent in measured["sharding_bytes"].items():
                    assert sent == nbytes[op], (phase, op)
    # muon_fsdp: the expert stacks stay where their experts are; only the dense (32, 32) matrix
    # travels: its other rank's 16 rows to the owner and back, 16 x 32 fp32 each way.
    for experts in (8, 64):
        for rank in summary[f"muon_fsdp/E={experts}"]["measured"]:
            moved = {k: v for k, v in rank["sharding_bytes"].items() if k in ("to_owner", "from_owner")}
            assert sum(moved.values()) == 16 * 32 * 4
    # Every rank runs Newton-Schulz on experts: the work splits, with no rank idle.
    assert all(r["ns_flops"] > 0 for r in summary["muon_fsdp/E=64"]["measured"])


def test_bench_ddp_counters_agree(bench):
    """What the comparison rests on: the wire counter, ``CommStats``, DDP's hook and the ring formula agree (W = 2)."""
    report = bench("bench_ddp.py", 2, "--steps", "1", "--warmup", "0")
    flops, ranks, world = report["flops"], report["ranks"], 2
    # Counted from what each rank orthogonalized: every matrix once, on exactly one rank.
    assert sum(flops["per_rank"]) == flops["total"] > 0
    matrices = report["model"]["muon_matrices"]
    assert sum(r["configs"]["reduce_scatter"]["ns_matrices_per_step"] for r in ranks) == matrices
    assert ranks[0]["single"]["ns_matrices_per_step"] == matrices
    assert flops["ddp_per_rank"] == [flops["total"]] * world  # plain DDP: every rank orthogonalizes everything
    assert flops["max_share"] <= 1.1 / world and report["targets"][0]["passed"]
    numel, conf = report["model"]["numel"], report["bytes"]["per_config"]
    assert report["bytes"]["ddp_measured"] == pytest.approx(all_reduce_bytes(numel["total"], 4, world))
    assert conf["ddp"]["per_rank_ddp_buckets"] == pytest.approx(conf["ddp"]["per_rank"])
    for config in ("reduce_scatter", "all_gather", "overlap"):
        c = conf[config]
        for wire, buckets, muon in zip(c["per_rank"], c["per_rank_ddp_buckets"], c["per_rank_muon_path"]):
            assert wire == pytest.approx(buckets + sum(muon.values()))
    non_muon = all_reduce_bytes(numel["non_muon"], 4, world)
    assert conf["reduce_scatter"]["per_rank_ddp_buckets"] == pytest.approx([non_muon] * world)
    assert conf["reduce_scatter"]["ratio_to_ddp"] <= 1.05 and report["targets"][1]["passed"]
    # all_gather mode: DDP's full all-reduce, then each owner sends its matrices to W - 1 ranks.
    for rank, muon in zip(ranks, conf["all_gather"]["per_rank_muon_path"]):
        assert muon["all_gather"] == pytest.approx((world - 1) * 4 * rank["numel"]["owned"])
    assert conf["all_gather"]["ratio_to_ddp"] > 1.0


def test_bench_fsdp_counters_agree(bench):
    """FSDP2's own traffic is the same whatever the optimizer; the owner and gather-all bytes and FLOPs (W = 2)."""
    report = bench("bench_fsdp.py", 2, "--steps", "1", "--ns-dtype", "float32")
    ranks, b, world = report["ranks"], report["bytes"], 2
    for config in ("adamw", "owner", "gather_all", "blockwise"):
        assert b[config]["fsdp"] == pytest.approx(b["adamw"]["fsdp"])
    check = all_reduce_bytes(3, 8, world)  # the per-step agreement on finiteness (3 int64)
    muon = ranks[0]["numel"]["muon"]
    for r, rank in enumerate(ranks):
        owner = rank["configs"]["owner"]["sharding_bytes_per_step"]
        assert owner["to_owner"] + owner["from_owner"] == pytest.approx(rank["expected_owner_bytes"])
        assert owner["step_check"] == pytest.approx(check)
        # Gathering every matrix: each rank sends its half of every matrix (rows divide evenly).
        gathered = rank["configs"]["gather_all"]["sharding_bytes_per_step"]
        assert gathered["all_gather"] == pytest.approx((world - 1) / world * muon * 4)
        assert b["blockwise"]["muon"][r] == pytest.approx(check)  # no Newton-Schulz traffic
    flops = report["flops"]
    assert sum(flops["owner"]) == pytest.approx(flops["single"]) and flops["single"] > 0
    assert flops["gather_all"] == pytest.approx([flops["single"]] * world)
    matrices = ranks[0]["muon_matrices"]
    assert sum(r["configs"]["owner"]["ns_matrices_per_step"] for r in ranks) == matrices
    assert all(r["configs"]["gather_all"]["ns_matrices_per_step"] == matrices for r in ranks)
    assert report["targets_total"] == 2 and all(t["passed"] for t in report["targets"])  # FLOP share and bytes


# ---------------------------------------------------------------- the model itself


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
    """muon_ddp (groups of 8 + overlap) <= plain DDP with replicated Muon, all presets, W = 8..1024."""
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


# ---------------------------------------------------------------- memory per rank


FP32_BF16_NS = smem.Dtypes(torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16)
# One run of `python benchmarks/bench_fsdp.py --memory` (then `bench_memory.py --sections fsdp`), 2026-11-26
# (CPU, 2 gloo ranks, torch 2.13.0+cpu, fast bf16 matmul: yes, so Newton-Schulz in bf16;
# step_memory_mb="auto" = 32 MiB on CPU). CharGPT d=768 x 2 layers, vocab 256, block 64, fp32.
# Bytes per rank, from the JSON's sections.fsdp.rows.
MEASURED_PARAMS = 29_239_296  # both configs, both ranks
MEASURED_GRADS = 29_239_296
MEASURED_MUON_FSDP_STATE = 30_167_124  # counters included (21 AdamW tensors x 4 B)
MEASURED_MUON_FSDP_PEAK = (139_370_580, 133_472_344)  # ranks 0, 1
MEASURED_ADAMW_STATE = 58_478_708
MEASURED_ADAMW_PEAK = 146_196_596  # FSDP2 + AdamW (foreach), both ranks
CPU_CAP = int(smem.AUTO_STEP_MEMORY_MB["cpu"] * 2**20)


def test_memory_terms_are_exact_byte_counts_for_a_tiny_model():
    # Odd row counts: the worst rank of 2 holds ceil(rows / 2) rows (torch.chunk blocks).
    tiny = smem.MemoryModel("tiny", matrices=((5, 4), (3, 4)), others=((7,), (6, 2)))
    assert smem.shard_numel((5, 4), 2) == 12 and smem.shard_numel((7,), 2) == 4
    # Worst-rank shards: matrices 3*4 + 2*4 = 20 elements, others 4 + 3*2 = 10.
    ours = smem.muon_fsdp_memory(tiny, 2, smem.BF16_FP32_STATE, cap_bytes=1)
    assert ours["params"] == 30 * 2 and ours["grads"] == 30 * 2
    assert ours["state"] == 20 * 4 + 2 * 10 * 4 + 2 * 4  # momentum, two moments, two step counters
    # The (5, 4) matrix: update + result 20 * (2 + 2), iterate + two 4 x 4 Grams (20 + 32) * 2 = 184 bytes;
    # a unit of two is over the 1-byte cap, times the exchange factor; AdamW: one fp32 temporary.
    assert ours["muon_transient"] == int(smem.EXCHANGE_FACTOR * 2 * 184)
    assert ours["adamw_transient"] == 10 * 4
    assert ours["peak"] == ours["params"] + ours["grads"] + ours["state"] + ours["transient"]
    # A cap above the unit bounds the transient instead.
    assert smem.muon_fsdp_memory(tiny, 2, smem.BF16_FP32_STATE, cap_bytes=1000)["muon_transient"] == 1500
    ref = smem.fsdp_adamw_memory(tiny, 2, smem.BF16_FP32_STATE)
    assert (ref["params"], ref["grads"], ref["state"], ref["transient"]) == (60, 60, 2 * 30 * 4 + 4 * 4, 30 * 4)
    # The 8B layout counts Llama-3-8B's 8.03B parameters.
    assert smem.MODELS["8b"]().numel == 8_030_261_248


def test_memory_char_gpt_shapes_are_the_routed_module():
    model = smem.from_module("tiny", CharGPT(VOCAB, 8, n_layer=2, n_head=2, n_embd=16))
    spec = smem.char_gpt_like(16, 2, VOCAB, 8)
    assert sorted(model.matrices) == sorted(spec.matrices)
    assert sorted(model.others) == sorted(spec.others)


def test_memory_peak_bounds_the_measured_fsdp_peak():
    model = smem.char_gpt_like(768, 2, VOCAB, 64)
    ours = smem.muon_fsdp_memory(model, 2, FP32_BF16_NS, CPU_CAP)
    assert (ours["params"], ours["grads"], ours["state"]) == (MEASURED_PARAMS, MEASURED_GRADS, MEASURED_MUON_FSDP_STATE)
    worst = max(MEASURED_MUON_FSDP_PEAK)
    assert worst <= ours["peak"] <= 1.25 * worst, ours["peak"] / worst
    ref = smem.fsdp_adamw_memory(model, 2, FP32_BF16_NS)
    assert ref["state"] == MEASURED_ADAMW_STATE
    assert ref["peak"] == MEASURED_ADAMW_PEAK


if __name__ == "__main__":
    # No third-party pytest plugins: the checks need none, and the imports above (Lightning's)
    # already loaded one that pytest would then warn it cannot rewrite.
    os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
