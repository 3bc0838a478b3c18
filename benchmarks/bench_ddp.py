"""Benchmark: Muon's Newton-Schulz sharded over W ranks (gloo on CPU, NCCL on GPUs), against one process and plain DDP.

Three results, each a ratio of two numbers measured in the same run on the same model
(CharGPT, routed by ``route_parameters``, Newton-Schulz in the automatic dtype):

- Newton-Schulz FLOPs per rank, counted from the matrices each rank actually hands to
  ``orthogonalize_many``, against the total a single process orthogonalizes;
- bytes one rank sends per training step, counted by wrapping ``torch.distributed``'s
  collectives, against plain DDP (every gradient all-reduced) measured the same way;
- optimizer step wall time (``reduce_gradients`` + ``Muon.step``, which gathers the
  parameters; the slowest rank, median over steps) against one process with the same
  number of threads per process.

Usage::

    python benchmarks/bench_ddp.py                  # d=256 x 4 layers, 2 ranks x 1 thread, ~1 min
    python benchmarks/bench_ddp.py --quick          # tiny model, 2 timed steps (smoke test)
    python benchmarks/bench_ddp.py --world-size 3 --steps 30 --out /tmp/ddp.json
    python benchmarks/bench_ddp.py --device cuda    # NCCL, rank r on cuda:r: one GPU per rank

benchmarks/README.md ("bench_ddp.py") says what each row measures and why.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import lightning_muon.functional as functional
from lightning_muon import Muon, route_parameters
from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.distributed.sharded import MuonSharding
from lightning_muon.newton_schulz import ns_flops_as_run, resolve_ns_dtype
from lightning_muon_demo.models import CharGPT

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_ddp.json"
VOCAB = 256
# The W-rank configurations, each run on the same W processes: plain DDP (every gradient
# all-reduced, every rank orthogonalizes every matrix) and MuonSharding's two modes.
CONFIGS = ("ddp", "reduce_scatter", "all_gather")

# Targets (issue 4, point 5; benchmarks/README.md).
FLOPS_SLACK = 1.1  # busiest rank's Newton-Schulz FLOPs <= FLOPS_SLACK / W of the total
BYTES_RATIO_MAX = 1.05  # reduce_scatter bytes per step <= 1.05 x plain DDP
STEP_RATIO_MAX = 0.65  # reduce_scatter optimizer step <= 0.65 x one process (W = 2)

# Hyperparameters (they do not change the cost).
LR, WEIGHT_DECAY, ADAMW_LR = 0.02, 0.01, 3e-4


@dataclass(frozen=True)
class Settings:
    """The model, the world, and how many steps are counted and timed."""

    quick: bool
    world_size: int
    threads: int
    """torch threads per rank; the single-process baseline uses the same (and W times as many)."""
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch: int
    """Sequences per rank; the single process takes ``world_size * batch``."""
    count_steps: int
    """Real training steps (forward, backward, reduce, step) over which bytes and FLOPs are counted."""
    warmup: int
    steps: int
    """Timed optimizer steps per configuration, after ``warmup`` untimed rounds."""
    wide_budget_s: float
    """Seconds the 1-process x W-threads baseline may use in all: on a busy machine its
    threads wait for each other and one step can take seconds. It stops after that (keeping
    at least one step past the warm-up rounds it got)."""
    device: str = "cpu"
    """``"cpu"`` (gloo ranks) or ``"cuda"`` (NCCL ranks, rank r on ``cuda:r``)."""


def _sync(device: str) -> None:
    # CUDA runs asynchronously: a clock read must wait for this rank's queued kernels.
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- counting


def _bound(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


class WireCounter:
    """Bytes this rank sends, per phase and collective, read off the tensors passed to ``torch.distributed``.

    Costs per rank follow the bandwidth-optimal algorithms, as ``CommStats`` does: all-reduce
    ``2 (W - 1) / W`` of the payload, reduce-scatter and all-gather ``(W - 1) / W`` of the full
    tensor, all-to-all exactly the elements addressed to other ranks. Installed in a worker
    process only; calls made while ``phase`` is None (setup, barriers) are not counted.
    """

    OPS = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world = rank, world_size
        self.phase: str | None = None
        self.bytes: dict[str, Counter[str]] = {}
        self.calls: dict[str, Counter[str]] = {}

    def install(self) -> None:
        for op in self.OPS:
            setattr(dist, op, self._wrap(op, getattr(dist, op)))

    def _wrap(self, op: str, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase is not None:
                sent = self._sent(op, _bound(original, args, kwargs))
                self.bytes.setdefault(self.phase, Counter())[op] += sent
                self.calls.setdefault(self.phase, Counter())[op] += 1
            return original(*args, **kwargs)

        return counted

    def _sent(self, op: str, a: dict[str, Any]) -> float:
        w = self.world
        if op == "all_reduce":
            return all_reduce_bytes(a["tensor"].numel(), a["tensor"].element_size(), w)
        if op == "all_to_all_single":
            x, splits = a["input"], a["input_split_sizes"]
            own = splits[self.rank] if splits else x.numel() // w
            return float((x.numel() - own) * x.element_size())
        if op == "reduce_scatter_tensor":
            return (w - 1) / w * a["input"].numel() * a["input"].element_size()
        if op == "all_gather_into_tensor":
            return float((w - 1) * a["input_tensor"].numel() * a["input_tensor"].element_size())
        t = a["tensor"]  # broadcast: the source sends the tensor once
        return float(t.numel() * t.element_size()) if a["src"] == self.rank else 0.0


class NSCounter:
    """Newton-Schulz FLOPs per phase: ``ns_flops`` of every matrix ``Muon`` orthogonalizes on this rank.

    Wraps ``lightning_muon.functional.orthogonalize_many``, the call through which ``Muon``
    orthogonalizes its updates, so what is counted is what ran, not what the plan says.
    ``seconds`` adds up the wall time of every call, counted or not.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.phase: str | None = None
        self.flops: Counter[str] = Counter()
        self.matrices: Counter[str] = Counter()
        self.seconds = 0.0
        self.device = device

    def install(self) -> None:
        original = functional.orthogonalize_many

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase is not None:
                a = _bound(original, args, kwargs)
                for M in a["matrices"]:
                    rows, cols = M.shape[-2:]
                    count = M.numel() // max(1, rows * cols)  # a batch of matrices counts each
                    self.flops[self.phase] += ns_flops_as_run(M, a["steps"], a.get("method", "standard"), a["dtype"])
                    self.matrices[self.phase] += count
            _sync(self.device)
            start = time.perf_counter()
            out = original(*args, **kwargs)
            _sync(self.device)
            self.seconds += time.perf_counter() - start
            return out

        functional.orthogonalize_many = counted


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
    sharding: MuonSharding | None = None
    hook: _HookState | None = None
    grads: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    muon_path_bytes: dict[str, float] = field(default_factory=dict)
    """MuonSharding's own byte counts over the counted steps (its stats keep counting later)."""
    gather_s: float = 0.0
    times: dict[str, list[float]] = field(
        default_factory=lambda: {k: [] for k in ("step", "reduce", "ns", "gather", "cpu")}
    )
    """Seconds per timed step: wall time of the step and of its reduce_gradients, Newton-Schulz
    and gather_parameters parts; CPU time of the step."""


