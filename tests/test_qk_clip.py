"""QKClip: per-head maxima, the clip rule (GQA, fused c_attn), logging, resumption, YAML, 2 ranks.

The logits checked after a clip are recomputed here by hand (q and k from the weights,
RoPE from transformers' own function), not by the code under test.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from dist_utils import run_distributed
from qk_clip_modules import (
    BLOCK,
    EMBD,
    HEADS,
    PLANT,
    PLANTED,
    TAU,
    DumpingGPT,
    PlantedGPT,
    fit_worker,
    plant,
    tokens,
    trainer,
)
from torch import nn

from lightning_muon import QKClip
from lightning_muon.attention import (
    QKHeads,
    capped_query,
    clip_factors,
    global_head_maxima,
    head_max_logits,
    record_max_logits,
)
from lightning_muon.attention import maxima as maxima_module
from lightning_muon.attention.maxima import is_recording

ROOT = Path(__file__).resolve().parents[1]
# Q and K scaled by eta^alpha and eta^(1-alpha) in fp32: the recomputed maximum is tau up
# to a few roundings of the weights and the q . k sums (relative ~1e-6).
ROUNDING = 1e-5


def _brute_max(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """``(H,)`` max of ``scale * q . k`` over allowed positions, GQA keys repeated the plain way."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3)).float()


def test_head_max_logits_against_brute_force(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 7, 4, generator=gen), torch.randn(2, 3, 7, 4, generator=gen)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    padding = torch.rand(2, 1, 7, 7, generator=gen) > 0.4
    additive = torch.zeros(2, 1, 7, 7).masked_fill(~padding, torch.finfo(torch.float32).min) - 0.25  # bias left out
    torch.testing.assert_close(head_max_logits(q, k, is_causal=True), _brute_max(q, k, causal, 0.5))
    torch.testing.assert_close(head_max_logits(q, k, attn_mask=padding, scale=0.3), _brute_max(q, k, padding, 0.3))
    torch.testing.assert_close(head_max_logits(q, k, attn_mask=additive), _brute_max(q, k, padding, 0.5))
    monkeypatch.setattr(maxima_module, "_MAX_SCORE_ELEMENTS", 40)  # query blocks of one row
    torch.testing.assert_close(head_max_logits(q, k, is_causal=True), _brute_max(q, k, causal, 0.5))
    torch.testing.assert_close(
        head_max_logits(q, k, attn_mask=padding, is_causal=True), _brute_max(q, k, padding & causal, 0.5)
    )


def test_head_max_logits_bounds_only_when_every_head_is_under_exact_above():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    exact = _brute_max(q, k, causal, 8**-0.5)
    bound = (
        8**-0.5
        * torch.linalg.vector_norm(q, dim=-1).amax(dim=(0, 2))
        * torch.linalg.vector_norm(k, dim=-1).amax(dim=(0, 2)).repeat_interleave(2)
    )
    assert torch.all(bound > exact)  # random directions: the bound is loose
    # Every bound under exact_above: the bounds come back (no head can be over it).
    got = head_max_logits(q, k, is_causal=True, exact_above=float(bound.max()))
    torch.testing.assert_close(got, bound)
    # One bound over it: every head is measured.
    torch.testing.assert_close(head_max_logits(q, k, is_causal=True, exact_above=float(bound.min())), exact)
    q[1, 2, 3, 0] = float("nan")  # a NaN bound is never "under": measured, NaN for its head
    assert head_max_logits(q, k, is_causal=True, exact_above=1e9)[2].isnan()


