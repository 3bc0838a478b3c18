"""Expert parallelism: expert stacks ``Shard(0)`` on the mesh's expert dim, FSDP2 on the data dim
(torchtitan's layout), on a 2 x 2 gloo mesh with the user's ``configure_model``, through
``MuonFSDPStrategy`` and through Lightning's own ``ModelParallelStrategy``: every rank
orthogonalizes the whole experts it holds, sends no Muon bytes, and the run equals one process."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from ep_modules import E, ep_fit_worker, reference_fit

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py

STEPS = 3
# fp32 Newton-Schulz; the ranks sum gradients in another order than one process: a few ulps
# per step (measured 1e-7 after 3 steps). A wrong expert, offset or lr scale moves 1e-3.
FP32 = dict(rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_expert_parallel_mesh_equals_one_process_and_sends_no_muon_bytes(tmp_path):
    ranks = run_distributed(ep_fit_worker, 4, tmp_path / "ep", STEPS)
    reference = reference_fit(tmp_path / "ref", STEPS)
    assert [run["strategy"] for run in ranks[0]] == ["MuonFSDPStrategy", "ModelParallelStrategy"]
    for rank in ranks:
        for run in rank:
            assert run["sharding"] == "MuonTPSharding"  # Lightning's strategy: attached by Muon's first step
            assert run["params"].keys() == reference.keys()
            for name, expected in reference.items():
                torch.testing.assert_close(run["params"][name], expected, **FP32, msg=lambda m, n=name: f"{n}: {m}")
            # torchtitan's layout: experts split on the expert (tensor) dim, then on the data dim.
            assert run["placements"]["net.experts.gate_up_proj"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
            assert run["local_experts"] == E // 4  # whole experts on every rank
            assert run["muon_groups"] == {"muon_experts_gate_up": (True, (12, 12)), "muon_experts": (True, None)}
            # The only Muon matrices are the experts: nothing travels to or from owners on either dim.
            for dim in ("data_parallel", "tensor_parallel"):
                moved = {k: v for k, v in run["bytes"][dim].items() if k in ("to_owner", "from_owner") or "tp_" in k}
                assert sum(moved.values()) == 0, (dim, moved)
