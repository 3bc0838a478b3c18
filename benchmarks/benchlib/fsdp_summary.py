"""The FSDP2 benchmark's settings, targets, summary and tables (``bench_fsdp.py`` measures, this reads).

``summarize`` turns every rank's raw counts and times into bytes, FLOPs and times per
configuration and the two targets; ``print_report`` prints the tables (larger W:
``studies/scale_model.py``). benchmarks/README.md ("bench_fsdp.py") says what each row
measures and why.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

from benchlib.harness import fixed_cell, table, target, verdict
from benchlib.ranks import RankSettings, slowest_rank_median

# The configurations, each run on the same W processes (bench_fsdp.py's docstring).
CONFIGS = ("adamw", "owner", "gather_all", "blockwise")
TIMES = ("step", "optimizer", "optimizer_cpu")

# Targets (benchmarks/README.md, "bench_fsdp.py").
FLOPS_SLACK = 1.1  # owner: busiest rank's Newton-Schulz FLOPs <= FLOPS_SLACK / W of the total
MUON_BYTES_SLACK = 0.02  # owner's Muon bytes / gather_all's <= 2 / W + slack (the analytic ratio)


@dataclass(frozen=True, kw_only=True)
class Settings(RankSettings):
    """The shared world and model (``ranks.RankSettings``); bytes and FLOPs are per timed step."""

    ns_dtype: str | None = None
    """Newton-Schulz dtype; None is the automatic policy (bf16 where this host's bf16 matmul is fast)."""


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The world, model and step counts of ``bench_fsdp.py``'s flags (``--quick``: a tiny model)."""
    if args.quick:
        values = dict(n_layer=2, n_embd=32, n_head=2, block_size=16, batch=2, warmup=1, steps=2)
    else:
        # d=256: Newton-Schulz is most of a single process's optimizer step, as in the models Muon is for.
        values = dict(n_layer=4, n_embd=256, n_head=4, block_size=64, batch=4, warmup=2, steps=8)
    if args.steps is not None:
        values["steps"] = args.steps
    return Settings(
        quick=args.quick,
        world_size=args.world_size,
        threads=args.threads,
        ns_dtype=args.ns_dtype,
        device=args.device,
        **values,
    )


# ---------------------------------------------------------------- summary and report


def summarize(s: Settings, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    w, first = s.world_size, ranks[0]
    bytes_ = {}
    for c in CONFIGS:
        per_rank = [r["configs"][c]["bytes_per_step"] for r in ranks]
        total = [sum(b.values()) for b in per_rank]
        # The sharding's own count (CommStats) is the Muon part; FSDP2 sent the rest.
        muon = [sum(r["configs"][c]["sharding_bytes_per_step"].values()) for r in ranks]
        bytes_[c] = {"per_rank_by_op": per_rank, "total": total, "muon": muon}
        bytes_[c]["fsdp"] = [t - m for t, m in zip(total, muon)]
    baseline = max(bytes_["adamw"]["total"])
    for c in CONFIGS:
        bytes_[c]["ratio_to_adamw"] = max(bytes_[c]["total"]) / baseline
    gather_muon = max(bytes_["gather_all"]["muon"])
    muon_ratio = max(bytes_["owner"]["muon"]) / gather_muon
    total_flops = first["single"]["ns_flops_per_step"]
    flops = {
        "single": total_flops,
        **{c: [r["configs"][c]["ns_flops_per_step"] for r in ranks] for c in CONFIGS if c != "adamw"},
    }
    max_share = max(flops["owner"]) / total_flops
    single_times = {k: statistics.median(v) for k, v in first["single"]["times_s"].items()}
    times = {
        "single": single_times,
        **{c: {k: slowest_rank_median(ranks, c, k) for k in TIMES} for c in CONFIGS},
    }
    for c in CONFIGS:
        for k in TIMES:
            times[c][f"{k}_ratio_to_single"] = times[c][k] / single_times[k]
    if s.device == "cuda":
        # The host's CPU time there is mostly waiting for the GPU: not a measure of the work.
        for entry in times.values():
            for key in ("optimizer_cpu", "optimizer_cpu_ratio_to_single"):
                if key in entry:
                    entry[key] = None
    targets = [
        target(f"owner: NS FLOPs, busiest rank / all <= {FLOPS_SLACK}/W", max_share, "<=", FLOPS_SLACK / w),
        target("owner: Muon bytes / gather_all's <= 2/W (+2%)", muon_ratio, "<=", 2 / w + MUON_BYTES_SLACK),
    ]
    return {
        "bytes": bytes_,
        "muon_bytes_owner_over_gather_all": muon_ratio,
        "flops": flops,
        "owner_max_flops_share": max_share,
        "times": times,
        "targets": targets,
    }


def print_report(s: Settings, ranks: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    first, w = ranks[0], s.world_size
    b, f, t = summary["bytes"], summary["flops"], summary["times"]
    cpu = s.device == "cpu"  # on CUDA the CPU-time columns are dropped: the host mostly waits there
    backend = "gloo" if cpu else "nccl"
    print(
        f"\n== Muon under FSDP2, {w} {backend} ranks x {s.threads} thread(s): "
        f"CharGPT d={s.n_embd} x {s.n_layer} layers, "
        f"{first['muon_matrices']} Muon matrices ({first['numel']['muon']:,} of {first['numel']['total']:,} elements), "
        f"wire dtype {first['wire_dtype']} =="
    )
    rows = []
    for c in CONFIGS:
        ns = "-" if c == "adamw" else max(f[c]) / 1e9
        rows.append(
            [
                c,
                max(b[c]["fsdp"]) / 1e6,
                max(b[c]["muon"]) / 1e6,
                max(b[c]["total"]) / 1e6,
                b[c]["ratio_to_adamw"],
                ns,
                t[c]["optimizer"] * 1e3,
                t[c]["optimizer_ratio_to_single"],
                *([t[c]["optimizer_cpu"] * 1e3, t[c]["optimizer_cpu_ratio_to_single"]] if cpu else []),
                t[c]["step"] * 1e3,
                t[c]["step_ratio_to_single"],
            ]
        )
    single = t["single"]
    rows.append(["1 process", 0.0, 0.0, 0.0, "-", f["single"] / 1e9, single["optimizer"] * 1e3, 1.0])
    rows[-1] += [*([single["optimizer_cpu"] * 1e3, 1.0] if cpu else []), single["step"] * 1e3, 1.0]
    headers = ["config", "FSDP MB", "Muon MB", "total MB", "/ adamw", "NS GFLOP", "opt ms", "/ 1 proc"]
    headers += ["opt CPU ms", "/ 1 proc"] if cpu else []
    print(table([*headers, "step ms", "/ 1 proc"], rows, fixed_cell))
    print(
        "MB sent per step by the busiest rank (all calls to torch.distributed, counted by a wrapper; Muon = the\n"
        "sharding's own count, FSDP = the rest); NS GFLOP = Newton-Schulz work of the busiest rank; times: slowest\n"
        f"rank, median of {s.steps} steps (opt = Muon.step or AdamW.step; step = forward + backward + opt);\n"
        f"1 process = {w} x {s.batch} sequences, {s.threads} thread(s)"
        + ("" if cpu else ", on cuda:0; times synchronized")
    )
    ratio = summary["muon_bytes_owner_over_gather_all"]
    print(f"owner Muon bytes / gather_all Muon bytes = {ratio:.3f} (2/W = {2 / w:.3f})")
    for t in summary["targets"]:
        print(f"target {t['name']}: {t['value']:.3f} {t['op']} {t['bound']:.3f} {verdict(t['passed'])}")
