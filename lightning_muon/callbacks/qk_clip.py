"""``QKClip``: MuonClip's per-head QK-clip as a Lightning callback, on one process or many."""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_muon.attention.clip import apply_qk_clip, clip_factors, global_head_maxima
from lightning_muon.attention.hf import enable_hf_recording, hf_qk_heads, is_hf_module
from lightning_muon.attention.maxima import QKHeads

__all__ = ["QKClip", "find_attention"]


def _matches(name: str, patterns: Sequence[str] | None) -> bool:
    if patterns is None:
        return True
    return any(re.search(p[3:], name) if p.startswith("re:") else fnmatch.fnmatchcase(name, p) for p in patterns)


def find_attention(
    model: nn.Module, names: Sequence[str] | None = None
) -> list[tuple[str, nn.Module, Callable[[], QKHeads]]]:
    """``(name, module, read QKHeads)`` for every attention module of ``model`` QK-clip can act on.

    In order of ``named_modules()``: modules with a ``qk_clip_heads()`` method (the
    protocol; the demo ``CharGPT``'s attention has one), then transformers' attention
    modules (Llama-style ``q_proj``/``k_proj``, BERT-style ``query``/``key``, GPT-2's ``c_attn``). ``names`` (glob
    patterns, or regular expressions prefixed ``"re:"``) keeps only the matching names.
    """
    found = []
    for name, module in model.named_modules():
        if not _matches(name, names):
            continue
        if callable(getattr(module, "qk_clip_heads", None)):
            found.append((name, module, module.qk_clip_heads))
        elif is_hf_module(module) and hf_qk_heads(module) is not None:
            found.append((name, module, lambda m=module: hf_qk_heads(m)))
    return found


def _loggers_write_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning passes this training step's logged values to the loggers.

    Lightning's own rule (``log_every_n_steps``, a stopping trainer, ``fast_dev_run``), read
    from its logger connector; it counts the step about to end, so it holds from the
    batch's start to its end. True where a Lightning version does not expose it.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True)) or bool(trainer.fast_dev_run)


