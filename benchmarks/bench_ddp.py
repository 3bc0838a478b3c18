"""Benchmark: Muon's Newton-Schulz sharded over W ranks (gloo on CPU, NCCL on GPUs), against one process and plain DDP.

Three results, each a ratio of two numbers measured in the same run on the same model
(CharGPT, routed by ``route_parameters``, Newton-Schulz in the automatic dtype):

- Newton-Schulz FLOPs per rank, counted from the matrices each rank actually hands to
  ``orthogonalize_many``, against the total a single process orthogonalizes;
- bytes one rank sends per training step, counted by wrapping ``torch.distributed``'s
  collectives, against plain DDP (every gradient all-reduced) measured the same way;
- optimizer step wall time (``reduce_gradients`` + ``Muon.step``, which gathers the
  parameters; the slowest rank, median over steps) against one process with the same
  number of threads per process;
- time from the end of backward to the end of the step in a whole training step, with the
  Muon gradients sent after backward (``reduce_scatter``) against sent from backward's
  hooks (``overlap``).

Usage::

    python benchmarks/bench_ddp.py                  # d=256 x 4 layers, 2 ranks x 1 thread, ~1 min
    python benchmarks/bench_ddp.py --quick          # tiny model, 2 timed steps (smoke test)
    python benchmarks/bench_ddp.py --world-size 3 --steps 30 --out /tmp/ddp.json
    python benchmarks/bench_ddp.py --device cuda    # NCCL, rank r on cuda:r: one GPU per rank
    python benchmarks/bench_ddp.py --memory         # memory per rank of one step instead

``--memory`` measures instead each rank's memory in one optimizer step: ``muon_ddp`` against
DDP + AdamW and DDP + Muon replicated, CharGPT d=768 x 2 (``benchlib.memory_ranks``).
benchmarks/README.md ("bench_ddp.py", "Memory") says what each row measures and why.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchlib import memory_ranks
from benchlib.counting import NSCounter, WireCounter
from benchlib.ddp_summary import CONFIGS, Settings, print_report, settings_from_args, summarize
from benchlib.harness import describe_machine, load_average, machine_line, sync, targets_met, write_report
from benchlib.memory import add_memory_arguments, memory_settings, run_memory
from benchlib.ranks import add_rank_arguments, char_batch, char_gpt, check_rank_arguments, ranks_line, run_ranks
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_muon import Muon, route_parameters
from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.distributed.ddp import MuonDDPSharding
from lightning_muon.newton_schulz import resolve_ns_dtype
from lightning_muon.strategies.ddp_core import MuonDDPCore
from lightning_muon_demo.models import CharGPT

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_ddp.json"
MEMORY_OUT = DEFAULT_OUT.with_name("bench_ddp_memory.json")
# Hyperparameters (they do not change the cost).
LR, WEIGHT_DECAY, ADAMW_LR = 0.02, 0.01, 3e-4
# The collectives counted: DDP's bucket all-reduce, MuonDDPSharding's reduce-scatter and
# all-gather, and the broadcast of the parameters DDP ignores.
WIRE_OPS = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")


# ---------------------------------------------------------------- DDP's own count


@dataclass
class _HookState:
    world_size: int
    bytes: float = 0.0
    calls: int = 0


# No annotations: DDP compares them with dist.GradBucket, and here they would be strings.
def _all_reduce_hook(state, bucket):
    """DDP's default all-reduce of one ``dist.GradBucket``, with its bytes counted; returns a future."""
    buf = bucket.buffer()
    state.bytes += all_reduce_bytes(buf.numel(), buf.element_size(), state.world_size)
    state.calls += 1
    buf.div_(state.world_size)
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


# ---------------------------------------------------------------- one rank


