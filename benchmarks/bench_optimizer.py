"""Benchmarks: Newton-Schulz accuracy, optimizer step time against torch.optim.Muon,
throughput against plain matmul, the batching threshold, Gram Newton-Schulz, and the
symmetric products by blocks; on request, the step's memory against torch.optim.Muon.

One run prints every table from the same inputs (fixed seeds) on one machine, names
that machine first, and writes the same numbers as JSON. Ratios measured in the run
are the result; absolute times only give them scale.

Usage::

    python benchmarks/bench_optimizer.py                  # all tables, cuda if available
    python benchmarks/bench_optimizer.py --quick          # tiny sizes, 1 rep (smoke test)
    python benchmarks/bench_optimizer.py --sections step roofline --out /tmp/r.json
    python benchmarks/bench_optimizer.py --sections step --step-processes 5   # the medians of 5 processes
    python benchmarks/bench_optimizer.py --sections memory --device cpu       # the step's memory (not in "all")

benchmarks/README.md says what each table measures and which targets it checks.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from benchlib.harness import (
    check_device,
    describe_machine,
    load_average,
    machine_line,
    table,
    targets_met,
    verdict,
    write_report,
)
from benchlib.memory import add_memory_arguments, memory_settings
from benchlib.memory_optimizer import bench_memory_section, model_size
from benchlib.ns_tables import bench_accuracy, bench_batching, bench_gram, bench_roofline, bench_symmetric
from benchlib.step_table import bench_step
from benchlib.timing import Settings

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_optimizer.json"
SECTIONS = ("accuracy", "step", "roofline", "batching", "gram", "symmetric", "memory")
DEFAULT_SECTIONS = SECTIONS[:-1]  # memory (MemTracker on a CPU) only when asked for


# ---------------------------------------------------------------- main

BENCHES: dict[str, Callable[[Settings], dict[str, Any]]] = {
    "accuracy": bench_accuracy,
    "step": bench_step,
    "roofline": bench_roofline,
    "batching": bench_batching,
    "gram": bench_gram,
    "symmetric": bench_symmetric,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 1 rep (a smoke test, < 20 s)")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(DEFAULT_SECTIONS),
        help="tables (default: all but memory)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument(
        "--step-budget",
        type=float,
        default=None,
        help="seconds the step table may spend before skipping its optional forced-bf16 rows (default 300)",
    )
    parser.add_argument(
        "--step-processes",
        type=int,
        default=1,
        help="fresh processes the step table measures in, one after another; it reports the median of their"
        " ratios and their range (default 1: this process). Each process places its tensors in memory anew,"
        " which moved the same rows by up to 10%% between processes on a 2-core VM",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_memory_arguments(parser, None)
    args = parser.parse_args(argv)
    if args.step_processes < 1:
        parser.error(f"--step-processes must be at least 1, got {args.step_processes}")
    return check_device(parser, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        settings = Settings(device, True, budget_s=2.0, max_reps=1, step_budget_s=60.0)
    else:
        budget = 2.0 if device.type == "cuda" else 6.0
        settings = Settings(device, False, budget_s=budget, max_reps=100, step_budget_s=300.0)
    step_budget = settings.step_budget_s if args.step_budget is None else args.step_budget
    settings = Settings(device, settings.quick, settings.budget_s, settings.max_reps, step_budget, args.step_processes)
    machine = describe_machine(device)
    print(f"lightning_muon benchmarks ({'quick' if args.quick else 'full'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_line(machine)}")
    report: dict[str, Any] = {
        "machine": machine,
        "settings": {
            "quick": settings.quick,
            "budget_s": settings.budget_s,
            "max_reps": settings.max_reps,
            "step_budget_s": settings.step_budget_s,
            "step_processes": settings.step_processes,
            "sections": [s for s in SECTIONS if s in args.sections],
        },
        "sections": {},
    }
    benches = dict(BENCHES)
    if "memory" in args.sections:
        cfg = memory_settings(args, single_model=model_size(args.quick))
        report["settings"].update(step_memory_given=cfg["step_memory_given"], step_memory_mb=cfg["step_memory_mb"])
        benches["memory"] = lambda _: bench_memory_section(cfg)
    start = time.perf_counter()
    for name in SECTIONS:
        if name not in args.sections:
            continue
        section_start = time.perf_counter()
        result = benches[name](settings)
        result["elapsed_s"] = time.perf_counter() - section_start
        report["sections"][name] = result
        print(f"({name}: {result['elapsed_s']:.1f} s)")
    report["elapsed_s"] = time.perf_counter() - start
    report["load_avg_1m_at_end"] = load_average()
    targets = [t for s in report["sections"].values() for t in s.get("targets", [])]
    report.update(targets_met(targets))
    if targets:
        print("\n== targets ==")
        rows = [[t["name"], t["value"], f"{t['op']} {t['bound']}", verdict(t["passed"])] for t in targets]
        print(table(["target", "value", "bound", "result"], rows))
        print(f"{report['targets_passed']} of {len(targets)} targets met")
    print(f"\ntotal {report['elapsed_s']:.1f} s; load average at the end {report['load_avg_1m_at_end']:.2f}")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
