"""MuonDDPSharding on gloo: owners orthogonalize, results shared; equal to one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

from lightning_muon import Muon, route_parameters
from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.distributed.ddp import MuonDDPSharding

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py

STEPS = 6
BATCH = 12  # divisible by 2 and 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Shapes differ so that ownership is uneven at 3 ranks; the head goes to AdamW.
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)
    )


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _optimizer(model: nn.Module, ns_dtype: str) -> Muon:
    # fp32 Newton-Schulz by default: bf16 would turn reduction-order noise into percent-level
    # differences against one process (bf16 is compared at the same world size instead).
    return Muon(route_parameters(model), lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, adamw_lr=1e-2)


def _train(rank: int, world: int, mode: str, drop_grad_step: int | None, ns_dtype: str = "float32") -> dict:
    """``mode="replicated"`` is plain DDP: every gradient averaged, every rank steps every matrix."""
    model = _model()
    opt = _optimizer(model, ns_dtype)
    sharding = MuonDDPSharding(opt, mode=mode) if world > 1 and mode != "replicated" else None
    muon_ids = {id(p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    for step in range(STEPS):
        x, y = _data(step)
        lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
        opt.zero_grad()
        nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        if step == drop_grad_step:
            model[2].weight.grad = None  # a matrix without a gradient on every rank this step
        if world > 1:
            # Plain DDP's job for what it reduces: average every gradient it was not told to ignore.
            for p in model.parameters():
                if (mode != "reduce_scatter" or id(p) not in muon_ids) and p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        if sharding is not None:
            sharding.reduce_gradients()
        opt.step()
    stats = dict(sharding.stats.bytes) if sharding else {}
    owned = len(sharding.plan.owned(rank)) if sharding else None
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "bytes": stats,
        "owned": owned,
        "muon_numel": sum(model.get_parameter(n).numel() for n in _muon_names(opt)),
    }


def _muon_names(opt: Muon) -> list[str]:
    return [n for g in opt.param_groups if g["algorithm"] == "muon" for n in g["param_names"]]


# What each launch trains: (mode, drop_grad_step, ns_dtype) -> every rank's result.
FP32_SCENARIOS = [("reduce_scatter", 3, "float32"), ("all_gather", 3, "float32")]
BF16_SCENARIOS = [(mode, None, "bfloat16") for mode in ("replicated", "reduce_scatter", "all_gather")]
SCENARIOS = {2: [*FP32_SCENARIOS, *BF16_SCENARIOS, ("replicated", None, "float32")], 3: FP32_SCENARIOS[:1]}


def _scenarios(rank: int, world: int) -> dict:
    """Every scenario of this world size in one launch; rank 0 also trains the one-process reference.

    The reference (world 1) makes no collective call, so rank 0 computes it in its own
    process, as a one-rank launch would, while the other ranks go on.
    """
    out = {scenario: _train(rank, world, *scenario) for scenario in SCENARIOS[world]}
    if rank == 0 and world == 2:
        out["single"] = _train(0, 1, "reduce_scatter", 3)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    """One launch per world size (2 and 3 gloo ranks) for every test below."""
    return {world: run_distributed(_scenarios, world) for world in SCENARIOS}


@pytest.mark.parametrize(("world_size", "mode"), [(2, "reduce_scatter"), (3, "reduce_scatter"), (2, "all_gather")])
def test_sharded_equals_single_process(runs, world_size, mode):
    reference = runs[2][0]["single"]  # one process: the same for every mode
    results = [rank[(mode, 3, "float32")] for rank in runs[world_size]]
    for res in results:
        for a, b in zip(res["params"], reference["params"]):
            # fp32 everywhere; the only differences are summation orders of the gradient
            # average (~1e-7 relative), which Newton-Schulz keeps at that level over 6 steps.
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert sum(r["owned"] for r in results) == 3  # three hidden matrices, each owned once
    if mode == "reduce_scatter" and world_size == 2:
        muon_bytes = all_reduce_bytes(reference["muon_numel"], 4, world_size) * STEPS
        for res in results:
            moved = res["bytes"]["reduce_scatter"] + res["bytes"]["all_gather"]
            flags = res["bytes"].get("nonfinite_flag", 0)
            # Exactly DDP's all-reduce of the Muon matrices, plus one flag per matrix and step.
            assert moved <= muon_bytes + 4 * 3 * STEPS and moved + flags <= 1.05 * muon_bytes


def test_sharded_equals_plain_ddp_with_bfloat16_newton_schulz(runs):
    """bf16 Newton-Schulz: owners reproduce what plain DDP (every rank steps everything) computes.

    One process is no reference in bf16 (a one-ulp change of the gradient sum turns into
    percent-level differences); plain DDP at the same world size sums the same two gradients.
    At 2 ranks both sums are the one addition a + b, so every Newton-Schulz input is bitwise
    the same; only the stacking of same-shape matrices may differ (an owner batches fewer of
    them), which can move an orthogonalized entry by one bf16 ulp, u = 2^-8 of entries <= 1.2,
    per step, scaled by lr * adjust (<= 0.02 * 2): the bound allows that on all 6 steps.
    Measured on an AVX512-BF16 CPU: bit for bit equal.
    """
    u = 2.0**-8
    bound = STEPS * 0.02 * 2 * 1.2 * u
    plain = [rank[("replicated", None, "bfloat16")] for rank in runs[2]]
    for mode in ("reduce_scatter", "all_gather"):
        sharded = [rank[(mode, None, "bfloat16")] for rank in runs[2]]
        for rank in range(2):
            for a, b in zip(sharded[rank]["params"], plain[rank]["params"]):
                torch.testing.assert_close(a, b, rtol=0, atol=bound)
    # Not vacuous: bf16 and fp32 Newton-Schulz do differ by more than the bound here.
    fp32 = [rank[("replicated", None, "float32")] for rank in runs[2]]
    assert max((a - b).abs().max().item() for a, b in zip(plain[0]["params"], fp32[0]["params"])) > bound
