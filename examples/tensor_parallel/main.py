"""Muon with tensor parallelism: a transformer whose ``configure_model`` applies TP, then FSDP2.

Run (4 CPU processes, gloo: a 2 x 2 data x tensor mesh):
    python examples/tensor_parallel/main.py fit --config examples/tensor_parallel/config.yaml
Another tp_mode, or another mesh, from the command line:
    ... --trainer.strategy.tp_mode=distributed
    ... --trainer.devices=8 --trainer.strategy.tensor_parallel_size=4
On GPUs: --trainer.accelerator=gpu (nccl). Lightning starts the processes by re-running this
script, so it must stay a script with a ``__main__`` guard.

``configure_model`` reads ``self.device_mesh`` (Lightning's ``ModelParallelStrategy`` layout,
which ``MuonFSDPStrategy`` keeps): ``parallelize_module`` on ``["tensor_parallel"]`` (q, k, v and
fc1 column-wise, proj and fc2 row-wise, whole heads per rank), then ``fully_shard`` on
``["data_parallel"]``. Lightning's distributed sampler splits the data by the data-parallel rank
only: the ranks of a tensor-parallel group see the same batch, as they must.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn

from lightning_muon import MuonConfig, MuonModuleMixin
from lightning_muon.callbacks import MuonSaveConfigCallback


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        self.q = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.k = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.proj = nn.Linear(n_head * self.head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under tensor parallelism each rank holds whole heads: the sizes here are local.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads_local, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, kv_heads_local, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, n_kv_head)
        self.fc1 = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc2 = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TPTransformer(MuonModuleMixin, pl.LightningModule):
    """A causal transformer LM; Muon on q, k, v, proj, fc1, fc2, AdamW on embeddings, norms and head."""

    def __init__(
        self,
        vocab: int = 64,
        seq_len: int = 32,
        d_model: int = 64,
        n_head: int = 4,
        n_kv_head: int = 2,
        n_layer: int = 2,
        muon_config: MuonConfig | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, n_kv_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def configure_model(self) -> None:
        """Tensor parallelism on the tensor dim of the mesh, then FSDP2 on its data dim."""
        if self.device_mesh is None:  # one process, no ModelParallelStrategy: nothing to shard
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1 and (self.hparams.n_kv_head % tp.size() or self.hparams.n_head % tp.size()):
            raise ValueError(f"n_head and n_kv_head must be multiples of tensor_parallel_size ({tp.size()})")
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(),
        }
        for block in self.blocks:
            parallelize_module(block, tp, plan)
            fully_shard(block, mesh=dp)
        for module in (self.tok, self.pos, self.ln_f, self.head):
            fully_shard(module, mesh=dp)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
        (seq,) = batch
        logits = self(seq[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)


class MarkovData(pl.LightningDataModule):
    """Sequences from a fixed random Markov chain over ``vocab`` tokens (a learnable next-token task)."""

    def __init__(self, vocab: int = 64, seq_len: int = 32, samples: int = 2048, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(0)
        h = self.hparams
        # Each token has 4 likely successors: the loss can fall from log(64) = 4.16 to about log(4) = 1.39.
        successors = torch.randint(0, h.vocab, (h.vocab, 4), generator=gen)
        seq = torch.empty(h.samples, h.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, h.vocab, (h.samples,), generator=gen)
        for t in range(h.seq_len):
            pick = torch.randint(0, 4, (h.samples,), generator=gen)
            seq[:, t + 1] = successors[seq[:, t], pick]
        split = h.samples * 7 // 8
        self.train_set = torch.utils.data.TensorDataset(seq[:split])
        self.val_set = torch.utils.data.TensorDataset(seq[split:])

    def train_dataloader(self):
        # Lightning swaps in a DistributedSampler over the data-parallel ranks (ModelParallelStrategy).
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_set, batch_size=self.hparams.batch_size)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(TPTransformer, MarkovData, save_config_callback=MuonSaveConfigCallback, args=args)


if __name__ == "__main__":
    main()