def _model(s: Settings) -> CharGPT:
    torch.manual_seed(0)  # initialized on the CPU, so every rank and device starts from the same weights
    return CharGPT(VOCAB, s.block_size, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd).to(s.device)


def _optimizer(model: nn.Module) -> Muon:
    # ns_dtype None: the automatic policy, float32 on CPUs without fast bf16 matmul.
    return Muon(route_parameters(model), lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR)


def _batch(s: Settings, step: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """Rows ``lo:hi`` of the global batch of ``step`` (W * batch sequences): inputs and next-token targets."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (s.world_size * s.batch, s.block_size + 1), generator=gen)[lo:hi]
    return tokens[:, :-1].to(s.device), tokens[:, 1:].to(s.device)


def _build(name: str, s: Settings) -> _Run:
    """A CharGPT wrapped in DDP as ``MuonDDPStrategy`` wraps it, for one of ``CONFIGS``."""
    model = _model(s)
    opt = _optimizer(model)
    run = _Run(name, model, opt)
    if name != "ddp":
        run.sharding = MuonSharding(opt, mode=name)
        inner = run.sharding.gather_parameters

        def timed_gather() -> None:  # Muon.step calls it through the instance: time it apart
            _sync(s.device)
            start = time.perf_counter()
            inner()
            _sync(s.device)
            run.gather_s += time.perf_counter() - start

        run.sharding.gather_parameters = timed_gather  # type: ignore[method-assign]
    if name == "reduce_scatter":
        ids = {id(p) for p in run.sharding.params}
        names = [n for n, p in model.named_parameters() if id(p) in ids]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        for p in run.sharding.params:  # DDP does not broadcast what it ignores
            dist.broadcast(p.data, src=0)
    run.model = DistributedDataParallel(model)
    run.hook = _HookState(s.world_size)
    run.model.register_comm_hook(run.hook, _all_reduce_hook)
    return run


def _count(run: _Run, s: Settings, lo: int, hi: int, wire: WireCounter | None, ns: NSCounter) -> None:
    """``count_steps`` real training steps with bytes and FLOPs counted; keeps the last local gradients."""
    if wire is not None:
        wire.phase = run.name
    ns.phase = run.name
    params = [p for p in run.model.parameters() if p.requires_grad]
    for step in range(s.count_steps):
        run.optimizer.zero_grad(set_to_none=True)
        x, y = _batch(s, step, lo, hi)
        CharGPT.loss(run.model(x), y).backward()
        if step == s.count_steps - 1:
            # What reduce_gradients sees: DDP's averaged grads, and local ones where DDP ignores.
            run.grads = [(p, p.grad.detach().clone()) for p in params if p.grad is not None]
        if run.sharding is not None:
            run.sharding.reduce_gradients()
        run.optimizer.step()
    if run.sharding is not None:
        run.muon_path_bytes = dict(run.sharding.stats.bytes)
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
    _sync(device)  # the gradient copies above are not part of the step
    start, start_cpu = time.perf_counter(), time.process_time()
    if run.sharding is not None:
        run.sharding.reduce_gradients()
    _sync(device)
    reduced = time.perf_counter()
    run.optimizer.step()
    _sync(device)
    end, end_cpu = time.perf_counter(), time.process_time()
    run.times["step"].append(end - start)
    run.times["reduce"].append(reduced - start)
    run.times["gather"].append(run.gather_s)
    run.times["ns"].append(ns.seconds - ns_before)
    # CPU time of every thread of this process (gloo's included): not stretched by other
    # processes taking the cores, so it shows the work when the wall time is distorted.
    # On CUDA it counts the host waiting for the GPU instead: summarize() drops it there.
    run.times["cpu"].append(end_cpu - start_cpu)


def _rank_main(rank: int, s: Settings) -> dict[str, Any]:
    w = s.world_size
    wire, ns = WireCounter(rank, w), NSCounter(s.device)
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
        model = _model(s)
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
                "ddp_bucket_bytes_per_step": run.hook.bytes / n,
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


def _worker(rank: int, s: Settings, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(s.threads)
    if s.device == "cuda":
        # NCCL: one GPU per rank; "cuda" below (models, batches) means this rank's GPU.
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=s.world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=s.world_size)
    try:
        result = _rank_main(rank, s)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(s: Settings) -> list[dict[str, Any]]:
    """Every rank's raw counts and times, from ``s.world_size`` spawned gloo processes."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(s, _free_port(), out_dir), nprocs=s.world_size, join=True)
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(s.world_size)]


