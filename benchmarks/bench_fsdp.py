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
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchlib.counting import NSCounter, WireCounter
from benchlib.harness import (
    describe_machine,
    fixed_cell,
    machine_line,
    sync,
    table,
    target,
    targets_met,
    verdict,
    write_report,
)
from benchlib.ranks import (
    RankSettings,
    add_rank_arguments,
    char_batch,
    char_gpt,
    check_rank_arguments,
    ranks_line,
    run_ranks,
    slowest_rank_median,
)
from torch import Tensor

import lightning_muon.functional as functional
from lightning_muon import Muon, route_parameters
from lightning_muon.distributed.fsdp import MuonFSDPSharding, _matrix_shape, shard_rows
from lightning_muon_demo.models import CharGPT

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_fsdp.json"
CONFIGS = ("adamw", "owner", "gather_all", "blockwise")
TIMES = ("step", "optimizer", "optimizer_cpu")
LR, WEIGHT_DECAY, ADAMW_LR = 0.02, 0.01, 3e-4

# The collectives counted: FSDP2's all-gathers and reduce-scatters, the shardings' all-to-all
# and all-gather, and the per-step agreement on finiteness (all-reduce).
WIRE_OPS = ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce", "all_gather_into_tensor")

# Targets (benchmarks/README.md, "bench_fsdp.py").
FLOPS_SLACK = 1.1  # owner: busiest rank's Newton-Schulz FLOPs <= FLOPS_SLACK / W of the total
MUON_BYTES_SLACK = 0.02  # owner's Muon bytes / gather_all's <= 2 / W + slack (the analytic ratio)


@dataclass(frozen=True, kw_only=True)
class Settings(RankSettings):
    """The shared world and model (``ranks.RankSettings``); bytes and FLOPs are per timed step."""

    ns_dtype: str | None = None
    """Newton-Schulz dtype; None is the automatic policy (bf16 where this host's bf16 matmul is fast)."""


class GatherAllSharding(MuonFSDPSharding):
    """The baseline: every rank gathers every whole matrix (one all-gather) and orthogonalizes all of them."""

    @torch.no_grad()
    def orthogonalize(self, params: list[Tensor], updates: list[Tensor], **ns_kwargs: Any) -> list[list[Tensor]]:
        W, layout = self.world_size, ns_kwargs["layout"]
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
        ortho = functional.muon_orthogonalize([f.view(_matrix_shape(f.shape, layout)) for f in full], **ns_kwargs)
        out = []
        for o, u, r in zip(ortho, updates, rows):
            start = sum(r[: self.rank])
            mine = o[0].reshape(u.shape[0], -1)[start : start + r[self.rank]].reshape(self.local_shard(u).shape)
            out.append([self._as_dtensor(mine, u.device_mesh, _matrix_shape(u.shape, layout))])
        return out


# ---------------------------------------------------------------- one rank


def _sharded(name: str, s: Settings, mesh: Any) -> tuple[CharGPT, torch.optim.Optimizer, MuonFSDPSharding | None]:
    from torch.distributed.fsdp import fully_shard

    model = char_gpt(s)
    for block in model.blocks:  # what MuonFSDPStrategy's default sharding makes of CharGPT
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if name == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, weight_decay=WEIGHT_DECAY), None
    opt = Muon(route_parameters(model), lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR, ns_dtype=s.ns_dtype)
    sharding = GatherAllSharding(opt) if name == "gather_all" else MuonFSDPSharding(opt, mode=name)
    return model, opt, sharding


def _train_step(
    model: CharGPT, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, barrier: bool, device: str = "cpu"
) -> dict[str, float]:
    """One training step; returns its seconds, those of its optimizer step, and that step's CPU seconds."""
    opt.zero_grad(set_to_none=True)
    if barrier:
        dist.barrier()  # ranks start together: the slowest rank's time is the step's time
    sync(device)
    start = time.perf_counter()
    CharGPT.loss(model(x), y).backward()
    sync(device)
    middle, middle_cpu = time.perf_counter(), time.process_time()
    opt.step()
    sync(device)
    end, end_cpu = time.perf_counter(), time.process_time()
    # CPU time of this process's threads (gloo's too): not stretched when other processes
    # take the cores, so it shows the work when wall times are distorted by load. On CUDA it
    # counts the host waiting for the GPU instead: summarize() drops it there.
    return {"step": end - start, "optimizer": end - middle, "optimizer_cpu": end_cpu - middle_cpu}


