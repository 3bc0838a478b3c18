"""The DDP benchmark's settings, targets, summary and tables (``bench_ddp.py`` measures, this reads).

``summarize`` turns every rank's raw counts and times into the three results and their
targets; ``print_report`` prints the tables. benchmarks/README.md ("bench_ddp.py") says
what each row measures and why.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

from benchlib.harness import cell, table, target, verdict
from benchlib.ranks import RankSettings, slowest_rank_median
from lightning_muon.distributed.comm import all_reduce_bytes

# The W-rank configurations, each run on the same W processes: plain DDP (every gradient
# all-reduced, every rank orthogonalizes every matrix), MuonDDPSharding's two modes, and
# reduce_scatter with the Muon gradients sent from backward's hooks (overlap).
CONFIGS = ("ddp", "reduce_scatter", "all_gather", "overlap")

# Targets (benchmarks/README.md, "bench_ddp.py").
FLOPS_SLACK = 1.1  # busiest rank's Newton-Schulz FLOPs <= FLOPS_SLACK / W of the total
BYTES_RATIO_MAX = 1.05  # reduce_scatter bytes per step <= 1.05 x plain DDP
STEP_RATIO_MAX = 0.65  # reduce_scatter optimizer step <= 0.65 x one process (W = 2)


@dataclass(frozen=True, kw_only=True)
class Settings(RankSettings):
    """The shared world and model (``ranks.RankSettings``), and what only this benchmark counts."""

    count_steps: int
    """Real training steps (forward, backward, reduce, step) over which bytes and FLOPs are counted."""
    wide_budget_s: float
    """Seconds the 1-process x W-threads baseline may use in all: on a busy machine its
    threads wait for each other and one step can take seconds. It stops after that (keeping
    at least one step past the warm-up rounds it got)."""


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The world, model and step counts of ``bench_ddp.py``'s flags (``--quick``: a tiny model)."""
    if args.quick:
        values = dict(
            n_layer=2, n_embd=32, n_head=2, block_size=16, batch=2, count_steps=2, warmup=1, steps=2, wide_budget_s=5.0
        )
    else:
        # d=256: Newton-Schulz is most of the single-process step (18.8 GFLOP), as in the models Muon is for.
        values = dict(
            n_layer=4,
            n_embd=256,
            n_head=4,
            block_size=64,
            batch=4,
            count_steps=3,
            warmup=2,
            steps=15,
            wide_budget_s=20.0,
        )
    for key in ("n_layer", "n_embd", "steps", "warmup"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    return Settings(quick=args.quick, world_size=args.world_size, threads=args.threads, device=args.device, **values)


# ---------------------------------------------------------------- summary


def summarize(s: Settings, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """FLOPs, bytes and times across ranks, and the three targets."""
    w, first = s.world_size, ranks[0]
    total = first["single"]["ns_flops_per_step"]
    per_rank = [r["configs"]["reduce_scatter"]["ns_flops_per_step"] for r in ranks]
    flops = {
        "total": total,
        "per_rank": per_rank,
        "max_share": max(per_rank) / total,
        "plan_total": sum(first["plan"]["flops"]),
        "plan_per_rank": first["plan"]["loads"],
        "ddp_per_rank": [r["configs"]["ddp"]["ns_flops_per_step"] for r in ranks],
    }
    wire = {c: [sum(r["configs"][c]["wire_bytes_per_step"].values()) for r in ranks] for c in CONFIGS}
    ddp_bytes = max(wire["ddp"])
    bytes_ = {
        "ddp_measured": ddp_bytes,
        "ddp_analytic": all_reduce_bytes(first["numel"]["total"], 4, w),
        "per_config": {
            c: {
                "per_rank": wire[c],
                "max": max(wire[c]),
                "ratio_to_ddp": max(wire[c]) / ddp_bytes,
                "per_rank_by_op": [r["configs"][c]["wire_bytes_per_step"] for r in ranks],
                "per_rank_ddp_buckets": [r["configs"][c]["ddp_bucket_bytes_per_step"] for r in ranks],
                "per_rank_muon_path": [r["configs"][c]["muon_path_bytes_per_step"] for r in ranks],
            }
            for c in CONFIGS
        },
    }
    single = {
        t: {"samples": len(series["step"]), **{k: statistics.median(v) for k, v in series.items()}}
        for t, series in first["single"]["times_s"].items()
    }
    base = single[str(s.threads)]
    per_config = {}
    for c in CONFIGS:
        step, cpu = slowest_rank_median(ranks, c, "step"), slowest_rank_median(ranks, c, "cpu")
        per_config[c] = {
            "step_s": step,
            "cpu_s": cpu,
            "ratio_to_single": step / base["step"],
            "cpu_ratio_to_single": cpu / base["cpu"],
            "backward_s": slowest_rank_median(ranks, c, "backward"),
            "after_backward_s": slowest_rank_median(ranks, c, "after_backward"),
            **{
                f"per_rank_{k}_s": [statistics.median(r["configs"][c]["times_s"][k]) for r in ranks]
                for k in ("step", "reduce", "ns", "gather", "cpu")
            },
        }
    if s.device == "cuda":
        # The host's CPU time there is mostly waiting for the GPU: not a measure of the work.
        for times in (*single.values(), *per_config.values()):
            for key in ("cpu", "cpu_s", "cpu_ratio_to_single", "per_rank_cpu_s"):
                if key in times:
                    times[key] = None
    times = {
        "single": single,
        "per_config": per_config,
        # Plain DDP runs the single process's work on every rank: on a quiet machine with a
        # core per rank its time matches the single process, and the excess measures the load.
        "contention": per_config["ddp"]["step_s"] / base["step"],
        "ratio_to_ddp": per_config["reduce_scatter"]["step_s"] / per_config["ddp"]["step_s"],
        # The same training step, Muon gradients sent from backward's hooks against after backward.
        "after_backward_overlap_over_reduce_scatter": (
            per_config["overlap"]["after_backward_s"] / per_config["reduce_scatter"]["after_backward_s"]
        ),
        "idle_cpu_fraction": [r["idle_cpu_fraction"] for r in ranks[1:]],
    }
    targets = [
        target(f"NS FLOPs, busiest rank / total <= {FLOPS_SLACK}/W", flops["max_share"], "<=", FLOPS_SLACK / w),
        target(
            "bytes per step / plain DDP", bytes_["per_config"]["reduce_scatter"]["ratio_to_ddp"], "<=", BYTES_RATIO_MAX
        ),
        target(
            f"optimizer step / 1 process x {s.threads} thread(s)",
            per_config["reduce_scatter"]["ratio_to_single"],
            "<=",
            STEP_RATIO_MAX,
        ),
    ]
    return {"flops": flops, "bytes": bytes_, "times": times, "targets": targets}


# ---------------------------------------------------------------- printing


def _summary_rows(s: Settings, summary: dict[str, Any]) -> list[list[Any]]:
    """Rows of the main table: quantity, ours, reference, ours / reference, target, result."""
    w, t = s.world_size, s.threads
    flops, conf, times = summary["flops"], summary["bytes"]["per_config"], summary["times"]
    by_config, single = times["per_config"], times["single"]
    fl, by, st = (verdict(tg["passed"]) for tg in summary["targets"])
    ddp_mb = summary["bytes"]["ddp_measured"] / 1e6
    ranks, one = f"{w} ranks x {t} thr", f"1 process x {t} thr"
    rows = []

    def add(quantity: str, ours: float, ref: float, ref_label: str, target: str = "-", result: str = "info") -> None:
        rows.append([quantity, ours, f"{cell(ref)} ({ref_label})", ours / ref, target, result])

    add(
        "NS GFLOP per step, busiest rank",
        max(flops["per_rank"]) / 1e9,
        flops["total"] / 1e9,
        "all, 1 process",
        f"<= {FLOPS_SLACK / w:.3f}",
        fl,
    )
    add(
        "MB sent per step per rank, reduce_scatter",
        conf["reduce_scatter"]["max"] / 1e6,
        ddp_mb,
        "plain DDP",
        f"<= {BYTES_RATIO_MAX}",
        by,
    )
    add("MB sent per step per rank, all_gather", conf["all_gather"]["max"] / 1e6, ddp_mb, "plain DDP")
    ours = by_config["reduce_scatter"]["step_s"] * 1e3
    base = single[str(t)]["step"] * 1e3
    add(f"step ms, reduce_scatter, {ranks}", ours, base, one, f"<= {STEP_RATIO_MAX}", st)
    add(f"step ms, all_gather, {ranks}", by_config["all_gather"]["step_s"] * 1e3, base, one)
    add(f"step ms, plain DDP, {ranks}", by_config["ddp"]["step_s"] * 1e3, base, one, result="load")
    wide = single[str(w * t)]
    n = wide["samples"]
    steps = "" if n == s.steps else f", {n} step{'s' * (n != 1)}"  # wide_budget_s ran out
    add(f"step ms, reduce_scatter, {ranks}", ours, wide["step"] * 1e3, f"1 process x {w * t} thr{steps}")
    add(f"step ms, reduce_scatter, {ranks}", ours, by_config["ddp"]["step_s"] * 1e3, f"plain DDP, {ranks}")
    if s.device == "cpu":  # on CUDA the host's CPU time is not the work (summarize drops it)
        add(
            f"step CPU ms, reduce_scatter, {ranks}",
            by_config["reduce_scatter"]["cpu_s"] * 1e3,
            single[str(t)]["cpu"] * 1e3,
            one,
        )
    return rows


def print_report(s: Settings, ranks: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    first = ranks[0]
    times = summary["times"]
    backend = "nccl" if s.device == "cuda" else "gloo"
    print(
        f"\n== Muon over {s.world_size} {backend} ranks vs 1 process: CharGPT d={s.n_embd} x {s.n_layer} layers, "
        f"{first['muon_matrices']} Muon matrices ({first['numel']['muon']:,} of {first['numel']['total']:,} "
        f"elements), Newton-Schulz in {first['ns_dtype']}, ns_method {first['ns_method']!r} =="
    )
    print(
        f"FLOPs and bytes per step counted over {s.count_steps} training steps; step = reduce_gradients + "
        f"Muon.step (incl. gather), median of {s.steps} steps after {s.warmup} warm-up, each the slowest rank's"
    )
    print(table(["quantity", "ours", "reference", "ratio", "target", "result"], _summary_rows(s, summary)))

    print("\n== per rank, reduce_scatter: Newton-Schulz GFLOP and MB sent per step ==")
    rows = []
    for r in ranks:
        c = r["configs"]["reduce_scatter"]
        muon = c["muon_path_bytes_per_step"]
        rows.append(
            [
                r["rank"],
                r["plan"]["owners"].count(r["rank"]),
                c["ns_flops_per_step"] / 1e9,
                r["plan"]["loads"][r["rank"]] / 1e9,
                c["ddp_bucket_bytes_per_step"] / 1e6,
                muon.get("reduce_scatter", 0.0) / 1e6,
                muon.get("all_gather", 0.0) / 1e6,
                sum(c["wire_bytes_per_step"].values()) / 1e6,
            ]
        )
    print(table(["rank", "owned", "NS GFLOP", "plan GFLOP", "DDP rest", "RS muon", "AG muon", "wire"], rows))
    print(
        f"DDP rest = DDP's bucket all-reduce of the {first['numel']['non_muon']:,} non-Muon elements (comm hook); "
        "RS/AG muon = MuonDDPSharding's own counts; wire = every collective call, counted by a wrapper"
    )
    conf = summary["bytes"]["per_config"]
    print("\n== MB sent per step, largest rank, by configuration ==")
    rows = [
        [c, max(conf[c]["per_rank_ddp_buckets"]) / 1e6, conf[c]["max"] / 1e6, conf[c]["ratio_to_ddp"]] for c in CONFIGS
    ]
    print(table(["config", "DDP buckets", "wire", "/ plain DDP"], rows))
    print(
        f"plain DDP analytic: 2 (W-1)/W x 4 B x {first['numel']['total']:,} = "
        f"{summary['bytes']['ddp_analytic'] / 1e6:.3f} MB"
    )
    print(f"\n== step time by part, ms: medians; for {s.world_size} ranks, the slowest rank's median of each part ==")
    rows = []
    cpu = s.device == "cpu"  # on CUDA the CPU column is dropped: the host mostly waits there
    parts = ("step", "reduce", "ns", "gather", "cpu") if cpu else ("step", "reduce", "ns", "gather")
    for t, part in times["single"].items():
        rows.append(
            [f"1 process x {t} thr", part["step"], 0.0, part["ns"], 0.0, part["step"] - part["ns"], part["cpu"]]
        )
    for c in CONFIGS:
        part = {k: max(times["per_config"][c][f"per_rank_{k}_s"]) for k in parts}
        rest = part["step"] - part["reduce"] - part["ns"] - part["gather"]
        rows.append([c, part["step"], part["reduce"], part["ns"], part["gather"], rest, part.get("cpu")])
    headers = ["run", "step", "reduce", "NS", "gather", "rest", "CPU"]
    if not cpu:
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    rows = [[row[0], *(v * 1e3 for v in row[1:])] for row in rows]
    print(table(headers, rows))
    print(
        "reduce = reduce_gradients (Muon grads to owners; plain DDP does this in backward); NS = orthogonalize_many; "
        "gather = gather_parameters; rest = momentum, update, AdamW, checks"
        + ("; CPU = CPU time of the step" if cpu else "; times synchronized with the GPU")
    )
    print("\n== whole training step, ms: forward + backward, and end of backward to end of step (slowest rank) ==")
    rows = [
        [c, times["per_config"][c]["backward_s"] * 1e3, times["per_config"][c]["after_backward_s"] * 1e3]
        for c in CONFIGS
    ]
    print(table(["run", "forward + backward", "after backward"], rows))
    print(
        "after backward: reduce_scatter sends the Muon gradients then; overlap sent them from backward's hooks "
        f"and waits; overlap / reduce_scatter = {times['after_backward_overlap_over_reduce_scatter']:.3f}"
    )
    idle = [f for f in times["idle_cpu_fraction"] if f is not None]
    print(
        f"\nload: plain DDP / 1 process = {times['contention']:.2f} (about 1 on a quiet machine with a core per rank); "
        f"waiting ranks used {max(idle, default=0.0):.1%} of a core while the baseline ran"
    )
    met = sum(t["passed"] for t in summary["targets"])
    print(f"{met} of {len(summary['targets'])} targets met")
