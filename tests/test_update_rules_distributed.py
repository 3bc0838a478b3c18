"""Every update-rule variant under sharding equals one process: MuonDDPSharding (DDP) and
MuonFSDPSharding (FSDP2) on 2 gloo ranks, in one launch.

The variants are Muon's settings, plus ``algorithm`` (a Muon variant for the hidden matrices:
MuonHyperball, whose whole-matrix norms the owners take under DDP and one all-reduce sums
under FSDP2, its settings given as ``MuonHyperballSettings``) and its own keys. The
coefficient schedules Megatron calls ``cans`` and ``deepseekv4`` run here too, and their
singular-value bands (test_newton_schulz.py) are checked on matrices orthogonalized by an
FSDP2 owner from the rows of two ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from test_newton_schulz import BANDS, with_spectrum
from torch import nn
from torch.testing import assert_close

from lightning_muon import Muon, MuonHyperballSettings, route_parameters
from lightning_muon.algorithms import orthogonalizes
from lightning_muon.distributed.ddp import MuonDDPSharding

pytestmark = [pytest.mark.numerics, pytest.mark.distributed, pytest.mark.policy_free]  # see conftest.py

# ------------------------------------------------------- distributed: equal to one process

DIST_VARIANTS = [
    dict(momentum_form="sum"),
    dict(second_moment="normuon", weight_decay_method="cautious"),
    dict(second_moment="adamuon", sign_momentum=True, nesterov=False),
    dict(ns_method="gram", momentum_form="sum", second_moment="normuon"),
    dict(algorithm="muon_hyperball"),
    dict(algorithm="muon_hyperball", hyperball_radius=3.0, second_moment="normuon", nesterov=False),
    dict(ns_coefficients="cans"),
    dict(ns_coefficients="deepseekv4", ns_steps=10),
]
BAND_SCHEDULES = ("cans", "deepseekv4")
DIST_STEPS, DIST_BATCH = 5, 12


def _split(variant: dict) -> tuple[str, dict, dict]:
    """(the hidden matrices' algorithm, its settings shared with Muon's, that algorithm's own keys)."""
    algorithm = variant.get("algorithm", "muon")
    own = {k: v for k, v in variant.items() if k.startswith("hyperball_")}
    keywords = {k: v for k, v in variant.items() if k != "algorithm" and k not in own}
    return algorithm, keywords, own


def _muon(groups: list, algorithm: str, settings: dict, **adamw) -> Muon:
    """A ``Muon`` whose ``algorithm`` groups start from ``settings``: Muon's keywords for "muon", else that
    algorithm's settings (Muon's keywords set "muon" groups only); ``adamw``: the ``adamw_*`` keywords."""
    if algorithm == "muon":
        return Muon(groups, **settings, **adamw)
    assert algorithm == "muon_hyperball"
    return Muon(groups, settings=[MuonHyperballSettings(**settings)], **adamw)


def _dist_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)
    )


def _dist_train(rank: int, world: int) -> list[dict]:
    """Every variant in turn, MuonDDPSharding (reduce_scatter) when world > 1; params and full states."""
    out = []
    for variant in DIST_VARIANTS:
        model = _dist_model()
        algorithm, keywords, own = _split(variant)
        groups = route_parameters(model, matrix_algorithm=algorithm)
        settings = dict(lr=0.02, weight_decay=0.1, ns_dtype="float32", **keywords, **own)  # own: the defaults
        opt = _muon(groups, algorithm, settings, adamw_lr=1e-2)
        sharding = MuonDDPSharding(opt) if world > 1 else None
        muon_ids = {id(p) for g in opt.param_groups if orthogonalizes(g) for p in g["params"]}
        for step in range(DIST_STEPS):
            gen = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(DIST_BATCH, 8, generator=gen), torch.randn(DIST_BATCH, 4, generator=gen)
            lo, hi = rank * DIST_BATCH // world, (rank + 1) * DIST_BATCH // world
            opt.zero_grad()
            nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
            if sharding is not None:
                for p in model.parameters():  # plain DDP's share: everything but the Muon matrices
                    if id(p) not in muon_ids:
                        torch.distributed.all_reduce(p.grad)
                        p.grad /= world
                sharding.reduce_gradients()
            opt.step()
        muon_params = [p for g in opt.param_groups if orthogonalizes(g) for p in g["params"]]
        states = sharding.gather_states() if sharding is not None else [dict(opt.state[p]) for p in muon_params]
        sums = sharding.stats.calls["matrix_sums"] if sharding is not None else 0
        out.append({"params": [p.detach().clone() for p in model.parameters()], "states": states, "sums": sums})
    return out