@dataclass
class _Run:
    """One configuration on one rank: its model, optimizer, sharding and measurements."""

    name: str
    model: nn.Module
    optimizer: Muon
    sharding: MuonDDPSharding | None = None
    hook: _HookState | None = None
    grads: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    muon_path_bytes: dict[str, float] = field(default_factory=dict)
    """MuonDDPSharding's own byte counts over the counted steps (its stats keep counting later)."""
    ddp_bucket_bytes: float = 0.0
    """DDP's comm hook count over the counted steps (the timed training steps add to the hook's)."""
    gather_s: float = 0.0
    times: dict[str, list[float]] = field(
        default_factory=lambda: {k: [] for k in ("step", "reduce", "ns", "gather", "cpu", "backward", "after_backward")}
    )
    """Seconds per timed step: wall time of the step and of its reduce_gradients, Newton-Schulz
    and gather_parameters parts; CPU time of the step. Of a whole training step: forward +
    backward, and from the end of backward to the end of the optimizer step."""


def _optimizer(model: nn.Module) -> Muon:
    # ns_dtype None: the automatic policy, float32 on CPUs without fast bf16 matmul.
    return Muon(route_parameters(model), lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR)


def _build(name: str, s: Settings) -> _Run:
    """A CharGPT wrapped in DDP as ``MuonDDPStrategy`` wraps it, for one of ``CONFIGS``.

    The sharded configurations go through the strategy's own setup (``MuonDDPCore``, as
    ``MuonDDPStrategy.configure_ddp`` calls it): the sharding, DDP told to ignore the Muon
    matrices (``reduce_scatter``), and with ``overlap`` the reduce from backward's hooks.
    ``ddp`` is plain DDP: every gradient all-reduced, Muon replicated.
    """
    model = char_gpt(s)
    opt = _optimizer(model)
    run = _Run(name, model, opt)
    core, shardings = None, []
    if name != "ddp":
        core = MuonDDPCore(muon_mode="reduce_scatter" if name == "overlap" else name, overlap=name == "overlap")
        shardings = core.attach([opt], model, s.world_size, s.world_size)
        (run.sharding,) = shardings
        _time_gather(run, s.device)
        core.leave_to_owners(model, shardings)
    run.model = DistributedDataParallel(model)
    run.hook = _HookState(s.world_size)
    run.model.register_comm_hook(run.hook, _all_reduce_hook)
    if core is not None:
        core.after_wrap(run.model, shardings)
    return run


def _time_gather(run: _Run, device: str) -> None:
    """Times ``gather_parameters`` apart: ``Muon.step`` calls it through the sharding instance."""
    inner = run.sharding.gather_parameters

    def timed_gather() -> None:
        sync(device)
        start = time.perf_counter()
        inner()
        sync(device)
        run.gather_s += time.perf_counter() - start

    run.sharding.gather_parameters = timed_gather  # type: ignore[method-assign]


def _count(run: _Run, s: Settings, lo: int, hi: int, wire: WireCounter | None, ns: NSCounter) -> None:
    """``count_steps`` real training steps with bytes and FLOPs counted; keeps the last local gradients."""
    if wire is not None:
        wire.phase = run.name
    ns.phase = run.name
    params = [p for p in run.model.parameters() if p.requires_grad]
    for step in range(s.count_steps):
        run.optimizer.zero_grad(set_to_none=True)
        x, y = char_batch(s, step, lo, hi)
        CharGPT.loss(run.model(x), y).backward()
        if step == s.count_steps - 1:
            # What reduce_gradients sees: DDP's averaged grads, and local ones where DDP ignores.
            run.grads = [(p, p.grad.detach().clone()) for p in params if p.grad is not None]
        if run.sharding is not None:
            run.sharding.reduce_gradients()
        run.optimizer.step()
    if run.sharding is not None:
        run.muon_path_bytes = dict(run.sharding.stats.bytes)
    run.ddp_bucket_bytes = run.hook.bytes if run.hook is not None else 0.0
    if wire is not None:
        wire.phase = None
    ns.phase = None


def _timed_step(run: _Run, ns: NSCounter, barrier: bool, device: str = "cpu") -> None:
    """One optimizer step on the saved gradients: reduce_gradients (sharded) then Muon.step."""
    for p, g in run.grads:
        p.grad = g.clone()
    run.gather_s = 0.0
    ns_before = ns.seconds
    if barrier:
        dist.barrier()  # ranks start together: the slowest rank's time is the step's time
    sync(device)  # the gradient copies above are not part of the step
    start, start_cpu = time.perf_counter(), time.process_time()
    if run.sharding is not None:
        run.sharding.reduce_gradients()
    sync(device)
    reduced = time.perf_counter()
    run.optimizer.step()
    sync(device)
    end, end_cpu = time.perf_counter(), time.process_time()
    run.times["step"].append(end - start)
    run.times["reduce"].append(reduced - start)
    run.times["gather"].append(run.gather_s)
    run.times["ns"].append(ns.seconds - ns_before)
    # CPU time of every thread of this process (gloo's included): not stretched by other
    # processes taking the cores, so it shows the work when the wall time is distorted.
    # On CUDA it counts the host waiting for the GPU instead: summarize() drops it there.
    run.times["cpu"].append(end_cpu - start_cpu)