def test_unlogged_steps_clip_exactly_as_if_every_step_were_measured(tmp_path, monkeypatch):
    """Between logging steps a layer whose q, k norms bound every head under tau skips Q K^T.

    Layer 1 un-planted (logits far under tau), layer 0 planted (over it): over 4 Muon steps,
    logging every step and logging every 4th step clip the same heads by the same factors,
    bit for bit, and step 4's logged maxima are equal; the second run measured layer 1 once.
    """
    measured = []
    original = maxima_module._measured_maxima
    monkeypatch.setattr(maxima_module, "_measured_maxima", lambda *a: measured.append(1) or original(*a))
    runs = []
    for every in (1, 4):
        measured.clear()
        model = PlantedGPT()
        plant(model.model, {1: PLANTED[1]}, 1 / PLANT)
        model, fit = _fit(tmp_path / str(every), 4, [QKClip(threshold=TAU)], model=model, log_every_n_steps=every)
        runs.append((dict(model.named_parameters()), dict(fit.callback_metrics), fit.callbacks[0], len(measured)))
    (params_1, logged_1, clip_1, measured_1), (params_4, logged_4, clip_4, measured_4) = runs
    assert (measured_1, measured_4) == (8, 5)  # 2 layers x 4 steps; layer 0 every step + layer 1 at step 4
    for name, p in params_1.items():
        assert torch.equal(p, params_4[name]), name
    assert clip_1.clipped_heads_total == clip_4.clipped_heads_total > 0  # layer 0's planted head
    for key in ("qk_clip/max_logit", "qk_clip/clipped_heads", "qk_clip/max_logit/model.blocks.1.attn"):
        assert torch.equal(logged_1[key], logged_4[key]), key


def test_gqa_rule_and_bad_arguments():
    # 4 query heads on 2 key heads: head 1 of group 0 clipped (eta 0.25), group 1 both clipped.
    q, k = clip_factors(torch.tensor([2.0, 8.0, 4.0, 3.0]), 2.0, 0.5, num_kv_heads=2)
    torch.testing.assert_close(q, torch.tensor([1.0, 0.5, 0.5**0.5, (2 / 3) ** 0.5]))
    torch.testing.assert_close(k, torch.tensor([0.5, 0.5**0.5]))  # each group's smallest eta, ^(1 - alpha)
    # Every head of a group ends at or under tau: eta_h^alpha * min(eta)^(1-alpha) * S_h <= tau.
    assert torch.all(torch.tensor([2.0, 8.0, 4.0, 3.0]) * q * k.repeat_interleave(2) <= 2.0 + 1e-6)
    for bad, match in (
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=math.inf), "threshold"),
        (dict(alpha=1.5), "alpha"),
        (dict(names=[]), "names"),
        (dict(clip="yes"), "clip"),
        (dict(cap_forward=1), "cap_forward"),
        (dict(cap_forward=True, clip=False), "needs clip=True"),
    ):
        with pytest.raises(ValueError, match=match):
            QKClip(**bad)
    w = nn.Parameter(torch.zeros(6, 4))
    with pytest.raises(ValueError, match="num_kv_heads"):
        QKHeads(w, w, num_heads=3, num_kv_heads=2, head_dim=1)
    with pytest.raises(ValueError, match="need 8 outputs"):
        QKHeads(w, w, num_heads=2, num_kv_heads=2, head_dim=2, k_offset=4)


def test_global_head_maxima_refuses_what_it_cannot_place():
    # (H,) maxima pass through; fewer (a tensor-parallel rank's own heads) need a q weight split
    # by heads on one mesh dim. Placed on a 2 x 2 mesh: tests/test_tp_strategy.py.
    q, k = nn.Parameter(torch.zeros(8, 4)), nn.Parameter(torch.zeros(4, 4))
    heads = QKHeads(q, k, num_heads=4, num_kv_heads=2, head_dim=2)
    full = torch.arange(4.0)
    assert global_head_maxima(full, heads, "blocks.0.attn") is full
    with pytest.raises(ValueError, match="'blocks.0.attn' recorded 5 maxima for its 4 query heads"):
        global_head_maxima(torch.zeros(5), heads, "blocks.0.attn")
    with pytest.raises(ValueError, match="'blocks.0.attn' recorded 2 maxima .* q_weight is not a DTensor"):
        global_head_maxima(torch.zeros(2), heads, "blocks.0.attn")
    fused = QKHeads(q, q, num_heads=2, num_kv_heads=2, head_dim=2, k_offset=4)
    with pytest.raises(ValueError, match="'blocks.0.attn' .* fused Q/K weight under tensor parallelism"):
        global_head_maxima(torch.zeros(1), fused, "blocks.0.attn")


def _layer_inputs(model: PlantedGPT) -> list[torch.Tensor]:
    """What each block's attention reads on the fixed batch: ``ln1`` of the residual stream."""
    rows = tokens()[:, :-1]
    inputs = []
    with torch.no_grad():
        x = model.model.tok_emb(rows) + model.model.pos_emb(torch.arange(BLOCK))
        for block in model.model.blocks:
            inputs.append(block.ln1(x))
            x = block(x)
    return inputs


