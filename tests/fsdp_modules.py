"""Module-level code for the MuonFSDPStrategy tests: spawned gloo workers import it by name.

Two kinds of worker:

- ``sharding_worker``: ``Muon`` + ``MuonFSDPSharding`` on hand-made ``Shard(0)`` DTensors
  (uneven rows, an empty shard, a batched tensor, a conv kernel, an unused matrix), against
  the same steps on one process with plain tensors.
- ``fit_worker``: a whole ``Trainer.fit`` with ``MuonFSDPStrategy`` on a process that
  ``dist_utils.run_distributed`` started (as torchrun would: Lightning finds ``LOCAL_RANK``
  and takes the processes as given); it returns the full parameters after the fit.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_muon import (
    AdamWSettings,
    MomentumWarmup,
    Muon,
    MuonConfig,
    MuonHyperballSettings,
    MuonModuleMixin,
    MuonSettings,
    RoutingSettings,
    ScheduleSettings,
)

# ---------------------------------------------------------------- the sharding on its own

# name -> (shape, group). 5 rows on 3 ranks are 2, 2, 1 and on 2 ranks 3, 2; 2 rows on 3
# ranks leave rank 2 an empty shard, as do 4 rows (2, 2, 0).
SHAPES: dict[str, tuple[tuple[int, ...], str]] = {
    "a": ((5, 4), "plain"),
    "b": ((2, 6), "plain"),
    "c": ((4, 3), "plain"),
    "d": ((6, 7), "plain"),
    "conv": ((4, 2, 3, 3), "plain"),
    "unused": ((3, 3), "plain"),  # never gets a gradient
    "experts": ((3, 4, 5), "batched"),
    "qkv_t": ((5, 12), "split_t"),  # GPT-2's c_attn with split_qkv: (fan_in, fan_out), q | k | v columns
    "gate_up": ((3, 8, 5), "gate_up"),  # Mixtral's experts: (E, [gate | up], in), NorMuon per expert
    "oss_gate_up": ((3, 5, 8), "oss_gate_up"),  # GPT-OSS's: (E, in, out), gate and up interleaved
    "hb_experts": ((3, 6, 4), "hb_experts"),  # muon_hyperball: every expert on its own sphere
    "lone": ((7, 5), "lone"),  # its own group: one owner, the other ranks own nothing in that call
    "normed": ((6, 5), "normuon"),
    "bias": ((5,), "adamw"),
}
STEPS = 4


def _full_tensors() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(shape, generator=gen) for n, (shape, _) in SHAPES.items()}
    grads = [{n: torch.randn(shape, generator=gen) for n, (shape, _) in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def _groups(params: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    def pick(kind: str) -> list[torch.Tensor]:
        return [params[n] for n, (_, k) in SHAPES.items() if k == kind]

    return [
        {"params": pick("plain"), "algorithm": "muon", "name": "plain"},
        {"params": pick("batched"), "algorithm": "muon", "name": "batched", "batched": True},
        {"params": pick("split_t"), "algorithm": "muon", "name": "split_t", "transposed": True, "split_parts": 3},
        {
            "params": pick("gate_up"),
            "algorithm": "muon",
            "name": "gate_up",
            "batched": True,
            "split_parts": 2,
            "second_moment": "normuon",
        },
        {
            "params": pick("oss_gate_up"),
            "algorithm": "muon",
            "name": "oss_gate_up",
            "batched": True,
            "transposed": True,
            "split_sizes": [1, 1],
            "weight_decay_method": "cautious",
        },
        {"params": pick("hb_experts"), "algorithm": "muon_hyperball", "name": "hb_experts", "batched": True},
        # spectral_norm scales by sqrt(rows / cols): a shard's row count would give another lr.
        {"params": pick("lone"), "algorithm": "muon", "name": "lone", "adjust_lr": "spectral_norm"},
        {
            "params": pick("normuon"),
            "algorithm": "muon",
            "name": "normuon",
            "second_moment": "normuon",
            "weight_decay_method": "cautious",
        },
        {"params": pick("adamw"), "algorithm": "adamw", "name": "adamw"},
    ]


def _optimizer(params: dict[str, torch.Tensor], ns_dtype: str = "float32") -> Muon:
    # fp32 Newton-Schulz unless asked: the comparison is against one process, and bf16 would
    # amplify the ulp differences of another reduction order into percent-level ones.
    hyperball = MuonHyperballSettings(lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype)
    return Muon(_groups(params), lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype, adamw_lr=0.01, settings=[hyperball])


def _record(log: list, names: dict[int, str]):
    def observer(group, params, updates, ortho) -> None:
        for p, u, pieces in zip(params, updates, ortho):
            log.append((names[id(p)], type(u).__name__, u.clone(), [o.clone() for o in pieces]))

    return observer


def reference_run(ns_dtype: str = "float32") -> dict[str, Any]:
    """The steps on one process with plain tensors: final parameters and what the observer saw."""
    full, grads = _full_tensors()
    params = {n: t.clone() for n, t in full.items()}
    opt = _optimizer(params, ns_dtype)
    log: list = []
    opt.register_update_hook(_record(log, {id(p): n for n, p in params.items()}))
    for step in range(STEPS):
        for n, p in params.items():
            p.grad = None if n == "unused" else grads[step][n].clone()
        opt.step()
    return {"params": params, "observed": log}


def sharding_worker(rank: int, world_size: int) -> dict[str, Any]:
    """The same steps with every tensor a ``Shard(0)`` DTensor, in both modes, then the failure paths."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {mode: _sharded_run(mesh, mode) for mode in ("owner", "blockwise")}
    out["owner_bf16"] = _sharded_run(mesh, "owner", "bfloat16")
    out["failures"] = _failures(mesh)
    return out