# FSDP2: Shard(0) DTensors, whole matrices orthogonalized by owners (MuonFSDPSharding).
FSDP_SHAPES = {"a": (5, 4), "b": (6, 7), "conv": (4, 2, 3, 3), "experts": (3, 4, 5)}


def _fsdp_run(rank: int, world: int) -> list[dict]:
    """Every variant in turn on Shard(0) DTensors (world > 1) or plain tensors; full params and states."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    place = (lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])) if mesh else (lambda t: t.clone())
    full = lambda t: t.full_tensor() if mesh else t
    out = []
    for variant in DIST_VARIANTS:
        gen = torch.Generator().manual_seed(0)
        params = {n: nn.Parameter(place(torch.randn(s, generator=gen))) for n, s in FSDP_SHAPES.items()}
        grads = [{n: torch.randn(s, generator=gen) for n, s in FSDP_SHAPES.items()} for _ in range(4)]
        algorithm, keywords, own = _split(variant)
        groups = [
            {"params": [params[n] for n in ("a", "b", "conv")], "algorithm": algorithm, **own},
            {"params": [params["experts"]], "algorithm": algorithm, "batched": True, **own},
        ]
        opt = _muon(groups, algorithm, dict(lr=0.05, weight_decay=0.1, ns_dtype="float32", **keywords))
        sharding = MuonFSDPSharding(opt) if mesh else None
        for step in range(4):
            for n, p in params.items():
                p.grad = place(grads[step][n])
            opt.step()
        states = {n: {k: full(v) for k, v in opt.state[p].items()} for n, p in params.items()}
        types = {type(v).__name__ for p in params.values() for v in opt.state[p].values()}
        sums = sharding.stats.calls["matrix_sums"] if sharding is not None else 0
        out.append(
            {"params": {n: full(p.detach()) for n, p in params.items()}, "states": states, "types": types, "sums": sums}
        )
    return out


def _band_run(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Per schedule, the whole orthogonalized matrix of a known spectrum (``with_spectrum(seed=1)``),
    its rows spread over the ranks as FSDP2 spreads them, in float64."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon.distributed.fsdp import MuonFSDPSharding
    from lightning_muon.functional import muon_orthogonalize
    from lightning_muon.layout import layout_of

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in BAND_SCHEDULES:
        steps = BANDS[name][0]
        _, _, G = with_spectrum(torch.logspace(-4, 0, 48, dtype=torch.float64), 64, 48, seed=1)
        p = nn.Parameter(distribute_tensor(torch.ones_like(G), mesh, [Shard(0)]))
        opt = Muon([{"params": [p], "ns_coefficients": name, "ns_steps": steps, "ns_dtype": "float64"}])
        group = opt.param_groups[0]
        kwargs = {k: group[k] for k in ("ns_steps", "ns_coefficients", "ns_dtype", "ns_method")}
        layout = layout_of(group)

        def newton_schulz(indices, wholes, layout=layout, kwargs=kwargs):
            return muon_orthogonalize([w[0] for w in wholes], layout=layout, **kwargs, keep_work_dtype=True)

        (pieces,) = MuonFSDPSharding(opt).map_whole(
            [p], [[distribute_tensor(G, mesh, [Shard(0)])]], newton_schulz, layout=layout
        )
        out[name] = pieces[0].full_tensor()
    return out


def _both(rank: int, world: int) -> dict:
    bands = _band_run(rank, world) if world > 1 else {}
    return {"sharded": _dist_train(rank, world), "fsdp": _fsdp_run(rank, world), "bands": bands}


@pytest.fixture(scope="module")
def distributed_runs() -> dict:
    """One spawn of 2 gloo ranks runs every variant under MuonDDPSharding and under FSDP2; one process too."""
    return {"single": _both(0, 1), "ranks": run_distributed(_both, 2)}


def _tolerance(variant: dict) -> float:
    # fp32; the gradient average's summation order differs (~1e-7 relative), which
    # Newton-Schulz keeps near 1e-6 over 5 steps. Gram Newton-Schulz carries R = X X^T
    # between restarts, whose rounding (eps ||X||^2) swamps the near-zero singular values
    # of rank-deficient gradients (batch 12 < 16 rows) that the polynomial then amplifies:
    # perturbing every gradient by 1e-7 relative moved the weights by 0.9-1.4e-6 with the
    # standard iteration and by 2.2-4.2e-6 with Gram (5 seeds, measured).
    # deepseekv4's 10 steps begin with eight of Keller's quintic (slope 3.44 at 0), which grow
    # those near-zero singular values 3.44^8 ~ 2e4 times: the same 1e-7 perturbation moved the
    # weights by 1.7-2.3e-5 (5 seeds, measured), against 0.9-1.6e-6 for cans and polar_express.
    if variant.get("ns_coefficients") == "deepseekv4":
        return 5e-5
    return 5e-6 if variant.get("ns_method") == "gram" else 1e-6


def test_sharded_variants_equal_single_process(distributed_runs):
    """Two gloo ranks with owner-based Newton-Schulz equal one process for every variant; the
    gathered checkpoint state (momentum and second moments, whichever rank owns them) too."""
    single = distributed_runs["single"]["sharded"]
    for v, variant in enumerate(DIST_VARIANTS):
        atol = _tolerance(variant)
        for res in (r["sharded"] for r in distributed_runs["ranks"]):
            for a, b in zip(res[v]["params"], single[v]["params"]):
                assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m, variant=variant: f"{variant}: {m}")
            for got, want in zip(res[v]["states"], single[v]["states"]):
                assert set(got) == set(want), variant
                for key in want:
                    assert_close(got[key], want[key], rtol=1e-5, atol=atol)
        if "second_moment" in variant:
            assert all("second_moment" in s for s in single[v]["states"])
        # DDP owners hold whole matrices: MuonHyperball's norms need no collective there.
        assert all(r["sharded"][v]["sums"] == 0 for r in distributed_runs["ranks"])


def test_fsdp_variants_equal_single_process(distributed_runs):
    """Under FSDP2 every variant's state is a Shard(0) DTensor made from its param (NorMuon's per-row
    buffer, AdaMuon's per-element one) and the steps equal one process."""
    single = distributed_runs["single"]["fsdp"]
    for v, variant in enumerate(DIST_VARIANTS):
        atol = _tolerance(variant)
        for res in (r["fsdp"] for r in distributed_runs["ranks"]):
            assert res[v]["types"] == {"DTensor"}, variant
            for n, want in single[v]["params"].items():
                label = f"{variant} {n}"
                assert_close(
                    res[v]["params"][n], want, rtol=1e-5, atol=atol, msg=lambda m, label=label: f"{label}: {m}"
                )
            for n, state in single[v]["states"].items():
                assert set(res[v]["states"][n]) == set(state)
                for key, want in state.items():
                    assert_close(res[v]["states"][n][key], want, rtol=1e-5, atol=atol)
            # MuonHyperball's norms: one all-reduce per step for the plain group (4 steps); the
            # expert group's norms are per expert, and every rank holds whole experts: none.
            assert res[v]["sums"] == (4 if variant.get("algorithm") == "muon_hyperball" else 0), variant


def test_cans_and_deepseekv4_bands_hold_on_two_ranks(distributed_runs):
    """Each rank's rows went to the owner and came back: the singular values lie in the schedule's band."""
    s = torch.logspace(-4, 0, 48, dtype=torch.float64)
    U, V, _ = with_spectrum(s, 64, 48, seed=1)
    above = s / torch.linalg.vector_norm(s) >= 1e-3
    for name in BAND_SCHEDULES:
        _, floor, lo, hi = BANDS[name]
        assert floor == 1e-3 and 0 < int(above.sum()) < len(s)
        for rank in distributed_runs["ranks"]:
            out = torch.diagonal(U.T @ rank["bands"][name] @ V)  # output singular value per input one
            assert lo <= out[above].min().item() and out[above].max().item() <= hi, name
            assert out.min().item() > 0 and out.max().item() <= hi, name
