"""Module-level code for the QKClip tests: spawned ranks import it by name.

``PlantedGPT`` is a tiny demo ``CharGPT`` whose chosen heads have their Q and K rows
multiplied by ``PLANT``, so their logits start far over the test's threshold; every
optimizer step sees the same global batch, cut by rank (``rank::world`` rows), so one
process and two ranks see the same data, and a resumed run replays nothing that matters.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_muon import AdamWSettings, MuonConfig, MuonModuleMixin, MuonSettings, QKClip
from lightning_muon_demo.models import CharGPT

VOCAB, BLOCK, EMBD, HEADS, LAYERS, BATCH = 32, 8, 16, 2, 2, 8
PLANT = 40.0
PLANTED = {0: [0], 1: [1]}  # layer -> heads with large Q/K weights
TAU = 1.0
# fp32 Newton-Schulz, so 2 ranks equal 1 process to rounding. adamw_eps: the key bias's
# gradient is zero in exact arithmetic (softmax ignores what is added to every logit of a
# query), so under eps 1e-8 AdamW turns its rounding noise into +-lr steps whose signs
# depend on the order of the gradient sums; 1e-4 leaves noise-level gradients at rest.
CONFIG = MuonConfig(
    matrix=MuonSettings(lr=0.02, ns_dtype="float32", weight_decay=0.1), scalar=AdamWSettings(lr=1e-2, eps=1e-4)
)


def tokens() -> torch.Tensor:
    """The fixed global batch ``(BATCH, BLOCK + 1)``: inputs and next-token targets."""
    return torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(3))


def plant(model: CharGPT, layers: dict[int, list[int]] = PLANTED, factor: float = PLANT) -> None:
    """Multiply the Q and K rows of ``layers``' heads by ``factor`` (their logits by ``factor**2``)."""
    hd = EMBD // HEADS
    with torch.no_grad():
        for layer, heads in layers.items():
            w = model.blocks[layer].attn.qkv.weight
            for h in heads:
                w[h * hd : (h + 1) * hd] *= factor
                w[EMBD + h * hd : EMBD + (h + 1) * hd] *= factor


class PlantedGPT(MuonModuleMixin, pl.LightningModule):
    """``CharGPT`` with planted heads; ``optimizer="sgd0"`` steps with plain SGD at lr 0 (weights unchanged)."""

    def __init__(self, muon_config: MuonConfig | None = CONFIG, optimizer: str = "muon", dump_dir: str | None = None):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = CharGPT(VOCAB, BLOCK, LAYERS, HEADS, EMBD)
        plant(self.model)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        rows = tokens()[rank::world]
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=len(rows))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (rows,) = batch
        return self.model.loss(self.model(rows[:, :-1]), rows[:, 1:])

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "sgd0":
            return torch.optim.SGD(self.parameters(), lr=0.0)
        return super().configure_optimizers()


def trainer(root: Path, steps: int, callbacks: list, **kwargs: Any) -> pl.Trainer:
    settings = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # QKClip logs on the steps Lightning writes to the loggers
    )
    return pl.Trainer(max_steps=steps, callbacks=callbacks, **{**settings, **kwargs})


def full_state(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Full, plain parameters on every rank (DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def fit_worker(
    rank: int, world_size: int, strategy: str, steps: int, root: str, cap_forward: bool = False
) -> dict[str, Any]:
    """A ``Trainer.fit`` of ``PlantedGPT`` with ``QKClip`` on a process ``run_distributed`` started."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes made outside Lightning, as torchrun's
    model = PlantedGPT()
    clip = QKClip(threshold=TAU, cap_forward=cap_forward)
    fit = trainer(Path(root), steps, [clip], devices=world_size, strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset notices
        fit.fit(model)
    return {"params": full_state(model), "clipped": clip.clipped_heads_total, "step": fit.global_step}


class DumpingGPT(PlantedGPT):
    """``PlantedGPT`` that writes its parameters and the callback's count to ``dump_dir/rank<r>.pt`` (spawned ranks)."""

    def on_train_end(self) -> None:
        clip = next(c for c in self.trainer.callbacks if isinstance(c, QKClip))
        out = {"params": full_state(self), "clipped": clip.clipped_heads_total, "step": self.trainer.global_step}
        torch.save(out, Path(self.hparams.dump_dir) / f"rank{self.trainer.global_rank}.pt")
