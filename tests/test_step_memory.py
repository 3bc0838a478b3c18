"""The step's memory cap (``step_memory_mb``): rounds that fit it, the same bits as without it, the peak it bounds."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from param_sets import gpt_parameters
from step_memory_modules import ddp_worker, fsdp_worker
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_muon import Muon, MuonConfig, MuonHyperballSettings, StateSettings
from lightning_muon.algorithms import HparamError
from lightning_muon.algorithms.muon import matrix_working_bytes
from lightning_muon.layout import MatrixLayout
from lightning_muon.step_memory import AUTO_STEP_MEMORY_MB, plan_rounds, step_memory_bytes

pytestmark = [pytest.mark.policy_free]  # every dtype pinned: runs alike under either bf16 policy

MiB = 2**20


# ---------------------------------------------------------------- the setting


def test_the_setting_resolves_per_device_and_refuses_bad_values():
    assert step_memory_bytes("auto", "cpu") == AUTO_STEP_MEMORY_MB["cpu"] * MiB
    assert step_memory_bytes("auto", "cuda") == AUTO_STEP_MEMORY_MB["cuda"] * MiB
    assert step_memory_bytes(None, "cpu") is None and step_memory_bytes(1.5, "cpu") == int(1.5 * MiB)
    assert (
        MuonConfig().state.step_memory_mb == "auto"
        and MuonConfig(state=StateSettings(step_memory_mb=None)).state.step_memory_mb is None
    )
    assert Muon([torch.nn.Parameter(torch.ones(2, 2))], step_memory_mb=8).state_settings.step_memory_mb == 8.0
    for bad in (0, -1, float("inf"), "big", True):
        with pytest.raises(HparamError, match="step_memory_mb must be 'auto', None"):
            Muon([torch.nn.Parameter(torch.ones(2, 2))], step_memory_mb=bad)


# ---------------------------------------------------------------- the rounds


def test_rounds_fit_the_cap_per_owner_and_never_leave_a_matrix_of_a_stacked_kind_alone():
    kinds = [("a",)] * 7 + [("b",)] * 3 + [("c",)]
    costs = [10] * 7 + [25] * 3 + [100]
    rounds = plan_rounds(costs, kinds, cap=30)
    assert sorted(i for r in rounds for i in r) == list(range(11))
    for r in rounds:
        assert sum(costs[i] for i in r) <= 30 or len({kinds[i] for i in r}) == 1  # over the cap: one unit
        for kind in {kinds[i] for i in r}:
            assert sum(kinds[i] == kind for i in r) >= 2 or kinds.count(kind) == 1  # company where it exists
    # The "b"s (25 each) go two and one: the one joins the two, over the cap, rather than run alone.
    assert [i for r in rounds for i in r if kinds[i] == ("b",)] == [7, 8, 9]
    assert plan_rounds(costs, kinds, cap=None) == [list(range(11))]
    # With owners, each owner's load is what counts: a round holds a unit of two per owner,
    # and a matrix that every rank orthogonalizes in part (owner None) loads each by its share.
    owners = [0, 1] * 4 + [None]
    costs, kinds = [10] * 9, [("a",)] * 8 + [("e",)]
    rounds = plan_rounds(costs, kinds, cap=20, owners=owners, world_size=2)
    assert len(rounds) == 3 and sorted(i for r in rounds for i in r) == list(range(9))
    for r in rounds:
        for owner in (0, 1):
            assert sum(10 for i in r if owners[i] == owner) + sum(5 for i in r if owners[i] is None) <= 20
    assert plan_rounds(costs, kinds, 20, owners, 2) == rounds  # deterministic


# ---------------------------------------------------------------- the same bits


def _run(d: int, layers: int, cap, ns_dtype: str, hooked: bool = False) -> list[torch.Tensor]:
    hidden, other = gpt_parameters(d, layers, torch.device("cpu"))
    groups = [
        {"params": hidden[0::4], "algorithm": "muon", "second_moment": "normuon"},  # qkv: NorMuon
        {"params": hidden[1::4], "algorithm": "muon_hyperball"},  # projections on their spheres
        {"params": hidden[2::4] + hidden[3::4], "algorithm": "muon", "weight_decay_method": "cautious"},
        {"params": other, "algorithm": "adamw"},
    ]
    shared = dict(lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)  # Muon's keywords set "muon" groups only
    opt = Muon(groups, **shared, settings=[MuonHyperballSettings(**shared)], step_memory_mb=cap)
    seen = []
    if hooked:
        opt.register_update_hook(lambda group, params, updates, ortho: seen.extend(o.clone() for p in ortho for o in p))
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p in hidden + other:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in hidden + other] + sorted(seen, key=lambda t: (t.shape, float(t.sum())))


@pytest.mark.parametrize(("d", "layers", "ns_dtype"), [(64, 2, "float32"), (64, 2, "bfloat16"), (224, 1, "bfloat16")])
def test_a_capped_step_equals_the_unbounded_one_bit_for_bit(d, layers, ns_dtype):
    """d=64: every matrix stacks; d=224 in bf16: qkv runs alone, fc1 and fc2 share a stack (CPU half precision)."""
    unbounded = _run(d, layers, None, ns_dtype)
    for cap in (1e-6, 0.3) if d == 64 else (1e-6,):  # one unit per round, a few
        assert all(torch.equal(a, b) for a, b in zip(_run(d, layers, cap, ns_dtype), unbounded, strict=True)), cap
    # With an update hook (no donated temporaries): the hook sees the same results too.
    hooked = _run(64, 2, None, ns_dtype, hooked=True)
    assert all(torch.equal(a, b) for a, b in zip(_run(64, 2, 1e-6, ns_dtype, hooked=True), hooked, strict=True))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("worker", [fsdp_worker, ddp_worker], ids=["muon_fsdp", "muon_ddp"])
def test_under_each_sharding_the_cap_changes_no_bit_and_no_byte(worker):
    caps = [None, 1e-6, 0.05]
    for rank_result in run_distributed(worker, 2, caps, "float32"):
        unbounded = rank_result["None"]
        for cap in caps[1:]:
            capped = rank_result[str(cap)]
            for name, value in unbounded["params"].items():
                assert torch.equal(capped["params"][name], value), (cap, name)
            assert capped["bytes"] == unbounded["bytes"], cap  # rounds cut the exchange, not its size


# ---------------------------------------------------------------- the peak


def _transient(d: int, layers: int, cap) -> tuple[int, int, int]:
    """(transient bytes of a steady-state step, params bytes, largest matrix's working bytes), by MemTracker."""
    hidden, _ = gpt_parameters(d, layers, torch.device("cpu"))
    opt = Muon([{"params": hidden, "algorithm": "muon"}], ns_dtype="float32", step_memory_mb=cap, nonfinite="ignore")
    opt.step()  # the momentum exists from here on
    tracker = MemTracker()
    tracker.track_external(*hidden, opt)
    with tracker:
        opt.step()
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = snapshot[next(iter(snapshot))]["Total"]
    size = sum(p.numel() * 4 for p in hidden)
    largest = max(matrix_working_bytes(p.shape, MatrixLayout(), torch.float32, torch.float32) for p in hidden)
    return peak - 3 * size, size, largest  # params, grads and momentum: one size each


def test_the_cap_bounds_the_step_peak_on_a_model_many_times_larger():
    """The transient stays under max(cap, two of the largest matrix's working sets) whatever the model's size."""
    cap = 1.25
    transient, size, largest = _transient(96, 12, cap)
    assert size >= 4 * cap * MiB  # the model's matrices: 5.3 MiB, 4.2x the cap
    # The rounds' estimate is what the step holds (measured: the cap to the byte), plus the
    # norms and scalars of a round's matrices: a few bytes each, 64 KiB allowed.
    assert transient <= max(cap * MiB, 2 * largest) + 64 * 1024, (transient / MiB, largest / MiB)
    unbounded, _, _ = _transient(96, 12, None)
    assert unbounded > 2 * cap * MiB  # without the cap, the step holds every update at once
