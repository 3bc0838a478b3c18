"""Benchmark: Muon's ``tp_mode``s on a (data x tensor) mesh: bytes per mesh dim and Newton-Schulz FLOPs per rank.

Four gloo processes on CPU form a 2 x 2 mesh (``--dp``, ``--tp``). A stack of transformer
blocks' matrices (q, k, v, fc1 colwise; proj, fc2 rowwise; k and v of grouped-query
attention, a quarter of q's rows) is placed as Lightning's ``ModelParallelStrategy`` places
it (``parallelize_module`` on the tensor dim, then ``fully_shard`` on the data dim), and
``Muon`` + ``MuonTPSharding`` takes optimizer steps on random gradients in each
``tp_mode``. Per step, measured beside the formulas of ``tp_math`` (bytes: what each rank
sends, as ``CommStats`` counts it):

- data dim: the owners' all-to-alls, ``2 (D - 1) / D * P / T`` per rank (balanced owners);
- tensor dim: ``tp_bytes`` per matrix on each of the T ranks of its owning group;
- Newton-Schulz FLOPs per rank: counted from the matrices handed to the iteration, against
  ``tp_ns_flops`` (duplicated: the whole matrix T times over; distributed: the blocks'
  products plus the replicated ``A A``; blockwise: the blocks alone);
- the optimizer step's wall time (slowest rank, median), against ``duplicated`` in the same run.

Usage::

    python benchmarks/bench_tp.py                 # d=256 x 2 blocks, 2 x 2 mesh, about 1 min
    python benchmarks/bench_tp.py --quick         # d=64, 2 timed steps (smoke test)
    python benchmarks/bench_tp.py --d-model 512 --blocks 4 --out /tmp/tp.json
    python benchmarks/bench_tp.py --memory        # memory per rank of one step instead (d=768 x 2 blocks)

``--memory`` measures instead each rank's memory in one optimizer step, ``Muon`` +
``MuonTPSharding`` in each ``tp_mode`` against AdamW on the same DTensors
(``benchlib.memory_ranks``; benchmarks/README.md, "Memory"). The blocks are
``benchlib.tp_blocks``'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchlib import harness, memory_ranks
from benchlib.memory import add_memory_arguments, memory_settings, run_memory
from benchlib.ranks import run_ranks
from benchlib.tp_blocks import COLWISE, build_model, shapes

import lightning_muon.distributed.tensor_parallel as tp_module
from lightning_muon import Muon
from lightning_muon.distributed.tensor_parallel import DP_DIM, TP_DIM, MuonTPSharding
from lightning_muon.distributed.tp_math import TP_MODES, tp_bytes, tp_ns_flops
from lightning_muon.newton_schulz import ns_flops

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_tp.json"
MEMORY_OUT = DEFAULT_OUT.with_name("bench_tp_memory.json")
NS_STEPS = 5


class FlopCounter:
    """Newton-Schulz FLOPs this rank runs, on whole matrices and on blocks.

    Wraps ``muon_orthogonalize`` and ``newton_schulz_on_shards`` where ``MuonTPSharding`` calls them.
    """

    def __init__(self) -> None:
        self.flops = 0
        whole, blocks = tp_module.muon_orthogonalize, tp_module.newton_schulz_on_shards

        def count_whole(updates, **kwargs):
            self.flops += sum(ns_flops(*u.shape[-2:], kwargs["ns_steps"]) for u in updates)
            return whole(updates, **kwargs)

        def count_blocks(shards, schedule, norm, all_reduce):
            for s in shards:  # (K, m, n_t): two products with the block, A A on the whole short side
                K, m, n_t = s.shape
                self.flops += K * len(schedule) * (4 * m * m * n_t + 2 * m**3)
            return blocks(shards, schedule, norm, all_reduce)

        tp_module.muon_orthogonalize, tp_module.newton_schulz_on_shards = count_whole, count_blocks


def _worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every tp_mode on this rank of the (data, tensor) mesh: bytes per dim, FLOPs, step times."""
    device = args["device"]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (args["dp"], args["tp"]), mesh_dim_names=(DP_DIM, TP_DIM))
    model = build_model(args["d_model"], args["blocks"], mesh, device)
    counter = FlopCounter()
    results = {}
    for mode in TP_MODES:
        opt = Muon(model.parameters(), lr=0.02, ns_dtype=args["ns_dtype"], tp_mode=mode)
        sharding = MuonTPSharding(opt, tp_mode=mode)
        times = []
        for step in range(args["warmup"] + args["steps"]):
            torch.manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            if step == args["warmup"]:
                counter.flops = 0
                for stats in sharding.stats_by_dim.values():
                    stats.reset()
            harness.sync(device)
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            harness.sync(device)
            elapsed = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if step >= args["warmup"]:
                times.append(float(elapsed))
        n = args["steps"]
        results[mode] = {
            "bytes": {dim: stats.total_bytes / n for dim, stats in sharding.stats_by_dim.items()},
            "ns_flops": counter.flops / n,
            "optimizer_s": statistics.median(times),
        }
    return results