def _shard(mesh, t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t.clone(), mesh, [Shard(0)])


def _sharded_run(mesh, mode: str, ns_dtype: str = "float32") -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    full, grads = _full_tensors()
    params = {n: nn.Parameter(_shard(mesh, t)) for n, t in full.items()}
    opt = _optimizer(params, ns_dtype)
    sharding = MuonFSDPSharding(opt, mode=mode)
    log: list = []
    opt.register_update_hook(_record(log, {id(p): n for n, p in params.items()}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for n, p in params.items():
                p.grad = None if n == "unused" else _shard(mesh, grads[step][n])
            opt.step()
    out = {
        "params": {n: p.full_tensor() for n, p in params.items()},
        "local_rows": {n: p.to_local().shape[0] for n, p in params.items()},
        "momentum_type": type(opt.state[params["a"]]["momentum_buffer"]).__name__,
        "observed": log,
        "warnings": [str(w.message) for w in caught],
        "bytes": dict(sharding.stats.bytes),
        "owners": {n: sharding.plan.owners[i] for i, n in enumerate(n for n, p in params.items() if p.ndim >= 2)},
    }
    # What a distributed checkpoint's loader does to a fresh optimizer: one step with zero
    # gradients at lr = 0 (torch.distributed.checkpoint.state_dict._init_optim_state).
    opt.zero_grad(set_to_none=True)  # as after loading: no gradients, else the step is not run
    before = {n: p.full_tensor() for n, p in params.items()}
    fresh = _optimizer(params, ns_dtype)
    MuonFSDPSharding(fresh, mode=mode)
    get_optimizer_state_dict(nn.ParameterDict(params), fresh)
    out["zero_step_changed"] = [n for n, p in params.items() if not torch.equal(p.full_tensor(), before[n])]
    out["zero_step_momenta"] = sum("momentum_buffer" in s for s in fresh.state.values())
    out["zero_step_momentum_max"] = max(
        float(s["momentum_buffer"].full_tensor().abs().max()) for s in fresh.state.values() if "momentum_buffer" in s
    )
    return out


def _failures(mesh) -> dict[str, str]:
    """What each rank does when only rank 0 sees a NaN, or only rank 0 lacks a gradient: never a hang."""
    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    rank = mesh.get_local_rank()
    full, grads = _full_tensors()
    params = {n: nn.Parameter(_shard(mesh, t)) for n, t in full.items()}
    out = {}
    for case in ("skip", "raise", "disagree"):
        opt = Muon(_groups(params), ns_dtype="float32", nonfinite="skip" if case == "skip" else "raise")
        MuonFSDPSharding(opt)
        for n, p in params.items():
            p.grad = _shard(mesh, grads[0][n])
        if case == "disagree" and rank == 0:
            params["a"].grad = None
        elif rank == 0:
            params["d"].grad.to_local()[0, 0] = float("nan")  # rank 0 holds row 0 of every matrix
        before = {n: p.full_tensor() for n, p in params.items()}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            unchanged = all(torch.equal(p.full_tensor(), before[n]) for n, p in params.items())
            out[case] = f"stepped, unchanged={unchanged}, warned={[str(w.message) for w in caught]}"
        except (FloatingPointError, RuntimeError) as err:
            out[case] = f"{type(err).__name__}: {err}"
    return out


# ---------------------------------------------------------------- Trainer fits

WIDTH = 12
SAMPLES = 12  # per optimizer step: divisible by every world size x accumulation tried (1..3 x 1..2)


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Experts(nn.Module):
    """Mixture-of-experts stacks in transformers 5's layout: ``gate_up_proj`` ``(E, 2I, W)`` (gate rows,
    then up rows) and ``down_proj`` ``(E, W, I)``; every sample goes to every expert, weighted."""

    def __init__(self, width: int, inter: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, width) / math.sqrt(width))
        self.down_proj = nn.Parameter(torch.randn(experts, width, inter) / math.sqrt(inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("nw,eow->neo", x, self.gate_up_proj).chunk(2, dim=-1)  # (N, E, I) each
        y = torch.einsum("nei,ewi->new", nn.functional.silu(gate) * up, self.down_proj)  # (N, E, W)
        return (y * weights.unsqueeze(-1)).sum(1)


class Net(nn.Module):
    """Blocks of Linear layers with uneven row counts (5 and 2 rows on 2 and 3 ranks), and 3 experts
    (whole experts per rank: 2 and 1 on 2 ranks, 1 each on 3)."""

    def __init__(self, experts: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH, 5), Block(WIDTH, 2)])
        if experts:
            self.router = nn.Linear(WIDTH, 3, bias=False)
            self.experts = Experts(WIDTH, 4, 3)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if hasattr(self, "experts"):
            h = h + self.experts(h, self.router(h).softmax(-1))
        return self.head(h)


class FSDPRegressor(MuonModuleMixin, pl.LightningModule):
    """A small regressor whose every optimizer step sees the same ``SAMPLES`` samples.

    Identical batches make a resumed run replay nothing that matters (Lightning replays one
    batch after resuming a fit that stopped at max_steps).
    The step's samples are cut into ``world_size * accumulate`` micro-batches in a fixed
    order; rank ``r`` takes micro-batches ``m * world_size + r``, so one process with
    ``accumulate * world_size`` micro-batches of the same size computes every micro-batch
    exactly as the ranks do (this matters under bf16 autocast).

    It has no ``configure_model``: the strategy's default sharding applies.
    """

    def __init__(self, muon_config: MuonConfig | None = None, accumulate: int = 1, experts: bool = True):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = Net(experts)

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        pieces = world * self.hparams.accumulate
        size = SAMPLES // pieces
        order = [m * world + rank for m in range(self.hparams.accumulate)]
        indices = [k * size + j for k in order for j in range(size)]
        return torch.utils.data.DataLoader(torch.utils.data.Subset(dataset(), indices), batch_size=size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


class SelfShardingRegressor(FSDPRegressor):
    """``FSDPRegressor`` that shards itself: one FSDP unit per block, then ``net``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 3, generator=g))


CONFIG = MuonConfig(
    matrix=MuonSettings(lr=0.02, weight_decay=0.1, ns_dtype="float32", adjust_lr="spectral_norm"),
    scalar=AdamWSettings(lr=1e-2, weight_decay=0.01),
    schedule=ScheduleSettings(warmup=2, momentum_warmup=MomentumWarmup(steps=3)),
)


def trainer_kwargs(root: Path, max_steps: int, accumulate: int, clip: float | None, precision: str) -> dict:
    return dict(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        gradient_clip_val=clip,
        accumulate_grad_batches=accumulate,
        precision=precision,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )


def fit_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """``Trainer.fit`` with ``MuonFSDPStrategy`` on this rank; returns the full parameters (rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    from lightning_muon import MuonFSDPStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes made outside Lightning
    cls = SelfShardingRegressor if spec.get("shard_itself") else FSDPRegressor
    model = cls(CONFIG, accumulate=spec["accumulate"], experts=spec.get("experts", True))
    callbacks = []
    if spec.get("save_every"):
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=spec["root"] / "ckpt", every_n_train_steps=spec["save_every"], save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        devices=world_size,
        strategy=MuonFSDPStrategy(muon_mode=spec.get("mode", "owner")),
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        **trainer_kwargs(spec["root"], spec["max_steps"], spec["accumulate"], spec["clip"], spec["precision"]),
    )
    trainer.fit(model, ckpt_path=spec.get("ckpt_path"))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharding = trainer.optimizers[0].sharding
    return {
        "params": state if rank == 0 else None,
        "global_step": trainer.global_step,
        "bytes": dict(sharding.stats.bytes),
        "fsdp_units": [name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
        "default_units": trainer.strategy.default_units,
        "groups": {g["name"]: g.get("param_names") for g in trainer.optimizers[0].param_groups},
    }


# ---------------------------------------------------------------- GPT-2 with split_qkv

GPT2_CONFIG = MuonConfig(
    matrix=MuonSettings(lr=0.02, weight_decay=0.1, ns_dtype="float32"),
    scalar=AdamWSettings(lr=1e-2),
    routing=RoutingSettings(split_qkv=True, qkv_split_shapes=(32, 32, 32)),
)


class GPT2LM(MuonModuleMixin, pl.LightningModule):
    """A tiny transformers GPT-2 (``Conv1D`` layers, fused ``c_attn``), 12 fixed sequences per step."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)
        self.muon_config = GPT2_CONFIG

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        ids = torch.randint(0, 64, (SAMPLES, 12), generator=torch.Generator().manual_seed(5))
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(ids[rank::world]), batch_size=SAMPLES // world
        )

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss


def gpt2_fit(root: Path, steps: int, world_size: int = 1, rank: int = 0) -> dict[str, Any]:
    """A GPT-2 fit with ``split_qkv=True``: under ``MuonFSDPStrategy`` when ``world_size > 1``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_muon import MuonFSDPStrategy

    model = GPT2LM()
    trainer = pl.Trainer(
        devices=world_size,
        strategy=MuonFSDPStrategy() if world_size > 1 else "auto",
        enable_checkpointing=False,
        **trainer_kwargs(root, steps, 1, None, "32-true"),
    )
    trainer.fit(model)
    if world_size > 1:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    groups = {g["name"]: (g.get("split_sizes"), g.get("transposed")) for g in trainer.optimizers[0].param_groups}
    return {"params": state if rank == 0 else None, "groups": groups}


def gpt2_fit_worker(rank: int, world_size: int, root: Path, steps: int) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes made outside Lightning
    return gpt2_fit(root, steps, world_size, rank)