class QKClip(Callback):
    r"""MuonClip's QK-clip: after each optimizer step, shrink the Q and K weights of every head whose logits ran away.

    For each attention head ``h`` the step's forward passes record ``S_h``, the largest
    pre-softmax logit ``scale * q . k`` over the batch (all micro-batches of the step; all
    ranks, by one MAX all-reduce). After the optimizer step, a head with ``S_h > tau``
    gets ``eta_h = tau / S_h`` and

    .. math::

        W_q^{(h)} \leftarrow \eta_h^{\alpha} W_q^{(h)}, \qquad
        W_k^{(h)} \leftarrow \eta_h^{1-\alpha} W_k^{(h)}

    (Q and K biases with their rows), so its logits scale by exactly ``eta_h`` and their
    maximum on that forward's inputs lands on ``tau``. Heads at or under ``tau`` are left
    bit for bit as they were. With grouped-query attention a key head shared by several
    query heads takes the smallest ``eta`` of its group (the only choice that puts every
    head of the group at or under ``tau``; ``lightning_muon.attention.clip``).

    The maxima are those of the step's own forward, taken before the update, as in Kimi K2
    and Megatron; the next forward's logits differ by what the step changed (at a high lr
    one Muon update can raise a head's maximum by tens of percent, and another batch has
    another maximum), so the forwards of a clipped run can still see logits somewhat over
    ``tau``. ``cap_forward=True`` closes that gap: each training forward also caps, for
    itself, every head whose maximum in that forward exceeds ``tau`` (its queries times
    ``tau / S_h`` before the softmax, the factor the clip will give the head's logits;
    ``lightning_muon.attention.capped_query``), so no training softmax ever sees a logit
    over ``tau``. The weights are clipped after the step as above, by the maxima before the
    cap. The factor is a constant to autograd.

    Which modules: every module of the LightningModule implementing the protocol
    (``qk_clip_heads()`` plus recording through
    ``lightning_muon.attention.scaled_dot_product_attention(..., module=self)``; the demo
    ``CharGPT`` does), and every transformers attention (Llama-style ``q_proj``/``k_proj``,
    with GQA; GPT-2's fused ``c_attn``), whose models are switched to the registered
    ``"qk_clip_sdpa"`` attention function (transformers' SDPA, plus the maxima).

    Logged through ``LightningModule.log`` (so TensorBoard, CSV and any logger show them)
    on the steps whose values Lightning writes to the loggers (every ``log_every_n_steps``
    steps; set it to 1 for every step): ``qk_clip/max_logit/<module name>`` (the largest
    ``S_h`` of the layer, before clipping), ``qk_clip/max_logit`` (of the model) and
    ``qk_clip/clipped_heads`` (heads over ``threshold`` this step: the ones clipped, unless
    ``clip=False``).

    Args:
        threshold: ``tau``, the largest logit allowed (Kimi K2 and Megatron: 100).
        alpha: the share of the shrinking put on Q, in [0, 1] (0.5: split evenly).
        names: only attention modules with these names (glob patterns or ``"re:"``
            regular expressions); None: every one found.
        clip: False measures and logs the maxima without changing any weight (a
            baseline run).
        log_per_layer: log ``qk_clip/max_logit/<module name>`` for each layer (the
            model-wide maximum and the clipped count are always logged).
        cap_forward: also cap each training forward's logits at ``threshold`` (above);
            needs ``clip=True``. Attention recording through the SDPA drop-in or the
            transformers function is capped by them; one that records its own maxima must
            pass its queries through ``capped_query`` (the callback raises otherwise).
            Flex attention returns its maxima only after the attention, so it cannot be
            capped (it raises). Under data parallelism each rank caps its forward by its
            own maxima (no collective inside the forward), so a run on several ranks is
            not bit for bit a one-process run on the whole batch; the weights are still
            clipped alike on every rank.

    Raises:
        ValueError: on a bad argument (naming it), when the model has no attention module
            QK-clip can act on (at fit start), or for an attention it cannot bound (a
            transformers attention with QK-norm; flash or flex attention implementations).

    Example::

        trainer = Trainer(callbacks=[QKClip(threshold=100.0, alpha=0.5)])

    Notes:
        Cost: on logged steps each attention call computes ``Q K^T`` once more (no
        gradient, in query blocks of at most 2^24 scores) and its masked maximum:
        ``2 B H T^2 d`` FLOPs, a third of the attention's forward-and-backward ``Q K^T``
        work. On the other steps (CPU) a layer whose heads the norms of q and k bound
        under ``threshold`` skips that product (none of its heads can be clipped). After
        each step: one all-reduce of ``H`` floats per layer (packed into one tensor) and
        one multiply over the Q and K weights; no host-device synchronization on CUDA
        except what the loggers read. Flex attention users get the maxima from the kernel
        itself (``lightning_muon.attention.flex_attention``, CUDA).
        ``benchmarks/bench_qk_clip.py`` measures the share of the step: on a 2-core CPU,
        1.8-1.9% for the demo model at Lightning's default logging interval, 5.0-5.6% when
        every step is measured exactly; 0.4-0.6% and 1.6-2.0% at d=512. ``cap_forward`` needs the
        exact maxima in every forward where a head's norm bound exceeds ``threshold`` (on
        CPU; on CUDA always), as on a logged step, plus one multiply over the queries.

        Distributed: the maxima are MAX-reduced over all ranks, so every rank computes the
        same factors. Under ``muon_ddp`` each replica scales its parameters identically;
        under ``muon_fsdp`` each rank scales the rows of its own DTensor shards (no
        communication). Under tensor parallelism (``MuonFSDPStrategy(tensor_parallel_size=T)``,
        Q and K split by heads with ``ColwiseParallel``) a rank records the maxima of its own
        heads only; they are placed at its heads' offset in the Q weight's shard (``-inf``
        for the others, ``lightning_muon.attention.global_head_maxima``) before the
        same one all-reduce, and each rank then scales its own heads' rows. A fused Q/K
        weight under tensor parallelism is refused. Tested against one process in fp32:
        2 ranks under ``muon_ddp_spawn`` and ``muon_fsdp``, and a 2 x 2 (data x tensor)
        mesh with grouped-query attention, with and without ``cap_forward`` (which caps
        each forward by the maxima of the heads it ran). Every rank must run this callback.

    References:
        Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, 2025.
    """

    def __init__(
        self,
        threshold: float = 100.0,
        alpha: float = 0.5,
        names: Sequence[str] | None = None,
        clip: bool = True,
        log_per_layer: bool = True,
        cap_forward: bool = False,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
            raise ValueError(f"QKClip: threshold must be a finite number > 0, got {threshold!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"QKClip: alpha must be a number in [0, 1], got {alpha!r}")
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"QKClip: names must be None or a non-empty list of non-empty strings, got {names!r}")
        for flag, value in (("clip", clip), ("log_per_layer", log_per_layer), ("cap_forward", cap_forward)):
            if not isinstance(value, bool):
                raise ValueError(f"QKClip: {flag} must be a bool, got {value!r}")
        if cap_forward and not clip:
            raise ValueError("QKClip: cap_forward=True caps logits at the threshold the clip keeps; it needs clip=True")
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.names = names
        self.clip = clip
        self.log_per_layer = log_per_layer
        self.cap_forward = cap_forward
        self._clipped_total = 0
        self._pending: Tensor | None = None
        self._modules: list[tuple[str, nn.Module, Callable[[], QKHeads]]] = []
        self._last_step: int | None = None
        self._exact = True  # this step's maxima are exact (not bounds): it may log them

    @property
    def clipped_heads_total(self) -> int:
        """Heads clipped since the run started, over every step and layer (checkpointed, so resumes add up)."""
        if self._pending is not None:
            self._clipped_total += int(self._pending)
            self._pending = None
        return self._clipped_total

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(threshold=self.threshold, alpha=self.alpha, names=self.names)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy set the model up (configure_model, DDP/FSDP wrapping): the
        # modules found here are the ones that run.
        enable_hf_recording(pl_module)
        self._modules = find_attention(pl_module, self.names)
        if not self._modules:
            where = f" matching names={self.names}" if self.names is not None else ""
            raise ValueError(
                f"QKClip: found no attention module{where} in {type(pl_module).__name__}: give your attention "
                "a qk_clip_heads() method and record with lightning_muon.attention.scaled_dot_product_attention"
                "(..., module=self). A transformers attention is found where transformers runs it through its "
                "AttentionInterface (sdpa or eager) with q_proj/k_proj (Llama, Mistral, Qwen2, ...), query/key "
                "(BERT, RoBERTa, ViT) or GPT-2's c_attn"
            )
        for _, module, read in self._modules:
            read()  # validates the layout now, not after the first step
            module.qk_clip_recording = True
            module.qk_clip_max_logits = None
            module.qk_clip_exact_above = None
            module.qk_clip_cap = self.threshold if self.cap_forward else None
            module.qk_clip_capped = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Exact maxima on the steps whose values reach the loggers; on the others only the
        # clip needs them, and a head whose Cauchy-Schwarz bound (norms of q and k) is at most
        # the threshold cannot be clipped: a layer whose every bound is under it skips the
        # Q K^T product (``head_max_logits(exact_above=...)``). clip=False needs nothing then.
        self._exact = _loggers_write_this_step(trainer)
        exact_above = None if self._exact else (self.threshold if self.clip else math.inf)
        for _, module, _ in self._modules:
            module.qk_clip_exact_above = exact_above

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # accumulating gradients: no step yet, the maxima keep folding
        self._last_step = trainer.global_step
        if self.cap_forward:
            self._check_capped()
        heads = [read() for _, _, read in self._modules]  # read once a step (FSDP may replace parameters)
        maxima = self._reduced_maxima(trainer, pl_module, heads)
        # Lightning hands on_step values to the loggers only every log_every_n_steps steps (a
        # value logged in between is overwritten unseen), and each LightningModule.log call
        # costs ~0.2 ms of Python: logged on those steps only, the loggers show the same.
        # Decided at the batch's start, where the maxima were asked exact for it.
        log = self._exact
        clipped = torch.zeros((), dtype=torch.long, device=maxima[0].device)
        for (name, _, _), layer, layout in zip(self._modules, maxima, heads):
            over = layer > self.threshold
            clipped = clipped + over.sum()
            if self.clip:
                q, k = clip_factors(layer, self.threshold, self.alpha, layout.num_kv_heads)
                apply_qk_clip(layout, q, k)
            if self.log_per_layer and log:
                pl_module.log(f"qk_clip/max_logit/{name}", layer.amax(), on_step=True, on_epoch=False)
        if log:
            pl_module.log(
                "qk_clip/max_logit", torch.stack([m.amax() for m in maxima]).amax(), on_step=True, on_epoch=False
            )
            pl_module.log("qk_clip/clipped_heads", clipped.float(), on_step=True, on_epoch=False)
        if self.clip:  # a running count on the device: no host sync per step
            self._pending = clipped if self._pending is None else self._pending + clipped
        for _, module, _ in self._modules:
            module.qk_clip_max_logits = None

    def _check_capped(self) -> None:
        """Raise for a module that recorded maxima this step without capping its queries (cap_forward)."""
        for name, module, _ in self._modules:
            if getattr(module, "qk_clip_max_logits", None) is not None and not module.qk_clip_capped:
                raise ValueError(
                    f"QKClip(cap_forward=True): attention {name!r} ({type(module).__name__}) recorded its maxima "
                    "without capping its queries: record through lightning_muon.attention.scaled_dot_product_attention"
                    "(..., module=self), or pass the query through lightning_muon.attention.capped_query"
                )
            module.qk_clip_capped = False

    def _reduced_maxima(self, trainer: pl.Trainer, pl_module: pl.LightningModule, heads: list[QKHeads]) -> list[Tensor]:
        """Each layer's ``(H,)`` maxima of this step, MAX-reduced over all ranks in one packed all-reduce.

        Over the whole world, not the data-parallel group: under tensor parallelism a rank
        records its own heads only, placed among ``-inf`` for the others
        (``global_head_maxima``), and its tensor-parallel peers hold the rest. Ranks that
        ran the same heads on the same data (tensor-parallel peers of a replicated
        attention) add nothing to a maximum, so the world is right on every mesh.
        """
        layers = []
        for (name, module, _), layout in zip(self._modules, heads):
            recorded = getattr(module, "qk_clip_max_logits", None)
            if recorded is None:  # the layer did not run this step (or does not record)
                recorded = torch.full((layout.num_heads,), float("-inf"), device=pl_module.device)
            layers.append(global_head_maxima(recorded, layout, name))
        packed = torch.cat(layers)  # (sum of H,) one tensor, one collective
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        return list(packed.split([m.numel() for m in layers]))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for _, module, _ in self._modules:
            module.qk_clip_recording = False
            module.qk_clip_max_logits = None
            module.qk_clip_exact_above = None
            module.qk_clip_cap = None
            module.qk_clip_capped = False
        self._modules = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"clipped_heads_total": self.clipped_heads_total}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._clipped_total = int(state_dict.get("clipped_heads_total", 0))
        self._pending = None
