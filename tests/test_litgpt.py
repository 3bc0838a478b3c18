"""litgpt's ``GPT`` (random init, offline): routing, Q/K/V pieces of its fused ``qkv``, a step under Muon.

litgpt 0.5.13 lays its fused ``attn.qkv`` rows out as all query heads, then all key heads,
then all value heads (``qkv.split((n_head * hs, n_query_groups * hs, n_query_groups * hs))``
in its forward), not per query group as Megatron does: ``split_qkv`` takes
``qkv_split_shapes = [n_head * hs, n_query_groups * hs, n_query_groups * hs]``, one group.
"""

from __future__ import annotations

import litgpt.model as litgpt_model
import pytest
import torch

from lightning_muon import Muon, MuonConfig, RoutingSettings
from lightning_muon.layout import MatrixLayout

pytestmark = pytest.mark.policy_free  # policy_free: see conftest.py

N_HEAD, GROUPS, N_EMBD = 4, 2, 64
HEAD = N_EMBD // N_HEAD
SHAPES = [N_HEAD * HEAD, GROUPS * HEAD, GROUPS * HEAD]  # 64, 32, 32
SPLIT_QKV = MuonConfig(routing=RoutingSettings(split_qkv=True, qkv_split_shapes=SHAPES))


def _gpt(**overrides) -> torch.nn.Module:
    config = litgpt_model.Config(
        n_layer=2,
        n_head=N_HEAD,
        n_embd=N_EMBD,
        n_query_groups=GROUPS,
        block_size=64,
        vocab_size=256,
        padded_vocab_size=256,
        mlp_class_name="LLaMAMLP",
        intermediate_size=172,
        norm_class_name="RMSNorm",
        bias=False,
        **overrides,
    )
    torch.manual_seed(0)
    return litgpt_model.GPT(config)


def test_routing_of_a_tiny_gpt():
    groups = SPLIT_QKV.route(_gpt())
    by_name = {g["name"]: g for g in groups}
    assert by_name["adamw"]["param_names"] == ["lm_head.weight", "transformer.wte.weight"]
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0 and len(by_name["adamw_no_decay"]["params"]) == 5
    muon = [n for g in groups if g["algorithm"] == "muon" for n in g["param_names"]]
    assert len(muon) == 10  # qkv, proj, fc_1, fc_2, mlp.proj per block
    assert by_name["muon_qkv"]["param_names"] == [f"transformer.h.{i}.attn.qkv.weight" for i in (0, 1)]
    assert by_name["muon_qkv"]["split_sizes"] == SHAPES


def test_split_qkv_pieces_are_litgpts_own_q_k_v():
    # Record q, k (before rotary embedding, applied to the whole head here) and v as litgpt's
    # forward computes them, and check each equals x @ piece^T for our pieces of the weight.
    model = _gpt(rotary_percentage=1.0)
    seen: dict[str, torch.Tensor] = {}
    apply_rope = litgpt_model.apply_rope

    def recording_rope(x, cos, sin):
        for key in ("q", "k"):  # block 0 applies it to q, then to k; later blocks are not recorded
            if key not in seen:
                seen[key] = x.detach().clone()
                break
        return apply_rope(x, cos, sin)

    attn = model.transformer.h[0].attn
    sdpa = attn.scaled_dot_product_attention

    def recording_sdpa(q, k, v, mask=None):
        seen["v"] = v.detach().clone()  # (B, n_head, T, hs): each kv head repeated per query head
        return sdpa(q, k, v, mask)

    x_tokens = torch.randint(256, (2, 8), generator=torch.Generator().manual_seed(1))
    h = model.transformer.wte(x_tokens)
    x = model.transformer.h[0].norm_1(h)  # what attn.qkv sees in block 0
    litgpt_model.apply_rope = recording_rope
    attn.scaled_dot_product_attention = recording_sdpa
    try:
        with torch.no_grad():
            model(x_tokens)
    finally:
        litgpt_model.apply_rope = apply_rope
        del attn.scaled_dot_product_attention
    group = next(g for g in SPLIT_QKV.route(model) if "split_sizes" in g)
    q_w, k_w, v_w = MatrixLayout(group["split_sizes"]).views(attn.qkv.weight.detach())

    def heads(w: torch.Tensor) -> torch.Tensor:  # (B, heads, T, hs), as litgpt arranges them
        return (x @ w.T).view(2, 8, -1, HEAD).transpose(1, 2)

    torch.testing.assert_close(heads(q_w), seen["q"])
    torch.testing.assert_close(heads(k_w), seen["k"])
    torch.testing.assert_close(heads(v_w).repeat_interleave(N_HEAD // GROUPS, dim=1), seen["v"])
    # Megatron's per-group sizes would cut other rows: a layout mistake shows here.
    megatron = MatrixLayout((HEAD * N_HEAD // GROUPS, HEAD, HEAD)).views(attn.qkv.weight.detach())
    assert not torch.allclose(heads(megatron[0]), seen["q"])


def test_a_muon_step_with_split_qkv_trains():
    model = _gpt()
    groups = SPLIT_QKV.route(model)
    optimizer = Muon(groups, lr=0.02, ns_dtype="float32")
    tokens = torch.randint(256, (4, 17), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