def _timed_train_step(run: _Run, s: Settings, step: int, lo: int, hi: int) -> None:
    """A whole training step; times forward + backward, and the end of backward to the end of the step.

    Plain DDP's backward returns once its bucket all-reduces are done; ``reduce_scatter``
    then sends the Muon gradients in one all-to-all; ``overlap`` sent them from backward's
    hooks and only waits. Newton-Schulz, the update and the gather come after in all three.
    """
    run.optimizer.zero_grad(set_to_none=True)
    x, y = char_batch(s, step, lo, hi)
    dist.barrier()  # ranks start together: the slowest rank's time is the step's time
    sync(s.device)
    start = time.perf_counter()
    CharGPT.loss(run.model(x), y).backward()
    sync(s.device)
    backward_end = time.perf_counter()
    if run.sharding is not None:
        run.sharding.reduce_gradients()
    run.optimizer.step()
    sync(s.device)
    run.times["backward"].append(backward_end - start)
    run.times["after_backward"].append(time.perf_counter() - backward_end)


def _rank_main(rank: int, w: int, s: Settings) -> dict[str, Any]:
    wire, ns = WireCounter(rank, w, WIRE_OPS), NSCounter(s.device)
    wire.install()
    ns.install()
    runs = {name: _build(name, s) for name in CONFIGS}
    for run in runs.values():
        _count(run, s, rank * s.batch, (rank + 1) * s.batch, wire, ns)
    # The single-process baseline lives on rank 0 and runs while the other ranks wait in a
    # barrier (which idles them), interleaved with the W-rank steps so that a change in the
    # machine's load falls on every configuration alike.
    single = None
    if rank == 0:
        model = char_gpt(s)
        single = _Run("single", model, _optimizer(model))
        _count(single, s, 0, w * s.batch, None, ns)
    single_times = {t: {"step": [], "ns": [], "cpu": []} for t in (s.threads, w * s.threads)}
    wide_spent, idle_cpu, idle_wall = 0.0, 0.0, 0.0
    for _ in range(s.warmup + s.steps):
        dist.barrier()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        if single is not None:
            for threads, series in single_times.items():
                if threads != s.threads and wide_spent > s.wide_budget_s:
                    continue
                torch.set_num_threads(threads)
                _timed_step(single, ns, barrier=False, device=s.device)
                for key, values in series.items():
                    values.append(single.times[key][-1])
                if threads != s.threads:
                    wide_spent += single.times["step"][-1]
            torch.set_num_threads(s.threads)
        dist.barrier()
        if rank != 0:
            idle_cpu += time.process_time() - start_cpu
            idle_wall += time.perf_counter() - start_wall
        for run in runs.values():
            _timed_step(run, ns, barrier=True, device=s.device)
        for run in runs.values():
            _timed_train_step(run, s, len(run.times["backward"]), rank * s.batch, (rank + 1) * s.batch)
    everything = [*single_times.values(), *(run.times for run in runs.values())]
    for series in (values for times in everything for values in times.values()):
        del series[: min(s.warmup, len(series) - 1)]

    sharded = runs["reduce_scatter"].sharding
    plan = sharded.plan
    muon_ids = {id(p) for p in sharded.params}
    params = list(runs["reduce_scatter"].model.parameters())
    n = s.count_steps
    result: dict[str, Any] = {
        "rank": rank,
        "numel": {
            "total": sum(p.numel() for p in params),
            "muon": sum(p.numel() for p in sharded.params),
            "non_muon": sum(p.numel() for p in params if id(p) not in muon_ids),
            "owned": plan.elements(rank),
        },
        "muon_matrices": len(sharded.params),
        "plan": {"owners": list(plan.owners), "flops": list(plan.flops), "loads": [plan.load(r) for r in range(w)]},
        "ns_dtype": str(resolve_ns_dtype(None, s.device, torch.float32)).removeprefix("torch."),
        "ns_method": next(
            g.get("ns_method", "standard") for g in sharded.optimizer.param_groups if g["algorithm"] == "muon"
        ),
        "idle_cpu_fraction": idle_cpu / idle_wall if idle_wall > 0 else None,
        "configs": {
            run.name: {
                "wire_bytes_per_step": {k: v / n for k, v in wire.bytes.get(run.name, {}).items()},
                "wire_calls_per_step": {k: v / n for k, v in wire.calls.get(run.name, {}).items()},
                "ddp_bucket_bytes_per_step": run.ddp_bucket_bytes / n,
                "muon_path_bytes_per_step": {k: v / n for k, v in run.muon_path_bytes.items()},
                "ns_flops_per_step": ns.flops[run.name] / n,
                "ns_matrices_per_step": ns.matrices[run.name] / n,
                "times_s": run.times,
            }
            for run in runs.values()
        },
    }
    if single is not None:
        result["single"] = {
            "ns_flops_per_step": ns.flops["single"] / n,
            "ns_matrices_per_step": ns.matrices["single"] / n,
            "times_s": {str(t): times for t, times in single_times.items()},
        }
    return result


