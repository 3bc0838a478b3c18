"""Benchmark: exact Muon under FSDP2 on W ranks (gloo on CPU, NCCL on GPUs), against AdamW, gather-all and one process.

Four configurations run on the same W processes, each a CharGPT sharded with
``fully_shard`` (one unit per block, then the root), as ``MuonFSDPStrategy`` shards it:

- ``adamw``: FSDP2 with ``torch.optim.AdamW``: the traffic FSDP2 itself needs;
- ``owner``: ``Muon`` + ``MuonFSDPSharding`` (exact; shards to owners and back by all-to-all);
- ``gather_all``: ``Muon`` where every rank all-gathers every whole matrix and orthogonalizes
  all of them (exact, the simple way: W times the Newton-Schulz work);
- ``blockwise``: ``Muon`` + ``MuonFSDPSharding(mode="blockwise")`` (each rank its own rows; not Muon).

Measured per rank and step: bytes sent, by wrapping the ``torch.distributed`` calls that
FSDP2 and the shardings make; Newton-Schulz FLOPs, from the matrices handed to
``orthogonalize_many``; wall time of a training step and of its optimizer step (the
slowest rank, median), against one process training on the same W x batch samples
with the same threads per process.

Usage::

    python benchmarks/bench_fsdp.py                  # d=256 x 4 layers, 2 ranks x 1 thread, about 1-2 min
    python benchmarks/bench_fsdp.py --quick          # tiny model, 2 timed steps (smoke test)
    python benchmarks/bench_fsdp.py --world-size 3 --out /tmp/fsdp.json
    python benchmarks/bench_fsdp.py --device cuda    # NCCL, rank r on cuda:r: one GPU per rank
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import lightning_muon.functional as functional
from lightning_muon import Muon, route_parameters
from lightning_muon.distributed.fsdp import MuonFSDPSharding, _matrix_shape, shard_rows
from lightning_muon.newton_schulz import ns_flops_as_run
from lightning_muon_demo.models import CharGPT

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_fsdp.json"
CONFIGS = ("adamw", "owner", "gather_all", "blockwise")
TIMES = ("step", "optimizer", "optimizer_cpu")
VOCAB = 256
LR, WEIGHT_DECAY, ADAMW_LR = 0.02, 0.01, 3e-4

# Targets (issue 5, point 5).
FLOPS_SLACK = 1.1  # owner: busiest rank's Newton-Schulz FLOPs <= FLOPS_SLACK / W of the total
MUON_BYTES_SLACK = 0.02  # owner's Muon bytes / gather_all's <= 2 / W + slack (the analytic ratio)


@dataclass(frozen=True)
class Settings:
    quick: bool
    world_size: int
    threads: int
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch: int
    """Sequences per rank; the single process takes ``world_size * batch``."""
    warmup: int
    steps: int
    """Timed training steps per configuration after ``warmup`` untimed ones; bytes and FLOPs are per step."""
    ns_dtype: str | None = None
    """Newton-Schulz dtype; None is the automatic policy (bf16 where this host's bf16 matmul is fast)."""
    device: str = "cpu"
    """``"cpu"`` (gloo ranks) or ``"cuda"`` (NCCL ranks, rank r on ``cuda:r``)."""


class GatherAllSharding(MuonFSDPSharding):
    """The baseline: every rank gathers every whole matrix (one all-gather) and orthogonalizes all of them."""

    @torch.no_grad()
    def orthogonalize(self, params: list[Tensor], updates: list[Tensor], **ns_kwargs: Any) -> list[list[Tensor]]:
        W, batched = self.world_size, ns_kwargs["batched"]
        rows = [shard_rows(u.shape[0], W) for u in updates]
        pad = [max(r) for r in rows]  # every rank sends equal-sized (padded) pieces
        wire = self._wire_dtype(updates, ns_kwargs.get("ns_dtype"))
        pieces = []
        for u, p in zip(updates, pad):
            local = self.local_shard(u).to(wire)
            padded = local.new_zeros(p, *local.shape[1:])
            padded[: local.shape[0]] = local
            pieces.append(padded.reshape(-1))
        blob = torch.cat(pieces)
        gathered = blob.new_empty(W * blob.numel())
        if W > 1:
            dist.all_gather_single(gathered, blob, group=self.group)
            self.stats.record("all_gather", (W - 1) * blob.numel() * blob.element_size())
        else:
            gathered.copy_(blob)
        gathered = gathered.view(W, -1)  # (W, sum_i pad_i * cols_i)
        full, offset = [], 0
        for u, p, r in zip(updates, pad, rows):
            cols = math.prod(u.shape[1:])
            block = gathered[:, offset : offset + p * cols].reshape(W, p, cols)
            full.append(torch.cat([block[s, : r[s]] for s in range(W)]).view(u.shape).to(u.dtype))
            offset += p * cols
        ortho = functional.muon_orthogonalize([f.view(_matrix_shape(f.shape, batched)) for f in full], **ns_kwargs)
        out = []
        for o, u, r in zip(ortho, updates, rows):
            start = sum(r[: self.rank])
            mine = o[0].reshape(u.shape[0], -1)[start : start + r[self.rank]].reshape(self.local_shard(u).shape)
            out.append([self._as_dtensor(mine.view(_matrix_shape(mine.shape, batched)), u, batched)])
        return out


# ---------------------------------------------------------------- counting


class Counters:
    """Bytes this rank sends and Newton-Schulz FLOPs it runs, per configuration (``phase``).

    Bytes follow the bandwidth-optimal algorithms per rank, as ``CommStats``: all-gather
    (W - 1) x the local piece, reduce-scatter (W - 1) / W of the input, all-reduce
    2 (W - 1) / W, all-to-all the elements addressed to other ranks.
    """

    OPS = ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce", "all_gather_into_tensor")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world = rank, world_size
        self.phase: str | None = None
        self.bytes: dict[str, Counter[str]] = {}
        self.flops: Counter[str] = Counter()
        self.matrices: Counter[str] = Counter()

    def install(self) -> None:
        for op in self.OPS:
            setattr(dist, op, self._count_bytes(op, getattr(dist, op)))
        functional.orthogonalize_many = self._count_flops(functional.orthogonalize_many)

    def _count_bytes(self, op: str, original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase is not None:
                a = signature.bind(*args, **kwargs).arguments
                self.bytes.setdefault(self.phase, Counter())[op] += self._sent(op, a)
            return original(*args, **kwargs)

        return counted

    def _sent(self, op: str, a: dict[str, Any]) -> float:
        w = self.world
        if op == "all_to_all_single":
            x, splits = a["input"], a.get("input_split_sizes")
            own = splits[self.rank] if splits else x.numel() // w
            return float((x.numel() - own) * x.element_size())
        x = a.get("input_tensor", a.get("input", a.get("tensor")))
        nbytes = x.numel() * x.element_size()
        if op in ("all_gather_single", "all_gather_into_tensor"):
            return float((w - 1) * nbytes)
        if op == "reduce_scatter_single":
            return (w - 1) / w * nbytes
        return 2.0 * (w - 1) / w * nbytes  # all_reduce

    def _count_flops(self, original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase is not None:
                a = signature.bind(*args, **kwargs)
                a.apply_defaults()
                for M in a.arguments["matrices"]:
                    rows, cols = M.shape[-2:]
                    self.flops[self.phase] += ns_flops_as_run(
                        M, a.arguments["steps"], a.arguments["method"], a.arguments["dtype"]
                    )
                    self.matrices[self.phase] += M.numel() // max(1, rows * cols)
            return original(*args, **kwargs)

        return counted


# ---------------------------------------------------------------- one rank


def _sync(device: str) -> None:
    # CUDA runs asynchronously: a clock read must wait for this rank's queued kernels.
    if device == "cuda":
        torch.cuda.synchronize()


def _model(s: Settings) -> CharGPT:
    torch.manual_seed(0)  # initialized on the CPU, so every rank and device starts from the same weights
    return CharGPT(VOCAB, s.block_size, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd).to(s.device)


def _sharded(name: str, s: Settings, mesh: Any) -> tuple[CharGPT, torch.optim.Optimizer, MuonFSDPSharding | None]:
    from torch.distributed.fsdp import fully_shard

    model = _model(s)
    for block in model.blocks:  # what MuonFSDPStrategy's default sharding makes of CharGPT
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if name == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, weight_decay=WEIGHT_DECAY), None
    opt = Muon(route_parameters(model), lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR, ns_dtype=s.ns_dtype)
    sharding = GatherAllSharding(opt) if name == "gather_all" else MuonFSDPSharding(opt, mode=name)
    return model, opt, sharding


def _batch(s: Settings, step: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (s.world_size * s.batch, s.block_size + 1), generator=gen)[lo:hi]
    return tokens[:, :-1].to(s.device), tokens[:, 1:].to(s.device)


def _train_step(
    model: CharGPT, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, barrier: bool, device: str = "cpu"
) -> dict[str, float]:
    """One training step; returns its seconds, those of its optimizer step, and that step's CPU seconds."""
    opt.zero_grad(set_to_none=True)
    if barrier:
        dist.barrier()  # ranks start together: the slowest rank's time is the step's time
    _sync(device)
    start = time.perf_counter()
    CharGPT.loss(model(x), y).backward()
    _sync(device)
    middle, middle_cpu = time.perf_counter(), time.process_time()
    opt.step()
    _sync(device)
    end, end_cpu = time.perf_counter(), time.process_time()
    # CPU time of this process's threads (gloo's too): not stretched when other processes
    # take the cores, so it shows the work when wall times are distorted by load. On CUDA it
    # counts the host waiting for the GPU instead: summarize() drops it there.
    return {"step": end - start, "optimizer": end - middle, "optimizer_cpu": end_cpu - middle_cpu}


def _rank_main(rank: int, s: Settings) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    w = s.world_size
    counters = Counters(rank, w)
    counters.install()
    mesh = init_device_mesh(s.device, (w,))
    runs = {name: _sharded(name, s, mesh) for name in CONFIGS}
    single = _model(s) if rank == 0 else None
    single_opt = (
        Muon(route_parameters(single), lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR, ns_dtype=s.ns_dtype)
        if single
        else None
    )
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in TIMES} for n in (*CONFIGS, "single")}
    for step in range(s.warmup + s.steps):
        counted = step >= s.warmup
        if step == s.warmup:
            for _, _, sharding in runs.values():
                if sharding is not None:
                    sharding.stats.reset()  # count the timed steps only, as the wrapper does
        x, y = _batch(s, step, rank * s.batch, (rank + 1) * s.batch)
        for name, (model, opt, _) in runs.items():
            counters.phase = name if counted else None
            for key, value in _train_step(model, opt, x, y, barrier=True, device=s.device).items():
                times[name][key].append(value)
            counters.phase = None
        # The single process runs on rank 0 while the others wait at the barrier below.
        if single is not None:
            counters.phase = "single" if counted else None
            single_step = _train_step(single, single_opt, *_batch(s, step, 0, w * s.batch), False, s.device)
            for key, value in single_step.items():
                times["single"][key].append(value)
            counters.phase = None
        dist.barrier()
    for series in times.values():
        for values in series.values():
            del values[: s.warmup]
    owner = runs["owner"][2]
    muon_numel = sum(p.numel() for p in owner.params)
    return {
        "rank": rank,
        "numel": {"total": sum(p.numel() for p in runs["owner"][0].parameters()), "muon": muon_numel},
        "muon_matrices": len(owner.params),
        "wire_dtype": str(owner._wire_dtype(owner.params, s.ns_dtype)).removeprefix("torch."),
        "plan": {"owners": list(owner.plan.owners), "loads": [owner.plan.load(r) for r in range(w)]},
        "expected_owner_bytes": _expected_owner_bytes(owner, rank, s.ns_dtype),
        "configs": {
            name: {
                "bytes_per_step": {k: v / s.steps for k, v in counters.bytes.get(name, {}).items()},
                "ns_flops_per_step": counters.flops[name] / s.steps,
                "ns_matrices_per_step": counters.matrices[name] / s.steps,
                "sharding_bytes_per_step": (
                    {k: v / s.steps for k, v in runs[name][2].stats.bytes.items()} if runs[name][2] else {}
                ),
                "times_s": times[name],
            }
            for name in CONFIGS
        },
        "single": (
            {
                "ns_flops_per_step": counters.flops["single"] / s.steps,
                "ns_matrices_per_step": counters.matrices["single"] / s.steps,
                "times_s": times["single"],
            }
            if rank == 0
            else None
        ),
    }


