"""Scale model: Muon's optimizer and exposed-communication time per step, on 8 to 1024 GPUs.

The CPU benchmarks run at W <= 4 ranks on one host, where Newton-Schulz dominates and the
network is free. This model predicts what the distributed designs cost where the network
is the bottleneck. Per training step and scheme, from the project's own planner
(``plan_ownership``, ``matrix_shapes``, ``shard_rows``, ``ns_flops``) and byte counting
(``all_reduce_bytes``, the all-to-all counts of ``MuonSharding`` / ``MuonFSDPSharding``):

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

Usage::

    python benchmarks/scale_model.py                                  # H100 table, 3 presets, W = 8..1024
    python benchmarks/scale_model.py --preset gpt2-small --group-size 4
    python benchmarks/scale_model.py --set inter_gbps=25 --set ns_fraction=0.4
    python benchmarks/scale_model.py --module lightning_muon_demo.models.CharGPT --init-args '{"n_embd": 256}'
    python benchmarks/scale_model.py --profile this-cpu               # measures this host first
    python benchmarks/scale_model.py --worlds 64 1024 --sweep-group-sizes 1 2 4 8 16 32
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.distributed.fsdp import shard_rows
from lightning_muon.distributed.planning import matrix_shapes, plan_ownership
from lightning_muon.distributed.tp_math import TP_MODES, tp_bytes, tp_ns_flops
from lightning_muon.newton_schulz import ns_flops, resolve_ns_method

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

# ---------------------------------------------------------------- hardware profiles

# Every constant with where its number comes from. ``--set name=value`` changes any.
H100_SXM: dict[str, tuple[float, str]] = {
    "peak_tflops": (989.0, "NVIDIA H100 SXM5 datasheet: bf16 dense Tensor Core 989.4 TFLOP/s (1979 with sparsity)"),
    "ns_fraction": (
        0.5,
        "assumed, not measured (no GPU on the host that wrote this): Newton-Schulz's products have an inner size "
        "of 768-4096 and run below large-GEMM rates; --profile this-gpu measures orthogonalize on a GPU",
    ),
    "train_fraction": (
        0.75,
        "assumed, not measured: large bf16 cuBLAS GEMMs on H100 SXM run at roughly 70-80% of peak; real training "
        "MFU is lower, so the '% of step' column is an upper bound; --profile this-gpu measures an 8192^3 product",
    ),
    "intra_gbps": (450.0, "NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction per GPU (NVIDIA H100 datasheet)"),
    "inter_gbps": (50.0, "one 400 Gb/s NDR InfiniBand NIC per GPU (ConnectX-7, DGX H100) = 50 GB/s per direction"),
    "hbm_gbps": (3350.0, "NVIDIA H100 SXM5 datasheet: HBM3 3.35 TB/s"),
    "ranks_per_node": (8, "DGX/HGX H100: 8 GPUs per node"),
    "grad_bytes": (4, "fp32 master weights: DDP reduces gradients (and muon_ddp moves parameters) in fp32"),
    "wire_bytes_fsdp": (2, "muon_fsdp sends Newton-Schulz inputs and results in bf16 where Newton-Schulz runs in bf16"),
    "update_bytes": (
        20,
        "bytes of memory traffic per Muon element in the elementwise update: read grad, read+write momentum, "
        "read+write parameter, 4 B each (fp32)",
    ),
    "bucket_mb": (25.0, "torch DistributedDataParallel's default bucket_cap_mb"),
    "tokens_per_rank": (16384, "tokens per rank per optimizer step (micro-batch 16 x 1024); a flag sets it"),
}


@dataclass(frozen=True)
class Profile:
    """One hardware profile: rates, bandwidths and sizes, each with its source."""

    name: str
    values: dict[str, float]
    sources: dict[str, str]
    ns_dtype: torch.dtype = torch.bfloat16
    """The Newton-Schulz dtype there (it decides ``ns_method="auto"``)."""

    def __getattr__(self, key: str) -> float:
        try:
            return self.__dict__["values"][key]
        except KeyError:
            raise AttributeError(key) from None

    def with_values(self, **changes: float) -> Profile:
        unknown = set(changes) - set(self.values)
        if unknown:
            raise ValueError(f"--set: unknown profile constant(s) {sorted(unknown)}; known: {sorted(self.values)}")
        sources = {**self.sources, **{k: f"set on the command line (was {self.values[k]})" for k in changes}}
        return replace(self, values={**self.values, **changes}, sources=sources)


def h100_profile() -> Profile:
    return Profile("H100 SXM", {k: v for k, (v, _) in H100_SXM.items()}, {k: s for k, (_, s) in H100_SXM.items()})


# ---------------------------------------------------------------- the model's matrices


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    """The parameter's shape, as the shardings plan on it and FSDP2 shards it."""
    split_sizes: tuple[int, ...] | None = None
    batched: bool = False
    transposed: bool = False
    """Stored (fan_in, fan_out): a QKV split cuts dim 1 (``functional.piece_shapes``)."""

    @property
    def stored(self) -> tuple[int, ...]:
        return self.shape


