"""``muon_ddp`` and ``muon_fsdp`` under Lightning Fabric: exact Muon in a plain training loop.

Every multi-rank run is compared with the same loop on one process (plain ``Muon``, no
sharding) over the same global batches, in fp32 Newton-Schulz, and its bytes per collective
with the Trainer's strategy of the same name on the same model, run in the same processes.
Newton-Schulz is counted where it runs (``fabric_modules.orthogonalized``): each Muon
matrix once per step over the data-parallel ranks.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from dist_utils import run_distributed
from fabric_modules import fabric_worker, one_process, spawn_worker
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

from lightning_muon import Muon, checkpoints
from lightning_muon import MuonDDPStrategy as TrainerDDP
from lightning_muon.fabric import MuonDDPStrategy, MuonFSDPStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py

# fp32 throughout; only the order of sums differs (gradients averaged across ranks, a
# batched Newton-Schulz matmul against a single one): a few ulps per step. Measured at most
# 7e-7 after 4 steps; a wrong owner, shard or lr moves parameters by 1e-3 or more.
FP32 = dict(rtol=1e-5, atol=2e-6)
STEPS = 4


def _assert_params_equal(result: dict, reference: dict, where: str) -> None:
    assert result["params"].keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, **FP32, msg=lambda m, n=name: f"{where}, {n}: {m}")


def _assert_split_once(per_rank: list[int], reference: int) -> None:
    """Each matrix orthogonalized once per step: the ranks' counts add up to one process's, none does it all."""
    assert sum(per_rank) == reference
    assert all(0 < n < reference for n in per_rank), per_rank


def test_names_and_options_in_fabric():
    assert STRATEGY_REGISTRY["muon_ddp"]["strategy"] is MuonDDPStrategy
    assert STRATEGY_REGISTRY["muon_ddp_spawn"]["init_params"] == {"start_method": "spawn"}
    assert STRATEGY_REGISTRY["muon_fsdp"]["strategy"] is MuonFSDPStrategy
    assert isinstance(L.Fabric(accelerator="cpu", devices=2, strategy="muon_ddp").strategy, MuonDDPStrategy)
    assert isinstance(L.Fabric(accelerator="cpu", devices=2, strategy="muon_fsdp").strategy, MuonFSDPStrategy)
    strategy = MuonDDPStrategy(muon_mode="all_gather", owner_group_size=2, overlap=False, bucket_cap_mb=4)
    assert (strategy.muon.muon_mode, strategy.muon.owner_group_size, strategy.muon.overlap) == ("all_gather", 2, False)
    # The same checks as the Trainer's strategies (one implementation).
    for bad, match in (
        (dict(muon_mode="bogus"), "muon_mode must be one of"),
        (dict(owner_group_size=0), "owner_group_size must be a positive int"),
        (dict(overlap="yes"), "overlap must be True or False"),
    ):
        for cls in (MuonDDPStrategy, TrainerDDP):
            with pytest.raises(ValueError, match=match):
                cls(**bad)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs a parallelize_fn"):
        MuonFSDPStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="muon_mode must be one of"):
        MuonFSDPStrategy(muon_mode="exact")


def _specs(kind: str, strategy, root, **extra) -> list[dict]:
    base = dict(kind=kind, steps=STEPS, strategy=strategy, root=str(root), **extra)
    return [base, dict(base, setup="separate"), dict(base, trainer=kind)]


@pytest.mark.slow
def test_muon_ddp_two_ranks_equal_one_process_with_accumulation_and_clipping(tmp_path):
    # fabric.setup(model, optimizer), then setup_module + setup_optimizers (the DDP wrapper
    # rebuilt with the Muon matrices ignored), then the Trainer's muon_ddp on the same model.
    # Then without overlap, accumulating outside no_backward_sync (each backward synchronizes,
    # as plain DDP allows: the Muon gradients are reduced once, at the step), and all_gather mode.
    kwargs = dict(accumulate=2, clip=0.05)
    reference = one_process(dict(kind="ddp", steps=STEPS, **kwargs))
    specs = _specs("ddp", "muon_ddp", tmp_path, **kwargs)
    specs += [
        dict(specs[0], strategy=("ddp", dict(overlap=False)), no_sync=False),
        dict(specs[0], strategy=("ddp", dict(muon_mode="all_gather"))),
    ]
    ranks = run_distributed(fabric_worker, 2, specs)
    for rank, (joint, separate, trainer, no_overlap, all_gather) in enumerate(ranks):
        _assert_params_equal(no_overlap, reference, f"rank {rank}, overlap=False, no no_backward_sync")
        _assert_params_equal(all_gather, reference, f"rank {rank}, all_gather")
        assert all_gather["bytes"]["all"].keys() == {"all_gather", "nonfinite_flag"}  # DDP reduces the rest
        _assert_params_equal(joint, reference, f"rank {rank}, fabric.setup")
        _assert_params_equal(separate, reference, f"rank {rank}, setup_module + setup_optimizers")
        assert joint["bytes"] == separate["bytes"] == trainer["bytes"]
        assert joint["calls"] == trainer["calls"]
        assert set(joint["bytes"]["all"]) == {"reduce_scatter", "all_gather", "nonfinite_flag", "clip_norm"}
        assert joint["mean_rank"] == 0.5  # fabric.all_reduce
    _assert_split_once([r[0]["matrices"] for r in ranks], reference["matrices"])
    assert reference["matrices"] == 3 * STEPS  # three Muon matrices, the head on AdamW


@pytest.mark.slow
def test_muon_ddp_spawn_through_fabric_launch(tmp_path):
    # Fabric starts the processes itself: fabric.launch(fn) under "muon_ddp_spawn".
    spec = dict(kind="ddp", steps=2, clip=0.05, out=str(tmp_path))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="muon_ddp_spawn")
    fabric.launch(spawn_worker, spec)
    reference = one_process(spec)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, result in enumerate(ranks):
        _assert_params_equal(result, reference, f"rank {rank}")
    _assert_split_once([r["matrices"] for r in ranks], reference["matrices"])


@pytest.mark.slow
def test_muon_fsdp_two_ranks_equal_one_process_with_accumulation_and_clipping(tmp_path):
    # Uneven row shards (5 and 2 rows); the default sharding makes each block a unit, then the root.
    kwargs = dict(accumulate=2, clip=0.05, setup="separate")
    reference = one_process(dict(kind="fsdp", steps=STEPS, **kwargs))
    specs = _specs("fsdp", "muon_fsdp", tmp_path, **kwargs)[1:]  # FSDP2: the optimizer after setup_module
    ranks = run_distributed(fabric_worker, 2, specs)
    for rank, (fabric_run, trainer) in enumerate(ranks):
        _assert_params_equal(fabric_run, reference, f"rank {rank}")
        assert fabric_run["bytes"] == trainer["bytes"]
        assert fabric_run["calls"] == trainer["calls"]
        assert set(fabric_run["bytes"]["all"]) == {"to_owner", "from_owner", "step_check"}
    _assert_split_once([r[0]["matrices"] for r in ranks], reference["matrices"])


@pytest.mark.slow
def test_2x2_mesh_equals_one_process(tmp_path):
    # tensor_parallel_size=2: the user's parallelize_fn (colwise/rowwise, then fully_shard).
    strategy = ("tp", dict(data_parallel_size=2, tensor_parallel_size=2))
    kwargs = dict(clip=0.05, setup="separate")
    reference = one_process(dict(kind="tp", steps=STEPS, **kwargs))
    ranks = run_distributed(fabric_worker, 4, _specs("tp", strategy, tmp_path, **kwargs)[1:])
    for rank, (fabric_run, trainer) in enumerate(ranks):
        _assert_params_equal(fabric_run, reference, f"rank {rank}")
        assert fabric_run["bytes"] == trainer["bytes"]  # per mesh dim: data, tensor and world
        assert fabric_run["calls"] == trainer["calls"]
        assert fabric_run["calls"]["world"]["clip_norm"] == STEPS  # one all-reduce per global norm
    # "duplicated": the owner's tensor-parallel peers both run Newton-Schulz on the whole
    # matrix; over the data-parallel ranks (tensor rank 0: global ranks 0 and 2) each matrix once.
    _assert_split_once([ranks[0][0]["matrices"], ranks[2][0]["matrices"]], reference["matrices"])


@pytest.mark.slow
def test_checkpoint_saved_at_two_ranks_resumes_exactly_at_one_and_three(tmp_path):
    # fabric.save after 3 of 6 steps at 2 ranks; fabric.load at 1 and 3 ranks continues as an
    # uninterrupted run. muon_ddp writes one full file (every momentum, from its owner);
    # muon_fsdp a distributed checkpoint folder, resharded on load.
    full = {kind: one_process(dict(kind=kind, steps=6, setup="separate")) for kind in ("ddp", "fsdp")}
    ckpt = {"ddp": str(tmp_path / "ddp.ckpt"), "fsdp": str(tmp_path / "fsdp")}
    run_distributed(
        fabric_worker,
        2,
        [
            dict(kind=k, steps=3, setup="separate", strategy=f"muon_{k}", save=ckpt[k], save_at=3)
            for k in ("ddp", "fsdp")
        ],
    )
    resumed = {k: dict(kind=k, steps=6, setup="separate", load=ckpt[k]) for k in ("ddp", "fsdp")}
    # One process: a plain single-device Fabric reads the full file; muon_fsdp on one rank reads the folder.
    _assert_params_equal(one_process(resumed["ddp"]), full["ddp"], "ddp, 1 process")
    (one,) = run_distributed(fabric_worker, 1, [dict(resumed["fsdp"], strategy="muon_fsdp")])
    _assert_params_equal(one[0], full["fsdp"], "fsdp, 1 rank")
    three = run_distributed(fabric_worker, 3, [dict(resumed[k], strategy=f"muon_{k}") for k in ("ddp", "fsdp")])
    for rank, (ddp, fsdp) in enumerate(three):
        _assert_params_equal(ddp, full["ddp"], f"ddp, rank {rank} of 3")
        _assert_params_equal(fsdp, full["fsdp"], f"fsdp, rank {rank} of 3")


@pytest.mark.slow
def test_muon_fsdp_resumes_one_file_checkpoints_at_one_and_two_ranks(tmp_path):
    # One file keys the optimizer state by position, as Muon numbers its parameters (group by
    # group): fabric.save under muon_ddp at 2 ranks and on one device, and convert-checkpoint
    # of a muon_fsdp folder. muon_fsdp at 1 and 2 ranks loads each after step 3 of 6 and
    # continues as an uninterrupted run; Fabric's own loading read the positions in the
    # module's parameter order ("The size of tensor a (12) must match the size of tensor b (2)").
    base = dict(kind="fsdp", setup="separate")
    files = {k: tmp_path / f"{k}.ckpt" for k in ("muon_ddp", "auto", "converted")}
    full = one_process(dict(base, steps=6, save=str(files["auto"]), save_at=3))
    folder = tmp_path / "muon_fsdp"
    run_distributed(
        fabric_worker,
        2,
        [
            dict(base, steps=3, strategy="muon_ddp", save=str(files["muon_ddp"]), save_at=3),
            dict(base, steps=3, strategy="muon_fsdp", save=str(folder), save_at=3),
        ],
    )
    assert checkpoints.main([str(folder), str(files["converted"])]) == 0
    for name, path in files.items():
        saved = torch.load(path, weights_only=False)
        assert saved["step"] == 3 and all(isinstance(k, int) for k in saved["optimizer"]["state"]), name
    specs = [dict(base, steps=6, strategy="muon_fsdp", load=str(path)) for path in files.values()]
    for world in (1, 2):
        for rank, results in enumerate(run_distributed(fabric_worker, world, specs)):
            for name, result in zip(files, results):
                _assert_params_equal(result, full, f"{name} file, rank {rank} of {world}")


# ---------------------------------------------------------------- bad input


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))


def _fabric(strategy) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()  # a world of one in this process; conftest tears the group down
    return fabric


def test_muon_ddp_refuses_a_plain_optimizer_and_foreign_parameters():
    fabric = _fabric("muon_ddp")
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(TypeError, match=r"optimizer 0 is a torch\.optim\.adamw\.AdamW, not a lightning_muon\.Muon"):
        fabric.setup(model, torch.optim.AdamW(model.parameters()))
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"param group 0 \('muon'\), parameter 0 of shape \(8, 4\) is not a parameter"):
        fabric.setup(model, Muon(other.parameters()))
    with pytest.raises(ValueError, match="set up the model before its optimizer"):
        fabric.setup_optimizers(Muon(model.parameters()))  # no model was set up (both setups above failed)


def test_overlap_asks_for_no_backward_sync_when_accumulating():
    # With overlap, a synchronizing backward sends the Muon gradients at once: a second one
    # before the step would add to values already sent. It says what to do instead.
    fabric = _fabric("muon_ddp")
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, optimizer = fabric.setup(model, Muon(model.parameters()))
    fabric.backward(model(torch.randn(3, 4)).sum())
    with pytest.raises(RuntimeError, match=r"fabric\.no_backward_sync\(model\).*overlap=False"):
        fabric.backward(model(torch.randn(3, 4)).sum())


def test_muon_fsdp_refuses_a_model_not_sharded_the_supported_way():
    from torch.distributed.fsdp import fully_shard

    # The optimizer made before the model was sharded holds the replaced plain parameters.
    fabric = _fabric("muon_fsdp")
    model = _net()
    with pytest.raises(ValueError, match=r"FSDP2 replaced the model's parameters by DTensors"):
        fabric.setup(model, Muon(model.parameters()))
    # A parallelize_fn that shards nothing.
    with pytest.raises(ValueError, match="returned a model without FSDP2-sharded parameters"):
        _fabric(MuonFSDPStrategy(parallelize_fn=lambda m, mesh: m)).setup_module(_net())

    # One that shards a block only: the other Muon matrices stay plain tensors.
    def block_only(m, mesh):
        fully_shard(m[2], mesh=mesh["data_parallel"])
        return m

    fabric = _fabric(MuonFSDPStrategy(parallelize_fn=block_only))
    model = fabric.setup_module(_net())
    with pytest.raises(ValueError, match=r"holds a plain tensor of shape \(8, 4\).*apply fully_shard"):
        fabric.setup_optimizers(Muon(model.parameters()))
    with pytest.raises(TypeError, match="not a lightning_muon.Muon"):
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
