"""Module-level pieces for the multi-process spectra tests (spawned processes import them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_muon import AdamWSettings, Muon, MuonConfig, MuonModuleMixin, MuonSettings, UpdateSpectrumMonitor
from lightning_muon.callbacks._spectra import SpectrumCollector
from lightning_muon.metrics import EffectiveRank, LargestSingularValue, SpectrumMetrics, StableRank

LR = 0.05
# fp32 Newton-Schulz: a 2-rank run then equals one process to ~1e-6 (bf16 would amplify the
# ulp differences of another reduction order into percent-level ones).
CONFIG = MuonConfig(matrix=MuonSettings(lr=LR, ns_dtype="float32"), scalar=AdamWSettings(lr=1e-2))
TRAINER = dict(
    accelerator="cpu",
    max_steps=5,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    use_distributed_sampler=False,
    num_sanity_val_steps=0,
)
EVERY = 2  # logging steps 0, 2 and 4


class SpectraRegressor(MuonModuleMixin, pl.LightningModule):
    """Four linear layers; the three hidden matrices go to Muon."""

    def __init__(self, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4)
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Rank r takes samples r, r + W, ...: per step all ranks together see what one process
        # with a W-times larger batch sees (use_distributed_sampler=False).
        world, rank = self.trainer.world_size, self.trainer.global_rank
        g = torch.Generator().manual_seed(7)
        data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 4, generator=g))
        subset = torch.utils.data.Subset(data, range(rank, 48, world))
        return torch.utils.data.DataLoader(subset, batch_size=8 // world, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


class OwnershipMonitor(UpdateSpectrumMonitor):
    """Writes, per rank, the names of the matrices this rank measured at each logging step."""

    def __init__(self, out_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self.measured: list[list[str]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        collector = self._collector
        observe = collector.observe

        def counting(group, params, updates, ortho) -> None:
            before = len(collector.records)
            observe(group, params, updates, ortho)
            self.measured.append([r.name for r in collector.records[before:]])

        collector.observe = counting  # type: ignore[method-assign]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        path = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.measured))


def _rank_matrices(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(3, 6, 4, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)]


def distributed_worker(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """torchmetrics sync over ranks; the collector on hand-made DTensors; a ``muon_fsdp`` fit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    out: dict[str, Any] = {}
    # 1. Metrics: each rank adds its own matrices; compute() must be the mean over all ranks'.
    metrics = {"sigma_max": LargestSingularValue(), "stable_rank": StableRank(), "effective_rank": EffectiveRank()}
    spectrum = SpectrumMetrics()
    for m in _rank_matrices(rank):
        for metric in metrics.values():
            metric.update(m)
        spectrum.update(m, weight=m + 1.0)
    out["metrics"] = {k: float(v.compute()) for k, v in metrics.items()}
    out["spectrum"] = {k: float(v) for k, v in spectrum.compute().items()}

    # 2. DTensor weights: every rank holds rows of W; the owner observes the full update.
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 4, generator=g), torch.randn(9, 5, generator=g)]  # the same on every rank
    params = [nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in full]
    opt = Muon(
        [
            {"params": [params[0]], "param_names": ["plain"], "algorithm": "muon", "lr": LR},
            {"params": [params[1]], "param_names": ["fused"], "algorithm": "muon", "lr": LR, "split_sizes": [3, 6]},
        ]
    )
    collector = SpectrumCollector([opt], log_weights=True)
    out["observes_on"] = collector.observes_on(opt, rank)
    out["has_dtensors"] = collector.has_dtensors
    out["local_rows"] = [p.to_local().shape[0] for p in params]
    assert all(isinstance(p, DTensor) for p in params)
    # Known directions: O = (scaled) identity-like semi-orthogonal blocks; the update is ignored.
    ortho = [[torch.eye(6, 4)], [2.0 * torch.eye(3, 5), torch.eye(6, 5)]]
    owner = [0, world_size - 1]
    for i, group in enumerate(opt.param_groups):
        if owner[i] == rank:
            collector.observe(group, [params[i]], [torch.randn(full[i].shape)], [ortho[i]])
    records = collector.collect()
    out["records"] = None if records is None else [(r.name, r.scalars) for r in records]
    out["skipped_weight_spectra"] = collector.skipped_weight_spectra
    out["full"] = full

    # 3. A real FSDP2 fit (processes made outside Lightning, as torchrun would make them).
    from lightning_muon import MuonFSDPStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    monitor = OwnershipMonitor(str(root), every_n_steps=EVERY)
    trainer = pl.Trainer(
        devices=world_size, strategy=MuonFSDPStrategy(), logger=CSVLogger(root), callbacks=[monitor], **TRAINER
    )
    trainer.fit(SpectraRegressor(CONFIG))
    out["fsdp_param_types"] = sorted({type(p).__name__ for p in trainer.optimizers[0].param_groups[0]["params"]})
    dist.barrier()
    return out
