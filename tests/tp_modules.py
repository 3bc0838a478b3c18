"""Module-level code for the tensor-parallel tests: spawned gloo workers import it by name.

``TinyTPTransformer`` is a 2-block causal transformer whose ``configure_model`` applies
tensor parallelism (``parallelize_module`` on the mesh's ``"tensor_parallel"`` dim: q, k,
v and fc1 colwise, proj and fc2 rowwise) and then FSDP2 (``fully_shard`` on
``"data_parallel"``), the layout of Lightning's ``ModelParallelStrategy``. It has every
case the TP sharding meets:

- q (16 x 16) colwise: split along dim 0, the short side of a square matrix's wide form;
- k, v (8 x 16, grouped-query attention) colwise: split along the short side;
- proj (16 x 16), fc2 (16 x 32) rowwise, fc1 (32 x 16) colwise: split along the long side;
- ``mix`` (16 x 16): a Muon matrix left out of the TP plan, so FSDP2 puts it on the 1-D
  data-parallel mesh beside the 2-D ones;
- embeddings, head, norms and biases on AdamW (colwise biases are ``Shard(0)`` on the
  tensor dim, rowwise ones and norms replicated).

Without a device mesh (one process, no strategy) ``configure_model`` does nothing: that is
the single-process reference. Every optimizer step sees the same ``SAMPLES`` sequences,
split by the data-parallel rank only (tensor-parallel peers see the same batch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_muon import (
    AdamWSettings,
    MuonConfig,
    MuonHyperballSettings,
    MuonModuleMixin,
    MuonSettings,
    QKClip,
    RoutingSettings,
    Rule,
    ScheduleSettings,
)
from lightning_muon.attention import QKHeads, global_head_maxima, scaled_dot_product_attention

VOCAB, D_MODEL, HEADS, KV_HEADS, HIDDEN, SEQ = 12, 16, 4, 2, 32, 6
SAMPLES = 8  # sequences per optimizer step: divisible by every data-parallel size tried (1, 2, 4)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = D_MODEL // HEADS
        self.q = nn.Linear(D_MODEL, HEADS * self.head_dim)
        # No key bias: softmax cancels it, its gradient is rounding noise that AdamW would amplify.
        self.k = nn.Linear(D_MODEL, KV_HEADS * self.head_dim, bias=False)
        self.v = nn.Linear(D_MODEL, KV_HEADS * self.head_dim)
        self.proj = nn.Linear(HEADS * self.head_dim, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under ColwiseParallel each rank holds whole heads of q, k and v: local sizes.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hq_local, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv_local, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        group = q.shape[1] // k.shape[1]  # query heads per kv head, the same on every rank
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # torch's SDPA unless a QKClip records: then each query head's maxima (k repeated, so
        # query head h meets key head h // group, as the global GQA grouping has it).
        y = scaled_dot_product_attention(q, k, v, is_causal=True, module=self)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def qk_clip_heads(self) -> QKHeads:
        # Global counts: under ColwiseParallel the weights are DTensors of the global shape,
        # while the forward above runs (and records) this rank's heads only.
        return QKHeads(self.q.weight, self.k.weight, HEADS, KV_HEADS, self.head_dim, q_bias=self.q.bias)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc1 = nn.Linear(D_MODEL, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.mix = nn.Linear(D_MODEL, D_MODEL, bias=False)  # not in the TP plan: 1-D mesh
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(self.mix(x)))


def apply_tp_fsdp(net: Net, mesh) -> None:
    """Tensor parallelism on ``mesh["tensor_parallel"]``, then FSDP2 on ``mesh["data_parallel"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    }
    for block in net.blocks:
        parallelize_module(block, tp, plan)
        fully_shard(block, mesh=dp)
    fully_shard(net, mesh=dp)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(3))


