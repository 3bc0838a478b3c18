"""Module-level code for the expert-parallel tests: spawned gloo workers import it by name.

``TinyMoE`` is a byte LM with one mixture-of-experts layer in transformers 5's layout: a
router ``Linear(D, E)`` beside an expert module with ``num_experts`` and two fused stacks,
``gate_up_proj`` ``(E, 2I, D)`` (gate rows, then up rows) and ``down_proj`` ``(E, D, I)``.
Every token is sent to every expert, weighted by the router's softmax (dense routing keeps
the reference exact).

Its ``configure_model`` is torchtitan's layout on Lightning's 2-D mesh: the expert stacks are
``Shard(0)`` on the ``"tensor_parallel"`` dim, used here as the expert-parallel dim (rank t
holds experts ``[t E/T, (t+1) E/T)`` and computes only their outputs, summed over the dim),
and FSDP2 shards everything on ``"data_parallel"``. Without a mesh it does nothing: that is
the single-process reference.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_muon import (
    AdamWSettings,
    MuonConfig,
    MuonModuleMixin,
    MuonSettings,
    RoutingSettings,
    Rule,
    ScheduleSettings,
)

VOCAB, D, INTER, E, SEQ, SAMPLES = 32, 16, 12, 4, 8, 8
# The experts' forward communicates across the expert dim, which the routing's probe does not run: a
# rule says how they are laid out ((E, out, in), gate rows then up rows).
EXPERT_RULES = (
    Rule(name="expert_gate_up", algorithm="muon", names="*experts.gate_up_proj", experts="out_in",
         group="muon_experts_gate_up", options={"split_parts": 2}),
    Rule(name="expert_down", algorithm="muon", names="*experts.down_proj", experts="out_in", group="muon_experts"),
)  # fmt: skip
CONFIG = dict(lr=0.05, weight_decay=0.1, ns_dtype="float32", adamw_lr=1e-2, warmup=1, rules=EXPERT_RULES)


class _SumOverExperts(torch.autograd.Function):
    """Sum the expert-parallel ranks' partial outputs; each rank's part gets the whole gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToExperts(torch.autograd.Function):
    """Identity forward; the backward sums the ranks' gradients (each rank's experts read the whole input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * INTER, D) / math.sqrt(D))
        self.down_proj = nn.Parameter(torch.randn(E, D, INTER) / math.sqrt(INTER))
        self.ep_group = None  # the expert-parallel process group, once sharded
        self.first = 0  # the first expert this rank holds

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.ep_group is not None:  # Megatron's copy to the parallel region, and the reduce back from it
            x, weights = _CopyToExperts.apply(x, self.ep_group), _CopyToExperts.apply(weights, self.ep_group)
        if hasattr(gate_up, "to_local"):  # a DTensor on the expert dim (FSDP2 gathered the data dim)
            gate_up, down = gate_up.to_local(), down.to_local()
        h = torch.einsum("nd,eod->neo", x, gate_up)  # (N, e, 2I) for this rank's e experts
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("nei,edi->ned", nn.functional.silu(gate) * up, down)  # (N, e, D)
        out = (y * weights[:, self.first : self.first + y.shape[1], None]).sum(1)
        return _SumOverExperts.apply(out, self.ep_group) if self.ep_group is not None else out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx).reshape(-1, D)
        x = x + self.experts(x, self.router(x).softmax(-1))
        return self.head(self.norm(x)).view(*idx.shape, VOCAB)


def apply_ep_fsdp(net: Net, mesh) -> None:
    """The expert stacks ``Shard(0)`` on ``mesh["tensor_parallel"]`` (experts), then FSDP2 on ``"data_parallel"``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    ep, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    experts = net.experts
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name).detach()
        setattr(experts, name, nn.Parameter(distribute_tensor(full, ep, [Shard(0)])))
    experts.ep_group = ep.get_group()
    experts.first = ep.get_local_rank() * math.ceil(E / ep.size())
    fully_shard(experts, mesh=dp)
    fully_shard(net, mesh=dp)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(3))


class TinyMoE(MuonModuleMixin, pl.LightningModule):
    def __init__(self, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = Net()

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            apply_ep_fsdp(self.net, self.device_mesh)

    def train_dataloader(self):
        data = tokens()
        if self.device_mesh is not None:  # split by the data-parallel rank only
            dp = self.device_mesh["data_parallel"]
            data = data.chunk(dp.size())[dp.get_local_rank()]
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=len(data))

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        logits = self.net(seq[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def _trainer(root: Path, max_steps: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def full_params(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def reference_fit(root: Path, max_steps: int) -> dict[str, torch.Tensor]:
    model = TinyMoE(
        MuonConfig(
            matrix=MuonSettings(lr=0.05, weight_decay=0.1, ns_dtype="float32"),
            scalar=AdamWSettings(lr=1e-2),
            routing=RoutingSettings(rules=EXPERT_RULES),
            schedule=ScheduleSettings(warmup=1),
        )
    )
    _trainer(root, max_steps, devices=1).fit(model)
    return full_params(model)


def ep_fit_worker(rank: int, world_size: int, root: Path, max_steps: int) -> list[dict[str, Any]]:
    """Two fits on a (world / 2) x 2 mesh, the experts sharded on the tensor (expert) dim: under
    ``MuonFSDPStrategy``, then under Lightning's own ``ModelParallelStrategy`` (where ``Muon``
    attaches its sharding at the first step)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_muon import MuonFSDPStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes made outside Lightning
    out = []
    for plain in (False, True):
        model = TinyMoE(
            MuonConfig(
                matrix=MuonSettings(lr=0.05, weight_decay=0.1, ns_dtype="float32"),
                scalar=AdamWSettings(lr=1e-2),
                routing=RoutingSettings(rules=EXPERT_RULES),
                schedule=ScheduleSettings(warmup=1),
            )
        )
        if plain:
            strategy = ModelParallelStrategy(data_parallel_size=world_size // 2, tensor_parallel_size=2)
        else:
            strategy = MuonFSDPStrategy(tensor_parallel_size=2)
        trainer = _trainer(root / str(plain), max_steps, devices=world_size, strategy=strategy)
        trainer.fit(model)
        optimizer = trainer.optimizers[0]
        groups = {
            g["name"]: (g["batched"], g["split_sizes"]) for g in optimizer.param_groups if g["algorithm"] == "muon"
        }
        out.append(
            {
                "strategy": type(strategy).__name__,
                "params": full_params(model),
                "placements": {
                    n: str(tuple(p.placements)) for n, p in model.named_parameters() if hasattr(p, "placements")
                },
                "local_experts": model.net.experts.gate_up_proj.to_local().shape[0],
                "sharding": type(optimizer.sharding).__name__,
                "bytes": {k: dict(v.bytes) for k, v in optimizer.sharding.stats_by_dim.items()},
                "muon_groups": groups,
            }
        )
    return out