def _expected_owner_bytes(sharding: MuonFSDPSharding, rank: int, ns_dtype: str | None) -> float:
    """Bytes this rank sends per step in owner mode, from the plan: its rows of others' matrices, then theirs back."""
    w, itemsize = sharding.world_size, sharding._wire_dtype(sharding.params, ns_dtype).itemsize
    total = 0
    for p, owner in zip(sharding.params, sharding.plan.owners):
        rows, cols = shard_rows(p.shape[0], w), math.prod(p.shape[1:])
        total += (rows[rank] if owner != rank else p.shape[0] - rows[rank]) * cols
    return float(total * itemsize)


def _worker(rank: int, s: Settings, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(s.threads)
    if s.device == "cuda":
        # NCCL: one GPU per rank; "cuda" below (models, batches, mesh) means this rank's GPU.
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=s.world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=s.world_size)
    try:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(_rank_main(rank, s)))
    finally:
        dist.destroy_process_group()


def run_ranks(s: Settings) -> list[dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(s, port, out_dir), nprocs=s.world_size, join=True)
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(s.world_size)]


# ---------------------------------------------------------------- summary and report


def _target(name: str, value: float, bound: float) -> dict[str, Any]:
    return {"name": name, "value": value, "op": "<=", "bound": bound, "passed": bool(value <= bound)}


