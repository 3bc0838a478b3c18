"""Module-level code for the Fabric tests: a plain training loop under ``L.Fabric`` and its workers.

``train(fabric, spec)`` is the loop a Fabric user writes (``fabric.setup``, ``fabric.backward``,
``fabric.no_backward_sync`` for accumulation, ``fabric.clip_gradients``, ``optimizer.step()``,
``fabric.save`` / ``fabric.load``), on one of three models:

- ``"ddp"``: ``ddp_modules.TinyRegressor``, the model of the Trainer's ``muon_ddp`` tests;
- ``"fsdp"``: ``fsdp_modules.Net`` (uneven row shards), as ``FSDPRegressor`` holds it;
- ``"tp"``: ``tp_modules.Net`` on a (data, tensor) mesh, parallelized by ``tp_modules.apply_tp_fsdp``.

Each optimizer step sees one global batch of ``6 * accumulate`` samples drawn from a
generator seeded by the step, so a resumed run sees what an uninterrupted one sees; rank r
of W takes rows r, r + W, ... of each micro-batch (6 divides among 1, 2 and 3 ranks).
``fabric_worker`` runs it on a process ``dist_utils.run_distributed`` started (as torchrun
would: Fabric finds ``LOCAL_RANK`` and takes the processes as given); ``spawn_worker`` is
what ``fabric.launch`` runs under ``muon_ddp_spawn``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

import lightning_muon.functional as functional
from lightning_muon import AdamWSettings, MomentumWarmup, MuonConfig, MuonSettings, ScheduleSettings

MICRO = 6  # samples per micro-batch over all ranks
# fp32 Newton-Schulz: bf16 would turn reduction-order noise into percent-level differences.
CONFIG = MuonConfig(
    matrix=MuonSettings(lr=0.02, weight_decay=0.1, ns_dtype="float32"),
    scalar=AdamWSettings(lr=1e-2),
    schedule=ScheduleSettings(warmup=2, momentum_warmup=MomentumWarmup(steps=3)),
)
IN_FEATURES = {"ddp": 8, "fsdp": 6}
OUT_FEATURES = {"ddp": 4, "fsdp": 3}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "ddp":
        from ddp_modules import TinyRegressor

        return TinyRegressor(CONFIG)
    if kind == "fsdp":
        from fsdp_modules import Net

        return Net()
    from tp_modules import Net

    return Net()


def batch(kind: str, step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of micro-batch ``micro`` of optimizer step ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    if kind == "tp":
        from tp_modules import SEQ, VOCAB

        tokens = torch.randint(VOCAB, (MICRO, SEQ + 1), generator=gen)[rank::world]
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(MICRO, IN_FEATURES[kind], generator=gen)
    y = torch.randn(MICRO, OUT_FEATURES[kind], generator=gen)
    return x[rank::world], y[rank::world]


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if kind == "tp":
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return nn.functional.mse_loss(out, y)


@contextmanager
def orthogonalized() -> Iterator[list[int]]:
    """``[n]``: the matrices ``Muon`` orthogonalizes inside the block, a stacked ``(K, m, n)`` batch counting K.

    Counted where they run: every Muon step hands its matrices to ``functional.orthogonalize_many``.
    """
    count, original = [0], functional.orthogonalize_many

    def counted(matrices: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        count[0] += sum(m.numel() // max(1, m.shape[-2] * m.shape[-1]) for m in matrices)
        return original(matrices, *args, **kwargs)

    functional.orthogonalize_many = counted
    try:
        yield count
    finally:
        functional.orthogonalize_many = original


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (DTensors gathered)."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("_forward_module.").removeprefix("module.")] = value.detach().cpu().clone()
    return out


def train(fabric: L.Fabric, spec: dict[str, Any]) -> dict[str, Any]:
    """The user's loop; returns the final parameters, the sharding's counts and Newton-Schulz matrices run here.

    spec: ``kind``; ``steps`` (the loop runs ``start``..``steps - 1``); ``accumulate``;
    ``clip`` (max norm or None); ``setup``: ``"joint"`` (``fabric.setup(model, optimizer)``) or
    ``"separate"`` (``setup_module`` then ``setup_optimizers``, the optimizer made after it);
    ``save`` / ``save_at``: a path and the step after which to ``fabric.save``; ``load``: a path
    to ``fabric.load`` before the loop; ``no_sync`` (default True): accumulate inside
    ``fabric.no_backward_sync``.
    """
    kind, accumulate = spec["kind"], spec.get("accumulate", 1)
    model = make_model(kind)
    if spec.get("setup", "joint") == "joint":
        optimizer, scheduler = CONFIG.build(model)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer, scheduler = CONFIG.build(model)
        optimizer = fabric.setup_optimizers(optimizer)
    start = 0
    if spec.get("load"):
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
        fabric.load(spec["load"], state)
        start = state["step"]
    rank, world = fabric.global_rank, fabric.world_size
    with orthogonalized() as matrices:
        for step in range(start, spec["steps"]):
            for micro in range(accumulate):
                x, y = fabric.to_device(batch(kind, step, micro, *_data_rank_and_world(fabric)))
                # no_sync=False: every micro-batch's backward synchronizes (plain DDP then all-reduces each).
                with fabric.no_backward_sync(model, enabled=spec.get("no_sync", True) and micro < accumulate - 1):
                    fabric.backward(loss_of(kind, model, x, y) / accumulate)
            if spec.get("clip") is not None:
                fabric.clip_gradients(model, optimizer, max_norm=spec["clip"])
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if spec.get("save") and step + 1 == spec["save_at"]:
                fabric.save(
                    spec["save"], {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step + 1}
                )
    shardings = fabric.strategy.shardings if hasattr(fabric.strategy, "shardings") else []
    return {
        "params": full_params(model),
        **counts(shardings[0] if shardings else None),
        "matrices": matrices[0],
        "muon_matrices": sum(len(g["params"]) for g in optimizer.param_groups if g["algorithm"] == "muon"),
        "mean_rank": float(fabric.all_reduce(torch.tensor(float(rank)), reduce_op="mean")),
        "world": world,
    }


def counts(sharding: Any) -> dict[str, Any]:
    """Bytes and calls per collective of a sharding, by mesh dim (``"all"`` for a 1-D sharding)."""
    if sharding is None:
        return {"bytes": {}, "calls": {}}
    stats = getattr(sharding, "stats_by_dim", None) or {"all": sharding.stats}
    return {
        "bytes": {k: dict(v.bytes) for k, v in stats.items()},
        "calls": {k: dict(v.calls) for k, v in stats.items()},
    }


def trainer_fit(kind: str, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's strategy of the same name on the same model: its sharding's counts after ``spec``'s steps."""
    import lightning.pytorch as pl

    from lightning_muon import MuonDDPStrategy, MuonFSDPStrategy

    accumulate, clip, steps = spec.get("accumulate", 1), spec.get("clip"), spec["steps"]
    root = Path(spec["root"])
    if kind == "ddp":
        from ddp_modules import TinyRegressor

        model, strategy = TinyRegressor(CONFIG, global_batch=MICRO), MuonDDPStrategy()
        kwargs = dict(accelerator="cpu", max_steps=steps, default_root_dir=root, use_distributed_sampler=False)
        kwargs.update(gradient_clip_val=clip, logger=False, enable_progress_bar=False, enable_model_summary=False)
    elif kind == "fsdp":
        from fsdp_modules import FSDPRegressor, trainer_kwargs

        model, strategy = FSDPRegressor(CONFIG, accumulate=accumulate), MuonFSDPStrategy()
        kwargs = trainer_kwargs(root, steps, accumulate, clip, "32-true")
    else:
        from tp_modules import TinyTPTransformer, trainer_kwargs

        model, strategy = TinyTPTransformer(CONFIG), MuonFSDPStrategy(tensor_parallel_size=2)
        kwargs = trainer_kwargs(root, steps, clip)
    kwargs.setdefault("accumulate_grad_batches", accumulate)
    trainer = pl.Trainer(devices=world_size, strategy=strategy, enable_checkpointing=False, **kwargs)
    trainer.fit(model)
    return counts(trainer.strategy.shardings[0])


