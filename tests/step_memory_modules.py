"""Workers of tests/test_step_memory.py: the same steps with and without a step-memory cap, muon_fsdp and muon_ddp.

Importable by spawned ranks (``dist_utils.run_distributed``): module-level functions only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_muon import Muon

STEPS = 3
LAYERS = 4
D = 32


def shapes() -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, group): a GPT-like set (four of each hidden shape), a fused QKV stored (in, 3 out), experts."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for layer in range(LAYERS):
        out[f"qkv{layer}"] = ((3 * D, D), "plain")
        out[f"proj{layer}"] = ((D, D), "plain")
        out[f"fc1_{layer}"] = ((4 * D, D), "plain")
        out[f"fc2_{layer}"] = ((D, 4 * D), "plain")
        out[f"ln{layer}"] = ((D,), "adamw")
    for i in range(2):
        out[f"c_attn{i}"] = ((D, 3 * D), "split_t")  # GPT-2's Conv1D: q, k, v side by side
        out[f"experts{i}"] = ((4, 16, D), "experts")  # (E, out, in), sharded by whole experts
        out[f"normed{i}"] = ((48, D), "normuon")
    out["lone"] = ((40, 24), "plain")  # the only one of its shape
    return out


def groups(params: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    def pick(kind: str) -> list[torch.Tensor]:
        return [params[n] for n, (_, k) in shapes().items() if k == kind]

    return [
        {"params": pick("plain"), "algorithm": "muon"},
        {"params": pick("split_t"), "algorithm": "muon", "transposed": True, "split_parts": 3},
        {"params": pick("experts"), "algorithm": "muon", "batched": True},
        {"params": pick("normuon"), "algorithm": "muon", "second_moment": "normuon"},
        {"params": pick("adamw"), "algorithm": "adamw"},
    ]


def tensors() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    params = {n: 0.1 * torch.randn(shape, generator=gen) for n, (shape, _) in shapes().items()}
    grads = [{n: torch.randn(shape, generator=gen) for n, (shape, _) in shapes().items()} for _ in range(STEPS)]
    return params, grads


def optimizer(params: dict[str, torch.Tensor], cap: float | str | None, ns_dtype: str) -> Muon:
    return Muon(groups(params), lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype, adamw_lr=0.01, step_memory_mb=cap)


def fsdp_worker(rank: int, world_size: int, caps: list, ns_dtype: str) -> dict:
    """``{cap: {"params", "bytes"}}`` after STEPS steps of ``MuonFSDPSharding`` over ``Shard(0)`` DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for cap in caps:
        full, grads = tensors()
        params = {n: nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for n, t in full.items()}
        opt = optimizer(params, cap, ns_dtype)
        sharding = MuonFSDPSharding(opt)
        for step in range(STEPS):
            for n, p in params.items():
                p.grad = distribute_tensor(grads[step][n], mesh, [Shard(0)])
            opt.step()
        out[str(cap)] = {"params": {n: p.full_tensor() for n, p in params.items()}, "bytes": dict(sharding.stats.bytes)}
    return out


def ddp_worker(rank: int, world_size: int, caps: list, ns_dtype: str) -> dict:
    """``{cap: {"params", "bytes"}}`` after STEPS steps of ``MuonDDPSharding`` (muon_ddp's reduce-scatter mode).

    Every rank is handed the same gradients: plain DDP's average of the non-Muon ones is then
    theirs, and the owners' reduce of the Muon ones is what the test compares.
    """
    from lightning_muon.distributed.ddp import MuonDDPSharding

    out = {}
    for cap in caps:
        full, grads = tensors()
        params = {n: nn.Parameter(t.clone()) for n, t in full.items()}
        opt = optimizer(params, cap, ns_dtype)
        sharding = MuonDDPSharding(opt, mode="reduce_scatter")
        for step in range(STEPS):
            for n, p in params.items():
                p.grad = grads[step][n].clone()
            sharding.reduce_gradients()
            opt.step()
        out[str(cap)] = {
            "params": {n: p.detach().clone() for n, p in params.items()},
            "bytes": dict(sharding.stats.bytes),
        }
    return out
