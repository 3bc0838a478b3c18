"""Benchmark: Muon bytes and Newton-Schulz FLOPs per rank for mixture-of-experts layers, at W ranks.

A MoE layer set (``--layers`` layers, each a fused ``gate_up_proj`` ``(E, 2I, H)`` split per
expert into gate and up, a ``down_proj`` ``(E, H, I)``, and one dense attention-like
``(H, H)`` matrix) for E = 8 and 64, under the two data-parallel shardings, on the same W
processes:

- ``muon_ddp``: ``MuonDDPSharding`` on whole tensors (reduce_scatter mode): the owner plan
  gives each stack to one rank, balancing Newton-Schulz FLOPs counted per expert;
- ``muon_fsdp``: ``MuonFSDPSharding`` on ``Shard(0)`` DTensors: every rank holds whole
  experts of every stack and orthogonalizes them where they are (no Muon bytes for them);
  the dense matrices go to owners.

Measured per rank and step, by wrapping the calls themselves (``counting.py``): bytes sent
by the shardings' collectives (``to_owner``/``from_owner``, ``reduce_scatter``/``all_gather``,
the finiteness check), and the Newton-Schulz FLOPs actually run; and the busiest rank's FLOPs
over the fair share (total / W). The JSON lists the tensors as the optimizer holds them
(``tensors``): ``studies/check_scale_model.py`` predicts the same counts from them.

Usage::

    python benchmarks/bench_moe.py              # E = 8 and 64, 2 layers, H = 64, I = 32, 2 ranks
    python benchmarks/bench_moe.py --quick      # E = 8 and 64, 1 layer, H = 32, I = 16 (smoke test)
    python benchmarks/bench_moe.py --world-size 3
    python benchmarks/bench_moe.py --device cuda    # NCCL, rank r on cuda:r: one GPU per rank
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from benchlib.counting import NSCounter, WireCounter
from benchlib.harness import describe_machine, machine_line, table, write_report
from benchlib.ranks import add_rank_arguments, check_rank_arguments, run_ranks
from torch import nn

from lightning_muon import Muon

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_moe.json"
WIRE_OPS = ("all_to_all_single", "all_reduce", "all_gather_into_tensor")
STEPS = 2
# Not Muon's traffic: the finiteness agreement and DDP's own buckets (none here).
CHECKS = ("nonfinite_flag", "step_check", "ddp_buckets")
EXPERTS = (8, 64)


@dataclass(frozen=True)
class Settings:
    world_size: int = 2
    device: str = "cpu"
    threads: int = 1
    layers: int = 2
    hidden: int = 64
    inter: int = 32
    experts: tuple[int, ...] = EXPERTS


def layer_set(s: Settings, experts: int) -> dict[str, tuple[tuple[int, ...], dict[str, Any]]]:
    """Name -> (shape, layout group keys) of the Muon tensors, in registration order."""
    out = {}
    for i in range(s.layers):
        out[f"l{i}.attn"] = ((s.hidden, s.hidden), {})
        out[f"l{i}.gate_up"] = ((experts, 2 * s.inter, s.hidden), {"batched": True, "split_sizes": (s.inter, s.inter)})
        out[f"l{i}.down"] = ((experts, s.hidden, s.inter), {"batched": True})
    return out


def _by_group(s: Settings, experts: int) -> list[tuple[str, tuple[int, ...], dict[str, Any]]]:
    """The tensors in the optimizer's order: one param group per layout, in first-use order."""
    groups: dict[tuple, list] = {}
    for name, (shape, keys) in layer_set(s, experts).items():
        groups.setdefault(tuple(sorted(keys.items())), []).append((name, shape, keys))
    return [entry for members in groups.values() for entry in members]


def _optimizer(params: dict[str, nn.Parameter], s: Settings, experts: int) -> Muon:
    groups: dict[tuple, dict[str, Any]] = {}
    for name, _, keys in _by_group(s, experts):
        key = tuple(sorted(keys.items()))
        groups.setdefault(key, {"params": [], "algorithm": "muon", **keys})["params"].append(params[name])
    return Muon(list(groups.values()), lr=0.02, ns_dtype="float32")


