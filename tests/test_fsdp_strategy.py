"""MuonFSDPStrategy and MuonFSDPSharding: exact Muon under FSDP2 on CPU with gloo.

Multi-process runs (about 10-30 s each on 2 busy cores): the sharding at 2 and 3 ranks,
a 2-rank fit that saves distributed checkpoints, its resumption at 1 and at 3 ranks and on
one device under ``strategy="auto"`` (converted to one file), a bf16-mixed 2-rank fit of a
module that shards itself, and configs/muon_fsdp.yaml.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from dist_utils import run_distributed
from fsdp_modules import (
    CONFIG,
    SHAPES,
    STEPS,
    WIDTH,
    FSDPRegressor,
    fit_worker,
    gpt2_fit,
    gpt2_fit_worker,
    reference_run,
    sharding_worker,
    trainer_kwargs,
)
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_muon import Muon, MuonFSDPStrategy
from lightning_muon.checkpoints import DistributedCheckpointError
from lightning_muon.cli import main as cli_main
from lightning_muon.distributed.fsdp import MuonFSDPSharding, shard_rows
from lightning_muon.strategies.fsdp import default_fully_shard

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py

ROOT = Path(__file__).resolve().parents[1]

# Exact mode against one process, fp32 throughout: the owner runs the same float32
# operations on the same numbers, except where the order of a sum differs (a batched
# Newton-Schulz matmul against a single one, a norm reduced across ranks, gradients
# averaged across ranks): a few ulps (~1e-7) per step. Measured at most 5e-7 after 4-5
# steps; a wrong matrix, shard offset or lr scale moves parameters by 1e-3 or more.
FP32 = dict(rtol=1e-5, atol=2e-6)


def test_registered_name_and_bad_arguments():
    assert StrategyRegistry["muon_fsdp"]["strategy"] is MuonFSDPStrategy
    with pytest.raises(ValueError, match="muon_mode must be one of"):
        MuonFSDPStrategy(muon_mode="bogus")
    plain = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="mode must be one of"):
        MuonFSDPSharding(Muon(plain.parameters()), mode="exact")
    with pytest.raises(ValueError, match="plain tensor of shape \\(3, 4\\)"):
        MuonFSDPSharding(Muon(plain.parameters()))
    split = Muon([{"params": [plain.weight], "algorithm": "muon", "split_sizes": [1, 2]}])
    with pytest.raises(ValueError, match="split_sizes"):
        MuonFSDPSharding(split)
    # 16-mixed is rejected, as an instance (by Lightning) and by name (by us); bf16-mixed works.
    with pytest.raises(ValueError, match="does not support"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=MuonFSDPStrategy(), precision="16-mixed")
    strategy = MuonFSDPStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu")
    with pytest.raises(ValueError, match="does not support precision='16-mixed'"):
        strategy._configure_launcher()


def test_default_sharding_needs_parameters_in_children():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.body = nn.Linear(3, 3)

    with pytest.raises(ValueError, match=re.escape("holds parameters directly (['scale'])")):
        default_fully_shard(Holder(), mesh=None)


@pytest.mark.parametrize(
    ("rows", "world", "expected"),
    [(5, 3, [2, 2, 1]), (5, 2, [3, 2]), (2, 3, [1, 1, 0]), (4, 3, [2, 2, 0]), (0, 2, [0, 0])],
)
def test_shard_rows_follow_torch_chunk(rows, world, expected):
    assert shard_rows(rows, world) == expected
    chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
    assert shard_rows(rows, world) == chunks + [0] * (world - len(chunks))


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.fixture(scope="module")
def reference_bf16():
    return reference_run("bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharding_equals_one_process(reference, reference_bf16, world):
    ranks = run_distributed(sharding_worker, world)
    exact, blockwise = ranks[0]["owner"], ranks[0]["blockwise"]
    # Uneven and empty shards really occur (5 rows: 3, 2 or 2, 2, 1; 2 rows on 3 ranks: 1, 1, 0).
    assert [r["owner"]["local_rows"]["a"] for r in ranks] == shard_rows(5, world)
    assert [r["owner"]["local_rows"]["b"] for r in ranks] == shard_rows(2, world)
    assert exact["momentum_type"] == "DTensor"  # state sharded like its parameter
    for name, expected in reference["params"].items():
        torch.testing.assert_close(exact["params"][name], expected, **FP32, msg=lambda m, n=name: f"{n}: {m}")
    # bf16 on the wire loses nothing when Newton-Schulz runs in bf16: it casts its input to
    # bf16 first and returns bf16 values. The owner computes on the numbers one process
    # computes on, so the results agree as closely as in fp32 (measured: bit for bit, but
    # for the second moment's norm reduced across ranks, 1e-7).
    for name, expected in reference_bf16["params"].items():
        torch.testing.assert_close(ranks[0]["owner_bf16"]["params"][name], expected, **FP32)
    # Blockwise orthogonalizes row blocks: not Muon wherever a matrix spans several ranks ...
    spread = [n for n, (shape, kind) in SHAPES.items() if kind in ("plain", "lone") and n != "unused"]
    for name in spread:
        assert (blockwise["params"][name] - reference["params"][name]).abs().max() > 1e-3, name
    # ... but exact for a batch of experts split between ranks by whole experts.
    torch.testing.assert_close(blockwise["params"]["experts"], reference["params"]["experts"], **FP32)

    # Every rank sends its rows of the others' matrices, then the owners send the rows back:
    # counted in fp32 bytes (Newton-Schulz runs in fp32 here, so the wire does too). A batch
    # of experts is sharded by whole experts: each rank orthogonalizes its own and sends nothing.
    owners = exact["owners"]
    local = {n for n, (_, kind) in SHAPES.items() if kind in ("batched", "gate_up", "oss_gate_up", "hb_experts")}
    for rank, result in enumerate(ranks):
        to_owner = from_owner = 0
        for name, owner in owners.items():
            if name == "unused" or name in local:
                continue
            shape = SHAPES[name][0]
            rows, row_numel = shard_rows(shape[0], world), math.prod(shape[1:])
            if owner != rank:
                to_owner += rows[rank] * row_numel
            else:
                from_owner += (shape[0] - rows[rank]) * row_numel
        assert result["owner"]["bytes"]["to_owner"] == STEPS * 4 * to_owner
        assert result["owner"]["bytes"].get("from_owner", 0) == STEPS * 4 * from_owner
        # With bf16 Newton-Schulz the shards travel in bf16: half the bytes.
        assert result["owner_bf16"]["bytes"]["to_owner"] == STEPS * 2 * to_owner
        assert result["owner_bf16"]["bytes"].get("from_owner", 0) == STEPS * 2 * from_owner
        assert set(result["blockwise"]["bytes"]) == {"step_check"}  # no Newton-Schulz traffic

    # The observer sees each whole matrix once per step, on its owner, as one process does.
    # Expert batches, orthogonalized where their experts live, are not observed (a warning says so).
    seen = [entry for r in ranks for entry in r["owner"]["observed"]]
    assert sorted(e[0] for e in seen) == sorted(e[0] for e in reference["observed"] if e[0] not in local)
    for rank, result in enumerate(ranks):
        assert {e[0] for e in result["owner"]["observed"]} == {
            n for n, r in owners.items() if r == rank and n != "unused" and n not in local
        }
    for name in {e[0] for e in seen}:
        ours = [e for e in seen if e[0] == name]
        theirs = [e for e in reference["observed"] if e[0] == name]
        for (_, kind, update, ortho), (_, _, ref_update, ref_ortho) in zip(ours, theirs, strict=True):
            assert kind == "Tensor"  # full plain tensors, not shards
            torch.testing.assert_close(update, ref_update, **FP32)
            if name != "normed":  # under FSDP the observer sees O before the second-moment rescale
                torch.testing.assert_close(ortho, ref_ortho, **FP32)
    assert ranks[0]["blockwise"]["observed"] == []
    assert any("blockwise mode never holds a whole matrix" in w for w in ranks[0]["blockwise"]["warnings"])

    # The loader's zero-gradient, lr = 0 step changes no parameter and leaves zero momenta.
    for result in ranks:
        for mode in ("owner", "blockwise"):
            assert result[mode]["zero_step_changed"] == []
            assert result[mode]["zero_step_momenta"] == sum(len(shape) >= 2 for shape, _ in SHAPES.values())
            assert result[mode]["zero_step_momentum_max"] == 0.0

    # A NaN on rank 0 only: every rank skips, or raises; ranks that disagree on which
    # matrices have gradients raise too. None waits forever in a collective.
    for rank, result in enumerate(ranks):
        failures = result["failures"]
        assert failures["skip"].startswith("stepped, unchanged=True"), failures["skip"]
        assert "step was skipped" in failures["skip"]
        expected = "parameter 3 of shape (6, 7)" if rank == 0 else "non-finite gradient on another rank"
        assert failures["raise"].startswith("FloatingPointError") and expected in failures["raise"], failures
        assert failures["disagree"].startswith("RuntimeError") and "disagree" in failures["disagree"], failures


def _reference_fit(
    root, world: int, accumulate: int, clip: float, precision: str, steps: int, experts: bool = True
) -> dict:
    """One process, plain tensors: ``world * accumulate`` micro-batches per step, as the ranks cut them."""
    model = FSDPRegressor(CONFIG, accumulate=world * accumulate, experts=experts)
    trainer = pl.Trainer(
        devices=1,
        enable_checkpointing=False,
        **trainer_kwargs(root, steps, world * accumulate, clip, precision),
    )
    trainer.fit(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_params_close(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


STEPS_FIT, SAVED_AT = 5, 2


@pytest.fixture(scope="module")
def two_rank_fit(tmp_path_factory):
    """A 2-rank fit with clipping and accumulation that saves a distributed checkpoint at step 2."""
    root = tmp_path_factory.mktemp("fsdp_fit")
    spec = dict(root=root, max_steps=STEPS_FIT, accumulate=2, clip=0.3, precision="32-true", save_every=SAVED_AT)
    ranks = run_distributed(fit_worker, 2, spec)
    reference = _reference_fit(root / "one", 2, 2, 0.3, "32-true", STEPS_FIT)
    return root, ranks, reference


@pytest.mark.slow
def test_fit_two_ranks_equals_one_process(two_rank_fit):
    root, ranks, reference = two_rank_fit
    assert [r["global_step"] for r in ranks] == [STEPS_FIT, STEPS_FIT]
    # No configure_model: the default sharding made each block a unit, then the root child.
    assert ranks[0]["default_units"] == ["net.blocks.0", "net.blocks.1", "net"]
    assert ranks[0]["fsdp_units"] == ["net", "net.blocks.0", "net.blocks.1"]
    assert {"to_owner", "from_owner"} <= set(ranks[0]["bytes"])
    # The expert stacks route per expert (gate and up apart) and the router to AdamW.
    assert ranks[0]["groups"]["muon_experts_gate_up"] == ["net.experts.gate_up_proj"]
    assert ranks[0]["groups"]["muon_experts"] == ["net.experts.down_proj"]
    assert "net.router.weight" in ranks[0]["groups"]["adamw"]
    _assert_params_close(ranks[0]["params"], reference, **FP32)
    # A distributed checkpoint: a folder with one shard file per rank.
    saved = root / "ckpt" / f"epoch={SAVED_AT - 1}-step={SAVED_AT}.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_another_world_size_continues_exactly(two_rank_fit, world):
    root, ranks, reference = two_rank_fit
    saved = root / "ckpt" / f"epoch={SAVED_AT - 1}-step={SAVED_AT}.ckpt"
    spec = dict(
        root=root / f"resumed{world}", max_steps=STEPS_FIT, accumulate=2, clip=0.3, precision="32-true", ckpt_path=saved
    )
    resumed = run_distributed(fit_worker, world, spec)
    assert resumed[0]["global_step"] == STEPS_FIT
    # One finiteness agreement per step resumed (counted at 3 ranks); loading made the state without a step
    # (torch's zero-gradient, lr = 0 call runs ``Algorithm.init_state``), so it agrees on nothing.
    if world > 1:
        assert resumed[0]["bytes"]["step_check"] == (STEPS_FIT - SAVED_AT) * 3 * 8 * 2 * (world - 1) / world
    # Same samples every step (FSDPRegressor), so only optimizer and scheduler state carry over.
    _assert_params_close(resumed[0]["params"], ranks[0]["params"], **FP32)
    _assert_params_close(resumed[0]["params"], reference, **FP32)


def _fit_one_device(root: Path, ckpt_path: Path) -> tuple[pl.Trainer, FSDPRegressor]:
    """The resumed fit on one device under ``strategy="auto"``: 2 micro-batches per step, as at world 1."""
    model = FSDPRegressor(CONFIG, accumulate=2)
    trainer = pl.Trainer(devices=1, enable_checkpointing=False, **trainer_kwargs(root, STEPS_FIT, 2, 0.3, "32-true"))
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.slow
def test_the_folder_under_auto_names_muon_fsdp_and_converted_resumes_exactly(two_rank_fit, tmp_path, capsys):
    # The 2-rank checkpoint on one device, both ways: strategy="muon_fsdp" with devices=1 reads
    # the folder (test_resume_at_another_world_size_continues_exactly[1]); strategy="auto" refuses
    # it, naming the ways out, and resumes the file convert-checkpoint makes of it.
    root, ranks, reference = two_rank_fit
    saved = root / "ckpt" / f"epoch={SAVED_AT - 1}-step={SAVED_AT}.ckpt"
    with pytest.raises(DistributedCheckpointError, match=r'strategy="muon_fsdp".*lightning_muon convert-checkpoint'):
        _fit_one_device(tmp_path / "refused", saved)
    converted = tmp_path / "step2.ckpt"
    assert cli_main(["convert-checkpoint", str(saved), str(converted)]) is None
    assert capsys.readouterr().out.startswith(f"{converted}: global_step {SAVED_AT}, 19 tensors, 1 optimizer(s)")
    # A plain torch.load reads a Lightning checkpoint as a single-device run saves it.
    checkpoint = torch.load(converted, weights_only=True)
    expected = {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "epoch", "hyper_parameters"}
    assert expected <= checkpoint.keys() and checkpoint["global_step"] == SAVED_AT
    assert all(type(t) is torch.Tensor for t in checkpoint["state_dict"].values())  # whole tensors, no DTensors
    (optimizer,) = checkpoint["optimizer_states"]
    # Keyed by position over the groups, as Muon.state_dict() keys it on one device.
    positions = [i for group in optimizer["param_groups"] for i in group["params"]]
    assert positions == list(range(19)) and set(optimizer["state"]) == set(positions)
    names = [name for group in optimizer["param_groups"] for name in group["param_names"]]
    assert optimizer["state"][names.index("net.blocks.0.up.weight")]["momentum_buffer"].shape == (5, WIDTH)
    trainer, model = _fit_one_device(tmp_path / "resumed", converted)
    assert trainer.global_step == STEPS_FIT
    resumed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _assert_params_close(resumed, ranks[0]["params"], **FP32)
    _assert_params_close(resumed, reference, **FP32)


@pytest.mark.slow
def test_bf16_mixed_module_that_shards_itself(tmp_path):
    # Without the experts: this is about a module sharding itself, under bf16 autocast.
    spec = dict(
        root=tmp_path, max_steps=STEPS_FIT, accumulate=2, clip=0.3, precision="bf16-mixed", shard_itself=True,
        experts=False,
    )  # fmt: skip
    ranks = run_distributed(fit_worker, 2, spec)
    assert ranks[0]["default_units"] == []  # configure_model's sharding was kept
    assert ranks[0]["fsdp_units"] == ["net", "net.blocks.0", "net.blocks.1"]
    reference = _reference_fit(tmp_path / "one", 2, 2, 0.3, "bf16-mixed", STEPS_FIT, experts=False)
    # Each micro-batch runs on the same samples in both runs, and the loss scales (1/2, 1/4)
    # are powers of two, so the first step's gradients agree to fp32 rounding. From then on
    # weights differing in the last fp32 bits round to different bf16 values now and then
    # (autocast: 8-bit mantissas, relative steps of 2^-8), which moves a gradient entry by
    # ~0.4%. Measured at most 1.7e-4 after 5 steps; every update moves a weight by ~5e-3.
    _assert_params_close(ranks[0]["params"], reference, rtol=0.0, atol=1e-3)


@pytest.mark.slow
def test_gpt2_with_split_qkv_trains_under_muon_fsdp_and_equals_one_process(tmp_path):
    """c_attn (Conv1D, (fan_in, fan_out)) split into Q, K and V columns: the owner holds it whole."""
    ranks = run_distributed(gpt2_fit_worker, 2, tmp_path / "two", 3)
    reference = gpt2_fit(tmp_path / "one", 3)
    assert ranks[0]["groups"]["muon_qkv_transposed"] == ((32, 32, 32), True)
    # The K part of c_attn's bias cancels in the softmax: its gradient is rounding noise
    # (~1e-9), which AdamW normalizes into +-lr steps of either sign. Compared apart from it.
    got, expected = dict(ranks[0]["params"]), dict(reference["params"])
    for layer in (0, 1):
        name = f"model.transformer.h.{layer}.attn.c_attn.bias"
        keep = torch.ones(96, dtype=torch.bool)
        keep[32:64] = False
        got[name], expected[name] = got[name][keep], expected[name][keep]
    _assert_params_close(got, expected, **FP32)
