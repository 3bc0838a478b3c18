"""``CharGPT``: a small decoder-only transformer for the byte-level demo data.

A GPT-2 shaped model (Radford et al. 2019) with pre-norm blocks::

    x = tok_emb(idx) + pos_emb(0..T-1)                    # (B, T, d)
    repeat n_layer times:
        x = x + attn(ln1(x))                              # causal self-attention
        x = x + mlp(ln2(x))                               # d -> 4d -> GELU -> d
    logits = lm_head(ln_f(x))                             # (B, T, vocab)

It is a plain ``torch.nn.Module``; the Lightning side (loss logging, Muon
optimizers) is written on top of it. Parameter names, which routing rules may
match (``i`` is the block index)::

    tok_emb.weight                  (vocab, d)     nn.Embedding
    pos_emb.weight                  (block_size, d) nn.Embedding
    blocks.i.ln1.{weight,bias}      (d,)           nn.LayerNorm
    blocks.i.attn.qkv.{weight,bias} (3d, d), (3d,) fused query/key/value projection
    blocks.i.attn.proj.{weight,bias} (d, d), (d,)  attention output projection
    blocks.i.ln2.{weight,bias}      (d,)
    blocks.i.mlp.fc1.{weight,bias}  (4d, d), (4d,)
    blocks.i.mlp.fc2.{weight,bias}  (d, 4d), (d,)
    ln_f.{weight,bias}              (d,)
    lm_head.weight                  (vocab, d)     nn.Linear without bias

The hidden matrices (``qkv``, ``proj``, ``fc1``, ``fc2``) are the ones Muon is
meant for; embeddings, ``lm_head``, norms and biases belong to AdamW. With
``tie_weights=True``, ``lm_head.weight`` *is* ``tok_emb.weight``: the tensor is
shared, and ``named_parameters()`` lists it once, as ``tok_emb.weight``.

``qkv`` is one ``(3d, d)`` matrix: Muon orthogonalizes it as a whole, not as
three ``(d, d)`` blocks, unless a routing rule says otherwise.

The attention implements QK-clip's protocol (``qk_clip_heads()``: Q is rows
``0 .. d-1`` of ``qkv``, K rows ``d .. 2d-1``, with their biases) and calls SDPA through
``lightning_muon.attention.scaled_dot_product_attention``, which is torch's function
unless a ``QKClip`` callback asked for the per-head maxima.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_muon.attention.maxima import QKHeads, scaled_dot_product_attention

__all__ = ["CharGPT"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused ``qkv`` projection and an output ``proj``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, H, T, C / H): heads become a batch dimension for SDPA.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, module=self
        )  # (B, H, T, C / H); per-head max logits recorded while a QKClip callback asks
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))

    def qk_clip_heads(self) -> QKHeads:
        """QK-clip's view of ``qkv``: Q is output rows ``0 .. d-1``, K rows ``d .. 2d-1`` (biases alike)."""
        d = self.qkv.out_features // 3
        return QKHeads(
            self.qkv.weight, self.qkv.weight, self.n_head, self.n_head, d // self.n_head,
            q_bias=self.qkv.bias, k_bias=self.qkv.bias, q_offset=0, k_offset=d,
        )  # fmt: skip


class MLP(nn.Module):
    """Position-wise feed-forward: ``fc2(GELU(fc1(x)))`` with a 4x wider hidden layer."""

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class CharGPT(nn.Module):
    """Small GPT for next-token prediction over a byte (or any small) vocabulary.

    Initialization follows GPT-2: every ``Linear`` and ``Embedding`` weight is
    ``N(0, 0.02^2)``, biases are zero, LayerNorms are the identity; the two
    projections that write into the residual stream (``attn.proj``, ``mlp.fc2``)
    get std ``0.02 / sqrt(2 * n_layer)`` so the residual's variance does not grow
    with depth.

    Args:
        vocab_size: Number of token ids (256 for byte-level text).
        block_size: Longest sequence the model accepts (size of the position table).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: Width ``d`` of the residual stream.
        dropout: Dropout probability on attention weights and residual branches.
        tie_weights: Share one ``(vocab, d)`` matrix between ``tok_emb`` and ``lm_head``.

    References:
        Radford, Wu, Child, Luan, Amodei and Sutskever, "Language Models are
        Unsupervised Multitask Learners" (GPT-2), OpenAI 2019.
        Vaswani et al., "Attention Is All You Need", arXiv 1706.03762.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        _check_int("vocab_size", vocab_size, 1)
        _check_int("block_size", block_size, 1)
        _check_int("n_layer", n_layer, 1)
        _check_int("n_head", n_head, 1)
        _check_int("n_embd", n_embd, 1)
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        if not isinstance(tie_weights, bool):
            raise ValueError(f"tie_weights must be a bool, got {tie_weights!r}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer
        self.tie_weights = tie_weights

        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, float(dropout)) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.reset_parameters()
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """Re-draw every weight with the GPT-2 initialization described in the class docstring."""
        residual_std = 0.02 / math.sqrt(2 * self.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.proj", "mlp.fc2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding ``tok_emb``."""
        return self.tok_emb

    def get_output_embeddings(self) -> nn.Linear:
        """The output head ``lm_head`` (sharing its weight with ``tok_emb`` when tied)."""
        return self.lm_head

    def forward(self, idx: Tensor) -> Tensor:
        """Next-token logits ``(B, T, vocab_size)`` for token ids ``idx`` of shape ``(B, T)``, ``T <= block_size``."""
        if idx.ndim != 2:
            raise ValueError(f"idx must have shape (batch, time), got {tuple(idx.shape)}")
        T = idx.shape[1]
        if self.block_size < T:
            raise ValueError(f"idx has {T} positions, more than block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    @staticmethod
    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)`` (nats per token)."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, generator: torch.Generator | None = None
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``; returns ``(B, T + max_new_tokens)``.

        Each step re-reads at most the last ``block_size`` tokens (no key/value
        cache: the demo model is small and clarity wins). ``temperature`` 0 is greedy.
        """
        _check_int("max_new_tokens", max_new_tokens, 0)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1]  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