def _rank_main(rank: int, w: int, s: Settings) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon.distributed.ddp import MuonDDPSharding
    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    wire, ns = WireCounter(rank, w, WIRE_OPS), NSCounter(s.device)
    wire.install()
    ns.install()
    mesh = init_device_mesh(s.device, (w,))
    device = torch.device("cuda", rank) if s.device == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {"rank": rank}
    for experts in s.experts:
        shapes = layer_set(s, experts)
        gen = torch.Generator().manual_seed(0)
        full = {n: torch.randn(shape, generator=gen).to(device) for n, (shape, _) in shapes.items()}
        grads = [
            {n: torch.randn(shape, generator=gen).to(device) for n, (shape, _) in shapes.items()} for _ in range(STEPS)
        ]
        for config in ("muon_ddp", "muon_fsdp"):
            phase = f"{config}/E={experts}"
            if config == "muon_ddp":
                params = {n: nn.Parameter(t.clone()) for n, t in full.items()}
                opt = _optimizer(params, s, experts)
                sharding = MuonDDPSharding(opt)
            else:
                params = {n: nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for n, t in full.items()}
                opt = _optimizer(params, s, experts)
                sharding = MuonFSDPSharding(opt)
            for step in range(STEPS):
                for n, p in params.items():
                    g = grads[step][n]
                    p.grad = distribute_tensor(g, mesh, [Shard(0)]) if config == "muon_fsdp" else g.clone()
                wire.phase = ns.phase = phase
                sharding.reduce_gradients() if config == "muon_ddp" else None
                opt.step()
                wire.phase = ns.phase = None
            out[phase] = {
                "bytes": {k: v / STEPS for k, v in wire.bytes.get(phase, {}).items()},
                "sharding_bytes": {k: v / STEPS for k, v in sharding.stats.bytes.items()},
                "ns_flops": ns.flops[phase] / STEPS,
                "ns_matrices": ns.matrices[phase] / STEPS,
            }
    return out


def summarize(s: Settings, ranks: list[dict[str, Any]]) -> tuple[list[list[Any]], dict[str, Any]]:
    rows, report = [], {}
    for experts in s.experts:
        for config in ("muon_ddp", "muon_fsdp"):
            phase = f"{config}/E={experts}"
            measured = [r[phase] for r in ranks]
            total = sum(m["ns_flops"] for m in measured)
            busiest = max(m["ns_flops"] for m in measured)
            for r, m in enumerate(measured):
                muon_bytes = sum(v for k, v in m["sharding_bytes"].items() if k not in CHECKS)
                rows.append(
                    [
                        config,
                        experts,
                        r,
                        f"{muon_bytes / 1e3:.1f}",
                        f"{m['ns_flops'] / 1e6:.1f}",
                        f"{m['ns_matrices']:.0f}",
                        f"{busiest / (total / s.world_size):.2f}" if r == 0 else "",
                    ]
                )
            report[phase] = {"measured": measured, "busiest_over_fair": busiest / (total / s.world_size)}
    return rows, report


HEADERS = ["sharding", "E", "rank", "Muon kB/step", "NS MFLOP/step", "matrices", "busiest/fair"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rank_arguments(parser, DEFAULT_OUT, quick_help="1 layer, H = 32, I = 16 (smoke test)")
    parser.set_defaults(steps=None)  # counted steps are fixed (STEPS): nothing is timed
    return check_rank_arguments(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = dict(layers=1, hidden=32, inter=16) if args.quick else {}
    s = Settings(world_size=args.world_size, device=args.device, threads=args.threads, **sizes)
    machine = describe_machine(s.device)
    backend = "nccl" if s.device == "cuda" else "gloo"
    ranks = run_ranks(_rank_main, s.world_size, s, backend=backend, threads=s.threads)
    rows, report = summarize(s, ranks)
    title = (
        f"{s.layers} layer(s) of gate_up (E, {2 * s.inter}, {s.hidden}) split per expert, down (E, {s.hidden}, "
        f"{s.inter}), attn ({s.hidden}, {s.hidden}); {s.world_size} ranks ({backend}), fp32"
    )
    print(f"== bench_moe: {title} ==")
    print(f"machine: {machine_line(machine)}")
    print(table(HEADERS, rows))
    print("(Muon kB: the sharding's own collectives per step, the finiteness check left out; busiest/fair: the")
    print(" busiest rank's Newton-Schulz FLOPs over total / W)")
    # In the optimizer's order, as the shardings plan them: name, shape and layout keys.
    tensors = {experts: _by_group(s, experts) for experts in s.experts}
    report = {"settings": asdict(s), "machine": machine, "tensors": tensors, "ranks": ranks, "summary": report}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
