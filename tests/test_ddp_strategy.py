"""MuonDDPStrategy end to end: registered names, same parameters as one process, complete checkpoints.

Every multi-rank fit here is compared with one process that sees the same global batches
(rank-strided loaders, ``use_distributed_sampler=False``); each rank writes its final
parameters to a file. The ranks are forked from the suite's forkserver (``dist_utils``: torch
and Lightning imported once), the strategy made in each (``ddp_modules.fit_worker``); one test
runs the registered ``muon_ddp_spawn``, whose Lightning launcher starts fresh interpreters.
"""

from __future__ import annotations

import pytest
import torch
from ddp_modules import TinyRegressor, fit, fit_worker
from dist_utils import run_distributed
from lightning.pytorch.strategies import StrategyRegistry

from lightning_muon import (
    AdamWSettings,
    MuonConfig,
    MuonDDPStrategy,
    MuonHyperballSettings,
    MuonSettings,
    ScheduleFreeSettings,
    ScheduleSettings,
    StateSettings,
)
from lightning_muon.distributed.planning import plan_ownership

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py

# fp32 Newton-Schulz: bf16 would turn reduction-order noise into percent-level differences.
CONFIG = MuonConfig(matrix=MuonSettings(lr=0.02, weight_decay=0.1, ns_dtype="float32"), scalar=AdamWSettings(lr=1e-2))
# fp32 throughout; only the gradient summation order differs (~1e-7 relative), and
# Newton-Schulz in fp32 keeps it at that level over a few steps.
FP32 = dict(rtol=1e-5, atol=1e-6)


def _fit(tmp_path, strategy, devices: int, steps: int = 6, ckpt_path=None, precision=None, **kwargs) -> None:
    """One fit; each rank writes ``tmp_path/rank<r>.pt``. ``strategy``: ``"auto"`` or ``"muon_ddp_spawn"`` (run here, by
    Lightning's launcher), or a spec (``_spawn``, ``_plain_ddp``) for ranks of ``run_distributed``."""
    trainer = {k: kwargs.pop(k) for k in ("gradient_clip_val", "accumulate_grad_batches") if k in kwargs}
    model = {"muon_config": kwargs.pop("config", CONFIG), **kwargs}
    spec = dict(root=tmp_path, strategy=strategy, steps=steps, ckpt_path=ckpt_path, precision=precision)
    spec.update(model=model, trainer=trainer)
    if isinstance(strategy, tuple):
        run_distributed(fit_worker, devices, spec)
    else:
        fit(spec, devices)


def _ranks(tmp_path, world: int) -> list[dict]:
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _assert_all_equal(results: list[dict], reference: dict, **tol) -> None:
    for rank, result in enumerate(results):
        assert result["params"].keys() == reference["params"].keys()
        for name, ref in reference["params"].items():
            torch.testing.assert_close(
                result["params"][name], ref, **tol, msg=lambda m, name=name, rank=rank: f"rank {rank}, {name}: {m}"
            )


def _spawn(**kwargs) -> tuple[str, dict]:
    """``MuonDDPStrategy(**kwargs)`` on ranks of ``run_distributed``."""
    return ("muon_ddp", kwargs)


def _plain_ddp(**kwargs) -> tuple[str, dict]:
    """Lightning's ``DDPStrategy(**kwargs)`` on ranks of ``run_distributed``."""
    return ("ddp", kwargs)


def test_registered_names():
    assert "muon_ddp" in StrategyRegistry and "muon_ddp_spawn" in StrategyRegistry
    assert StrategyRegistry["muon_ddp_spawn"]["strategy"] is MuonDDPStrategy
    assert StrategyRegistry["muon_ddp_spawn"]["init_params"] == {"start_method": "spawn"}
    with pytest.raises(ValueError, match="muon_mode must be one of"):
        MuonDDPStrategy(muon_mode="bogus")


@pytest.mark.parametrize("clip", [None, 0.05])
def test_two_ranks_equal_one_process_and_save_every_momentum(tmp_path, clip):
    _fit(tmp_path / "one", "auto", 1, gradient_clip_val=clip)
    # Two ranks of batch 4 see the same 8 samples per step as one process of batch 8. The registered name, whose
    # launcher spawns fresh interpreters, runs once; the other ranks fork from the suite's forkserver.
    strategy = "muon_ddp_spawn" if clip is None else _spawn()
    _fit(tmp_path / "two", strategy, 2, gradient_clip_val=clip)
    _assert_all_equal(_ranks(tmp_path / "two", 2), _ranks(tmp_path / "one", 1)[0], **FP32)
    # Rank 0's checkpoint holds the momentum of every matrix, rank 1's too.
    state = torch.load(next((tmp_path / "two").rglob("*.ckpt")), weights_only=True)["optimizer_states"][0]
    muon_indices = [i for g in state["param_groups"] if g["algorithm"] == "muon" for i in g["params"]]
    assert len(muon_indices) == 3
    assert all("momentum_buffer" in state["state"][i] for i in muon_indices)


