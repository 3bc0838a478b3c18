"""Scale model: Muon's optimizer and exposed-communication time per step, on 8 to 1024 GPUs.

The CPU benchmarks run at W <= 4 ranks on one host, where Newton-Schulz dominates and the
network is free. This model predicts what the distributed designs cost where the network
is the bottleneck. Per training step and scheme, from the project's own planner
(``plan_ownership``, ``matrix_shapes``, ``shard_rows``, ``ns_flops``) and byte counting
(``all_reduce_bytes``, the all-to-all counts of ``MuonDDPSharding`` / ``MuonFSDPSharding``):

- Newton-Schulz FLOPs on the busiest rank;
- bytes each rank sends, by collective, split into intra-node and inter-node links;
- communication left exposed after backward, from the gradient-ready order (gradients
  become ready in reverse parameter order, at a pace proportional to their size, and
  buckets go through one communication channel in the order they fill);
- predicted optimizer + exposed-communication time, and its share of a step, whose
  compute is ``6 x params x tokens per rank`` at the profile's achieved GEMM rate.

Rows (``SCHEMES``): plain DDP with every rank running Muon on every matrix; ``muon_ddp`` as
it is today (owners over all W ranks, one all-to-all after backward); ``muon_ddp`` with owner
groups of S ranks (reduce-scatter to owners inside the group, the owner's shard all-reduced
across groups, all-gather inside the group), without and with overlap of the reduce with
backward; ``muon_fsdp`` in ``owner`` and ``blockwise`` modes. A second table: ``muon_fsdp`` with
tensor parallelism of degree T = 2, 4, 8 inside a node, in each ``tp_mode`` (``predict_tp``).

Costs of a collective (bandwidth only; latency is not modelled): an all-reduce, reduce-scatter
or all-gather over ranks spread as m per node on k nodes is hierarchical (NCCL's rings over
one NIC per GPU move the same bytes per NIC): intra-node ``c (m - 1) / m * B`` then
inter-node ``c (k - 1) / k * B / m`` (c = 2 for all-reduce, 1 otherwise), the phases one after
the other. An all-to-all sends each rank's bytes straight to their destinations; intra- and
inter-node links run at once, and a rank is as slow as the larger of what it sends and
receives on each link class.

The model's matrices and each design's bytes and FLOPs per rank are in ``scale_counts.py``,
their time per step in ``scale_designs.py``, the hardware profiles in ``scale_profiles.py``;
this script runs them and writes the tables, the JSON and the PNG. A last table
(``scale_memory.py``, ``--memory-models``): per-rank memory of ``muon_fsdp``'s step (params,
grads, optimizer state, the step's transient) against FSDP2 + AdamW, for 8B and 70B models.

Usage::

    python studies/scale_model.py                                  # H100 table, 3 presets, W = 8..1024
    python studies/scale_model.py --preset gpt2-small --group-size 4
    python studies/scale_model.py --set inter_gbps=25 --set ns_fraction=0.4
    python studies/scale_model.py --module lightning_muon_demo.models.CharGPT --init-args '{"n_embd": 256}'
    python studies/scale_model.py --profile this-cpu               # measures this host first
    python studies/scale_model.py --device cuda                    # measures this GPU first (--profile this-gpu)
    python studies/scale_model.py --worlds 64 1024 --sweep-group-sizes 1 2 4 8 16 32
    python studies/scale_model.py --preset gpt2-small --memory-models 70b   # memory table: the 70B only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from scale_counts import PRESETS, ModelShapes, shapes_from_module
from scale_designs import TP_DEGREES, predict, predict_tp
from scale_memory import MODELS as MEMORY_MODELS
from scale_memory import memory_table, print_memory_table
from scale_profiles import Profile, h100_profile, measure_profile

from lightning_muon.distributed.tp_math import TP_MODES

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "scale_model.json"
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
SCHEMES = (
    "ddp_replicated",
    "muon_ddp_today",
    "muon_ddp_groups",
    "muon_ddp_groups_overlap",
    "fsdp_owner",
    "fsdp_blockwise",
)


def print_tp_tables(results: dict) -> None:
    if not any(rows.get("tp") for res in results.values() for rows in res["worlds"].values()):
        return
    print("== tensor parallelism: muon_fsdp with tensor_parallel_size T (inside a node) and tp_mode ==")
    print(
        f"{'preset':<12} {'W':>4} {'T':>2} {'tp_mode':<12} {'NS TFLOP busiest':>16} {'intra GB':>9} {'inter GB':>9} "
        f"{'optimizer ms':>13} {'exposed ms':>11} {'overhead ms':>12} {'% step':>7}"
    )
    for key, res in results.items():
        for W, rows in res["worlds"].items():
            for r in rows.get("tp", []):
                print(
                    f"{key:<12} {W:>4} {r['tp']:>2} {r['tp_mode']:<12} {r['ns_flops_busiest'] / 1e12:>16.3f} "
                    f"{r['intra_bytes'] / 1e9:>9.3f} {r['inter_bytes'] / 1e9:>9.3f} {r['optimizer_s'] * 1e3:>13.2f} "
                    f"{r['exposed_comm_s'] * 1e3:>11.2f} {r['overhead_s'] * 1e3:>12.2f} {r['overhead_pct']:>7.1f}"
                )
    print("(blockwise is not exact Muon; distributed's all-reduce latency is not modelled)")


# ---------------------------------------------------------------- output


SCHEME_LABELS = {
    "ddp_replicated": "plain DDP, every rank runs Muon",
    "muon_ddp_today": "muon_ddp, owners over all W (today)",
    "muon_ddp_groups": "muon_ddp, owner groups of S",
    "muon_ddp_groups_overlap": "muon_ddp, owner groups of S + overlap",
    "fsdp_owner": "muon_fsdp owner (Muon traffic only)",
    "fsdp_blockwise": "muon_fsdp blockwise (not exact Muon)",
}


def run_model(
    presets: dict[str, ModelShapes],
    p: Profile,
    worlds: tuple[int, ...],
    group_size: int | None,
    tp_degrees: tuple[int, ...] = (),
) -> dict:
    """Every preset x world x scheme, with the item-4 comparison of muon_ddp against plain DDP.

    ``tp_degrees``: also ``predict_tp``'s rows (key ``"tp"``), every ``tp_mode`` at each degree.
    """
    results = {}
    for key, shapes in presets.items():
        per_world = {}
        for W in worlds:
            S = group_size if group_size is not None else int(p.ranks_per_node)
            rows = predict(shapes, p, W, S, p.tokens_per_rank)
            rows["tp"] = [
                r for T in tp_degrees for mode in TP_MODES if (r := predict_tp(shapes, p, W, T, mode)) is not None
            ]
            ours, ref = rows["muon_ddp_groups_overlap"], rows["ddp_replicated"]
            rows["target"] = {
                "muon_ddp_s": ours["overhead_s"],
                "ddp_replicated_s": ref["overhead_s"],
                "ratio": ours["overhead_s"] / ref["overhead_s"],
                "inter_ratio": ours["inter_bytes"] / ref["inter_bytes"] if ref["inter_bytes"] else 0.0,
                "passed": ours["overhead_s"] <= ref["overhead_s"],
            }
            per_world[W] = rows
        results[key] = {
            "name": shapes.name,
            "params": shapes.total_numel,
            "muon_params": shapes.muon_numel,
            "matrices": len(shapes.muon),
            "expert_stacks": sum(m.batched for m in shapes.muon),
            "worlds": per_world,
        }
    return results


def print_tables(results: dict, p: Profile, tokens: float) -> None:
    print(f"\n== profile: {p.name} ==")
    for key in sorted(p.values):
        print(f"  {key:>16} = {p.values[key]:<10.4g} {p.sources[key]}")
    for res in results.values():
        print(
            f"\n== {res['name']}: {res['params'] / 1e6:,.0f}M params, {res['muon_params'] / 1e6:,.0f}M in "
            f"{res['matrices']} Muon matrices; {tokens:,.0f} tokens per rank =="
        )
        print(
            f"{'scheme':<40} {'W':>4} {'S':>3} {'NS TFLOP busiest':>16} {'intra GB':>9} {'inter GB':>9} "
            f"{'optimizer ms':>13} {'exposed ms':>11} {'overhead ms':>12} {'% step':>7}"
        )
        for W, rows in res["worlds"].items():
            for scheme in SCHEMES:
                r = rows[scheme]
                size = r.get("group_size", "-")
                print(
                    f"{SCHEME_LABELS[scheme]:<40} {W:>4} {size:>3} {r['ns_flops_busiest'] / 1e12:>16.3f} "
                    f"{r['intra_bytes'] / 1e9:>9.3f} {r['inter_bytes'] / 1e9:>9.3f} {r['optimizer_s'] * 1e3:>13.2f} "
                    f"{r['exposed_comm_s'] * 1e3:>11.2f} {r['overhead_s'] * 1e3:>12.2f} {r['overhead_pct']:>7.1f}"
                )
        print()
    print_tp_tables(results)
    print_expert_tables(results)
    print()
    print_targets(results)


def print_expert_tables(results: dict) -> None:
    """For models with expert stacks: the busiest rank's Newton-Schulz over its fair share (total / W), and bytes."""
    moe = {k: r for k, r in results.items() if r.get("expert_stacks")}
    if not moe:
        return
    print(
        "\n== expert stacks: busiest rank's Newton-Schulz / fair share (total / W), and GB sent by the busiest rank =="
    )
    print(
        f"{'preset':<12} {'W':>5} {'muon_ddp NS/fair':>17} {'muon_ddp GB':>12} "
        f"{'muon_fsdp NS/fair':>18} {'muon_fsdp GB':>13}"
    )
    for key, res in moe.items():
        for W, rows in res["worlds"].items():
            fair = rows["ddp_replicated"]["ns_flops_busiest"] / W  # replicated: every rank does the total
            ddp, fsdp = rows["muon_ddp_today"], rows["fsdp_owner"]
            print(
                f"{key:<12} {W:>5} {ddp['ns_flops_busiest'] / fair:>17.2f} "
                f"{(ddp['intra_bytes'] + ddp['inter_bytes']) / 1e9:>12.2f} {fsdp['ns_flops_busiest'] / fair:>18.2f} "
                f"{(fsdp['intra_bytes'] + fsdp['inter_bytes']) / 1e9:>13.2f}"
            )


