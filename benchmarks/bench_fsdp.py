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
    python benchmarks/bench_fsdp.py --memory         # memory per rank of one step instead

``--memory`` measures instead each rank's memory in one optimizer step: ``muon_fsdp`` (owner)
against FSDP2 + AdamW, foreach and for-loop, CharGPT d=768 x 2 (``benchlib.memory_ranks``).
benchmarks/README.md ("bench_fsdp.py", "Memory") says what each row measures and why;
the summary and tables are ``benchlib.fsdp_summary``'s.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchlib import memory_ranks
from benchlib.counting import NSCounter, WireCounter
from benchlib.fsdp_summary import CONFIGS, TIMES, Settings, print_report, settings_from_args, summarize
from benchlib.harness import describe_machine, machine_line, sync, targets_met, write_report
from benchlib.memory import add_memory_arguments, memory_settings, run_memory
from benchlib.ranks import (
    add_rank_arguments,
    char_batch,
    char_gpt,
    check_rank_arguments,
    ranks_line,
    run_ranks,
)
from torch import Tensor

from lightning_muon import Muon, route_parameters
from lightning_muon.distributed.fsdp import MuonFSDPSharding, _matrix_shape, shard_rows
from lightning_muon.newton_schulz import ns_wire_dtype
from lightning_muon_demo.models import CharGPT

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_fsdp.json"
MEMORY_OUT = DEFAULT_OUT.with_name("bench_fsdp_memory.json")
LR, WEIGHT_DECAY, ADAMW_LR = 0.02, 0.01, 3e-4

# The collectives counted: FSDP2's all-gathers and reduce-scatters, the shardings' all-to-all
# and all-gather, and the per-step agreement on finiteness (all-reduce).
WIRE_OPS = ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce", "all_gather_into_tensor")


class GatherAllSharding(MuonFSDPSharding):
    """The baseline: every rank gathers every whole matrix (one all-gather) and orthogonalizes all of them."""

    @torch.no_grad()
    def map_whole(
        self,
        params: list[Tensor],
        tensors: list[list[Tensor]],
        fn: Any,
        *,
        layout: Any = None,
        wire_dtype: torch.dtype | None = None,
        observe: Any = None,
        newton_schulz: dict[str, Any] | None = None,
    ) -> list[list[Tensor]]:
        if newton_schulz is None or layout is None:  # other per-matrix work: the owners' way
            return super().map_whole(params, tensors, fn, layout=layout, wire_dtype=wire_dtype, observe=observe)
        W, updates = self.world_size, [ts[0] for ts in tensors]
        rows = [shard_rows(u.shape[0], W) for u in updates]
        pad = [max(r) for r in rows]  # every rank sends equal-sized (padded) pieces
        wire = wire_dtype or updates[0].dtype
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
        ortho = fn(list(range(len(full))), [[f.view(_matrix_shape(f.shape, layout))] for f in full])
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
        "wire_dtype": str(_wire_dtype(owner, s.ns_dtype)).removeprefix("torch."),
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


def _wire_dtype(sharding: MuonFSDPSharding, ns_dtype: str | None) -> torch.dtype:
    """The dtype the Muon matrices travel to their owners in: Newton-Schulz's where narrower, else their own."""
    return ns_wire_dtype(sharding.params, ns_dtype) or sharding.params[0].dtype


def _expected_owner_bytes(sharding: MuonFSDPSharding, rank: int, ns_dtype: str | None) -> float:
    """Bytes this rank sends per step in owner mode, from the plan: its rows of others' matrices, then theirs back."""
    w, itemsize = sharding.world_size, _wire_dtype(sharding, ns_dtype).itemsize
    total = 0
    for p, owner in zip(sharding.params, sharding.plan.owners):
        rows, cols = shard_rows(p.shape[0], w), math.prod(p.shape[1:])
        total += (rows[rank] if owner != rank else p.shape[0] - rows[rank]) * cols
    return float(total * itemsize)


def rank_results(s: Settings) -> list[dict[str, Any]]:
    """Every rank's raw counts and times, from ``s.world_size`` spawned processes."""
    return run_ranks(_rank_main, s.world_size, s, backend=s.backend, threads=s.threads)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rank_arguments(
        parser, DEFAULT_OUT, quick_help="tiny model, 2 timed steps (a smoke test)", memory_out=MEMORY_OUT
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8; 2 with --quick)")
    parser.add_argument(
        "--ns-dtype", choices=("float32", "bfloat16"), default=None, help="Newton-Schulz dtype (default: automatic)"
    )
    add_memory_arguments(parser, "muon_fsdp against FSDP2 + AdamW (foreach, for-loop), CharGPT d=768 x 2")
    args = check_rank_arguments(parser, parser.parse_args(argv))
    if args.memory and (args.steps is not None or args.ns_dtype is not None):
        parser.error("--memory measures one step in the automatic dtype: --steps and --ns-dtype do not apply")
    if args.out is None:
        args.out = MEMORY_OUT if args.memory else DEFAULT_OUT
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory:
        size = memory_ranks.char_model_size(args.quick)
        cfg = memory_settings(args, threads=args.threads, world_size=args.world_size, dist_model=size)
        return run_memory(cfg, {"fsdp": (memory_ranks.bench_fsdp, memory_ranks.print_fsdp)}, args.out)
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
        **targets_met(summary["targets"]),
        "ranks": ranks,
        "elapsed_s": elapsed,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