def _rank_main(rank: int, w: int, s: Settings) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    wire, ns = WireCounter(rank, w, WIRE_OPS), NSCounter(s.device)
    wire.install()
    ns.install()
    mesh = init_device_mesh(s.device, (w,))
    runs = {name: _sharded(name, s, mesh) for name in CONFIGS}
    single = char_gpt(s) if rank == 0 else None
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
        x, y = char_batch(s, step, rank * s.batch, (rank + 1) * s.batch)
        for name, (model, opt, _) in runs.items():
            wire.phase = ns.phase = name if counted else None
            for key, value in _train_step(model, opt, x, y, barrier=True, device=s.device).items():
                times[name][key].append(value)
            wire.phase = ns.phase = None
        # The single process runs on rank 0 while the others wait at the barrier below.
        if single is not None:
            wire.phase = ns.phase = "single" if counted else None
            single_step = _train_step(single, single_opt, *char_batch(s, step, 0, w * s.batch), False, s.device)
            for key, value in single_step.items():
                times["single"][key].append(value)
            wire.phase = ns.phase = None
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
                "bytes_per_step": {k: v / s.steps for k, v in wire.bytes.get(name, {}).items()},
                "ns_flops_per_step": ns.flops[name] / s.steps,
                "ns_matrices_per_step": ns.matrices[name] / s.steps,
                "sharding_bytes_per_step": (
                    {k: v / s.steps for k, v in runs[name][2].stats.bytes.items()} if runs[name][2] else {}
                ),
                "times_s": times[name],
            }
            for name in CONFIGS
        },
        "single": (
            {
                "ns_flops_per_step": ns.flops["single"] / s.steps,
                "ns_matrices_per_step": ns.matrices["single"] / s.steps,
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


def rank_results(s: Settings) -> list[dict[str, Any]]:
    """Every rank's raw counts and times, from ``s.world_size`` spawned processes."""
    return run_ranks(_rank_main, s.world_size, s, backend=s.backend, threads=s.threads)


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
    print("\n== Muon MB per rank and step at larger W (formulas; the measured W checks them) ==")
    proj = projection(s, first, summary)
    print(
        table(
            ["W", "owner", "gather_all", "FSDP2 (AdamW)"],
            [[p["world_size"], p["owner_mb"], p["gather_all_mb"], p["fsdp_mb"]] for p in proj],
            fixed_cell,
        )
    )
    for t in summary["targets"]:
        print(f"target {t['name']}: {t['value']:.3f} {t['op']} {t['bound']:.3f} {verdict(t['passed'])}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rank_arguments(parser, DEFAULT_OUT, quick_help="tiny model, 2 timed steps (a smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8; 2 with --quick)")
    parser.add_argument(
        "--ns-dtype", choices=("float32", "bfloat16"), default=None, help="Newton-Schulz dtype (default: automatic)"
    )
    return check_rank_arguments(parser, parser.parse_args(argv))


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from_args(args)
    machine = describe_machine(s.device)
    print(f"lightning_muon FSDP2 benchmark ({'quick' if s.quick else 'full'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_line(machine)}")
    print(f"ranks: {ranks_line(s, machine)}, baseline 1 process x {s.threads} thread(s)")
    start = time.perf_counter()
    ranks = rank_results(s)
    summary = summarize(s, ranks)
    print_report(s, ranks, summary)
    elapsed = time.perf_counter() - start
    print(f"total {elapsed:.1f} s")
    report = {
        "machine": machine,
        "settings": s.as_json(),
        **summary,
        "projection": projection(s, ranks[0], summary),
        **targets_met(summary["targets"]),
        "ranks": ranks,
        "elapsed_s": elapsed,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
