"""The multi-process memory measurements: ``bench_ddp.py``, ``bench_fsdp.py`` and ``bench_tp.py`` with ``--memory``.

Per rank, the second optimizer step of each configuration (``memory.StepMeter``), each
against its reference on the same ranks:

- ``ddp``: ``muon_ddp`` (``reduce_scatter``, set up by the strategy's own ``MuonDDPCore`` with
  ``overlap=False``: the reduce runs inside the measured step) against plain DDP with AdamW
  and DDP with our ``Muon`` replicated (every rank steps everything), CharGPT d=768 x 2;
- ``fsdp``: ``muon_fsdp`` (``MuonFSDPSharding``, owner mode) against FSDP2 (``fully_shard``
  per block, then the root) with AdamW, foreach and for-loop;
- ``mesh``: ``bench_tp.py``'s blocks on the (data x tensor) mesh, ``Muon`` + ``MuonTPSharding``
  in each ``tp_mode`` against AdamW, on random gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchlib.harness import target
from benchlib.memory import (
    StepMeter,
    measure,
    our_kwargs,
    print_rank_table,
    print_targets,
    rank_rows,
    storages,
    torch_adamw,
)
from benchlib.ranks import RankSettings, char_batch, char_gpt, run_ranks
from benchlib.step_table import ADAMW_LR, LR, WEIGHT_DECAY
from benchlib.tp_blocks import build_model
from lightning_muon import Muon, route_parameters
from lightning_muon.strategies.ddp_core import MuonDDPCore
from lightning_muon_demo.models import CharGPT

# Targets (benchmarks/README.md, "Memory").
FSDP_PEAK_RATIO_MAX = 1.0  # fsdp: muon_fsdp's peak <= FSDP2 + AdamW's, on every rank

DDP_CONFIGS = {
    "adamw": "DDP + AdamW",
    "muon_replicated": "DDP + Muon, replicated",
    "muon_ddp": "muon_ddp",
}
FSDP_CONFIGS = {
    "adamw": "FSDP2 + AdamW (foreach)",
    "adamw_loop": "FSDP2 + AdamW (for-loop)",
    "owner": "muon_fsdp (owner)",
}
MESH_CONFIGS = {
    "adamw": "FSDP2 + TP + AdamW",
    "duplicated": "Muon, tp_mode=duplicated",
    "distributed": "Muon, tp_mode=distributed",
    "blockwise": "Muon, tp_mode=blockwise",
}


def char_model_size(quick: bool) -> dict[str, int]:
    """The CharGPT of the ``ddp`` and ``fsdp`` measurements, and its batch per rank."""
    if quick:
        return dict(n_embd=64, n_layer=2, n_head=2, block_size=16, batch=2)
    return dict(n_embd=768, n_layer=2, n_head=12, block_size=64, batch=2)


# ---------------------------------------------------------------- ddp, fsdp: W ranks, CharGPT


def _rank_settings(cfg: dict[str, Any]) -> RankSettings:
    m = cfg["dist_model"]
    return RankSettings(
        quick=cfg["quick"],
        world_size=cfg["world_size"],
        threads=cfg["threads"],
        n_layer=m["n_layer"],
        n_embd=m["n_embd"],
        n_head=m["n_head"],
        block_size=m["block_size"],
        batch=m["batch"],
        warmup=1,
        steps=1,
        device=cfg["device"],
    )


def _rank_device(cfg: dict[str, Any]) -> torch.device:
    # run_ranks set this rank's GPU as the current one: "cuda" means it.
    return torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" else torch.device("cpu")


def _our_optimizer(model: nn.Module, cfg: dict[str, Any]) -> Muon:
    return Muon(route_parameters(model), lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR, **our_kwargs(cfg))


def _muon_param_bytes(opt: Muon, device: torch.device) -> int:
    matrices = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    return sum(storages(matrices, device).values())


def _train_and_measure(
    model: nn.Module,
    step: Callable[[], Any],
    meter: StepMeter,
    zero_grad: Callable[[], Any],
    s: RankSettings,
    rank: int,
) -> dict[str, Any]:
    """Two training steps on this rank's batches; the second optimizer step is measured."""
    for i in range(2):
        zero_grad()
        x, y = char_batch(s, i, rank * s.batch, (rank + 1) * s.batch)
        CharGPT.loss(model(x), y).backward()
        if i == 0:
            step()
    return measure(step, meter)


