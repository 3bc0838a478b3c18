"""``global_grad_norm``: the norm of every gradient when each rank holds a part, as one process computes it."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from grad_norm_modules import NORM_TYPES, gradients, norm_worker

from lightning_muon.distributed.grad_norm import clip_by_total_norm_, global_grad_norm

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py


def _full_norm(p: float) -> float:
    return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in gradients().values()]), ord=p))


def test_one_process_matches_torch_and_clips_like_it():
    grads = list(gradients().values())
    for p in NORM_TYPES:
        total = global_grad_norm([(g, 1) for g in grads], p, device=torch.device("cpu"))
        torch.testing.assert_close(float(total), _full_norm(p), rtol=1e-6, atol=0)
    mine = [g.clone() for g in grads]
    theirs = [g.clone().requires_grad_() for g in grads]
    for t, g in zip(theirs, grads):
        t.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.5)
    total = clip_by_total_norm_(mine, global_grad_norm([(g, 1) for g in mine], device=torch.device("cpu")), 1.5)
    torch.testing.assert_close(total, expected)
    for m, t in zip(mine, theirs):
        torch.testing.assert_close(m, t.grad)


def test_bad_norm_type_and_nonfinite_norm_raise():
    with pytest.raises(ValueError, match="norm_type must be a positive number or inf, got -1.0"):
        global_grad_norm([(torch.ones(2), 1)], -1, device=torch.device("cpu"))
    nan = torch.tensor([float("nan"), 1.0])
    total = global_grad_norm([(nan, 1)], device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="order 2.0 for gradients is non-finite"):
        clip_by_total_norm_([nan], total, 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("world", [2, 3])
def test_pieces_across_ranks_give_the_whole_norm(world):
    # Row shards (one copy each), a matrix on one rank only, a vector on every rank: each value once.
    for result in run_distributed(norm_worker, world):
        for p in NORM_TYPES:
            assert result[p] == pytest.approx(_full_norm(p), rel=1e-6), (world, p)
