"""Owner groups (``owner_group_size``) and Muon gradients sent while backward runs (``overlap``).

One 4-rank Lightning fit (2 groups of 2, overlap on, clipping, accumulation, resumed from
a one-process checkpoint and resumed again on one process) against one process, with its
bytes per collective against the owner plan; one 2-rank launch for the overlap's order,
``no_sync`` and bitwise agreement with the unbucketed reduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_modules import TinyRegressor
from dist_utils import run_distributed
from test_ddp_strategy import CONFIG, FP32, _assert_all_equal, _fit, _ranks, _spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_muon import Muon, MuonDDPStrategy, route_parameters
from lightning_muon.distributed.comm import all_reduce_bytes
from lightning_muon.distributed.ddp import MuonDDPSharding
from lightning_muon.distributed.planning import plan_ownership

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py


def test_arguments_are_checked():
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="owner_group_size must be a positive int"):
            MuonDDPStrategy(owner_group_size=bad)
    with pytest.raises(ValueError, match="overlap must be True or False"):
        MuonDDPStrategy(overlap="yes")
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        MuonDDPStrategy(bucket_cap_mb=0)


def test_four_ranks_as_two_groups_of_two_equal_one_process(tmp_path):
    # The same 8 samples every micro-batch, so that resuming (which replays a batch) sees
    # what an uninterrupted run sees; 8 divides among 1 and 4 ranks.
    kwargs = dict(global_batch=8, samples=8, gradient_clip_val=0.05, accumulate_grad_batches=2)
    _fit(tmp_path / "ref4", "auto", 1, steps=4, **kwargs)
    _fit(tmp_path / "ref6", "auto", 1, steps=6, **kwargs)
    _fit(tmp_path / "start", "auto", 1, steps=2, **kwargs)
    start = next((tmp_path / "start").rglob("*.ckpt"))
    # 4 ranks, 2 owner groups of 2: resume one process's checkpoint, train steps 3-4, save.
    four = _spawn(owner_group_size=2, bucket_cap_mb=1e-3)  # a bucket per matrix
    _fit(tmp_path / "four", four, 4, steps=4, ckpt_path=start, **kwargs)
    results = _ranks(tmp_path / "four", 4)
    _assert_all_equal(results, _ranks(tmp_path / "ref4", 1)[0], **FP32)
    # ... and one process resumes the 4-rank checkpoint: every momentum was saved.
    saved = next((tmp_path / "four").rglob("*.ckpt"))
    _fit(tmp_path / "one", "auto", 1, steps=6, ckpt_path=saved, **kwargs)
    _assert_all_equal(_ranks(tmp_path / "one", 1), _ranks(tmp_path / "ref6", 1)[0], **FP32)

    # Bytes per collective, counted by MuonDDPSharding, against the owner plan of a group of 2
    # (every group holds the same plan): each rank sends its group peer the gradients the peer
    # owns (one flag element per matrix with them), all-reduces what it owns with the same
    # local rank of the other group, and sends its peer its new matrices; one fp32 flag
    # all-reduced over all 4 ranks.
    groups = Muon(route_parameters(TinyRegressor(CONFIG)), lr=0.02).param_groups
    muon = [p for g in groups if g["algorithm"] == "muon" for p in g["params"]]
    plan = plan_ownership([p.shape for p in muon], 2)
    owned = [plan.elements(r) for r in range(2)]
    payload = [owned[r] + len(plan.owned(r)) for r in range(2)]  # gradients + one flag per matrix
    steps = 2  # optimizer steps 3 and 4 ran here
    for rank, result in enumerate(results):
        mine, peer = rank % 2, 1 - rank % 2
        expected = {
            "reduce_scatter": payload[peer] * 4,
            "reduce_across": all_reduce_bytes(payload[mine], 4, 2),
            "all_gather": owned[mine] * 4,
            "nonfinite_flag": all_reduce_bytes(1, 4, 4),
        }
        for op, sent in expected.items():
            assert result["comm"][op] == pytest.approx(steps * sent), (rank, op)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 12)
        self.spare = nn.Linear(12, 12)  # used on some steps only: no gradient on the others
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, spare: bool) -> torch.Tensor:
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.head(torch.tanh(self.spare(h)) if spare else h)


def _overlap_scenarios(rank: int, world: int) -> dict:
    torch.manual_seed(1)
    data = [torch.randn(world * 4, 8) for _ in range(6)]
    runs = {}
    for name, size, overlap in (("plain", 2, False), ("groups", 2, True), ("singletons", 1, True)):
        net = _Net()
        opt = Muon(route_parameters(net), lr=0.02, weight_decay=0.1, ns_dtype="float32", adamw_lr=1e-2)
        sharding = MuonDDPSharding(opt, owner_group_size=size)
        names = [n for n, p in net.named_parameters() if any(p is q for q in sharding.params)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, names)
        ddp = DistributedDataParallel(net, find_unused_parameters=True)
        if overlap:
            sharding.overlap_with_backward(lambda ddp=ddp: ddp.require_backward_grad_sync, bucket_cap_mb=1e-4)
        runs[name] = (net, ddp, opt, sharding)
    events: list[str] = []
    originals = {op: getattr(dist, op) for op in ("all_to_all_single", "all_reduce")}

    def logged(op):
        def call(*args, **kwargs):
            events.append("issue")
            return originals[op](*args, **kwargs)

        return call

    for op in originals:
        setattr(dist, op, logged(op))
    out: dict = {"issued_during_backward": {}, "issued_in_no_sync": [], "grads": {}, "last_grad_at": {}}
    try:
        for step in range(3):
            spare = step != 1  # step 1: the spare Muon matrix has no gradient anywhere
            for name, (net, ddp, opt, sharding) in runs.items():
                opt.zero_grad(set_to_none=True)
                x = data[2 * step][rank * 4 : (rank + 1) * 4]
                with ddp.no_sync():  # a micro-batch that only accumulates
                    ddp(x, spare).square().mean().backward()
                if sharding._overlap is not None:
                    out["issued_in_no_sync"].append(list(sharding._overlap.issued))
                events.clear()
                hook = net.a.weight.register_post_accumulate_grad_hook(lambda p: events.append("last grad"))
                ddp(data[2 * step + 1][rank * 4 : (rank + 1) * 4], spare).square().mean().backward()
                hook.remove()
                if sharding._overlap is not None:
                    out["issued_during_backward"][(name, step)] = list(sharding._overlap.issued)
                    out["last_grad_at"][(name, step)] = list(events)
                sharding.reduce_gradients()
                out["grads"][(name, step)] = {
                    n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None
                }
                opt.step()
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
    out["params"] = {
        name: {n: p.detach().clone() for n, p in net.named_parameters()} for name, (net, *_) in runs.items()
    }
    out["buckets"] = len(runs["groups"][3]._overlap.buckets)
    return out


def test_overlap_issues_reduces_during_backward_and_changes_nothing():
    for rank, out in enumerate(run_distributed(_overlap_scenarios, 2)):
        assert out["buckets"] == 4  # one per Muon matrix at this bucket size
        # Under no_sync nothing leaves the rank; in the backward that ends the accumulation
        # the first all-to-all is issued before the last gradient (layer a's) exists.
        assert all(issued == [] for issued in out["issued_in_no_sync"])
        for name in ("groups", "singletons"):
            for step in (0, 2):
                issued, order = out["issued_during_backward"][(name, step)], out["last_grad_at"][(name, step)]
                assert issued and issued[0] == ("all_to_all", 0), (rank, name, issued)
                if name == "singletons":  # one rank per group: the all-reduce across groups is the reduce
                    assert ("all_reduce", 0) in issued
                assert order.index("issue") < order.index("last grad"), (rank, name, order)
            # Step 1: the spare matrix (bucket 0, backward's first) has no gradient; buckets
            # launch in order on every rank, so all of them wait for the step.
            assert out["issued_during_backward"][(name, 1)] == []
        # Bitwise the same gradients and parameters as the unbucketed reduce after backward.
        for step in range(3):
            plain = out["grads"][("plain", step)]
            assert out["grads"][("groups", step)].keys() == plain.keys()
            for n, g in plain.items():
                assert torch.equal(out["grads"][("groups", step)][n], g), (rank, step, n)
        for n, p in out["params"]["plain"].items():
            assert torch.equal(out["params"]["groups"][n], p), (rank, n)
            torch.testing.assert_close(out["params"]["singletons"][n], p, **FP32)