def _data_rank_and_world(fabric: L.Fabric) -> tuple[int, int]:
    # Tensor-parallel peers see the same batch: data is split by the data-parallel rank only.
    mesh = getattr(fabric.strategy, "_device_mesh", None)
    if mesh is None:
        return fabric.global_rank, fabric.world_size
    return mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].size()


def make_strategy(spec: dict[str, Any]) -> Any:
    """The strategy ``spec["strategy"]`` names: a registry name, or ``("fsdp" | "ddp" | "tp", options)``."""
    from lightning_muon.fabric import MuonDDPStrategy, MuonFSDPStrategy

    strategy = spec.get("strategy", "auto")
    if isinstance(strategy, str):
        return strategy
    which, options = strategy
    if which == "ddp":
        return MuonDDPStrategy(**options)
    if which == "tp":
        from tp_modules import apply_tp_fsdp

        def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
            apply_tp_fsdp(model, mesh)
            return model

        return MuonFSDPStrategy(parallelize_fn=parallelize, **options)
    return MuonFSDPStrategy(**options)


def fabric_worker(rank: int, world_size: int, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of ``specs`` in turn with a new ``L.Fabric`` over this externally started process.

    A spec with ``"trainer": kind`` runs ``trainer_fit`` instead (the Trainer's strategy on the
    same model, for its counts).
    """
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    results = []
    for spec in specs:
        if "trainer" in spec:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results.append(trainer_fit(spec["trainer"], world_size, spec))
            continue
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=make_strategy(spec))
        fabric.launch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Fabric's and DCP's notices on a CPU world
            results.append(train(fabric, spec))
    return results


def spawn_worker(fabric: L.Fabric, spec: dict[str, Any]) -> None:
    """What ``fabric.launch`` runs on every spawned rank; each writes its result to ``spec["out"]``."""
    result = train(fabric, spec)
    torch.save(result, Path(spec["out"]) / f"rank{fabric.global_rank}.pt")


def one_process(spec: dict[str, Any]) -> dict[str, Any]:
    """``train`` in this process on one CPU device, plain ``Muon`` (no sharding): the reference."""
    return train(L.Fabric(accelerator="cpu", devices=1), spec)