def _ddp_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    s, device = _rank_settings(cfg), _rank_device(cfg)
    out = {}
    for name in DDP_CONFIGS:
        model = char_gpt(s)
        core, shardings = None, []
        if name == "adamw":
            opt: torch.optim.Optimizer = torch_adamw(list(model.parameters()))
        else:
            opt = _our_optimizer(model, cfg)
        if name == "muon_ddp":
            # As MuonDDPStrategy(overlap=False) sets it up: DDP ignores the Muon matrices, whose
            # gradients the core's reduce sends to their owners inside the measured step.
            core = MuonDDPCore(muon_mode="reduce_scatter", overlap=False)
            shardings = core.attach([opt], model, world, world)
            core.leave_to_owners(model, shardings)
        ddp = DistributedDataParallel(model)
        if core is not None:
            core.after_wrap(ddp, shardings)

        def step(opt: torch.optim.Optimizer = opt, core: MuonDDPCore | None = core) -> None:
            if core is not None:
                core.reduce(opt)
            opt.step()

        meter = StepMeter(device, list(model.parameters()), [opt])
        row = _train_and_measure(ddp, step, meter, lambda opt=opt: opt.zero_grad(set_to_none=True), s, rank)
        if isinstance(opt, Muon):
            row["muon_param_bytes"] = _muon_param_bytes(opt, device)
        out[name] = row
        del ddp, model, opt, core, shardings, step, meter
    return out


def _fsdp_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    s, device = _rank_settings(cfg), _rank_device(cfg)
    mesh = init_device_mesh(cfg["device"], (world,))
    out = {}
    for name in FSDP_CONFIGS:
        model = char_gpt(s)
        for block in model.blocks:  # what MuonFSDPStrategy's default sharding makes of CharGPT
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "owner":
            opt: torch.optim.Optimizer = _our_optimizer(model, cfg)
            MuonFSDPSharding(opt, mode="owner")
        else:
            opt = torch_adamw(list(model.parameters()), foreach=name == "adamw")
        meter = StepMeter(device, list(model.parameters()), [opt])
        row = _train_and_measure(model, opt.step, meter, lambda opt=opt: opt.zero_grad(set_to_none=True), s, rank)
        if isinstance(opt, Muon):
            row["muon_param_bytes"] = _muon_param_bytes(opt, device)
        out[name] = row
        del model, opt, meter
    return out


def _backend(cfg: dict[str, Any]) -> str:
    return "nccl" if cfg["device"] == "cuda" else "gloo"


def _dist_line(cfg: dict[str, Any]) -> str:
    m = cfg["dist_model"]
    model = f"CharGPT d={m['n_embd']} x {m['n_layer']} layers ({m['n_head']} heads)"
    return f"{model}, batch {m['batch']} x {m['block_size']} per rank"


def bench_ddp(cfg: dict[str, Any]) -> dict[str, Any]:
    world = cfg["world_size"]
    ranks = run_ranks(_ddp_rank, world, cfg, backend=_backend(cfg), threads=cfg["threads"])
    return {"world_size": world, "model": cfg["dist_model"], "rows": rank_rows(ranks, DDP_CONFIGS, "adamw")}