def rank_results(s: Settings) -> list[dict[str, Any]]:
    """Every rank's raw counts and times, from ``s.world_size`` spawned processes."""
    return run_ranks(_rank_main, s.world_size, s, backend=s.backend, threads=s.threads)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quick = "tiny model, 2 timed steps (a smoke test, 20-40 s)"
    add_rank_arguments(parser, DEFAULT_OUT, quick_help=quick, memory_out=MEMORY_OUT)
    parser.add_argument("--n-layer", type=int, default=None, help="CharGPT blocks (default 4; 2 with --quick)")
    parser.add_argument("--n-embd", type=int, default=None, help="CharGPT width (default 256; 32 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 15)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2)")
    add_memory_arguments(parser, "muon_ddp against DDP + AdamW and DDP + Muon replicated, CharGPT d=768 x 2")
    args = check_rank_arguments(parser, parser.parse_args(argv))
    if args.memory and any(v is not None for v in (args.n_layer, args.n_embd, args.steps, args.warmup)):
        parser.error("--memory measures its own model and step: --n-layer, --n-embd, --steps, --warmup do not apply")
    if args.out is None:
        args.out = MEMORY_OUT if args.memory else DEFAULT_OUT
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory:
        size = memory_ranks.char_model_size(args.quick)
        cfg = memory_settings(args, threads=args.threads, world_size=args.world_size, dist_model=size)
        return run_memory(cfg, {"ddp": (memory_ranks.bench_ddp, memory_ranks.print_ddp)}, args.out)
    s = settings_from_args(args)
    machine = describe_machine(s.device)
    print(f"lightning_muon DDP benchmark ({'quick' if s.quick else 'full'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_line(machine)}")
    print(
        f"ranks: {ranks_line(s, machine)}, "
        f"baseline 1 process x {s.threads} (and x {s.world_size * s.threads}) thread(s)"
    )
    start = time.perf_counter()
    ranks = rank_results(s)
    summary = summarize(s, ranks)
    elapsed = time.perf_counter() - start
    print_report(s, ranks, summary)
    machine["load_avg_1m_at_end"] = load_average()
    print(f"total {elapsed:.1f} s; load average at the end {machine['load_avg_1m_at_end']:.2f}")
    report = {
        "machine": machine,
        "settings": s.as_json(),
        "model": {
            "numel": {k: v for k, v in ranks[0]["numel"].items() if k != "owned"},
            "muon_matrices": ranks[0]["muon_matrices"],
            "ns_dtype": ranks[0]["ns_dtype"],
            "ns_method": ranks[0]["ns_method"],
            "owners": ranks[0]["plan"]["owners"],
        },
        **summary,
        **targets_met(summary["targets"]),
        "ranks": ranks,
        "elapsed_s": elapsed,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
