"""Muon under tensor parallelism: MuonFSDPStrategy on a 2 x 2 (data x tensor) mesh, 4 gloo processes.

One 4-process launch runs every 2 x 2 scenario in turn (each Trainer.fit is a few seconds;
starting processes is the expensive part): ``duplicated`` and ``distributed`` against one
process with gradient clipping and the spectra callback, ``blockwise`` and how far it
lands, NorMuon/AdaMuon second moments, a resume of the 2 x 2 checkpoint on a 4 x 1 mesh,
``QKClip`` (each tensor-parallel rank records its own heads' maxima), with and without
``cap_forward``, MuonHyperball (whole-matrix norms summed over every rank's block), and
Lightning's own ``ModelParallelStrategy`` failing to clip the same model (its norms of
parameters on the 1-D and the 2-D mesh cannot be concatenated). A second,
1-process launch resumes the checkpoint on 1 x 1.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_distributed
from tp_modules import TinyTPTransformer, reference_fit, tp_fit_worker

from lightning_muon import Muon, MuonConfig, MuonFSDPStrategy, MuonSettings, Rule
from lightning_muon.distributed.tensor_parallel import MuonTPSharding
from lightning_muon.distributed.tp_math import tp_bytes

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py

# fp32 Newton-Schulz throughout. The ranks sum gradients, Gram matrices and norms in another
# order than one process: a few ulps per step. Measured at most 3e-7 (duplicated, distributed)
# and 1.4e-6 (second moments) after 3-4 steps; a wrong block, shard offset, owner or lr
# scale moves parameters by 1e-3 or more.
FP32 = dict(rtol=1e-5, atol=2e-6)
STEPS, SAVED_AT, CLIP, SPECTRA_EVERY = 4, 2, 0.5, 3
# QK-clip threshold: the tiny model's max logits start at 0.55-1.40, so over 4 steps heads of
# both tensor-parallel halves (0-1 and 2-3) of both layers go over it (11 clips; measured).
TAU = 1.0
QK_CLIP = dict(threshold=TAU)
QK_CAP = dict(threshold=TAU, cap_forward=True)
SECOND_MOMENTS = dict(
    tp_mode="distributed",  # from the matrix settings: the strategy leaves tp_mode=None
    rules=[
        Rule(name="normuon", algorithm="muon", names="*fc*", min_ndim=2, options={"second_moment": "normuon_rms"}),
        Rule(
            name="adamuon", algorithm="muon", names="*attn.[qv]*", min_ndim=2, options={"second_moment": "adamuon_rms"}
        ),
    ],
)
# MuonHyperball on the hidden matrices: its norms span blocks split on both mesh dims and a
# matrix on the 1-D data mesh (held alike by both tensor-parallel ranks, counted once).
HYPERBALL = dict(hyperball=True, tp_mode="distributed")


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    saved = root / "dup" / "ckpt" / f"epoch={SAVED_AT - 1}-step={SAVED_AT}.ckpt"
    fit = dict(max_steps=STEPS, clip=CLIP)
    runs = [
        dict(root=root / "dup", tp_mode="duplicated", save_every=SAVED_AT, spectra=SPECTRA_EVERY, **fit),
        dict(root=root / "dist", config={"tp_mode": "distributed"}, spectra=SPECTRA_EVERY, **fit),
        dict(root=root / "block", tp_mode="blockwise", **fit),
        dict(root=root / "moments", max_steps=3, config=SECOND_MOMENTS),
        dict(root=root / "resume4x1", tp=1, ckpt_path=saved, **fit),
        dict(root=root / "qk", qk_clip=QK_CLIP, **fit),
        dict(root=root / "qk_cap", qk_clip=QK_CAP, **fit),
        dict(root=root / "hyperball", max_steps=3, config=HYPERBALL),
        dict(root=root / "plain", plain=True, max_steps=3, clip=CLIP),  # last: its error ends the fit mid-step
    ]
    ranks = run_distributed(tp_fit_worker, 4, runs)
    one = run_distributed(tp_fit_worker, 1, [dict(root=root / "resume1x1", tp=1, ckpt_path=saved, **fit)])
    reference = reference_fit(root / "ref", STEPS, clip=CLIP, spectra=SPECTRA_EVERY)
    moments = reference_fit(root / "ref_moments", 3, **SECOND_MOMENTS)
    # cap_forward: each data-parallel rank caps its forward by its own half of the batch's
    # maxima, as one process does for two accumulated micro-batches (the same halves).
    qk = {
        "qk": reference_fit(root / "ref_qk", STEPS, clip=CLIP, qk_clip=QK_CLIP),
        "qk_cap": reference_fit(root / "ref_qk_cap", STEPS, clip=CLIP, qk_clip=QK_CAP, micro_batches=2),
    }
    hyperball = reference_fit(root / "ref_hyperball", 3, **HYPERBALL)
    return ranks, one[0][0], reference, moments, qk, hyperball


def _close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **FP32, msg=lambda m, n=name: f"{n}: {m}")


MUON = [f"net.blocks.{b}.{m}.weight" for b in (0, 1) for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "fc1", "fc2")]
MUON.append("net.mix.weight")


@pytest.mark.slow
def test_exact_modes_equal_one_process(launch):
    ranks, _, reference, _, _, _ = launch
    dup, dist = ranks[0][0], ranks[0][1]
    assert dup["tp_mode"] == "duplicated" and dist["tp_mode"] == "distributed"
    # The layout the sharding meets: Colwise, Rowwise, a Muon matrix and norms on the 1-D mesh.
    placements = dup["placements"]
    assert placements["net.blocks.0.attn.q.weight"] == (2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    assert placements["net.blocks.0.fc2.weight"] == (2, "(Shard(dim=0), Shard(dim=1))")
    assert placements["net.blocks.0.fc2.bias"] == (2, "(Shard(dim=0), Replicate())")
    assert placements["net.mix.weight"] == placements["net.blocks.0.ln1.weight"] == (1, "(Shard(dim=0),)")
    for rank in ranks:
        for run in rank[:2]:
            assert run["global_step"] == STEPS
            _close(run["params"], reference["params"])  # with gradient clipping by the global norm
            assert run["calls"]["world"]["clip_norm"] == STEPS


@pytest.mark.slow
def test_bytes_per_mesh_dim_follow_the_formulas(launch):
    ranks, _, _, _, _, _ = launch
    T = D = 2
    shapes = {n: p.shape for n, p in TinyTPTransformer().named_parameters() if n in MUON}
    split = {n: 0 if any(k in n for k in ("attn.q", "attn.k", "attn.v", "fc1")) else 1 for n in MUON}
    tp_split = [n for n in MUON if n != "net.mix.weight"]
    for index, mode in ((0, "duplicated"), (1, "distributed")):
        total = {dim: sum(sum(r[index]["bytes"][dim].values()) for r in ranks) for dim in ("data_parallel",)}
        # Data dim: every non-owner sends its rows each way; the 1-D mesh matrix once per TP column.
        dp = sum((D - 1) / D * math.prod(shapes[n]) * 4 * (1 if n in tp_split else T) for n in MUON)
        assert total["data_parallel"] == pytest.approx(2 * STEPS * dp)
        # Tensor dim, each of the T ranks of the owning group (spectra gathers apart: only on observed steps).
        tp = sum(tp_bytes(*shapes[n], 5, T, mode, split[n], 4) for n in tp_split)
        sent = sum(r[index]["bytes"]["tensor_parallel"].get(k, 0) for r in ranks for k in ("tp_gram", "tp_resplit"))
        if mode == "duplicated":
            sent = sum(r[index]["bytes"]["tensor_parallel"]["tp_gather"] for r in ranks)
        assert sent == pytest.approx(STEPS * T * tp)


@pytest.mark.slow
def test_blockwise_differs(launch):
    ranks, _, reference, _, _, _ = launch
    block = ranks[0][2]
    assert block["bytes"]["tensor_parallel"] == {}
    start = {n: p.detach() for n, p in TinyTPTransformer().named_parameters()}
    # How far blockwise lands from Muon, relative to how far Muon moved the weights in 4 steps
    # (Frobenius norms over the Muon matrices). Measured: 0.65 (exact modes: 1e-7). The 1-D mesh
    # matrix is whole on its owner, but the blocks' error reaches it through the forward pass.
    moved = sum((reference["params"][n] - start[n]).square().sum() for n in MUON).sqrt()
    apart = sum((block["params"][n] - reference["params"][n]).square().sum() for n in MUON).sqrt()
    print(f"blockwise vs Muon after {STEPS} steps: {float(apart / moved):.3f} of the distance moved")
    assert 0.05 < float(apart / moved) < 1.0


@pytest.mark.slow
def test_second_moments_under_tp(launch):
    ranks, _, _, moments, _, _ = launch
    assert ranks[0][3]["tp_mode"] == "distributed"
    _close(ranks[0][3]["params"], moments["params"])


@pytest.mark.slow
def test_spectra_measured_once_each_on_one_rank(launch):
    ranks, _, reference, _, _, _ = launch
    for index in (0, 1):  # duplicated holds whole matrices; distributed gathers them for the observer
        for name in MUON:
            measured = [r[index]["measured"].get(name, 0) for r in ranks]
            assert sorted(measured) == [0, 0, 0, 2], (name, measured)  # steps 0 and 3, one rank
        ours, theirs = ranks[0][index]["spectra"], reference["spectra"]
        assert ours.keys() == theirs.keys() and len(ours) > len(MUON)
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_hyperball_under_tp(launch):
    ranks, _, _, _, _, hyperball = launch
    for rank in ranks:
        run = rank[7]
        assert run["tp_mode"] == "distributed" and run["global_step"] == 3
        _close(run["params"], hyperball["params"])
        # One all-reduce of the norms' sums per Muon group and step, over the world.
        assert run["calls"]["world"]["matrix_sums"] == 3
    # On their spheres: every matrix's norm shrank by the same factor, the decay's (1 - lr_t wd) per step.
    start = {n: p.detach() for n, p in TinyTPTransformer().named_parameters()}
    ratios = [float(ranks[0][7]["params"][n].norm() / start[n].norm()) for n in MUON]
    assert max(ratios) < 1.0 and max(ratios) - min(ratios) < 1e-5, ratios


@pytest.mark.slow
def test_checkpoint_resumes_on_other_meshes(launch):
    ranks, one, reference, _, _, _ = launch
    for resumed in (ranks[0][4], one):  # 4 x 1, then 1 x 1
        assert resumed["global_step"] == STEPS
        _close(resumed["params"], ranks[0][0]["params"])
        _close(resumed["params"], reference["params"])


@pytest.mark.slow
def test_plain_model_parallel_strategy_cannot_clip(launch):
    ranks, _, _, _, _, _ = launch
    # torch 2.13: the per-parameter norms live on the 1-D and the 2-D mesh and cannot be joined
    # (torch's clip_grad_norm_ stacks them). Without clipping the same strategy trains: Muon
    # attaches MuonTPSharding at its first step (tests/test_expert_parallel.py).
    for rank in ranks:
        error = rank[-1]["error"]
        assert "Sharding propagation failed" in error and ("cross mesh" in error or "same mesh" in error), error


@pytest.mark.slow
@pytest.mark.parametrize(("index", "key"), [(5, "qk"), (6, "qk_cap")])
def test_qk_clip_clips_each_tensor_parallel_ranks_heads_as_one_process(launch, index, key):
    # Each TP rank runs (and records the maxima of) its own 2 of the 4 query heads; the
    # callback places them at its heads' offset and MAX-reduces over all 4 ranks, so every
    # rank sees the (4,) maxima of one process and scales the rows of its own heads.
    ranks, _, _, _, qk, _ = launch
    expected = qk[key]
    for rank, result in enumerate(ranks):
        run = result[index]
        assert run["global_step"] == STEPS
        maxima = torch.stack(run["qk_clip"]["maxima"])  # (steps, layers, heads), after the all-reduce
        assert maxima.shape == (STEPS, 2, 4), maxima.shape
        over = maxima > TAU
        # Heads of both TP halves (0-1 on TP rank 0, 2-3 on TP rank 1) are clipped in each layer.
        assert over[:, :, :2].any(dim=(0, 2)).all() and over[:, :, 2:].any(dim=(0, 2)).all(), (rank, maxima)
        assert run["qk_clip"]["clipped"] == int(over.sum()) == expected["qk_clip"]["clipped"] > 0
        # Under tau a recorded value may be a norm bound (unlogged steps) of this rank's heads
        # or of all heads; over it, both are exact maxima.
        # Where the callback puts a rank's 2 maxima: at its TP coordinate's heads.
        placement = run["head_placement"]
        tp_rank = placement["tp_rank"]
        assert tp_rank == rank % 2  # the (data, tensor) mesh is row-major
        placed = torch.full((4,), -math.inf)
        placed[2 * tp_rank : 2 * tp_rank + 2] = torch.tensor([1.0, 2.0])
        assert torch.equal(placement["placed"], placed), placement
        rows = f"its rows {8 * tp_rank}..{8 * tp_rank + 7} of 16: not 1 whole heads"
        assert rows in placement["error"], placement["error"]
        reference = torch.stack(expected["qk_clip"]["maxima"])
        torch.testing.assert_close(maxima.clamp(min=TAU), reference.clamp(min=TAU), **FP32)
        _close(run["params"], expected["params"])
        apart = max(float((run["params"][n] - p).abs().max()) for n, p in expected["params"].items())
        print(f"{key} rank {rank}: {run['qk_clip']['clipped']} clips, parameters within {apart:.1e} of one process")


def test_arguments():
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        MuonFSDPStrategy(tensor_parallel_size=2, tp_mode="exact")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        MuonFSDPStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="choose tp_mode instead"):
        MuonFSDPStrategy(tensor_parallel_size=2, muon_mode="blockwise")
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        MuonConfig(matrix=MuonSettings(tp_mode="exact"))
    plain = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        MuonTPSharding(Muon(plain.parameters()), tp_mode="exact")
    with pytest.raises(ValueError, match="plain tensor of shape \\(3, 4\\)"):
        MuonTPSharding(Muon(plain.parameters()))