# ---------------------------------------------------------------- summary


def _slowest_rank_median(ranks: list[dict[str, Any]], config: str, key: str) -> float:
    # Each step starts at a barrier, so it lasts as long as its slowest rank.
    series = [r["configs"][config]["times_s"][key] for r in ranks]
    return statistics.median(max(step) for step in zip(*series))


def _target(name: str, value: float, op: str, bound: float) -> dict[str, Any]:
    passed = value <= bound if op == "<=" else value >= bound
    return {"name": name, "value": value, "op": op, "bound": bound, "passed": bool(passed)}


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
        step, cpu = _slowest_rank_median(ranks, c, "step"), _slowest_rank_median(ranks, c, "cpu")
        per_config[c] = {
            "step_s": step,
            "cpu_s": cpu,
            "ratio_to_single": step / base["step"],
            "cpu_ratio_to_single": cpu / base["cpu"],
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
        "idle_cpu_fraction": [r["idle_cpu_fraction"] for r in ranks[1:]],
    }
    targets = [
        _target(f"NS FLOPs, busiest rank / total <= {FLOPS_SLACK}/W", flops["max_share"], "<=", FLOPS_SLACK / w),
        _target(
            "bytes per step / plain DDP", bytes_["per_config"]["reduce_scatter"]["ratio_to_ddp"], "<=", BYTES_RATIO_MAX
        ),
        _target(
            f"optimizer step / 1 process x {s.threads} thread(s)",
            per_config["reduce_scatter"]["ratio_to_single"],
            "<=",
            STEP_RATIO_MAX,
        ),
    ]
    return {"flops": flops, "bytes": bytes_, "times": times, "targets": targets}