def test_muon_hyperball_matrices_are_sharded_and_equal_one_process(tmp_path):
    """Hidden matrices on MuonHyperball (the matrix section): sharded as Muon's are; owners take the norms."""
    config = MuonConfig(matrix=MuonHyperballSettings(**CONFIG.matrix.asdict()), scalar=CONFIG.scalar)
    _fit(tmp_path / "one", "auto", 1, config=config, gradient_clip_val=0.05)
    _fit(tmp_path / "two", _spawn(), 2, config=config, gradient_clip_val=0.05)
    ranks = _ranks(tmp_path / "two", 2)
    _assert_all_equal(ranks, _ranks(tmp_path / "one", 1)[0], **FP32)
    # The matrices went through the sharding (to owners and back), not through DDP's all-reduce.
    assert all(r["comm"].get("reduce_scatter", 0) > 0 and r["comm"].get("all_gather", 0) > 0 for r in ranks)
    state = torch.load(next((tmp_path / "two").rglob("*.ckpt")), weights_only=True)["optimizer_states"][0]
    hyperball = [i for g in state["param_groups"] if g["algorithm"] == "muon_hyperball" for i in g["params"]]
    assert len(hyperball) == 3 and all("momentum_buffer" in state["state"][i] for i in hyperball)


def test_three_ranks_one_owning_nothing_with_accumulation_and_clipping(tmp_path):
    # Two Muon matrices on three ranks: ownership is uneven and one rank owns none.
    widths = (32, 16)
    owners = plan_ownership([(32, 8), (16, 32)], 3).owners
    assert len(set(owners)) == 2
    kwargs = dict(widths=widths, global_batch=6, gradient_clip_val=0.05, accumulate_grad_batches=2)
    _fit(tmp_path / "one", "auto", 1, steps=4, **kwargs)
    _fit(tmp_path / "three", _spawn(), 3, steps=4, **kwargs)
    _assert_all_equal(_ranks(tmp_path / "three", 3), _ranks(tmp_path / "one", 1)[0], **FP32)


def _reference(tmp_path, precision, **kwargs) -> dict:
    """What the sharded run must equal: one process in fp32, plain DDP at 2 ranks under AMP.

    Under AMP each rank's weight-gradient GEMM reduces over its own samples and rounds to
    bf16/fp16, one process over all of them: gradients differ at 2^-9, and Newton-Schulz
    turns that into percent-level parameter differences within a few steps. Plain DDP at the
    same world size computes the very same per-rank gradients, so there the only difference
    left is how the two ranks' gradients are summed.
    """
    if precision is None:
        _fit(tmp_path / "one", "auto", 1, precision=precision, **kwargs)
        return _ranks(tmp_path / "one", 1)[0]
    plain = _plain_ddp(find_unused_parameters=kwargs.get("branch", False))
    _fit(tmp_path / "plain", plain, 2, precision=precision, **kwargs)
    return _ranks(tmp_path / "plain", 2)[0]


@pytest.mark.parametrize(("mode", "precision"), [("reduce_scatter", "bf16-mixed"), ("all_gather", None)])
def test_unused_and_frozen_parameters_under_each_mode(tmp_path, mode, precision):
    # A side layer without gradients on odd steps (Muon weight, AdamW bias), a frozen layer.
    kwargs = dict(branch=True, frozen=True)
    reference = _reference(tmp_path, precision, **kwargs)
    _fit(tmp_path / "two", _spawn(muon_mode=mode, find_unused_parameters=True), 2, precision=precision, **kwargs)
    _assert_all_equal(_ranks(tmp_path / "two", 2), reference, **FP32)
    untouched = TinyRegressor(branch=True, frozen=True)
    torch.testing.assert_close(reference["params"]["fixed.weight"], untouched.fixed.weight, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["16-mixed", None])
def test_overflow_on_one_rank_skips_the_step_everywhere(tmp_path, precision):
    # Rank 1 alone overflows at step 2, in a matrix rank 0 owns. With a GradScaler every
    # rank must skip the step and lower the scale; without one, Muon(nonfinite="skip")
    # must skip it on every rank. Either way nothing hangs and the ranks stay equal.
    config = MuonConfig(
        matrix=MuonSettings(lr=0.02, weight_decay=0.1, ns_dtype="float32"),
        scalar=AdamWSettings(lr=1e-2),
        state=StateSettings(nonfinite="skip"),
    )
    # The reference overflows at the same step on every rank it has (plain DDP reduces
    # gradients during backward, so an inf injected after it would stay on one rank).
    kwargs = dict(config=config, inject_inf=(-1, 2))
    reference = _reference(tmp_path, precision, **kwargs)
    _fit(tmp_path / "two", _spawn(), 2, precision=precision, **{**kwargs, "inject_inf": (1, 2)})
    results = _ranks(tmp_path / "two", 2)
    _assert_all_equal(results, reference, **FP32)
    _assert_all_equal(results[1:], results[0], rtol=0, atol=0)
    if precision == "16-mixed":
        assert reference["scale"] == results[0]["scale"] == results[1]["scale"] == 2.0**9  # one skip
    else:
        clean = tmp_path / "clean"
        _fit(clean, "auto", 1, config=config)
        changed = [n for n, p in reference["params"].items() if not torch.equal(p, _ranks(clean, 1)[0]["params"][n])]
        assert changed  # the overflow did change the run: a step was really skipped