def print_targets(results: dict) -> None:
    """The item-4 table: muon_ddp (owner groups + overlap) against plain DDP with replicated Muon, ms per step."""
    worlds = list(next(iter(results.values()))["worlds"])
    print("== target: muon_ddp (owner groups + overlap) optimizer + exposed comm <= plain DDP with replicated Muon ==")
    print("preset        " + "".join(f"{f'W={W}':>18}" for W in worlds))
    for key, res in results.items():
        cells = []
        for W in worlds:
            t = res["worlds"][W]["target"]
            cells.append(
                f"{t['muon_ddp_s'] * 1e3:.1f}/{t['ddp_replicated_s'] * 1e3:.1f}{'' if t['passed'] else ' MISS'}"
            )
        print(f"{key:<14}" + "".join(f"{c:>18}" for c in cells))
    met = sum(r["worlds"][W]["target"]["passed"] for r in results.values() for W in worlds)
    print(f"(ms: ours/plain DDP) {met} of {len(results) * len(worlds)} met")


def group_sweep(presets: dict[str, ModelShapes], p: Profile, worlds: tuple[int, ...], sizes: list[int]) -> dict:
    """``muon_ddp`` (owner groups + overlap) per step at each owner_group_size: ms, inter-node GB per rank."""
    out: dict = {}
    for key, shapes in presets.items():
        for W in worlds:
            row = {}
            for S in sizes:
                if W % S == 0:
                    r = predict(shapes, p, W, S, p.tokens_per_rank)
                    ours = r["muon_ddp_groups_overlap"]
                    row[S] = {"ms": ours["overhead_s"] * 1e3, "inter_gb": ours["inter_bytes"] / 1e9}
            row["plain_ddp_ms"] = r["ddp_replicated"]["overhead_s"] * 1e3
            out.setdefault(key, {})[W] = row
    print("\n== owner_group_size sweep: muon_ddp (groups + overlap) ms per step (inter-node GB per rank) ==")
    print(f"{'preset':<12} {'W':>5} {'plain DDP':>10} " + "".join(f"{f'S={S}':>16}" for S in sizes))
    for key, per_world in out.items():
        for W, row in per_world.items():
            cells = "".join(
                f"{row[S]['ms']:>8.1f} ({row[S]['inter_gb']:.2f})" if S in row else f"{'-':>16}" for S in sizes
            )
            print(f"{key:<12} {W:>5} {row['plain_ddp_ms']:>10.1f} {cells}")
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
    for col, res in enumerate(results.values()):
        worlds = list(res["worlds"])
        for scheme in SCHEMES:
            ms = [res["worlds"][W][scheme]["overhead_s"] * 1e3 for W in worlds]
            pct = [res["worlds"][W][scheme]["overhead_pct"] for W in worlds]
            axes[0][col].plot(worlds, ms, marker="o", label=SCHEME_LABELS[scheme])
            axes[1][col].plot(worlds, pct, marker="o", label=SCHEME_LABELS[scheme])
        axes[0][col].set_title(res["name"])
        axes[0][col].set_ylabel("Muon overhead per step (ms)")
        axes[1][col].set_ylabel("% of step")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("W (GPUs)")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(results: dict) -> dict:
    return json.loads(
        json.dumps(results, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=list(PRESETS), help="model presets")
    parser.add_argument("--module", help="a LightningModule (or nn.Module) class path, routed as Muon routes it")
    parser.add_argument("--init-args", default="{}", help="JSON keyword arguments for --module")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="world sizes (default 8..1024)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="GPUs per node (default: the profile's, 8)")
    parser.add_argument("--group-size", type=int, default=None, help="owner_group_size S (default: ranks per node)")
    parser.add_argument(
        "--sweep-group-sizes", type=int, nargs="*", default=None, help="also print muon_ddp at each of these S"
    )
    parser.add_argument("--tokens", type=float, default=None, help="tokens per rank per step (default 16384)")
    parser.add_argument(
        "--profile",
        choices=("h100", "this-cpu", "this-gpu"),
        default=None,
        help="h100: the datasheet table (default); this-cpu / this-gpu: rates measured here first "
        "(default with --device cuda: this-gpu)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where this-cpu / this-gpu is measured: cpu (default) or cuda[:i]"
    )
    parser.add_argument(
        "--tp-degrees", type=int, nargs="*", default=list(TP_DEGREES), help="tensor-parallel rows (default 2 4 8)"
    )
    parser.add_argument(
        "--memory-models",
        nargs="*",
        choices=sorted(MEMORY_MODELS),
        default=list(MEMORY_MODELS),
        help="models of the per-rank memory table, muon_fsdp vs FSDP2 + AdamW (default 8b 70b; none: no table)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="change a profile constant")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT}); PNG beside it"
    )
    args = parser.parse_args(argv)
    for w in args.worlds:
        if w < 1:
            parser.error(f"--worlds must be positive, got {w}")
    for t in args.tp_degrees:
        if t < 2:
            parser.error(f"--tp-degrees must be >= 2, got {t}")
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        parser.error(f"--device must be cpu or cuda[:i], got {args.device!r}")
    if kind not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:i], got {args.device!r}")
    # The device is where a profile is measured: --device cuda alone measures this GPU, and
    # --profile this-gpu (its spelling before --device) measures on cuda.
    if args.profile is None:
        args.profile = "this-gpu" if kind == "cuda" else "h100"
    elif args.profile == "this-gpu" and kind == "cpu":
        args.device, kind = "cuda", "cuda"
    elif kind == "cuda" and args.profile != "this-gpu":
        parser.error(f"--device {args.device}: --profile {args.profile} is not measured on a GPU; use this-gpu")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile == "h100":
        profile = h100_profile()
    else:
        profile = measure_profile(args.device, args.ranks_per_node or 1)
    changes = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set wants NAME=VALUE, got {item!r}")
        try:
            changes[key] = float(value)
        except ValueError:
            raise SystemExit(f"--set {key}: {value!r} is not a number") from None
    if args.ranks_per_node is not None:
        changes["ranks_per_node"] = args.ranks_per_node
    if args.tokens is not None:
        changes["tokens_per_rank"] = args.tokens
    try:
        profile = profile.with_values(**changes)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.module:
        presets = {args.module: shapes_from_module(args.module, json.loads(args.init_args))}
    else:
        presets = {key: PRESETS[key]() for key in args.preset}
    start = time.perf_counter()
    results = run_model(presets, profile, tuple(args.worlds), args.group_size, tuple(args.tp_degrees))
    print_tables(results, profile, profile.tokens_per_rank)
    sweep = None
    if args.sweep_group_sizes:
        sweep = group_sweep(presets, profile, tuple(args.worlds), args.sweep_group_sizes)
    memory = None
    if args.memory_models:
        memory = memory_table({k: MEMORY_MODELS[k]() for k in args.memory_models}, tuple(args.worlds))
        print_memory_table(memory)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "group_sweep": sweep,
        "memory": memory,
        "profile": {"name": profile.name, "values": profile.values, "sources": profile.sources},
        "group_size": args.group_size,
        "results": _jsonable(results),
        "elapsed_s": time.perf_counter() - start,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot(results, png)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