@dataclass(frozen=True)
class ModelShapes:
    """The Muon matrices and the other parameters, each list in parameter (registration) order."""

    name: str
    muon: list[Matrix]
    other: list[tuple[str, int]]
    """(name, elements) of every non-Muon parameter."""
    order: list[tuple[str, int, bool]] = field(default_factory=list)
    """(name, elements, is Muon) of every parameter in registration order; backward runs it in reverse."""

    @property
    def muon_numel(self) -> int:
        return sum(math.prod(m.shape) for m in self.muon)

    @property
    def total_numel(self) -> int:
        return self.muon_numel + sum(n for _, n in self.other)


def gpt_preset(name: str, d: int, layers: int, vocab: int, context: int, tied: bool) -> ModelShapes:
    """A GPT block stack: per layer qkv (3d, d), proj (d, d), fc1 (4d, d), fc2 (d, 4d) to Muon, the rest to AdamW."""
    order: list[tuple[str, int, bool]] = [("wte", vocab * d, False), ("wpe", context * d, False)]
    for i in range(layers):
        order += [(f"h{i}.ln1", 2 * d, False), (f"h{i}.qkv", 3 * d * d, True), (f"h{i}.qkv.b", 3 * d, False)]
        order += [(f"h{i}.proj", d * d, True), (f"h{i}.proj.b", d, False), (f"h{i}.ln2", 2 * d, False)]
        order += [(f"h{i}.fc1", 4 * d * d, True), (f"h{i}.fc1.b", 4 * d, False)]
        order += [(f"h{i}.fc2", 4 * d * d, True), (f"h{i}.fc2.b", d, False)]
    order.append(("ln_f", 2 * d, False))
    if not tied:
        order.append(("lm_head", vocab * d, False))
    shapes = {"qkv": (3 * d, d), "proj": (d, d), "fc1": (4 * d, d), "fc2": (d, 4 * d)}
    muon = [Matrix(n, shapes[n.split(".")[1]]) for n, _, is_muon in order if is_muon]
    other = [(n, k) for n, k, is_muon in order if not is_muon]
    return ModelShapes(name, muon, other, order)


PRESETS = {
    # Radford et al. 2019 (GPT-2 small: 124M, tied head); Brown et al. 2020 (GPT-3 XL: 1.3B);
    # a 7B of the same block (d = 4096, 32 layers, as LLaMA-7B's width and depth, untied head).
    "gpt2-small": lambda: gpt_preset("GPT-2 small (d=768, 12 layers)", 768, 12, 50257, 1024, tied=True),
    "1.3b": lambda: gpt_preset("1.3B (d=2048, 24 layers)", 2048, 24, 50257, 2048, tied=True),
    "7b": lambda: gpt_preset("7B (d=4096, 32 layers)", 4096, 32, 32000, 4096, tied=False),
}