class TinyTPTransformer(MuonModuleMixin, pl.LightningModule):
    """The tiny transformer, tensor parallel + FSDP2 under a 2-D mesh, plain on one process."""

    def __init__(self, muon_config: MuonConfig | None = None, micro_batches: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = Net()
        self.micro_batches = micro_batches  # batches per optimizer step (the reference of cap_forward)

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            apply_tp_fsdp(self.net, self.device_mesh)

    def train_dataloader(self):
        data = tokens()
        if self.device_mesh is not None:  # split by the data-parallel rank only
            dp = self.device_mesh["data_parallel"]
            data = data.chunk(dp.size())[dp.get_local_rank()]
        batch = len(data) // self.micro_batches
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=batch)

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        logits = self.net(seq[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def tp_config(tp_mode: str | None = None, rules: Sequence[Rule] = (), hyperball: bool = False) -> MuonConfig:
    """The runs' config: Muon (or MuonHyperball) on the hidden matrices, ``tp_mode`` where given, ``rules`` first."""
    matrix = (MuonHyperballSettings if hyperball else MuonSettings)(
        lr=0.02,
        weight_decay=0.1,
        ns_dtype="float32",  # bf16 Newton-Schulz turns one-ulp differences into percents
        adjust_lr="spectral_norm",  # sqrt(rows / cols): wrong if a shard's shape were used
        **({"tp_mode": tp_mode} if tp_mode is not None else {}),
    )
    return MuonConfig(
        matrix=matrix,
        scalar=AdamWSettings(lr=1e-2),
        routing=RoutingSettings(rules=list(rules)),
        schedule=ScheduleSettings(warmup=2),
    )


def trainer_kwargs(root: Path, max_steps: int, clip: float | None) -> dict[str, Any]:
    return dict(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        gradient_clip_val=clip,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )


class RecordingQKClip(QKClip):
    """``QKClip`` that keeps every step's reduced ``(H,)`` maxima per layer (the same on every rank)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.history: list[list[torch.Tensor]] = []

    def _reduced_maxima(self, *args: Any) -> list[torch.Tensor]:
        maxima = super()._reduced_maxima(*args)
        self.history.append([m.clone() for m in maxima])
        return maxima


def qk_clip_result(callback: RecordingQKClip | None) -> dict[str, Any] | None:
    if callback is None:
        return None
    return {"clipped": callback.clipped_heads_total, "maxima": [torch.stack(step) for step in callback.history]}


def head_placement(model: TinyTPTransformer) -> dict[str, Any]:
    """Where ``global_head_maxima`` puts 2 recorded maxima (this rank's heads) on a rank of a TP mesh.

    With the error it gives for 1 recorded maximum (this rank's shard holds 2 heads).
    """
    heads = model.net.blocks[0].attn.qk_clip_heads()
    try:
        global_head_maxima(torch.ones(1), heads, "net.blocks.0.attn")
        error = None
    except ValueError as err:
        error = str(err)
    return {
        "tp_rank": model.device_mesh["tensor_parallel"].get_local_rank(),
        "placed": global_head_maxima(torch.tensor([1.0, 2.0]), heads, "net.blocks.0.attn"),
        "error": error,
    }


def full_params(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (DTensors gathered), by name."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def reference_fit(
    root: Path,
    max_steps: int,
    clip: float | None = None,
    spectra: int = 0,
    qk_clip: dict[str, Any] | None = None,
    micro_batches: int = 1,
    **config: Any,
) -> dict[str, Any]:
    """The single-process reference: the same module and optimizer, no strategy.

    ``qk_clip``: ``QKClip`` arguments (a ``RecordingQKClip``). ``micro_batches``: the step's
    samples in that many batches, gradients accumulated (as the data-parallel ranks split them).
    """
    from lightning_muon import UpdateSpectrumMonitor

    model = TinyTPTransformer(tp_config(**config), micro_batches=micro_batches)
    monitor = UpdateSpectrumMonitor(every_n_steps=spectra) if spectra else None
    qk = RecordingQKClip(**qk_clip) if qk_clip else None
    trainer = pl.Trainer(
        devices=1,
        enable_checkpointing=False,
        callbacks=[c for c in (monitor, qk) if c],
        accumulate_grad_batches=micro_batches,
        **trainer_kwargs(root, max_steps, clip),
    )
    trainer.fit(model)
    return {
        "params": full_params(model),
        "spectra": monitor.last_metrics if monitor else None,
        "qk_clip": qk_clip_result(qk),
    }


def _count_measurements() -> dict[str, int]:
    """How many spectra this process measures, by matrix name (``SpectrumCollector._measure`` calls)."""
    from lightning_muon.callbacks._spectra import SpectrumCollector

    counts: dict[str, int] = {}
    measure = SpectrumCollector._measure

    def counting(self, target, *args, **kwargs):
        counts[target.name] = counts.get(target.name, 0) + 1
        return measure(self, target, *args, **kwargs)

    SpectrumCollector._measure = counting
    return counts


def tp_fit_worker(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several ``Trainer.fit`` runs on this rank, one after the other; what each left behind.

    A run with ``"plain": True`` uses Lightning's own ``ModelParallelStrategy`` and returns
    the error its fit raised (it is run last: the error ends the fit mid-step). ``"qk_clip"``:
    ``QKClip`` arguments; the run adds a ``RecordingQKClip`` and returns its maxima.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_muon import MuonFSDPStrategy, UpdateSpectrumMonitor

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes made outside Lightning
    counts = _count_measurements()
    out = []
    for spec in runs:
        counts.clear()
        model = TinyTPTransformer(tp_config(**spec.get("config", {})))
        monitor = UpdateSpectrumMonitor(every_n_steps=spec["spectra"]) if spec.get("spectra") else None
        callbacks: list[pl.Callback] = [monitor] if monitor else []
        qk = RecordingQKClip(**spec["qk_clip"]) if spec.get("qk_clip") else None
        if qk:
            callbacks.append(qk)
        if spec.get("save_every"):
            callbacks.append(
                pl.callbacks.ModelCheckpoint(
                    dirpath=spec["root"] / "ckpt", every_n_train_steps=spec["save_every"], save_top_k=-1
                )
            )
        tp = spec.get("tp", 2)
        if spec.get("plain"):
            strategy = ModelParallelStrategy(data_parallel_size=world_size // tp, tensor_parallel_size=tp)
        else:
            strategy = MuonFSDPStrategy(tensor_parallel_size=tp, tp_mode=spec.get("tp_mode"))
        trainer = pl.Trainer(
            devices=world_size,
            strategy=strategy,
            callbacks=callbacks,
            enable_checkpointing=bool(spec.get("save_every")),
            **trainer_kwargs(spec["root"], spec["max_steps"], spec.get("clip")),
        )
        if spec.get("plain"):
            try:
                trainer.fit(model)
                out.append({"error": None})
            except Exception as err:  # the test reads which error it was
                out.append({"error": f"{type(err).__name__}: {str(err)[:400]}"})
            continue
        trainer.fit(model, ckpt_path=spec.get("ckpt_path"))
        sharding = trainer.optimizers[0].sharding
        out.append(
            {
                "params": full_params(model),
                "global_step": trainer.global_step,
                "bytes": {k: dict(v.bytes) for k, v in sharding.stats_by_dim.items()},
                "calls": {k: dict(v.calls) for k, v in sharding.stats_by_dim.items()},
                "tp_mode": sharding.tp_mode,
                "placements": {
                    n: (p.device_mesh.ndim, str(tuple(p.placements))) if hasattr(p, "placements") else None
                    for n, p in model.named_parameters()
                },
                "spectra": monitor.last_metrics if monitor else None,
                "measured": dict(counts),
                "qk_clip": qk_clip_result(qk),
                "head_placement": head_placement(model) if qk else None,
            }
        )
    return out