@pytest.mark.parametrize("clip", [None, 0.05])
def test_expert_stacks_are_split_by_experts_over_the_ranks(tmp_path, clip):
    """5 experts: each rank steps a block of every stack's experts, not one rank each stack.

    The blocks rotate from stack to stack (``expert_blocks``): rank 0 steps experts 0-2 of the
    first stack and 3-4 of the second, rank 1 the rest.
    """
    _fit(tmp_path / "one", "auto", 1, gradient_clip_val=clip, experts=5)
    _fit(tmp_path / "two", _spawn(), 2, gradient_clip_val=clip, experts=5)
    ranks = _ranks(tmp_path / "two", 2)
    _assert_all_equal(ranks, _ranks(tmp_path / "one", 1)[0], **FP32)
    assert [r["stepped"] for r in ranks] == [
        {"experts.gate_up_proj": (3, 12, 24), "experts.down_proj": (2, 24, 6)},
        {"experts.gate_up_proj": (2, 12, 24), "experts.down_proj": (3, 24, 6)},
    ]
    # The checkpoint holds every expert's momentum, joined from both ranks' parts.
    state = torch.load(next((tmp_path / "two").rglob("*.ckpt")), weights_only=True)["optimizer_states"][0]
    stacks = [i for g in state["param_groups"] if g.get("batched") for i in g["params"]]
    assert len(stacks) == 2
    shapes = sorted(tuple(state["state"][i]["momentum_buffer"].shape) for i in stacks)
    assert shapes == [(5, 12, 24), (5, 24, 6)]


def test_checkpoint_from_two_ranks_resumes_on_one_and_three(tmp_path):
    # The same 6 samples every step, so that resuming (which replays a batch) sees what an
    # uninterrupted run sees (Lightning replays one batch after resuming a fit that stopped at
    # max_steps); 6 divides among 1, 2 and 3 ranks. The model holds dense matrices (owned
    # whole) and a stack of 5 experts (each rank saves its block of experts' state, joined in
    # the checkpoint and split again at 1 and 3 ranks): one run covers both kinds.
    kwargs = dict(global_batch=6, samples=6, experts=5)
    _fit(tmp_path / "full", "auto", 1, steps=6, **kwargs)
    _fit(tmp_path / "two", _spawn(), 2, steps=3, **kwargs)
    ckpt = next((tmp_path / "two").rglob("*.ckpt"))
    _fit(tmp_path / "one", "auto", 1, steps=6, ckpt_path=ckpt, **kwargs)
    _fit(tmp_path / "three", _spawn(), 3, steps=6, ckpt_path=ckpt, **kwargs)
    reference = _ranks(tmp_path / "full", 1)[0]
    _assert_all_equal(_ranks(tmp_path / "one", 1), reference, **FP32)
    _assert_all_equal(_ranks(tmp_path / "three", 3), reference, **FP32)


def test_schedule_free_groups_under_two_ranks_equal_one_process(tmp_path):
    # Head and biases on Schedule-Free AdamW: replicated, stepped on every rank from the
    # all-reduced gradients, like AdamW groups. The epoch-end checkpoint is saved in train
    # mode; it must come out in eval mode with the averaged weights on both strategies.
    config = MuonConfig(matrix=CONFIG.matrix, scalar=ScheduleFreeSettings(lr=1e-2), schedule=ScheduleSettings(warmup=2))
    _fit(tmp_path / "one", "auto", 1, config=config)
    _fit(tmp_path / "two", _spawn(), 2, config=config)
    reference = _ranks(tmp_path / "one", 1)[0]
    _assert_all_equal(_ranks(tmp_path / "two", 2), reference, **FP32)
    one = torch.load(next((tmp_path / "one").rglob("*.ckpt")), weights_only=True)
    two = torch.load(next((tmp_path / "two").rglob("*.ckpt")), weights_only=True)
    groups = two["optimizer_states"][0]["param_groups"]
    schedule_free = [g for g in groups if g["algorithm"] == "adamw_schedulefree"]
    assert [g["name"] for g in schedule_free] == ["adamw_schedulefree_no_decay", "adamw_schedulefree"]
    assert all(not g["train_mode"] and g["k"] == 6 for g in schedule_free)
    for i in (i for g in schedule_free for i in g["params"]):
        torch.testing.assert_close(
            two["optimizer_states"][0]["state"][i]["z"], one["optimizer_states"][0]["state"][i]["z"], **FP32
        )
    # The checkpoints hold the averaged weights: what the fits ended with (up to the rounding
    # of the train()/eval() between the save and the end of the fit).
    for name, value in two["state_dict"].items():
        torch.testing.assert_close(value, reference["params"][name], **FP32)