def print_ddp(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    title = f"\n== ddp: {section['world_size']} {_backend(cfg)} ranks, {_dist_line(cfg)}; per rank, second step() =="
    note = (
        "muon_ddp: MuonDDPSharding(reduce_scatter) with DDP ignoring the Muon matrices, as\n"
        "MuonDDPStrategy(overlap=False): its step is reduce_gradients() + step(), the all-to-all of Muon\n"
        "gradients included; kept = buffers it keeps between steps (none: its exchange runs in rounds).\n"
        "DDP's own gradient buckets (untouched by the step) are not counted."
    )
    print_rank_table(title, note, section["rows"], "DDP + AdamW")


def bench_fsdp(cfg: dict[str, Any]) -> dict[str, Any]:
    world = cfg["world_size"]
    ranks = run_ranks(_fsdp_rank, world, cfg, backend=_backend(cfg), threads=cfg["threads"])
    rows = rank_rows(ranks, FSDP_CONFIGS, "adamw")
    worst = max(r["peak_per_ref"] for r in rows if r["config"] == "owner")
    targets = [
        target("fsdp: muon_fsdp's peak / FSDP2 + AdamW (foreach)'s, worst rank", worst, "<=", FSDP_PEAK_RATIO_MAX)
    ]
    return {"world_size": world, "model": cfg["dist_model"], "rows": rows, "targets": targets}


def print_fsdp(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    ranks = f"{section['world_size']} {_backend(cfg)} ranks"
    title = f"\n== fsdp: FSDP2 on {ranks}, {_dist_line(cfg)}; per rank, second step() =="
    note = (
        "fully_shard per block, then the root, as MuonFSDPStrategy does; params, grads and state are this rank's\n"
        "shards; muon_fsdp = Muon + MuonFSDPSharding(mode='owner'): owners gather whole matrices in the step"
    )
    print_rank_table(title, note, section["rows"], "FSDP2 + AdamW (foreach)")
    print_targets(section["targets"])


# ---------------------------------------------------------------- mesh: data x tensor


def _mesh_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_muon.distributed.tensor_parallel import DP_DIM, TP_DIM, MuonTPSharding

    device = _rank_device(cfg)
    d, blocks = cfg["mesh_model"]
    mesh = init_device_mesh(cfg["device"], tuple(cfg["mesh"]), mesh_dim_names=(DP_DIM, TP_DIM))
    out = {}
    for name in MESH_CONFIGS:
        model = build_model(d, blocks, mesh, cfg["device"])
        params = list(model.parameters())
        if name == "adamw":
            opt: torch.optim.Optimizer = torch_adamw(params)
        else:
            opt = Muon(params, lr=LR, weight_decay=WEIGHT_DECAY, tp_mode=name, **our_kwargs(cfg))
            MuonTPSharding(opt, tp_mode=name)
        for i in range(2):
            torch.manual_seed(i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DTensor's notice on random ops over a CPU mesh
                for p in params:
                    p.grad = torch.randn_like(p)
            if i == 0:
                opt.step()
        out[name] = measure(opt.step, StepMeter(device, params, [opt]))
        del model, params, opt
    return out


def bench_mesh(cfg: dict[str, Any]) -> dict[str, Any]:
    dp, tp = cfg["mesh"]
    ranks = run_ranks(_mesh_rank, dp * tp, cfg, backend=_backend(cfg), threads=cfg["threads"])
    return {
        "world_size": dp * tp,
        "mesh": [dp, tp],
        "model": cfg["mesh_model"],
        "rows": rank_rows(ranks, MESH_CONFIGS, "adamw"),
    }


def print_mesh(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    d, blocks = section["model"]
    dp, tp = section["mesh"]
    title = (
        f"\n== mesh: {dp} x {tp} (data x tensor) {_backend(cfg)} ranks, {blocks} blocks of d={d} (bench_tp.py's: "
        "q,k,v,fc1 colwise, proj,fc2 rowwise); per rank, second step() =="
    )
    note = "random gradients; every parameter a matrix (no biases), so Muon's state is half of AdamW's"
    print_rank_table(title, note, section["rows"], "AdamW")