# ---------------------------------------------------------------- printing


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    # Text columns align left, numbers right.
    left = [all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]

    def fmt(values: list[str]) -> str:
        return "  ".join(v.ljust(wd) if lf else v.rjust(wd) for v, wd, lf in zip(values, widths, left)).rstrip()

    return "\n".join([fmt(headers), "  ".join("-" * wd for wd in widths), *(fmt(r) for r in cells)])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _verdict(target: dict[str, Any]) -> str:
    return "ok" if target["passed"] else "MISS"


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return -1.0


def describe_machine(device: str = "cpu") -> dict[str, Any]:
    """CPU model, cores, torch build and load (and the GPUs on CUDA): the context every number in the run needs."""
    cpu = platform.processor() or platform.machine() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        # Other processes on the same cores distort every time; the load says how much.
        "load_avg_1m_at_start": _load_average(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _summary_rows(s: Settings, summary: dict[str, Any]) -> list[list[Any]]:
    """Rows of the main table: quantity, ours, reference, ours / reference, target, result."""
    w, t = s.world_size, s.threads
    flops, conf, times = summary["flops"], summary["bytes"]["per_config"], summary["times"]
    by_config, single = times["per_config"], times["single"]
    fl, by, st = (_verdict(target) for target in summary["targets"])
    ddp_mb = summary["bytes"]["ddp_measured"] / 1e6
    ranks, one = f"{w} ranks x {t} thr", f"1 process x {t} thr"
    rows = []

    def add(quantity: str, ours: float, ref: float, ref_label: str, target: str = "-", result: str = "info") -> None:
        rows.append([quantity, ours, f"{_cell(ref)} ({ref_label})", ours / ref, target, result])

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
    print(_table(["quantity", "ours", "reference", "ratio", "target", "result"], _summary_rows(s, summary)))

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
    print(_table(["rank", "owned", "NS GFLOP", "plan GFLOP", "DDP rest", "RS muon", "AG muon", "wire"], rows))
    print(
        f"DDP rest = DDP's bucket all-reduce of the {first['numel']['non_muon']:,} non-Muon elements (comm hook); "
        "RS/AG muon = MuonSharding's own counts; wire = every collective call, counted by a wrapper"
    )
    conf = summary["bytes"]["per_config"]
    print("\n== MB sent per step, largest rank, by configuration ==")
    rows = [
        [c, max(conf[c]["per_rank_ddp_buckets"]) / 1e6, conf[c]["max"] / 1e6, conf[c]["ratio_to_ddp"]] for c in CONFIGS
    ]
    print(_table(["config", "DDP buckets", "wire", "/ plain DDP"], rows))
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
    print(_table(headers, rows))
    print(
        "reduce = reduce_gradients (Muon grads to owners; plain DDP does this in backward); NS = orthogonalize_many; "
        "gather = gather_parameters; rest = momentum, update, AdamW, checks"
        + ("; CPU = CPU time of the step" if cpu else "; times synchronized with the GPU")
    )
    idle = [f for f in times["idle_cpu_fraction"] if f is not None]
    print(
        f"\nload: plain DDP / 1 process = {times['contention']:.2f} (about 1 on a quiet machine with a core per rank); "
        f"waiting ranks used {max(idle, default=0.0):.1%} of a core while the baseline ran"
    )
    met = sum(t["passed"] for t in summary["targets"])
    print(f"{met} of {len(summary['targets'])} targets met")


# ---------------------------------------------------------------- main


def settings_from_args(args: argparse.Namespace) -> Settings:
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 timed steps (a smoke test, 20-40 s)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2; targets scale with it)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank and per baseline process")
    parser.add_argument("--n-layer", type=int, default=None, help="CharGPT blocks (default 4; 2 with --quick)")
    parser.add_argument("--n-embd", type=int, default=None, help="CharGPT width (default 256; 32 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 15)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo (default); cuda: NCCL, rank r on cuda:r"
    )
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")
    if args.threads < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--threads and --steps must be positive")
    if args.device == "cuda" and args.world_size > torch.cuda.device_count():
        parser.error(
            f"--device cuda needs one GPU per rank (NCCL): --world-size {args.world_size}, "
            f"but torch.cuda.device_count() is {torch.cuda.device_count()}"
        )
    return args


