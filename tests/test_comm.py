"""Byte-counted collectives on 1, 2 and 3 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from lightning_muon.distributed.comm import CommStats, all_reduce_, all_reduce_bytes, all_to_all_v

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py


def _exchange(rank: int, world: int) -> dict:
    # Rank r sends (r + 1) * (d + 1) elements to rank d, valued 100 r + d; the last rank sends itself nothing.
    send_counts = [0 if (rank == world - 1 and d == rank) else (rank + 1) * (d + 1) for d in range(world)]
    recv_counts = [0 if (s == world - 1 and rank == s) else (s + 1) * (rank + 1) for s in range(world)]
    send = torch.cat([torch.full((n,), 100.0 * rank + d) for d, n in enumerate(send_counts)])
    stats = CommStats()
    recv = all_to_all_v(send, send_counts, recv_counts, stats=stats)
    total = torch.tensor([float(rank + 1)])
    all_reduce_(total, stats=stats)
    return {
        "recv": recv,
        "send_counts": send_counts,
        "recv_counts": recv_counts,
        "bytes": dict(stats.bytes),
        "total": total.item(),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_v_delivers_uneven_pieces_and_counts_bytes(world_size):
    results = run_distributed(_exchange, world_size)
    for rank, res in enumerate(results):
        expected = torch.cat([torch.full((n,), 100.0 * s + rank) for s, n in enumerate(res["recv_counts"])])
        torch.testing.assert_close(res["recv"], expected, rtol=0, atol=0)
        sent_elsewhere = sum(n for d, n in enumerate(res["send_counts"]) if d != rank)
        assert res["bytes"]["all_to_all"] == 4 * sent_elsewhere
        assert res["bytes"]["all_reduce"] == pytest.approx(all_reduce_bytes(1, 4, world_size))
        assert res["total"] == sum(range(1, world_size + 1))


def test_single_process_is_a_copy_without_a_process_group(tmp_path):
    if dist.is_initialized():  # pragma: no cover - the suite never leaves a group behind
        pytest.fail("a process group leaked from another test")
    # world_size 1 needs no group for the shape checks; init one briefly for the call, in
    # this process (a spawned one would only add its start-up).
    dist.init_process_group("gloo", (tmp_path / "rendezvous").as_uri(), rank=0, world_size=1)
    try:
        results = [_exchange(0, 1)]
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(results[0]["recv"], torch.zeros(0))
    assert results[0]["bytes"] == {}


def test_all_reduce_bytes_is_the_ring_cost():
    assert all_reduce_bytes(1000, 4, 1) == 0
    assert all_reduce_bytes(1000, 4, 2) == 4000
    assert all_reduce_bytes(900, 2, 3) == pytest.approx(2 * 2 / 3 * 1800)


def _consult_policy(rank: int, world: int) -> str:
    from lightning_muon.newton_schulz import bf16_matmul_is_fast

    try:
        bf16_matmul_is_fast("cpu")
    except ValueError as err:
        return str(err)
    return "the policy answered"


def test_a_policy_free_module_trips_on_the_policy_here_and_in_its_ranks():
    """The guard of ``policy_free`` modules (conftest.py): consulting the bf16 policy raises, in ranks too."""
    from lightning_muon.newton_schulz import FAST_BF16_ENV, resolve_ns_dtype

    with pytest.raises(ValueError, match=FAST_BF16_ENV):
        resolve_ns_dtype(None, "cpu", torch.float32)
    assert resolve_ns_dtype("float32", "cpu", torch.float32) == torch.float32  # a pinned dtype asks nothing
    assert all(FAST_BF16_ENV in answer for answer in run_distributed(_consult_policy, 2))