def formulas(d: int, blocks: int, dp: int, tp: int, element_size: int) -> dict[str, dict[str, float]]:
    """Per-rank means per step from ``tp_math``: data-dim bytes, tensor-dim bytes, Newton-Schulz FLOPs."""
    world = dp * tp
    out = {}
    for mode in TP_MODES:
        data = tensor = flops = 0.0
        for name, (rows, cols) in shapes(d).items():
            split = 0 if name in COLWISE else 1
            # Data dim: each of the D - 1 non-owners of a block sends its rows, the owner returns them.
            data += 2 * (dp - 1) / dp * rows * cols * element_size
            # Tensor dim: the T ranks of the owning group (one group in D per matrix).
            tensor += tp * tp_bytes(rows, cols, NS_STEPS, tp, mode, split, element_size)
            flops += tp * tp_ns_flops(rows, cols, NS_STEPS, tp, mode, split)
        out[mode] = {k: blocks * v / world for k, v in (("data", data), ("tensor", tensor), ("flops", flops))}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d=64, 1 warmup + 2 timed steps")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--d-model", type=int, default=None, help="block width (default 256; 768 with --memory)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--ns-dtype", default=None, choices=("float32", "bfloat16"), help="(default float32)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo (default); cuda: NCCL, rank r on cuda:r"
    )
    parser.add_argument(
        "--out", type=Path, help=f"JSON output (default {DEFAULT_OUT}; {MEMORY_OUT.name} with --memory)"
    )
    add_memory_arguments(parser, "Muon in each tp_mode against AdamW, d=768 x 2 blocks")
    a = parser.parse_args(argv)
    if a.memory and (a.steps is not None or a.ns_dtype is not None):
        parser.error("--memory measures one step in the automatic dtype: --steps and --ns-dtype do not apply")
    defaults = dict(
        d_model=768 if a.memory else 256, steps=5, ns_dtype="float32", out=MEMORY_OUT if a.memory else DEFAULT_OUT
    )
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    for name in ("dp", "tp", "d_model", "blocks", "steps", "threads"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.d_model % 4:
        parser.error("--d-model must be a multiple of 4 (k and v have d / 4 rows)")
    if a.device == "cuda" and a.dp * a.tp > torch.cuda.device_count():
        parser.error(
            f"--device cuda needs one GPU per rank (NCCL): --dp {a.dp} x --tp {a.tp}, "
            f"but torch.cuda.device_count() is {torch.cuda.device_count()}"
        )
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.memory:
        size = (64 if a.quick else a.d_model, a.blocks)
        cfg = memory_settings(a, threads=a.threads, mesh=[a.dp, a.tp], mesh_model=size)
        return run_memory(cfg, {"mesh": (memory_ranks.bench_mesh, memory_ranks.print_mesh)}, a.out)
    args = dict(
        dp=a.dp,
        tp=a.tp,
        d_model=64 if a.quick else a.d_model,
        blocks=a.blocks,
        steps=2 if a.quick else a.steps,
        warmup=1,
        threads=a.threads,
        ns_dtype=a.ns_dtype,
        device=a.device,
    )
    world = a.dp * a.tp
    machine = harness.describe_machine(a.device)
    backend = "nccl" if a.device == "cuda" else "gloo"
    ranks = run_ranks(_worker, world, args, backend=backend, threads=a.threads)
    element_size = torch.empty(0, dtype=getattr(torch, a.ns_dtype)).element_size()
    expected = formulas(args["d_model"], args["blocks"], a.dp, a.tp, element_size)
    print(
        f"bench_tp: {a.dp} x {a.tp} (data x tensor) {backend} ranks, {args['blocks']} blocks of d={args['d_model']} "
        f"(q,k,v,fc1 colwise; proj,fc2 rowwise), Newton-Schulz {a.ns_dtype}, {NS_STEPS} steps; "
        "per optimizer step, mean per rank"
    )
    print(f"machine: {harness.machine_line(machine)}")
    rows, lines = {}, []
    base = None
    for mode in TP_MODES:
        mean = {k: statistics.mean(r[mode]["bytes"][k] for r in ranks) for k in (DP_DIM, TP_DIM)}
        flops = [r[mode]["ns_flops"] for r in ranks]
        seconds = ranks[0][mode]["optimizer_s"]
        base = base or seconds
        rows[mode] = {
            "data_bytes": mean[DP_DIM],
            "data_bytes_formula": expected[mode]["data"],
            "tensor_bytes": mean[TP_DIM],
            "tensor_bytes_formula": expected[mode]["tensor"],
            "ns_flops_mean": statistics.mean(flops),
            "ns_flops_max": max(flops),
            "ns_flops_formula": expected[mode]["flops"],
            "optimizer_s": seconds,
        }
        lines.append(
            [
                mode,
                f"{mean[DP_DIM]:,.0f}",
                f"{expected[mode]['data']:,.0f}",
                f"{mean[TP_DIM]:,.0f}",
                f"{expected[mode]['tensor']:,.0f}",
                statistics.mean(flops) / 1e9,
                expected[mode]["flops"] / 1e9,
                max(flops) / 1e9,
                seconds * 1e3,
                seconds / base,
            ]
        )
    headers = ["tp_mode", "data-dim bytes", "formula", "tensor-dim bytes", "formula"]
    headers += ["NS GFLOP/rank", "formula", "max rank", "opt. step ms", "vs duplicated"]
    print(harness.table(headers, lines))
    print(
        "blockwise is an approximation (each block orthogonalized alone), not Muon; duplicated and "
        "distributed are exact. Bytes exclude the step's finiteness check (a few bytes per rank)."
    )
    result = {"machine": machine, "settings": args, "rows": rows}
    harness.write_report(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