def _settings_json(s: Settings) -> dict[str, Any]:
    settings = asdict(s)
    if s.device == "cpu":
        del settings["device"]  # CPU reports keep the keys they had before --device existed
    return settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from_args(args)
    machine = describe_machine(s.device)
    print(f"lightning_muon DDP benchmark ({'quick' if s.quick else 'full'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    ranks_on = f"{s.world_size} gloo ranks"
    if s.device == "cuda":
        ranks_on = f"{s.world_size} NCCL ranks on cuda:0-{s.world_size - 1} ({machine['gpu']})"
    print(
        f"machine: {machine['cpu']}, {machine['cpu_cores']} cores, torch {machine['torch']}, "
        f"CPU capability {machine['cpu_capability']}; {ranks_on} x {s.threads} torch thread(s), "
        f"baseline 1 process x {s.threads} (and x {s.world_size * s.threads}) thread(s); "
        f"load average {machine['load_avg_1m_at_start']:.2f}"
    )
    start = time.perf_counter()
    ranks = run_ranks(s)
    summary = summarize(s, ranks)
    elapsed = time.perf_counter() - start
    print_report(s, ranks, summary)
    machine["load_avg_1m_at_end"] = _load_average()
    print(f"total {elapsed:.1f} s; load average at the end {machine['load_avg_1m_at_end']:.2f}")
    report = {
        "machine": machine,
        "settings": _settings_json(s),
        "model": {
            "numel": {k: v for k, v in ranks[0]["numel"].items() if k != "owned"},
            "muon_matrices": ranks[0]["muon_matrices"],
            "ns_dtype": ranks[0]["ns_dtype"],
            "ns_method": ranks[0]["ns_method"],
            "owners": ranks[0]["plan"]["owners"],
        },
        **summary,
        "targets_passed": sum(tg["passed"] for tg in summary["targets"]),
        "targets_total": len(summary["targets"]),
        "ranks": ranks,
        "elapsed_s": elapsed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
