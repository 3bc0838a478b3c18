"""Module-level LightningModules and rank workers for the ``muon_ddp`` tests (processes import them by name).

``fit(spec, devices)`` is one ``Trainer.fit`` of ``TinyRegressor``; ``fit_worker`` runs it on a
rank of ``dist_utils.run_distributed`` (processes made outside Lightning, forked from the
suite's forkserver), the strategy made there from its spec: ``("muon_ddp", kwargs)`` for
``MuonDDPStrategy(**kwargs)``, ``("ddp", kwargs)`` for Lightning's ``DDPStrategy``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_muon import MuonConfig, MuonDDPStrategy, MuonModuleMixin


class TinyRegressor(MuonModuleMixin, pl.LightningModule):
    """An MLP whose hidden matrices go to Muon and whose head goes to AdamW.

    Args:
        widths: hidden widths; the first Linear and every hidden one are Muon matrices.
        global_batch: samples per optimizer micro-step over all ranks (divided among them).
        samples: dataset size; ``samples == global_batch`` gives the same batch every step.
        branch: a side layer used only on even steps, so it (and its AdamW bias) has no
            gradient on odd steps (needs ``find_unused_parameters=True`` under DDP).
        frozen: a frozen hidden layer (``requires_grad=False``) in the path.
        inject_inf: ``(rank, step)``: after backward on that rank (-1: every rank) and step,
            put an inf into the gradient of a Muon matrix another rank owns.
        dump_dir: where each rank writes its final parameters (``rank<r>.pt``).
        experts: a mixture-of-experts layer of that many experts (transformers 5's fused stacks
            and a router) after the hidden layers.
    """

    def __init__(
        self,
        muon_config: MuonConfig | None = None,
        widths: tuple[int, ...] = (32, 16, 24),
        global_batch: int = 8,
        samples: int = 48,
        branch: bool = False,
        frozen: bool = False,
        inject_inf: tuple[int, int] | None = None,
        dump_dir: str | None = None,
        experts: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for n_in, n_out in zip((8, *widths), widths):
            layers += [nn.Linear(n_in, n_out), nn.Tanh()]
        self.net = nn.Sequential(*layers)
        self.side = nn.Linear(widths[-1], widths[-1]) if branch else None
        self.fixed = nn.Linear(widths[-1], widths[-1]) if frozen else None
        if self.fixed is not None:
            self.fixed.requires_grad_(False)
        if experts:
            from fsdp_modules import Experts  # transformers 5's layout, as FSDP2's tests use it

            self.router = nn.Linear(widths[-1], experts, bias=False)
            self.experts = Experts(widths[-1], 6, experts)
        self.head = nn.Linear(widths[-1], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        if self.side is not None and self.trainer.global_step % 2 == 0:
            h = h + torch.tanh(self.side(h))
        if self.fixed is not None:
            h = torch.tanh(self.fixed(h))
        if self.hparams.experts:
            h = h + self.experts(h, self.router(h).softmax(-1))
        return self.head(h)

    def train_dataloader(self):
        # Rank r takes samples r, r + W, ...: per step the ranks together see the same samples
        # as one process with a W-times larger batch (use_distributed_sampler=False).
        world, rank = self.trainer.world_size, self.trainer.global_rank
        data = torch.utils.data.Subset(dataset(self.hparams.samples), range(rank, self.hparams.samples, world))
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.global_batch // world, shuffle=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_after_backward(self) -> None:
        if self.hparams.inject_inf is None:
            return
        rank, step = self.hparams.inject_inf
        if self.global_step != step or rank not in (-1, self.global_rank):
            return
        shardings = getattr(self.trainer.strategy, "shardings", [])
        # A matrix another rank owns: only the reduce-scatter carries the overflow to its owner.
        target = next((p for s in shardings for p in s.params if not s.owns(p)), self.net[0].weight)
        target.grad[0, 0] = float("inf")

    def on_fit_end(self) -> None:
        if self.hparams.dump_dir is None:
            return
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        shardings = getattr(self.trainer.strategy, "shardings", [])
        result = {
            "params": {n: p.detach().clone() for n, p in self.named_parameters()},
            "scale": None if scaler is None else float(scaler.get_scale()),
            # Bytes each collective of the Muon sharding sent from this rank, over the fit.
            "comm": dict(shardings[0].stats.bytes) if shardings else {},
            # What this rank steps of each expert stack (its block of experts), by name.
            "stepped": {
                n: tuple(part.shape) if (part := shardings[0].stepped(p)) is not None else None
                for n, p in self.named_parameters()
                if n.startswith("experts.")
            }
            if shardings
            else {},
        }
        torch.save(result, Path(self.hparams.dump_dir) / f"rank{self.global_rank}.pt")


def dataset(n: int = 48) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def fit(spec: dict[str, Any], devices: int) -> TinyRegressor:
    """``Trainer.fit`` of a ``TinyRegressor(**spec["model"])`` with ``spec``'s strategy on ``devices``: each rank writes
    its final parameters to ``spec["root"]/rank<r>.pt`` (``TinyRegressor.on_fit_end``)."""
    root, strategy = Path(spec["root"]), spec["strategy"]
    root.mkdir(parents=True, exist_ok=True)
    if isinstance(strategy, tuple):  # made here, in the rank: a strategy holds process-local state
        name, kwargs = strategy
        strategy = MuonDDPStrategy(**kwargs) if name == "muon_ddp" else DDPStrategy(**kwargs)
    precision, plugins = spec["precision"], []
    if precision == "16-mixed":
        # Lightning turns precision="16-mixed" into bf16 on CPU; fp16 autocast with a
        # GradScaler on CPU needs the plugin spelled out.
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10)))
        precision = None
    model = TinyRegressor(dump_dir=str(root), **spec["model"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=spec["steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        use_distributed_sampler=False,
        precision=precision,
        plugins=plugins or None,
        **spec["trainer"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the step was skipped", small-dataset notices
        trainer.fit(model, ckpt_path=spec["ckpt_path"])
    return model


def fit_worker(rank: int, world_size: int, spec: dict[str, Any]) -> None:
    """``fit`` on a rank made outside Lightning (``dist_utils.run_distributed``), which takes the process as given."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    fit(spec, world_size)
