"""Per-step time of each distributed design, for ``scale_model.py``: optimizer and exposed communication.

From ``scale_counts``'s bytes and FLOPs and a hardware ``Profile``: communication left exposed
after backward, from the gradient-ready order (gradients become ready in reverse parameter
order, at a pace proportional to their size, and buckets go through one communication
channel in the order they fill); predicted optimizer + exposed-communication time, and its
share of a step, whose compute is ``6 x params x tokens per rank`` at the profile's achieved
GEMM rate. An all-to-all runs intra- and inter-node links at once, and a rank is as slow as
the larger of what it sends and receives on each link class. ``predict_tp``: ``muon_fsdp``
with tensor parallelism inside a node, in each ``tp_mode``.
"""

from __future__ import annotations

import math
from typing import Any

from scale_counts import (
    Matrix,
    ModelShapes,
    NodeSums,
    Topology,
    collective_split,
    ddp_counts,
    fsdp_counts,
    ns_flops_of,
)
from scale_profiles import Profile

from lightning_muon.distributed.planning import expert_blocks, plan_ownership
from lightning_muon.distributed.tp_math import tp_bytes, tp_ns_flops
from lightning_muon.layout import MatrixLayout


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
    spread = [i for i, o in enumerate(plan.owners) if o == -1]  # expert stacks over the group, every rank a block
    blocks = dict(zip(spread, expert_blocks([shapes.muon[i].shape[0] for i in spread], S)))
    for i in indices:
        if i in blocks:
            shape = shapes.muon[i].shape
            for r, (_, rows) in enumerate(blocks[i]):
                payload[r] += (math.prod(shape[1:]) * rows + (1 if rows else 0)) * eb
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
    plan = plan_ownership(
        [m.stored for m in shapes.muon], D, layouts=[MatrixLayout(batched=m.batched) for m in shapes.muon]
    )
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
