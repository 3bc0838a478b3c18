"""What each distributed design moves and computes per step, for ``scale_model.py``: bytes and FLOPs per rank.

The model's Muon matrices (GPT presets, or any module routed as ``Muon`` routes it), the
cluster topology, and per-rank counts from the project's own planner (``plan_ownership``,
``matrix_shapes``, ``shard_rows``, ``ns_flops``) and byte counting (``all_reduce_bytes``, the
all-to-all counts of ``MuonDDPSharding`` / ``MuonFSDPSharding``).

Costs of a collective (bandwidth only; latency is not modelled): an all-reduce, reduce-scatter
or all-gather over ranks spread as m per node on k nodes is hierarchical (NCCL's rings over
one NIC per GPU move the same bytes per NIC): intra-node ``c (m - 1) / m * B`` then
inter-node ``c (k - 1) / k * B / m`` (c = 2 for all-reduce, 1 otherwise), the phases one after
the other. An all-to-all sends each rank's bytes straight to their destinations.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.distributed.fsdp import shard_rows
from lightning_muon.distributed.planning import expert_blocks, matrix_shapes, plan_ownership
from lightning_muon.layout import MatrixLayout
from lightning_muon.newton_schulz import ns_flops, resolve_ns_method


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    """The parameter's shape, as the shardings plan on it and FSDP2 shards it."""
    split_sizes: tuple[int, ...] | None = None
    batched: bool = False
    transposed: bool = False
    """Stored (fan_in, fan_out): a QKV split cuts dim 1 (``MatrixLayout.piece_shapes``)."""

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


def deepseek_v3_preset() -> ModelShapes:
    """DeepSeek-V3 (DeepSeek-AI, arXiv 2412.19437; its config.json): d = 7168, 61 layers, MLA attention,
    3 dense MLPs (18432), then 58 MoE layers of 256 routed experts (I = 2048, fused gate/up split
    per expert) and 1 shared expert; the routers, embeddings and head to AdamW."""
    d, inter, dense, experts, vocab = 7168, 2048, 18432, 256, 129280
    heads, q_lora, kv_lora, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    order: list[tuple[str, int, bool]] = [("embed", vocab * d, False)]
    shapes: dict[str, Matrix] = {}

    def add(name: str, matrix: Matrix | None = None, numel: int = 0) -> None:
        if matrix is not None:
            shapes[name] = matrix
            numel = math.prod(matrix.shape)
        order.append((name, numel, matrix is not None))

    for i in range(61):
        add(f"l{i}.attn_norm", numel=d)
        add(f"l{i}.q_a", Matrix(f"l{i}.q_a", (q_lora, d)))
        add(f"l{i}.q_a_norm", numel=q_lora)
        add(f"l{i}.q_b", Matrix(f"l{i}.q_b", (heads * (nope + rope), q_lora)))
        add(f"l{i}.kv_a", Matrix(f"l{i}.kv_a", (kv_lora + rope, d)))
        add(f"l{i}.kv_a_norm", numel=kv_lora)
        add(f"l{i}.kv_b", Matrix(f"l{i}.kv_b", (heads * (nope + v_dim), kv_lora)))
        add(f"l{i}.o", Matrix(f"l{i}.o", (d, heads * v_dim)))
        add(f"l{i}.mlp_norm", numel=d)
        if i < 3:
            for name, shape in (("gate", (dense, d)), ("up", (dense, d)), ("down", (d, dense))):
                add(f"l{i}.{name}", Matrix(f"l{i}.{name}", shape))
            continue
        add(f"l{i}.router", numel=experts * d)
        add(f"l{i}.gate_up", Matrix(f"l{i}.gate_up", (experts, 2 * inter, d), (inter, inter), batched=True))
        add(f"l{i}.down", Matrix(f"l{i}.down", (experts, d, inter), batched=True))
        for name, shape in (("shared_gate", (inter, d)), ("shared_up", (inter, d)), ("shared_down", (d, inter))):
            add(f"l{i}.{name}", Matrix(f"l{i}.{name}", shape))
    order += [("norm", d, False), ("head", vocab * d, False)]
    muon = [shapes[n] for n, _, is_muon in order if is_muon]
    other = [(n, k) for n, k, is_muon in order if not is_muon]
    return ModelShapes("DeepSeek-V3 (d=7168, 61 layers, 58 MoE x 256 experts)", muon, other, order)


PRESETS = {
    # Radford et al. 2019 (GPT-2 small: 124M, tied head); Brown et al. 2020 (GPT-3 XL: 1.3B);
    # a 7B of the same block (d = 4096, 32 layers, as LLaMA-7B's width and depth, untied head).
    "gpt2-small": lambda: gpt_preset("GPT-2 small (d=768, 12 layers)", 768, 12, 50257, 1024, tied=True),
    "1.3b": lambda: gpt_preset("1.3B (d=2048, 24 layers)", 2048, 24, 50257, 2048, tied=True),
    "7b": lambda: gpt_preset("7B (d=4096, 32 layers)", 4096, 32, 32000, 4096, tied=False),
    "deepseek-v3": deepseek_v3_preset,
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
        for r, c in matrix_shapes(m.shape, MatrixLayout(m.split_sizes, m.batched, m.transposed))
    )


