"""Emerging-Optimizers' algorithms under sharding equal one process: muon_ddp's owners (MuonDDPSharding), muon_fsdp's
(MuonFSDPSharding, Shard(0) DTensors) on 2 gloo ranks, and a 2 x 2 (data x tensor) mesh (MuonTPSharding) on 4.

Every per-matrix algorithm: the orthogonalizing ones (adaptive_muon's three second moments,
scion, polargrad, mop by SVD, spel's projection, sinkhorn_muon's map) and SOAP's family,
whose owner steps each whole matrix with its whole state (``Sharding.map_whole``). The
runs compare the weights and the full optimizer state after 3 steps, at fp32.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon
from lightning_muon.algorithms import sinkhorn_knopp

pytestmark = [pytest.mark.numerics, pytest.mark.distributed, pytest.mark.policy_free]  # see conftest.py

ORTHO = dict(ns_dtype="float32")
CASES = [
    ("adaptive_muon", dict(moment2_method="adamuon", lr=0.01, ns_dtype="float32")),
    ("adaptive_muon", dict(moment2_method="normuon", lr=0.01, ns_dtype="float32")),
    ("adaptive_muon", dict(moment2_method="namo", lr=0.01, ns_dtype="float32")),
    ("scion", dict(ORTHO, lr=0.01, spectral_radius=2.0)),
    ("polargrad", dict(ORTHO, lr=1e-3, nesterov=True, weight_decay_method="l2")),
    ("mop", dict(lr=1e-3)),
    ("mop", dict(lr=0.01, scale_mode="spectral")),
    ("spel", dict(ORTHO, lr=0.01)),
    ("sinkhorn_muon", dict(ORTHO, lr=1e-3)),
    ("soap", dict(lr=3e-3)),
    ("soap", dict(lr=3e-3, use_kl_shampoo=True, weight_decay_method="l2", nesterov=True)),
    ("rekls", dict(lr=3e-3)),
]
# Shapes that split on both mesh dims; on the 2 x 2 mesh "a" is split by columns on the tensor
# dim (row-parallel), "b" by rows (column-parallel), "c" replicated there.
SHAPES = {"a": (8, 6), "b": (6, 10), "c": (12, 8)}
STEPS = 3


def _start(algorithm: str) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen) / s[1] ** 0.5 for n, s in SHAPES.items()}
    if algorithm == "sinkhorn_muon":  # its weights must be Sinkhorn-normalized first
        weights = {n: sinkhorn_knopp(w) for n, w in weights.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(STEPS)]
    return weights, grads


def _run(place, full, make_sharding, sync=None) -> list[dict]:
    """Every case from the same start: the full weights and full states after the steps."""
    out = []
    for algorithm, keys in CASES:
        weights, grads = _start(algorithm)
        params = {n: nn.Parameter(place(n, w)) for n, w in weights.items()}
        opt = Muon([{"params": list(params.values()), "algorithm": algorithm, **keys}])
        sharding = make_sharding(opt)
        for step in range(STEPS):
            for n, p in params.items():
                p.grad = place(n, grads[step][n])
            if sync is not None:
                sync(sharding)
            opt.step()
        if hasattr(sharding, "gather_states"):  # DDP: each state lives on its matrix's owner
            states = dict(zip(params, sharding.gather_states()))
        else:
            states = {n: {k: full(v) for k, v in opt.state[p].items()} for n, p in params.items()}
        out.append({"params": {n: full(p.detach()) for n, p in params.items()}, "states": states})
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole of a DTensor; a plain tensor (a step count, NAMO's per-matrix scalar) is whole on every rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _single() -> list[dict]:
    return _run(lambda n, t: t.clone(), lambda t: t, lambda opt: None)


def _two_ranks(rank: int, world: int) -> dict:
    """DDP owners (whole tensors, gradients averaged to owners) and FSDP2 (Shard(0) DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon.distributed.ddp import MuonDDPSharding
    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    ddp = _run(lambda n, t: t.clone(), lambda t: t, MuonDDPSharding, sync=lambda s: s.reduce_gradients())
    mesh = init_device_mesh("cpu", (world,))
    fsdp = _run(lambda n, t: distribute_tensor(t.clone(), mesh, [Shard(0)]), _full, MuonFSDPSharding)
    return {"ddp": ddp, "fsdp": fsdp}


def _mesh_2x2(rank: int, world: int) -> list[dict]:
    """A (data, tensor) mesh, each weight placed as parallelize_module then fully_shard place it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_muon.distributed.tensor_parallel import DP_DIM, TP_DIM, MuonTPSharding

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(DP_DIM, TP_DIM))
    placements = {
        "a": [Shard(0), Shard(1)],  # row-parallel: columns on the tensor dim
        "b": [_StridedShard(0, split_factor=2), Shard(0)],  # column-parallel: rows on the tensor dim
        "c": [Shard(0), Replicate()],
    }

    def place(n: str, t: torch.Tensor) -> torch.Tensor:
        if n == "b":  # rows to the tensor dim first, then each block's rows over the data dim
            tp = distribute_tensor(t.clone(), mesh[TP_DIM], [Shard(0)])
            local = torch.chunk(tp.to_local(), 2, dim=0)[mesh[DP_DIM].get_local_rank()]
            stride = t.stride()
            return torch.distributed.tensor.DTensor.from_local(
                local.contiguous(), mesh, placements[n], run_check=False, shape=t.shape, stride=stride
            )
        return distribute_tensor(t.clone(), mesh, placements[n])

    return _run(place, _full, MuonTPSharding)


@pytest.fixture(scope="module")
def runs() -> dict:
    """One process; one spawn of 2 gloo ranks (DDP, then FSDP2); one of 4 (the 2 x 2 mesh)."""
    return {"single": _single(), "two": run_distributed(_two_ranks, 2), "mesh": run_distributed(_mesh_2x2, 4)}


def _compare(got: list[dict], want: list[dict], where: str) -> None:
    for (algorithm, keys), res, ref in zip(CASES, got, want):
        label = f"{where} {algorithm} {keys}"
        for n, w in ref["params"].items():
            # fp32; the ranks' sums (gradient averages, whole-matrix norms) run in another order:
            # ~1e-7 relative, which Newton-Schulz, an SVD or an eigenbasis keeps near 1e-6.
            assert_close(res["params"][n], w, rtol=1e-5, atol=2e-6, msg=lambda m, n=n, label=label: f"{label} {n}: {m}")
        for n, state in ref["states"].items():
            assert set(res["states"][n]) == set(state), label
            for key, value in state.items():
                assert_close(
                    res["states"][n][key],
                    value,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m, k=key, label=label: f"{label} {k}: {m}",
                )
        moved = max((ref["params"][n] - w).abs().max() for n, w in _start(algorithm)[0].items())
        assert moved > 1e-4, label  # the weights did move


def test_ddp_owners_equal_one_process(runs):
    """muon_ddp: each matrix stepped by its owner (its state there alone), gathered for the comparison."""
    for rank in runs["two"]:
        _compare(rank["ddp"], runs["single"], "ddp")


def test_fsdp_owners_equal_one_process(runs):
    """muon_fsdp: each whole matrix (and SOAP's whole state) on its owner, each rank's rows back."""
    for rank in runs["two"]:
        _compare(rank["fsdp"], runs["single"], "fsdp")


def test_2x2_mesh_equals_one_process(runs):
    """A 2 x 2 (data x tensor) mesh: weights split by rows, by columns and replicated on the tensor dim."""
    for rank in runs["mesh"]:
        _compare(rank, runs["single"], "2x2")