def shapes_from_optimizer(name: str, module: torch.nn.Module, optimizer: Any) -> ModelShapes:
    """The Muon matrices of a ``Muon`` optimizer over ``module``, in the order its sharding plans them."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [g for g in optimizer.param_groups if g["algorithm"] == "muon"]
    muon = [
        Matrix(
            names.get(id(p), "?"),
            tuple(p.shape),
            tuple(g["split_sizes"]) if g.get("split_sizes") else None,
            bool(g.get("batched", False)),
            bool(g.get("transposed", False)),
        )
        for g in groups
        for p in g["params"]
    ]
    muon_ids = {id(p) for g in groups for p in g["params"]}
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    other = [(n, p.numel()) for n, p in params if id(p) not in muon_ids]
    order = [(n, p.numel(), id(p) in muon_ids) for n, p in params]
    return ModelShapes(name, muon, other, order)


def shapes_from_module(class_path: str, init_args: dict[str, Any]) -> ModelShapes:
    """Instantiate ``class_path`` (a LightningModule or any nn.Module) and route it as ``Muon`` would."""
    from lightning_muon import Muon, route_parameters

    module_name, _, cls_name = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"--module must be a dotted class path (package.module.Class), got {class_path!r}")
    cls = getattr(importlib.import_module(module_name), cls_name)
    module = cls(**init_args)
    if hasattr(module, "configure_model"):
        module.configure_model()
    optimizer = Muon(route_parameters(module), lr=0.02)
    return shapes_from_optimizer(class_path, module, optimizer)


# ---------------------------------------------------------------- topology and collective costs


@dataclass(frozen=True)
class Topology:
    world: int
    ranks_per_node: int

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node


def collective_split(ranks: list[int], me: int, topo: Topology, nbytes: float, factor: float) -> tuple[float, float]:
    """(intra, inter) bytes ``me`` sends in a hierarchical ring collective over ``ranks`` of a ``nbytes`` payload.

    ``factor`` is 2 for all-reduce, 1 for reduce-scatter and all-gather. Intra and inter add
    up to the flat ring's ``factor (n - 1) / n * nbytes`` (``all_reduce_bytes`` for 2).
    """
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[topo.node(r)] = nodes.get(topo.node(r), 0) + 1
    m, k = nodes[topo.node(me)], len(nodes)
    # A reduce-scatter or all-gather is half an all-reduce (``comm.all_reduce_bytes``).
    return factor / 2 * all_reduce_bytes(1, nbytes, m), factor / 2 * all_reduce_bytes(1, nbytes / m, k)


@dataclass
class RankTraffic:
    """What one rank sends (and, for all-to-alls, receives), by collective and link class."""

    by_op: dict[str, float] = field(default_factory=dict)
    """Bytes sent per collective name (intra + inter), as ``CommStats`` counts them."""
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(intra, inter) bytes sent per collective."""
    recv: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(intra, inter) bytes received per all-to-all (a rank's time is the larger of the two ways)."""

    def add(self, op: str, intra: float, inter: float, recv: tuple[float, float] | None = None) -> None:
        self.by_op[op] = self.by_op.get(op, 0.0) + intra + inter
        self.links[op] = (intra, inter)
        if recv is not None:
            self.recv[op] = recv

    @property
    def intra(self) -> float:
        return sum(i for i, _ in self.links.values())

    @property
    def inter(self) -> float:
        return sum(o for _, o in self.links.values())


class NodeSums:
    """Per-rank values over a set of ranks, summed by node: what a rank sends or receives within and across nodes."""

    def __init__(self, values: dict[int, float], topo: Topology) -> None:
        self.values, self.topo = values, topo
        self.total = sum(values.values())
        self.by_node: dict[int, float] = {}
        for r, v in values.items():
            self.by_node[topo.node(r)] = self.by_node.get(topo.node(r), 0.0) + v

    def split(self, me: int) -> tuple[float, float]:
        """(intra, inter) of the values of every rank but ``me``."""
        near = self.by_node.get(self.topo.node(me), 0.0) - self.values.get(me, 0.0)
        return near, self.total - self.by_node.get(self.topo.node(me), 0.0)


# ---------------------------------------------------------------- per-scheme counts


def ns_flops_of(m: Matrix, steps: int, method: str, dtype: torch.dtype) -> int:
    """FLOPs ``orthogonalize`` runs for one Muon parameter: each of its matrices with the method it resolves to."""
    return sum(
        ns_flops(r, c, steps, method=resolve_ns_method(method, r, c, dtype))
        for r, c in matrix_shapes(m.shape, m.split_sizes, m.batched, m.transposed)
    )


def plan_for(shapes: ModelShapes, ranks: int, fsdp: bool = False):
    """``plan_ownership`` as ``MuonSharding`` (or, with ``fsdp``, ``MuonFSDPSharding``) calls it."""
    if fsdp:
        return plan_ownership([m.stored for m in shapes.muon], ranks, batched=[m.batched for m in shapes.muon])
    return plan_ownership(
        [m.shape for m in shapes.muon],
        ranks,
        split_sizes=[m.split_sizes for m in shapes.muon],
        batched=[m.batched for m in shapes.muon],
        transposed=[m.transposed for m in shapes.muon],
    )


def _entry(q: int, t: RankTraffic, **extra: Any) -> dict[str, Any]:
    return {"rank": q, "bytes": t.by_op, "links": t.links, "recv": t.recv, "intra": t.intra, "inter": t.inter, **extra}


def ddp_counts(
    shapes: ModelShapes,
    world: int,
    group_size: int,
    ranks_per_node: int,
    *,
    elem_bytes: int = 4,
    ns_steps: int = 5,
    ns_method: str = "auto",
    ns_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Per rank, ``muon_ddp``'s bytes by collective and link, received bytes, and Newton-Schulz FLOPs.

    Owner groups of ``group_size`` ranks (``group_size == world``: today's design): ranks
    ``[g S, (g + 1) S)`` form group g and share one plan over S ranks. Collective names are
    ``MuonSharding``'s (``CommStats``): ``reduce_scatter`` (uneven all-to-all of the Muon
    gradients to their owners inside the group, one extra flag element per parameter),
    ``reduce_across`` (the owner's gradients and flags all-reduced with the same local rank
    of every other group), ``all_gather`` (owners send their new matrices to the rest of the
    group), ``nonfinite_flag`` (one fp32 all-reduce over the world), and ``ddp_buckets``
    (DDP's all-reduce of every non-Muon gradient). ``recv`` is [intra, inter] bytes received
    in the two all-to-alls.
    """
    S, W = group_size, world
    if S < 1 or W % S:
        raise ValueError(f"group_size must divide the world size {W}, got {S}")
    topo = Topology(W, ranks_per_node)
    plan = plan_for(shapes, S)
    flops = [ns_flops_of(m, ns_steps, ns_method, ns_dtype) for m in shapes.muon]
    owned = [plan.owned(r) for r in range(S)]
    elems = [plan.elements(r) for r in range(S)]
    payload = [elems[r] + len(owned[r]) for r in range(S)]  # gradients + one flag per parameter
    non_muon = sum(n for _, n in shapes.other)
    world_ranks = list(range(W))
    flag = collective_split(world_ranks, 0, topo, 4.0, 2.0)  # the same on every rank
    ddp = collective_split(world_ranks, 0, topo, non_muon * elem_bytes, 2.0) if non_muon else None
    out = []
    for g in range(W // S):
        group = range(g * S, (g + 1) * S)
        members = NodeSums({r: 1.0 for r in group}, topo)
        to_owner = NodeSums({r: payload[r - g * S] * elem_bytes for r in group}, topo)
        gathered = NodeSums({r: elems[r - g * S] * elem_bytes for r in group}, topo)
        for q in group:
            lq = q - g * S
            near, far = members.split(q)
            t = RankTraffic()
            t.add(
                "reduce_scatter",
                *to_owner.split(q),
                recv=(near * payload[lq] * elem_bytes, far * payload[lq] * elem_bytes),
            )
            if W > S:
                t.add("reduce_across", *collective_split(list(range(lq, W, S)), q, topo, payload[lq] * elem_bytes, 2.0))
            t.add("all_gather", near * elems[lq] * elem_bytes, far * elems[lq] * elem_bytes, recv=gathered.split(q))
            t.add("nonfinite_flag", *flag)
            if ddp is not None:
                t.add("ddp_buckets", *ddp)
            out.append(
                _entry(
                    q,
                    t,
                    ns_flops=sum(flops[i] for i in owned[lq]),
                    owned_elements=elems[lq],
                    owned_matrices=len(owned[lq]),
                )
            )
    return {"plan": plan, "ranks": out}


def fsdp_counts(
    shapes: ModelShapes,
    world: int,
    ranks_per_node: int,
    *,
    wire_bytes: int = 2,
    ns_steps: int = 5,
    ns_method: str = "auto",
    ns_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Per rank, ``MuonFSDPSharding``'s bytes (``to_owner``, ``from_owner``, ``step_check``) and FLOPs by mode.

    Every matrix is sharded in ``torch.chunk`` row blocks (``shard_rows``); in owner mode each
    rank sends its rows of every matrix it does not own to the owner, and each owner sends
    every other rank its rows of the results. Blockwise mode orthogonalizes each rank's own
    rows and sends nothing but the step check (3 int64, all-reduced).
    """
    W, topo = world, Topology(world, ranks_per_node)
    plan = plan_for(shapes, W, fsdp=True)
    rows = [shard_rows(m.stored[0], W) for m in shapes.muon]
    cols = [math.prod(m.stored[1:]) for m in shapes.muon]
    flops = [
        ns_flops_of(replace(m, split_sizes=None, transposed=False), ns_steps, ns_method, ns_dtype) for m in shapes.muon
    ]
    everyone = list(range(W))
    check = collective_split(everyone, 0, topo, 24.0, 2.0)
    # Row blocks of each owner's matrices, per destination rank: what the owner sends back.
    owner_rows: dict[int, dict[int, float]] = {}
    for i, o in enumerate(plan.owners):
        per = owner_rows.setdefault(o, {r: 0.0 for r in everyone})
        for r in everyone:
            per[r] += rows[i][r] * cols[i] * wire_bytes
    zero = NodeSums({}, topo)
    back = {o: NodeSums(per, topo) for o, per in owner_rows.items()}
    out = []
    for q in everyone:
        mine = [i for i, o in enumerate(plan.owners) if o == q]
        sends: dict[int, float] = {}
        for i, o in enumerate(plan.owners):
            if o != q:
                sends[o] = sends.get(o, 0.0) + rows[i][q] * cols[i] * wire_bytes
        to_owner = NodeSums(sends, topo).split(q)
        from_owner = back.get(q, zero).split(q)
        t = RankTraffic()
        # A rank receives in the first all-to-all what it sends in the second, and the reverse.
        t.add("to_owner", *to_owner, recv=from_owner)
        t.add("from_owner", *from_owner, recv=to_owner)
        t.add("step_check", *check)
        blocks = [
            replace(m, shape=(rows[i][q], *m.stored[1:]), split_sizes=None, transposed=False)
            for i, m in enumerate(shapes.muon)
            if rows[i][q]
        ]
        out.append(
            _entry(
                q,
                t,
                ns_flops_owner=sum(flops[i] for i in mine),
                ns_flops_blockwise=sum(ns_flops_of(b, ns_steps, ns_method, ns_dtype) for b in blocks),
                local_elements=sum(rows[i][q] * cols[i] for i in range(len(rows))),
            )
        )
    return {"plan": plan, "ranks": out}


# ---------------------------------------------------------------- time


def a2a_seconds(sent: tuple[float, float], received: tuple[float, float], p: Profile) -> float:
    """An all-to-all: both link classes at once, each as slow as the larger direction."""
    return max(max(sent[0], received[0]) / (p.intra_gbps * 1e9), max(sent[1], received[1]) / (p.inter_gbps * 1e9))


def ring_seconds(split: tuple[float, float], p: Profile) -> float:
    """A hierarchical all-reduce / reduce-scatter / all-gather: the intra-node phase, then the inter-node one."""
    return split[0] / (p.intra_gbps * 1e9) + split[1] / (p.inter_gbps * 1e9)


def ready_order(shapes: ModelShapes, backward_s: float) -> list[tuple[str, int, bool, float]]:
    """(name, elements, is Muon, ready time) in the order backward produces gradients.

    Backward walks the parameters in reverse registration order (DDP's bucket order too)
    and its work is proportional to parameter size (the 6 x params x tokens rule), so a
    gradient is ready when the share of elements up to and including it is done.
    """
    total, done, out = shapes.total_numel, 0, []
    for name, numel, is_muon in reversed(shapes.order):
        done += numel
        out.append((name, numel, is_muon, backward_s * done / total))
    return out


def buckets(sizes: list[float], cap_bytes: float, first_bytes: float = 1024**2) -> list[list[int]]:
    """Bucketing of gradients of ``sizes`` bytes, in ready order: a bucket closes once it holds at least
    its limit, ``first_bytes`` for the first (DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES``), ``cap_bytes`` after."""
    out: list[list[int]] = [[]]
    size, limit = 0.0, float(first_bytes)
    for i, nbytes in enumerate(sizes):
        out[-1].append(i)
        size += nbytes
        if size >= limit:
            out.append([])
            size, limit = 0.0, cap_bytes
    return [b for b in out if b]


def channel(jobs: list[tuple[float, float]]) -> float:
    """When one communication channel finishes ``(ready time, seconds)`` jobs taken in ready order."""
    free = 0.0
    for ready, seconds in sorted(jobs):
        free = max(free, ready) + seconds
    return free


def _busiest(entries: list[dict[str, Any]], op: str, p: Profile) -> float:
    """Seconds of collective ``op`` on the slowest rank (0 where no rank runs it)."""
    worst = 0.0
    for e in entries:
        if op not in e["links"]:
            continue
        links = e["links"][op]
        worst = max(worst, a2a_seconds(links, e["recv"][op], p) if op in e["recv"] else ring_seconds(links, p))
    return worst


def _muon_bucket_seconds(shapes: ModelShapes, plan, indices: list[int], S: int, W: int, p: Profile) -> list[float]:
    """Per local rank of group 0, seconds to reduce Muon gradients ``indices`` onto their owners.

    The all-to-all inside the group involves every rank (as slow as its busiest rank); the
    all-reduce across groups only the ranks that own part of the bucket, each over its own
    NIC, so local ranks' channels are separate from there on.
    """
    owners = [plan.owners[i] for i in indices]
    topo, eb = Topology(W, int(p.ranks_per_node)), int(p.grad_bytes)
    payload = [
        sum(math.prod(shapes.muon[i].shape) + 1 for i, o in zip(indices, owners) if o == r) * eb for r in range(S)
    ]
    to_owner = NodeSums({r: payload[r] for r in range(S)}, topo)
    members = NodeSums({r: 1.0 for r in range(S)}, topo)
    a2a = max(a2a_seconds(to_owner.split(q), tuple(n * payload[q] for n in members.split(q)), p) for q in range(S))
    if W == S:
        return [a2a] * S
    peers = [ring_seconds(collective_split(list(range(q, W, S)), q, topo, payload[q], 2.0), p) for q in range(S)]
    return [a2a + t if payload[q] else a2a for q, t in enumerate(peers)]


def predict(shapes: ModelShapes, p: Profile, world: int, group_size: int, tokens: float) -> dict[str, dict[str, Any]]:
    """Every scheme's per-step prediction at ``world`` ranks (owner groups of ``group_size`` where they apply)."""
    G, W = int(p.ranks_per_node), world
    S = min(group_size, W)
    eb = int(p.grad_bytes)
    gemm = p.peak_tflops * 1e12
    compute_s = 6.0 * shapes.total_numel * tokens / (gemm * p.train_fraction)
    backward_s = compute_s * 2.0 / 3.0  # backward is 4 of the 6 x params x tokens
    ns_rate = gemm * p.ns_fraction
    hbm = p.hbm_gbps * 1e9
    items = ready_order(shapes, backward_s)
    kw = dict(ns_dtype=p.ns_dtype)
    muon_index = {m.name: i for i, m in enumerate(shapes.muon)}
    world_ar = lambda nbytes: ring_seconds(collective_split(list(range(W)), 0, Topology(W, G), nbytes, 2.0), p)

    def ddp_jobs(only_other: bool) -> list[tuple[float, float]]:
        chosen = [it for it in items if not (only_other and it[2])]
        groups = buckets([n * eb for _, n, _, _ in chosen], p.bucket_mb * 1024**2)
        return [(chosen[b[-1]][3], world_ar(sum(chosen[i][1] for i in b) * eb)) for b in groups]

    def row(ns: float, elements: float, exposed: float, intra: float, inter: float, **extra: Any) -> dict[str, Any]:
        optimizer = ns / ns_rate + elements * p.update_bytes / hbm
        overhead = optimizer + exposed
        return {
            "ns_flops_busiest": ns,
            "intra_bytes": intra,
            "inter_bytes": inter,
            "optimizer_s": optimizer,
            "exposed_comm_s": exposed,
            "overhead_s": overhead,
            "step_s": compute_s + overhead,
            "overhead_pct": 100.0 * overhead / (compute_s + overhead),
            **extra,
        }

    out: dict[str, dict[str, Any]] = {}
    # Plain DDP, replicated Muon: every gradient in DDP's buckets; every rank orthogonalizes everything.
    total_ns = sum(ns_flops_of(m, 5, "auto", p.ns_dtype) for m in shapes.muon)
    tail = max(0.0, channel(ddp_jobs(False)) - backward_s)
    ddp_split = collective_split(list(range(W)), 0, Topology(W, G), shapes.total_numel * eb, 2.0)
    out["ddp_replicated"] = row(total_ns, shapes.muon_numel, tail, *ddp_split)

    for name, size in (("muon_ddp_today", W), ("muon_ddp_groups", S)):
        counts = ddp_counts(shapes, W, size, G, elem_bytes=eb, **kw)
        ranks = counts["ranks"]
        end = max(channel(ddp_jobs(True)), backward_s)  # DDP's own buckets overlap backward
        reduce_s = _busiest(ranks, "reduce_scatter", p) + _busiest(ranks, "reduce_across", p)
        gather_s = _busiest(ranks, "all_gather", p)
        ns = max(e["ns_flops"] for e in ranks)
        owned = max(e["owned_elements"] for e in ranks)
        intra, inter = max(e["intra"] for e in ranks), max(e["inter"] for e in ranks)
        extra = {"group_size": size, "idle_owners": sum(1 for e in ranks[:size] if e["owned_matrices"] == 0)}
        out[name] = row(ns, owned, end - backward_s + reduce_s + gather_s, intra, inter, **extra)
        if name == "muon_ddp_groups":
            # Overlap: Muon gradients leave in buckets as backward makes them, through the same channel.
            muon_items = [it for it in items if it[2]]
            # OverlappedReduce's buckets: every one up to bucket_mb (no smaller first bucket).
            cap = p.bucket_mb * 1024**2
            groups = buckets([n * eb for _, n, _, _ in muon_items], cap, first_bytes=cap)
            per_bucket = [
                (
                    muon_items[b[-1]][3],
                    _muon_bucket_seconds(shapes, counts["plan"], [muon_index[muon_items[i][0]] for i in b], size, W, p),
                )
                for b in groups
            ]
            # One channel per local rank: DDP's buckets and every Muon bucket's share of that rank.
            end = max(channel(ddp_jobs(True) + [(t, secs[q]) for t, secs in per_bucket]) for q in range(size))
            end = max(end, backward_s)
            out["muon_ddp_groups_overlap"] = row(ns, owned, end - backward_s + gather_s, intra, inter, **extra)

    counts = fsdp_counts(shapes, W, G, wire_bytes=int(p.wire_bytes_fsdp), **kw)
    ranks = counts["ranks"]
    local = max(e["local_elements"] for e in ranks)
    moved = _busiest(ranks, "to_owner", p) + _busiest(ranks, "from_owner", p)
    intra, inter = max(e["intra"] for e in ranks), max(e["inter"] for e in ranks)
    out["fsdp_owner"] = row(max(e["ns_flops_owner"] for e in ranks), local, moved, intra, inter)
    check = ranks[0]["links"]["step_check"]
    out["fsdp_blockwise"] = row(max(e["ns_flops_blockwise"] for e in ranks), local, 0.0, *check, exact=False)
    return out


# ---------------------------------------------------------------- tensor parallelism (muon_fsdp with tp_mode)

TP_DEGREES = (2, 4, 8)
# Megatron's layout: QKV and fc1 column-parallel (split along dim 0), proj and fc2 row-parallel (dim 1).
TP_SPLIT = {"qkv": 0, "fc1": 0, "proj": 1, "fc2": 1}


def tp_split_dim(m: Matrix) -> int:
    """The dim tensor parallelism splits ``m`` along: by its preset name, else the MLP pattern.

    A weight that widens its input (rows >= cols) is column-parallel, one that narrows it row-parallel.
    """
    kind = m.name.split(".")[-1]
    if kind in TP_SPLIT:
        return TP_SPLIT[kind]
    return 0 if m.stored[0] >= math.prod(m.stored[1:]) else 1


def predict_tp(shapes: ModelShapes, p: Profile, world: int, tp: int, mode: str) -> dict[str, Any] | None:
    """``muon_fsdp`` with ``tensor_parallel_size=tp`` and ``tp_mode=mode`` at ``world`` ranks (None: does not fit).

    Tensor-parallel groups lie inside a node (``tp <= ranks_per_node``, NVLink); the data dim
    has D = W / T ranks, G / T of them per node. Per step:

    - data dim (``MuonTPSharding`` steps 1 and 3): each rank sends its rows of the blocks it
      does not own to their owners and gets them back, ``(D - 1) / D`` of its ``P / W``
      elements each way for balanced owners, to D - 1 peers of which G / T - 1 share its node
      (an all-to-all: both link classes at once);
    - tensor dim (step 2): ``tp_math.tp_bytes`` per owned matrix on the owner's group, over
      NVLink (bandwidth only: ``distributed``'s five all-reduces per bucket are latency-bound
      on small matrices, which this does not model);
    - Newton-Schulz FLOPs on the busiest rank: ``tp_math.tp_ns_flops`` summed over the matrices
      its data-parallel rank owns (owners from ``plan_ownership`` over D ranks, as the sharding
      plans them).
    """
    G = int(p.ranks_per_node)
    if tp > G or world % tp or G % tp:
        return None
    D, per_node = world // tp, G // tp
    wire = int(p.wire_bytes_fsdp)
    plan = plan_ownership([m.stored for m in shapes.muon], D, batched=[m.batched for m in shapes.muon])
    ns, tp_sent = [0.0] * D, [0.0] * D
    for m, owner in zip(shapes.muon, plan.owners):
        rows, cols = m.stored[0], math.prod(m.stored[1:])
        split = tp_split_dim(m)
        ns[owner] += tp_ns_flops(rows, cols, 5, tp, mode, split)
        tp_sent[owner] += tp_bytes(rows, cols, 5, tp, mode, split, wire)
    local = shapes.muon_numel / world
    each_way = (D - 1) / D * local * wire if D > 1 else 0.0
    intra_share = (per_node - 1) / (D - 1) if D > 1 else 0.0
    dp_link = (each_way * intra_share, each_way * (1.0 - intra_share))
    dp_s = 2.0 * a2a_seconds(dp_link, dp_link, p)  # to the owners and back
    tp_s = max(tp_sent) / (p.intra_gbps * 1e9)
    gemm = p.peak_tflops * 1e12
    compute_s = 6.0 * shapes.total_numel * p.tokens_per_rank / (gemm * p.train_fraction)
    optimizer = max(ns) / (gemm * p.ns_fraction) + local * p.update_bytes / (p.hbm_gbps * 1e9)
    overhead = optimizer + dp_s + tp_s
    return {
        "tp": tp,
        "tp_mode": mode,
        "ns_flops_busiest": max(ns),
        "intra_bytes": 2 * dp_link[0] + max(tp_sent),
        "inter_bytes": 2 * dp_link[1],
        "tp_bytes_busiest": max(tp_sent),
        "optimizer_s": optimizer,
        "exposed_comm_s": dp_s + tp_s,
        "overhead_s": overhead,
        "overhead_pct": 100.0 * overhead / (compute_s + overhead),
        "exact": mode != "blockwise",
    }


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


# ---------------------------------------------------------------- a profile measured here


def _best_seconds(fn: Any, device: str, reps: int = 3) -> float:
    fn()  # warm-up: allocation, kernel selection
    best = math.inf
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_profile(device: str = "cpu", ranks_per_node: int = 1) -> Profile:
    """Rates measured on this machine: a large GEMM, ``orthogonalize`` on Newton-Schulz-sized matrices, a copy.

    On CPU the "peak" is the large GEMM's measured rate (no datasheet to read), so the
    training fraction is 1. On CUDA the peak stays the H100 datasheet's and both fractions
    are measured. Link bandwidths are not measured (one host): CPU ranks talk through
    memory, so both link classes get the copy bandwidth; ``--set`` overrides them.
    """
    from lightning_muon.newton_schulz import orthogonalize, resolve_ns_dtype

    dtype = resolve_ns_dtype(None, device, torch.float32)
    cuda = device.startswith("cuda")
    n = 8192 if cuda else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    gemm = 2 * n**3 / _best_seconds(lambda: a @ a, device)
    sizes = [(768, 3072), (2048, 8192), (4096, 16384)] if cuda else [(256, 1024), (512, 2048)]
    ns_rates = {}
    for rows, cols in sizes:
        g = torch.randn(rows, cols, device=device)
        seconds = _best_seconds(lambda g=g: orthogonalize(g, steps=5, dtype=dtype), device)
        ns_rates[f"{rows}x{cols}"] = ns_flops(rows, cols, 5) / seconds
    x = torch.empty(64 * 1024**2 // 4, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 4 / _best_seconds(lambda: y.copy_(x), device)
    peak = H100_SXM["peak_tflops"][0] * 1e12 if cuda else gemm
    where = torch.cuda.get_device_name(device) if cuda else "this CPU"
    ns_best = max(ns_rates.values())
    values = {k: v for k, (v, _) in H100_SXM.items()}
    values.update(
        peak_tflops=peak / 1e12,
        ns_fraction=ns_best / peak,
        train_fraction=gemm / peak,
        hbm_gbps=copy / 1e9,
        ranks_per_node=ranks_per_node,
    )
    measured = ", ".join(f"{k}: {v / 1e9:.1f} GFLOP/s" for k, v in ns_rates.items())
    sources = {k: s for k, (_, s) in H100_SXM.items()}
    sources.update(
        peak_tflops=sources["peak_tflops"] if cuda else f"measured: {n}^3 {dtype} matmul on {where}",
        ns_fraction=f"measured on {where}: orthogonalize (5 steps, {dtype}) at {measured}; the best over the peak",
        train_fraction=f"measured on {where}: {n}^3 {dtype} matmul at {gemm / 1e9:.1f} GFLOP/s over the peak",
        hbm_gbps=f"measured on {where}: a 64 MiB copy (bytes read + written)",
        ranks_per_node="--ranks-per-node",
    )
    if not cuda:
        values.update(intra_gbps=copy / 1e9, inter_gbps=copy / 1e9)
        sources.update(
            intra_gbps="the measured copy bandwidth (ranks on one host share memory)",
            inter_gbps="as intra_gbps: one host has no inter-node link",
        )
    return Profile(f"measured on {where}", values, sources, ns_dtype=dtype)


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
    print()
    print_targets(results)


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
    parser.add_argument("--profile", choices=("h100", "this-cpu", "this-gpu"), default="h100")
    parser.add_argument(
        "--tp-degrees", type=int, nargs="*", default=list(TP_DEGREES), help="tensor-parallel rows (default 2 4 8)"
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile == "h100":
        profile = h100_profile()
    else:
        profile = measure_profile("cuda" if args.profile == "this-gpu" else "cpu", args.ranks_per_node or 1)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "group_sweep": sweep,
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