def _demo_maxima(model: PlantedGPT, inputs: list[torch.Tensor]) -> torch.Tensor:
    """``(layers, H)`` max logits of ``model``'s ``qkv`` weights on the given attention inputs, by hand.

    The clip bounds the logits of the inputs the step's forward saw; later layers' inputs
    change once earlier layers are clipped, so the check holds the inputs fixed.
    """
    out = []
    with torch.no_grad():
        for block, h in zip(model.model.blocks, inputs):
            q, k, _ = block.attn.qkv(h).split(EMBD, dim=2)
            q, k = (t.view(*t.shape[:2], HEADS, -1).transpose(1, 2) for t in (q, k))
            causal = torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril()
            out.append(_brute_max(q, k, causal, (EMBD // HEADS) ** -0.5))
    return torch.stack(out)


def _fit(root, steps, callbacks, model=None, **kwargs):
    model = model or PlantedGPT()
    fit = trainer(root, steps, callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset and logging notices
        fit.fit(model)
    return model, fit


def _row_factors(layer: int, eta: torch.Tensor) -> torch.Tensor:
    """``(3d,)`` factor per ``qkv`` output row: eta^(1/2) on a planted head's Q and K rows, else 1."""
    hd = EMBD // HEADS
    factor = torch.ones(3 * EMBD)
    for h in PLANTED[layer]:
        for block_start in (0, EMBD):  # the Q block, the K block
            factor[block_start + h * hd : block_start + (h + 1) * hd] = eta[layer, h] ** 0.5
    return factor


def _assert_clipped(after: dict, reference: dict, eta: torch.Tensor) -> None:
    """``after`` is ``reference`` with the planted heads' Q/K rows times eta^(1/2), every other bit equal."""
    for name, p in after.items():
        if ".attn.qkv." not in name:
            assert torch.equal(p, reference[name]), name
            continue
        factor = _row_factors(int(name.split(".")[2]), eta)
        keep = factor == 1  # heads under tau, and V
        assert torch.equal(p[keep], reference[name][keep]), name
        expect = reference[name] * (factor[:, None] if p.ndim == 2 else factor)
        torch.testing.assert_close(p[~keep], expect[~keep], rtol=1e-6, atol=0)


def test_planted_heads_land_on_tau_and_the_rest_stay_bitwise(tmp_path):
    # 1) Weights frozen by the optimizer (SGD, lr 0), so the clip is all that changes them:
    #    every recomputed maximum is <= tau, the clipped ones at tau (not over-clipped),
    #    and every other head's logits and weights are bitwise what they were.
    model = PlantedGPT(optimizer="sgd0")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = _layer_inputs(model)
    s_before = _demo_maxima(model, inputs)
    planted = torch.zeros_like(s_before, dtype=torch.bool)
    for layer, heads in PLANTED.items():
        planted[layer, heads] = True
    assert torch.all(s_before[planted] > 10 * TAU) and torch.all(s_before[~planted] < TAU)
    eta = torch.where(planted, TAU / s_before, torch.ones_like(s_before))
    _fit(tmp_path, 1, [QKClip(threshold=TAU)], model=model)
    s_after = _demo_maxima(model, inputs)
    assert torch.all(s_after <= TAU * (1 + ROUNDING)), s_after
    torch.testing.assert_close(s_after[planted], torch.full_like(s_after[planted], TAU), rtol=ROUNDING, atol=0)
    assert torch.equal(s_after[~planted], s_before[~planted])
    _assert_clipped(dict(model.named_parameters()), start, eta)

    # 2) A real Muon step against the same step with clip=False: heads under tau are
    #    bitwise the unclipped run's; clipped heads are it times eta^alpha (Q) and
    #    eta^(1-alpha) (K), eta from the maxima the step's forward saw (before the update).
    clipped, fit_on = _fit(tmp_path / "on", 1, [QKClip(threshold=TAU)])
    plain, fit_off = _fit(tmp_path / "off", 1, [QKClip(threshold=TAU, clip=False)])
    _assert_clipped(dict(clipped.named_parameters()), dict(plain.named_parameters()), eta)
    assert fit_on.callbacks[0].clipped_heads_total == 2 and fit_off.callbacks[0].clipped_heads_total == 0
    for fit in (fit_on, fit_off):  # logged through LightningModule.log, the maxima before clipping
        logged = fit.callback_metrics
        assert logged["qk_clip/clipped_heads"] == 2
        for layer in range(2):
            torch.testing.assert_close(
                logged[f"qk_clip/max_logit/model.blocks.{layer}.attn"], s_before[layer].max(), rtol=1e-5, atol=0
            )
        torch.testing.assert_close(logged["qk_clip/max_logit"], s_before.max(), rtol=1e-5, atol=0)


def _spy_softmax_logits(monkeypatch) -> list[torch.Tensor]:
    """Replace torch's SDPA by itself plus a record of the ``(H,)`` max logits it is handed (training forwards).

    What the softmax of each attention call actually saw, by hand from the query and key it
    received (the drop-in and transformers' SDPA path both call torch's function).
    """
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if torch.is_grad_enabled():
            Tq, Tk = query.shape[-2], key.shape[-2]
            allowed = torch.ones(Tq, Tk, dtype=torch.bool)
            if is_causal:
                allowed = allowed.tril()
            if attn_mask is not None:
                keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
                allowed = allowed & keep
            seen.append(_brute_max(query.detach(), key.detach(), allowed, scale or query.shape[-1] ** -0.5))
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    **kwargs)  # fmt: skip

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def test_cap_forward_keeps_every_training_softmax_under_tau(tmp_path, monkeypatch):
    # Real Muon steps (lr 0.02) on the planted model. By default the step's forward uses the
    # planted heads' logits as they are (far over tau) and the clip follows the step; with
    # cap_forward every softmax of every step gets logits <= tau, including those the
    # previous update pushed back over it.
    seen = _spy_softmax_logits(monkeypatch)
    _fit(tmp_path / "default", 3, [QKClip(threshold=TAU)])
    default = torch.stack(seen)  # (steps x layers, H)
    seen.clear()
    _, fit = _fit(tmp_path / "cap", 3, [QKClip(threshold=TAU, cap_forward=True)])
    capped = torch.stack(seen)
    assert capped.shape == default.shape == (3 * 2, HEADS)
    assert default[0, PLANTED[0]].min() > 10 * TAU  # the spy sees the uncapped logits
    assert torch.all(capped <= TAU * (1 + ROUNDING)), capped
    # Layer 0 of the first forward (same weights and inputs in both runs): the planted head
    # lands on tau, not under it, and the other head's queries pass bitwise unchanged.
    first, other = PLANTED[0][0], 1 - PLANTED[0][0]
    torch.testing.assert_close(capped[0, first], torch.tensor(TAU), rtol=ROUNDING, atol=0)
    assert torch.equal(capped[0, other], default[0, other])
    # The weights are still clipped after each step, by the maxima before the cap (the
    # capped ones never exceed tau, so no head would count as clipped).
    assert fit.callbacks[0].clipped_heads_total >= 2


class _SelfRecordingAttention(nn.Module):
    """A protocol attention that records its maxima itself (``record_max_logits``), optionally capping."""

    def __init__(self, cap: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(EMBD, 3 * EMBD)
        self.cap = cap

    def qk_clip_heads(self) -> QKHeads:
        return QKHeads(self.qkv.weight, self.qkv.weight, HEADS, HEADS, EMBD // HEADS, k_offset=EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(*x.shape[:2], HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(EMBD, dim=2))
        if is_recording(self):
            maxima = head_max_logits(q, k, is_causal=True)
            record_max_logits(self, maxima)
            if self.cap:
                q = capped_query(self, q, maxima)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


class _SelfRecordingModule(pl.LightningModule):
    def __init__(self, cap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = _SelfRecordingAttention(cap)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, BLOCK, EMBD)), batch_size=4)

    def training_step(self, batch, batch_idx):
        return self.attn(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_cap_forward_refuses_an_attention_that_records_without_capping(tmp_path):
    with pytest.raises(ValueError, match="'attn'.*without capping"):
        _fit(tmp_path / "no", 1, [QKClip(threshold=0.01, cap_forward=True)], model=_SelfRecordingModule(cap=False))
    _, fit = _fit(tmp_path / "yes", 2, [QKClip(threshold=0.01, cap_forward=True)], model=_SelfRecordingModule(cap=True))
    assert fit.global_step == 2 and fit.callbacks[0].clipped_heads_total > 0
    # flex attention hands out its maxima after the attention: no cap possible there.
    module = nn.Linear(1, 1)
    module.qk_clip_recording, module.qk_clip_cap = True, 1.0
    q = torch.randn(1, HEADS, BLOCK, 4)
    with pytest.raises(ValueError, match="cap_forward"):
        maxima_module.flex_attention(q, q, q, module=module)


class _HFModule(pl.LightningModule):
    """A transformers causal LM on one fixed batch, stepped by SGD at lr 0 (only the clip moves weights)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(5))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _hf_case(kind: str):
    """(model, attention module, by-hand (H,) maxima on fixed inputs, planted Q head, its key head)."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama_gqa":  # 4 query heads on 2 key heads of 8 dims, RoPE
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, attn_implementation="sdpa",
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        attn = model.model.layers[0].self_attn
        with torch.no_grad():  # Q head 0 x40 and its key head 0 x10: head 0 x400, head 1 x10
            attn.q_proj.weight[0:8] *= 40.0
            attn.k_proj.weight[0:8] *= 10.0
    elif kind == "bert_query_key":  # an encoder: query / key, no GQA, every query sees every key
        config = transformers.BertConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
        )  # fmt: skip
        model = transformers.BertForMaskedLM(config)
        attn = model.bert.encoder.layer[0].attention.self
        with torch.no_grad():  # head 0 x400
            attn.query.weight[0:8] *= 40.0
            attn.key.weight[0:8] *= 10.0
    else:  # GPT-2: fused c_attn, Conv1D (fan_in, fan_out); head 2's Q and K columns x40
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # the by-hand inputs must be the forward's
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        attn = model.transformer.h[0].attn
        with torch.no_grad():
            attn.c_attn.weight[:, 16:24] *= 40.0
            attn.c_attn.weight[:, 32 + 16 : 32 + 24] *= 40.0
    seen = {}
    proj = {"llama_gqa": "q_proj", "bert_query_key": "query"}.get(kind, "c_attn")
    proj = getattr(attn, proj)
    handle = proj.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach()))
    module = _HFModule(model)
    batch = next(iter(module.train_dataloader()))[0]
    with torch.no_grad():
        model(input_ids=batch)
    handle.remove()
    x = seen["x"]  # (B, T, 32): what the projections read

    def maxima() -> torch.Tensor:
        with torch.no_grad():
            T = x.shape[1]
            if kind == "llama_gqa":
                from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

                q = attn.q_proj(x).view(*x.shape[:2], 4, 8).transpose(1, 2)
                k = attn.k_proj(x).view(*x.shape[:2], 2, 8).transpose(1, 2)
                cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
            elif kind == "bert_query_key":
                q, k = (proj(x).view(*x.shape[:2], 4, 8).transpose(1, 2) for proj in (attn.query, attn.key))
                return _brute_max(q, k, torch.ones(T, T, dtype=torch.bool), 8**-0.5)
            else:
                q, k, _ = attn.c_attn(x).split(32, dim=2)
                q, k = (t.view(*t.shape[:2], 4, 8).transpose(1, 2) for t in (q, k))
            return _brute_max(q, k, torch.ones(T, T, dtype=torch.bool).tril(), 8**-0.5)

    return module, attn, maxima


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2_c_attn", "bert_query_key"])
def test_hugging_face_attention_gqa_and_fused_c_attn(tmp_path, kind):
    module, attn, maxima = _hf_case(kind)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    s_before = maxima()
    planted = 2 if kind == "gpt2_c_attn" else 0
    assert s_before[planted] > 10 * TAU and torch.all(torch.cat([s_before[:planted], s_before[planted + 1 :]]) < TAU)
    eta = TAU / s_before[planted]
    _, fit = _fit(tmp_path, 1, [QKClip(threshold=TAU)], model=module)
    # What the registered attention function recorded (after RoPE) is the by-hand maximum.
    name = {
        "llama_gqa": "model.model.layers.0.self_attn",
        "gpt2_c_attn": "model.transformer.h.0.attn",
        "bert_query_key": "model.bert.encoder.layer.0.attention.self",
    }[kind]
    torch.testing.assert_close(fit.callback_metrics[f"qk_clip/max_logit/{name}"], s_before.max(), rtol=1e-5, atol=0)
    assert attn.config._attn_implementation == "qk_clip_sdpa"
    s_after = maxima()
    assert torch.all(s_after <= TAU * (1 + ROUNDING)), s_after
    torch.testing.assert_close(s_after[planted], torch.tensor(TAU), rtol=ROUNDING, atol=0)
    params = dict(module.named_parameters())
    if kind == "llama_gqa":
        q, k = params[f"{name}.q_proj.weight"], params[f"{name}.k_proj.weight"]
        q0, k0 = start[f"{name}.q_proj.weight"], start[f"{name}.k_proj.weight"]
        torch.testing.assert_close(q[0:8], q0[0:8] * eta**0.5, rtol=1e-6, atol=0)
        assert torch.equal(q[8:], q0[8:])  # Q heads 1-3 keep their weights
        # Key head 0 serves query heads 0 and 1: it takes the smaller eta (head 0's), so
        # head 1, under tau, shrinks too, by eta^(1 - alpha); key head 1 is untouched.
        torch.testing.assert_close(k[0:8], k0[0:8] * eta**0.5, rtol=1e-6, atol=0)
        assert torch.equal(k[8:], k0[8:])
        torch.testing.assert_close(s_after[1], s_before[1] * eta**0.5, rtol=ROUNDING, atol=0)
        assert torch.equal(s_after[2:], s_before[2:])
    elif kind == "bert_query_key":  # one key head per query head: only head 0 moves
        for proj in ("query", "key"):
            w, w0 = params[f"{name}.{proj}.weight"], start[f"{name}.{proj}.weight"]
            torch.testing.assert_close(w[0:8], w0[0:8] * eta**0.5, rtol=1e-6, atol=0)
            assert torch.equal(w[8:], w0[8:])
        assert torch.equal(s_after[1:], s_before[1:])
    else:
        for suffix in ("weight", "bias"):
            w, w0 = params[f"{name}.c_attn.{suffix}"], start[f"{name}.c_attn.{suffix}"]
            cols = torch.zeros(96, dtype=torch.bool)
            cols[16:24] = cols[48:56] = True  # head 2 of Q, head 2 of K (columns: Conv1D's fan_out)
            torch.testing.assert_close(w[..., cols], w0[..., cols] * eta**0.5, rtol=1e-6, atol=0)
            assert torch.equal(w[..., ~cols], w0[..., ~cols])  # other heads and all of V
        assert torch.equal(torch.cat([s_after[:2], s_after[3:]]), torch.cat([s_before[:2], s_before[3:]]))
    moved = (".q_proj.", ".k_proj.", ".c_attn.", ".query.", ".key.")
    untouched = [n for n in params if not any(m in n for m in moved)]
    assert untouched and all(torch.equal(params[n], start[n]) for n in untouched)


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2_c_attn", "bert_query_key"])
def test_cap_forward_through_the_hugging_face_attention_function(tmp_path, monkeypatch, kind):
    # The registered transformers function caps per query head: with GQA, query head 0
    # (planted) lands on tau while head 1, on the same key head, keeps its logits.
    module, _, maxima = _hf_case(kind)
    s_before = maxima()
    seen = _spy_softmax_logits(monkeypatch)
    _fit(tmp_path, 1, [QKClip(threshold=TAU, cap_forward=True)], model=module)
    (used,) = seen
    planted = 2 if kind == "gpt2_c_attn" else 0
    torch.testing.assert_close(used[planted], torch.tensor(TAU), rtol=ROUNDING, atol=0)
    rest = torch.arange(len(used)) != planted
    torch.testing.assert_close(used[rest], s_before[rest], rtol=1e-5, atol=1e-6)
    assert torch.all(used[rest] < TAU)


def test_checkpoint_and_resume_equal_an_uninterrupted_run(tmp_path):
    # Muon steps with the planted heads clipped; 2 + 2 steps through a checkpoint against 4.
    straight, fit = _fit(tmp_path / "straight", 4, [QKClip(threshold=TAU)])
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _fit(tmp_path / "first", 2, [QKClip(threshold=TAU), saver], enable_checkpointing=True)
    (ckpt,) = (tmp_path / "ckpt").glob("*step=2.ckpt")
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert saved["QKClip{'threshold': 1.0, 'alpha': 0.5, 'names': None}"]["clipped_heads_total"] >= 2
    resumed_clip = QKClip(threshold=TAU)
    resumed = PlantedGPT()
    fit_resumed = trainer(tmp_path / "second", 4, [resumed_clip])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_resumed.fit(resumed, ckpt_path=ckpt)
    assert fit.callbacks[0].clipped_heads_total >= 2  # the two planted heads, at least on the first step
    assert resumed_clip.clipped_heads_total == fit.callbacks[0].clipped_heads_total
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["muon_ddp_spawn", "muon_fsdp"])
def test_two_ranks_equal_one_process(tmp_path, strategy):
    # Each rank sees half of the global batch, so each rank's maxima differ; after the MAX
    # all-reduce every rank clips alike (muon_ddp: whole replicas; muon_fsdp: its own
    # DTensor rows of qkv, the K block split across the two ranks' shards).
    steps = 3
    one, fit_one = _fit(tmp_path / "one", steps, [QKClip(threshold=TAU)])
    reference = {n: p.detach() for n, p in one.named_parameters()}
    if strategy == "muon_ddp_spawn":  # Lightning spawns the ranks; each writes a file
        dump = tmp_path / "dump"
        dump.mkdir()
        _fit(tmp_path / "two", steps, [QKClip(threshold=TAU)], model=DumpingGPT(dump_dir=str(dump)),
             devices=2, strategy=strategy)  # fmt: skip
        results = [torch.load(dump / f"rank{r}.pt", weights_only=True) for r in range(2)]
    else:  # processes started as torchrun would
        results = run_distributed(fit_worker, 2, strategy, steps, str(tmp_path / "two"))
    assert len(results) == 2
    for rank, result in enumerate(results):
        assert result["step"] == steps and result["clipped"] == fit_one.callbacks[0].clipped_heads_total > 0, rank
        for name, ref in reference.items():
            # fp32 Newton-Schulz; only the order of the gradient sums differs (~1e-7 relative).
            torch.testing.assert_close(
                result["params"][name], ref, rtol=1e-5, atol=2e-6, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )


@pytest.mark.distributed
def test_cap_forward_on_two_ranks_keeps_the_replicas_equal(tmp_path):
    # Each rank caps its own forward by its own maxima (no collective inside the forward);
    # the weights are clipped after the step by the maxima of both, so replicas stay equal.
    results = run_distributed(fit_worker, 2, "muon_ddp", 2, str(tmp_path), True)
    assert [r["step"] for r in results] == [2, 2]
    assert results[0]["clipped"] == results[1]["clipped"] >= 2
    for name, p in results[0]["params"].items():
        assert torch.isfinite(p).all() and torch.equal(p, results[1]["params"][name]), name


def test_yaml_config_trains_with_qk_clip_and_logs_to_csv(tmp_path):
    # examples/qk_clip/config.yaml through the CLI, shrunk; a threshold the fresh demo GPT's
    # logits already exceed, so heads are clipped from the first step.
    from lightning_muon.cli import MuonCLI

    args = [
        "fit", f"--config={ROOT / 'examples/qk_clip/config.yaml'}", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks.init_args.threshold=0.01", "--model.init_args.n_layer=1",
        "--model.init_args.n_embd=32", "--model.init_args.block_size=16", "--data.init_args.block_size=16",
        "--data.init_args.max_chars=20000", "--data.init_args.batch_size=4", "--data.init_args.val_samples=8",
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = MuonCLI(args=args)
    (clip,) = [c for c in cli.trainer.callbacks if isinstance(c, QKClip)]
    assert (clip.threshold, clip.alpha, clip.clip) == (0.01, 0.5, True)
    import csv

    (metrics,) = tmp_path.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("qk_clip/clipped_heads")]
    assert len(rows) == 2
    assert {"qk_clip/max_logit", "qk_clip/max_logit/model.blocks.0.attn"} <= rows[0].keys()
    assert float(rows[0]["qk_clip/clipped_heads"]) > 0 and float(rows[0]["qk_clip/max_logit"]) > 0.01