def plan_for(shapes: ModelShapes, ranks: int, fsdp: bool = False, spread: set[int] = frozenset(), spread_blocks=None):
    """``plan_ownership`` as ``MuonDDPSharding`` (or, with ``fsdp``, ``MuonFSDPSharding``) calls it.

    ``spread``: indices of expert stacks ``MuonDDPSharding`` splits by experts over every rank.
    """
    if fsdp:  # expert stacks stay where FSDP2 put their experts: no owner
        layouts = [MatrixLayout(m.split_sizes, m.batched, m.transposed) for m in shapes.muon]
        return plan_ownership(
            [m.stored for m in shapes.muon], ranks, layouts=layouts, spread=[m.batched for m in shapes.muon]
        )
    layouts = [MatrixLayout(m.split_sizes, m.batched, m.transposed) for m in shapes.muon]
    spread_flags = [i in spread for i in range(len(shapes.muon))]
    return plan_ownership(
        [m.shape for m in shapes.muon], ranks, layouts=layouts, spread=spread_flags, spread_blocks=spread_blocks
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
    ``MuonDDPSharding``'s (``CommStats``): ``reduce_scatter`` (uneven all-to-all of the Muon
    gradients to their owners inside the group, one extra flag element per unit: a whole
    matrix, or an expert stack's block of experts, each rank of the group owning one block),
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
    # Expert stacks are split by experts over the S ranks (torch.chunk blocks), the rest planned whole.
    stacks = [i for i, m in enumerate(shapes.muon) if m.batched and len(m.shape) == 3 and S > 1]
    blocks = expert_blocks([shapes.muon[i].shape[0] for i in stacks], S)
    split = {i: [rows for _, rows in per_rank] for i, per_rank in zip(stacks, blocks)}
    plan = plan_for(shapes, S, spread=set(split), spread_blocks=blocks)
    flops = [ns_flops_of(m, ns_steps, ns_method, ns_dtype) for m in shapes.muon]
    owned = [plan.owned(r) for r in range(S)]
    numel = [math.prod(m.shape) for m in shapes.muon]
    elems = [
        sum(numel[i] for i in owned[r])
        + sum(numel[i] // shapes.muon[i].shape[0] * rows[r] for i, rows in split.items())
        for r in range(S)
    ]
    units = [len(owned[r]) + sum(1 for rows in split.values() if rows[r]) for r in range(S)]
    payload = [elems[r] + units[r] for r in range(S)]  # gradients + one flag per unit
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
                    ns_flops=sum(flops[i] for i in owned[lq])
                    + sum(flops[i] * rows[lq] // shapes.muon[i].shape[0] for i, rows in split.items()),
                    owned_elements=elems[lq],
                    owned_matrices=units[lq],
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
    every other rank its rows of the results. An expert stack (``batched``) is sharded by whole
    experts: each rank orthogonalizes its own experts and sends nothing for it. Blockwise mode
    orthogonalizes each rank's own rows and sends nothing but the step check (3 int64,
    all-reduced).
    """
    W, topo = world, Topology(world, ranks_per_node)
    plan = plan_for(shapes, W, fsdp=True)
    rows = [shard_rows(m.stored[0], W) for m in shapes.muon]
    cols = [math.prod(m.stored[1:]) for m in shapes.muon]
    flops = [ns_flops_of(m, ns_steps, ns_method, ns_dtype) for m in shapes.muon]
    local = {i for i, m in enumerate(shapes.muon) if m.batched}  # whole experts on every rank
    owners = {i: o for i, o in enumerate(plan.owners) if i not in local}
    everyone = list(range(W))
    check = collective_split(everyone, 0, topo, 24.0, 2.0)
    # Row blocks of each owner's matrices, per destination rank: what the owner sends back.
    owner_rows: dict[int, dict[int, float]] = {}
    for i, o in owners.items():
        per = owner_rows.setdefault(o, {r: 0.0 for r in everyone})
        for r in everyone:
            per[r] += rows[i][r] * cols[i] * wire_bytes
    zero = NodeSums({}, topo)
    back = {o: NodeSums(per, topo) for o, per in owner_rows.items()}
    out = []
    for q in everyone:
        mine = [i for i, o in owners.items() if o == q]
        sends: dict[int, float] = {}
        for i, o in owners.items():
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
            replace(m, shape=(rows[i][q], *m.stored[1:]))
            if m.batched
            else replace(m, shape=(rows[i][q], *m.stored[1:]), split_sizes=None, transposed=False)
            for i, m in enumerate(shapes.muon)
            if rows[i][q]
        ]
        # A stack's experts all cost the same: this rank's share is its experts' count.
        experts = sum(flops[i] * rows[i][q] // shapes.muon[i].stored[0] for i in local)
        out.append(
            _entry(
                q,
                t,
                ns_flops_owner=sum(flops[i] for i in mine) + experts,
                ns_flops_blockwise=sum(ns_flops_of(b, ns_steps, ns_method, ns_dtype) for b in blocks),
                local_elements=sum(rows[i][q] * cols[i] for i in range(len(rows))),
            )
        )
    return {"plan": plan, "ranks": out}