def _slowest_median(ranks: list[dict[str, Any]], config: str, key: str) -> float:
    # Step by step the slowest rank sets the pace; the median over steps drops outliers.
    per_step = zip(*(r["configs"][config]["times_s"][key] for r in ranks))
    return statistics.median(max(values) for values in per_step)


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
        **{c: {k: _slowest_median(ranks, c, k) for k in TIMES} for c in CONFIGS},
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
        _target(f"owner: NS FLOPs, busiest rank / all <= {FLOPS_SLACK}/W", max_share, FLOPS_SLACK / w),
        _target("owner: Muon bytes / gather_all's <= 2/W (+2%)", muon_ratio, 2 / w + MUON_BYTES_SLACK),
    ]
    return {
        "bytes": bytes_,
        "muon_bytes_owner_over_gather_all": muon_ratio,
        "flops": flops,
        "owner_max_flops_share": max_share,
        "times": times,
        "targets": targets,
    }


def projection(s: Settings, first: dict[str, Any], summary: dict[str, Any], worlds=(2, 4, 8, 16, 64)) -> list:
    """Bytes per rank and step at larger W, from the formulas the measured W checks.

    Owner: ``2 (W - 1) / W^2 * P`` elements (its rows of the others' matrices out, the rows
    of its own matrices back); gather-all: ``(W - 1) / W * P``; FSDP2's own traffic scales
    as ``(W - 1) / W`` from the value measured here.
    """
    muon, itemsize = first["numel"]["muon"], 2 if first["wire_dtype"] == "bfloat16" else 4
    w0 = s.world_size
    fsdp = max(summary["bytes"]["adamw"]["fsdp"]) / ((w0 - 1) / w0)
    rows = []
    for w in worlds:
        rows.append(
            {
                "world_size": w,
                "owner_mb": 2 * (w - 1) / w**2 * muon * itemsize / 1e6,
                "gather_all_mb": (w - 1) / w * muon * itemsize / 1e6,
                "fsdp_mb": (w - 1) / w * fsdp / 1e6,
            }
        )
    return rows


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    left = [all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(n) if lf else v.rjust(n) for v, n, lf in zip(values, widths, left)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * n for n in widths), *(line(r) for r in cells)])


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
    print(_table([*headers, "step ms", "/ 1 proc"], rows))
    print(
        "MB sent per step by the busiest rank (all calls to torch.distributed, counted by a wrapper; Muon = the\n"
        "sharding's own count, FSDP = the rest); NS GFLOP = Newton-Schulz work of the busiest rank; times: slowest\n"
        f"rank, median of {s.steps} steps (opt = Muon.step or AdamW.step; step = forward + backward + opt);\n"
        f"1 process = {w} x {s.batch} sequences, {s.threads} thread(s)"
        + ("" if cpu else ", on cuda:0; times synchronized")
    )
    ratio = summary["muon_bytes_owner_over_gather_all"]
    print(f"owner Muon bytes / gather_all Muon bytes = {ratio:.3f} (2/W = {2 / w:.3f})")
    print("\n== Muon MB per rank and step at larger W (formulas; the measured W checks them) ==")
    proj = projection(s, first, summary)
    print(
        _table(
            ["W", "owner", "gather_all", "FSDP2 (AdamW)"],
            [[p["world_size"], p["owner_mb"], p["gather_all_mb"], p["fsdp_mb"]] for p in proj],
        )
    )
    for target in summary["targets"]:
        verdict = "ok" if target["passed"] else "MISS"
        print(f"target {target['name']}: {target['value']:.3f} {target['op']} {target['bound']:.3f} {verdict}")


def describe_machine(device: str = "cpu") -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):  # no /proc/cpuinfo, or no model name in it
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 timed steps (a smoke test)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8; 2 with --quick)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument(
        "--ns-dtype", choices=("float32", "bfloat16"), default=None, help="Newton-Schulz dtype (default: automatic)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo (default); cuda: NCCL, rank r on cuda:r"
    )
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.threads < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--world-size must be at least 2, --threads and --steps positive")
    if args.device == "cuda" and args.world_size > torch.cuda.device_count():
        parser.error(
            f"--device cuda needs one GPU per rank (NCCL): --world-size {args.world_size}, "
            f"but torch.cuda.device_count() is {torch.cuda.device_count()}"
        )
    return args


def settings_from_args(args: argparse.Namespace) -> Settings:
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


def _settings_json(s: Settings) -> dict[str, Any]:
    settings = asdict(s)
    if s.device == "cpu":
        del settings["device"]  # CPU reports keep the keys they had before --device existed
    return settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from_args(args)
    machine = describe_machine(s.device)
    print(f"lightning_muon FSDP2 benchmark ({'quick' if s.quick else 'full'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    gpus = f"; {s.world_size} NCCL ranks on cuda:0-{s.world_size - 1} ({machine['gpu']})" if s.device == "cuda" else ""
    print(
        f"machine: {machine['cpu']}, {machine['cpu_cores']} cores, torch {machine['torch']}, "
        f"CPU capability {machine['cpu_capability']}{gpus}; load average {machine['load_avg_1m_at_start']:.2f}"
    )
    start = time.perf_counter()
    ranks = run_ranks(s)
    summary = summarize(s, ranks)
    print_report(s, ranks, summary)
    elapsed = time.perf_counter() - start
    print(f"total {elapsed:.1f} s")
    report = {
        "machine": machine,
        "settings": _settings_json(s),
        **summary,
        "projection": projection(s, ranks[0], summary),
        "targets_passed": sum(t["passed"] for t in summary["targets"]),
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
