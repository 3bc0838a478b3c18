"""Models the project did not write: GPT-2's Conv1D layout, fused QKV, timm-style heads and tables, FSDP units.

Each defect has a stand-in with the real model's layout, which always runs, and, where the
package is installed (transformers is in the dev extras), the real model class.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from lightning_muon import AdamWSettings, Muon, MuonConfig, MuonSettings, RoutingSettings, Rule, route_parameters
from lightning_muon.functional import adjust_lr_ratio
from lightning_muon.layout import MatrixLayout
from lightning_muon.newton_schulz import orthogonalize

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

D = 16


class Conv1D(nn.Module):
    """transformers' Conv1D layout under its class name: weight (fan_in, fan_out), y = x W + b."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Block(nn.Module):
    """A GPT-2 block's matrices: c_attn (d -> 3d), attn.c_proj (d -> d), c_fc (d -> 4d), mlp.c_proj (4d -> d)."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.c_attn, self.attn_proj = layer(3 * D, D), layer(D, D)
        self.c_fc, self.c_proj = layer(4 * D, D), layer(D, 4 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        q, k, v = self.c_attn(h).split(D, dim=-1)
        x = x + self.attn_proj(torch.tanh(q * k) * v)
        return x + self.c_proj(torch.tanh(self.c_fc(x)))


def _linear(out_features: int, in_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features)


class TinyGPT(nn.Module):
    def __init__(self, layer) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, D)
        self.h = nn.ModuleList([Block(layer), Block(layer)])
        self.lm_head = nn.Linear(D, 32, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


def _pair() -> tuple[TinyGPT, TinyGPT]:
    """A Conv1D GPT and an nn.Linear GPT holding the same function (weights transposed)."""
    torch.manual_seed(0)
    conv = TinyGPT(Conv1D)
    linear = TinyGPT(_linear)
    with torch.no_grad():
        for (name, p), q in zip(conv.named_parameters(), linear.parameters()):
            q.copy_(p.T if isinstance(conv.get_submodule(name.rsplit(".", 1)[0]), Conv1D) and p.ndim == 2 else p)
    return conv, linear


def _train(model: nn.Module, config: MuonConfig, steps: int = 3) -> None:
    opt = config.make_optimizer(config.route(model))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, 32, (4, 8), generator=gen)
        opt.zero_grad()
        model(idx).square().mean().backward()
        opt.step()


# ------------------------------------------------------------------------ 1. Conv1D's lr scale


def test_conv1d_weights_route_as_transposed_and_show_it_in_the_report():
    conv, _ = _pair()
    groups = route_parameters(conv)
    transposed = next(g for g in groups if g["name"] == "muon_transposed")
    assert transposed["transposed"] is True
    assert sorted(transposed["param_names"]) == sorted(
        f"h.{i}.{m}.weight" for i in range(2) for m in ("c_attn", "attn_proj", "c_fc", "c_proj")
    )
    row = next(line for line in groups.report().splitlines() if line.startswith("muon_transposed"))
    assert row.split()[2:4] == ["hidden_matrices_transposed", "in,out(T)"]


@pytest.mark.parametrize(("layer", "ratio"), [("c_attn", math.sqrt(3)), ("c_fc", 2.0), ("c_proj", 1.0)])
def test_conv1d_lr_ratio_is_fan_out_over_fan_in(layer, ratio):
    conv, linear = _pair()
    w_conv = getattr(conv.h[0], layer).weight  # (in, out)
    w_linear = getattr(linear.h[0], layer).weight  # (out, in)
    conv1d = MatrixLayout(transposed=True)
    assert adjust_lr_ratio("original", *conv1d.fans(*w_conv.shape)) == pytest.approx(ratio)
    assert adjust_lr_ratio("original", *w_linear.shape) == pytest.approx(ratio)
    assert adjust_lr_ratio("match_rms_adamw", *conv1d.fans(*w_conv.shape)) == pytest.approx(
        adjust_lr_ratio("match_rms_adamw", *w_linear.shape)
    )


@pytest.mark.parametrize("adjust_lr", ["original", "spectral_norm", "match_rms_adamw"])
def test_a_conv1d_gpt_trains_exactly_like_its_linear_twin(adjust_lr):
    """Same function, weights stored transposed: the same updates, transposed, for every layer."""
    conv, linear = _pair()
    config = MuonConfig(
        matrix=MuonSettings(lr=0.05, ns_dtype="float32", adjust_lr=adjust_lr, weight_decay=0.1),
        scalar=AdamWSettings(lr=1e-2),
    )
    _train(conv, config)
    _train(linear, config)
    for (name, p), q in zip(conv.named_parameters(), linear.parameters()):
        transposed = isinstance(conv.get_submodule(name.rsplit(".", 1)[0]), Conv1D) and p.ndim == 2
        # fp32 Newton-Schulz on G and on G^T: the same products in another order (~1e-7).
        torch.testing.assert_close(p.T if transposed else p, q, rtol=1e-4, atol=1e-6, msg=name)


# -------------------------------------------------------------------- 2. fused QKV, GPT-2 layout


def test_split_qkv_splits_gpt2_c_attn_along_its_output_axis():
    """One step with momentum 0: c_attn's update is the three orthogonalized column blocks, by hand."""
    conv, _ = _pair()
    config = MuonConfig(
        matrix=MuonSettings(lr=0.1, momentum=0.0, ns_dtype="float32"),
        routing=RoutingSettings(split_qkv=True, qkv_split_shapes=(D, D, D)),
    )
    groups = config.route(conv)
    qkv = next(g for g in groups if g["name"] == "muon_qkv_transposed")
    assert qkv["transposed"] and qkv["split_sizes"] == [D, D, D]
    assert sorted(qkv["param_names"]) == ["h.0.c_attn.weight", "h.1.c_attn.weight"]
    opt = config.make_optimizer(groups)
    W = conv.h[0].c_attn.weight
    before = W.detach().clone()
    conv(torch.randint(0, 32, (4, 8))).square().mean().backward()
    G = W.grad.clone()  # (D, 3D): Q | K | V along dim 1
    opt.step()
    blocks = [orthogonalize(G[:, i * D : (i + 1) * D], dtype="float32") for i in range(3)]
    expected = before - 0.1 * torch.cat(blocks, dim=1)  # each block D x D: the "original" ratio is 1
    torch.testing.assert_close(W.detach(), expected, rtol=0, atol=1e-6)
    # Orthogonalizing c_attn whole (what the old row split amounted to here) differs: the check can tell.
    whole = before - 0.1 * math.sqrt(3) * orthogonalize(G, dtype="float32")
    assert (whole - W.detach()).abs().max() > 1e-2


def test_split_sizes_that_do_not_fit_the_output_axis_name_the_layout():
    W = nn.Parameter(torch.randn(D, 3 * D))  # a Conv1D c_attn: (fan_in, fan_out)
    group = {"params": [("c_attn.weight", W)], "algorithm": "muon", "transposed": True, "split_sizes": [20, 20, 20]}
    with pytest.raises(
        ValueError, match=r"'c_attn\.weight'.*dim 1 has size 48.*\(fan_in, fan_out\) weight, transposed=True"
    ):
        Muon([group])


def test_split_parts_orthogonalizes_each_head_along_the_output_axis():
    """Per-head orthogonalization of GPT-2's c_attn: 3 x 4 heads of 4 columns each, checked by hand."""
    conv, _ = _pair()
    W = conv.h[0].c_attn.weight  # (D, 3D), 4 heads of D / 4 per Q, K and V
    group = {"params": [("c_attn.weight", W)], "algorithm": "muon", "transposed": True, "split_parts": 12}
    opt = Muon([group], lr=0.1, momentum=0.0, ns_dtype="float32", adjust_lr="none")
    assert opt.param_groups[0]["split_sizes"] == (4,) * 12
    before = W.detach().clone()
    W.grad = torch.randn_like(W)
    opt.step()
    heads = [orthogonalize(W.grad[:, i * 4 : (i + 1) * 4], dtype="float32") for i in range(12)]
    torch.testing.assert_close(W.detach(), before - 0.1 * torch.cat(heads, dim=1), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"split_parts=5 does not divide the output axis \(dim 1, size 48\)"):
        Muon([{**group, "split_parts": 5}])


def test_split_qkv_splits_multihead_attention_in_proj_into_q_k_v():
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(D, 4), "head": nn.Linear(D, 2)})
    config = MuonConfig(
        matrix=MuonSettings(ns_dtype="float32"), routing=RoutingSettings(split_qkv=True, qkv_split_shapes=(D, D, D))
    )
    groups = config.route(model)
    assert groups.assignments["attn.in_proj_weight"] == "mha_in_proj"
    opt = config.make_optimizer(groups)
    (group,) = [g for g in opt.param_groups if g["name"] == "muon_mha_in_proj"]
    assert group["split_sizes"] == (D, D, D)
    # split_qkv alone does the same: in_proj_weight's Q, K and V rows are known from the module, no warning.
    alone = MuonConfig(routing=RoutingSettings(split_qkv=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = alone.route(model)
    assert groups.assignments["attn.in_proj_weight"] == "mha_in_proj"
    (group,) = [g for g in alone.make_optimizer(groups).param_groups if g["name"] == "muon_mha_in_proj"]
    assert group["split_sizes"] == (D, D, D)


# ------------------------------------------------------------- 7. timm-style tables and heads


class ViTLike(nn.Module):
    """timm ViT's parameter kinds: pos_embed (1, N, D) and cls_token (1, 1, D), a classifier via get_classifier()."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, D))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.blocks = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.logits = nn.Linear(D, 10)  # a name no head rule knows

    def get_classifier(self) -> nn.Module:
        return self.logits


class ConvClassifier(nn.Module):
    """DLA / squeezenet style: the classifier is a 1x1 convolution, found through get_classifier()."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.body = nn.Conv2d(8, 8, 3)
        self.fc = nn.Conv2d(8, 10, 1)

    def get_classifier(self) -> nn.Module:
        return self.fc


def test_vit_tables_and_head_go_to_adamw():
    groups = route_parameters(ViTLike())
    algorithm = {n: g["algorithm"] for g in groups for n in g["param_names"]}
    assert algorithm["pos_embed"] == algorithm["cls_token"] == "adamw"
    assert algorithm["logits.weight"] == "adamw"
    assert algorithm["blocks.0.weight"] == algorithm["patch.weight"] == "muon"
    assert groups.assignments["pos_embed"] == groups.assignments["cls_token"] == "token_tables"
    report = groups.report()
    assert "output_head:get_classifier()" in report and "token_tables" in report


def test_a_1x1_conv_classifier_goes_to_adamw_and_the_stem_on_request():
    groups = route_parameters(ConvClassifier())
    algorithm = {n: g["algorithm"] for g in groups for n in g["param_names"]}
    assert algorithm["fc.weight"] == "adamw" and algorithm["body.weight"] == algorithm["stem.weight"] == "muon"
    groups = route_parameters(ConvClassifier(), input_layer=True)
    assert groups.assignments["stem.weight"] == "input_layer"
    config = MuonConfig(routing=RoutingSettings(input_layer=True))
    assert config.route(ConvClassifier()).assignments["stem.weight"] == "input_layer"


def test_no_head_found_warns():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    with pytest.warns(UserWarning, match=r"no output head found"):
        route_parameters(model)


def test_a_rule_can_mark_a_weight_transposed():
    model = nn.ModuleDict({"proj": Conv1D(8, 4)})
    rule = Rule(name="mine", algorithm="muon", names="proj.weight", options={"transposed": True})
    with pytest.warns(UserWarning, match="no output head found"):  # a lone layer has none
        routed = route_parameters(model, rules=[rule])
    (group,) = [g for g in routed if g["name"] == "mine"]
    assert group["transposed"] is True


# ------------------------------------------------------------------ 5. FSDP units per block


def _units(rank: int, world: int, kind: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_muon.strategies.fsdp import default_fully_shard

    mesh = init_device_mesh("cpu", (world,))
    if kind == "transformers":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16))
    else:
        model = TinyGPT(Conv1D)
    return default_fully_shard(nn.ModuleDict({"model": model}), mesh)


def _units_of_every_kind(rank: int, world: int) -> dict[str, list[str]]:
    kinds = ["stand-in"] + (["transformers"] if importlib.util.find_spec("transformers") else [])
    return {kind: _units(rank, world, kind) for kind in kinds}


@pytest.fixture(scope="module")
def fsdp_units() -> dict[str, list[str]]:
    """The FSDP units of the stand-in and of transformers' GPT-2 (where installed): one launch for both."""
    (units,) = run_distributed(_units_of_every_kind, 1)
    return units


@pytest.mark.distributed
def test_gpt2_layout_gets_one_fsdp_unit_per_block(fsdp_units):
    units = fsdp_units["stand-in"]
    assert units[:2] == ["model.h.0", "model.h.1"]


# ----------------------------------------------------------------- the real transformers classes


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def test_real_gpt2_conv1d_weights_get_linear_lr_ratios(gpt2):
    groups = route_parameters(gpt2)
    transposed = next(g for g in groups if g["name"] == "muon_transposed")
    assert len(transposed["params"]) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    ratios = {n.split(".", 3)[-1]: adjust_lr_ratio("original", *MatrixLayout(transposed=True).fans(*p.shape))
              for n, p in zip(transposed["param_names"], transposed["params"])}  # fmt: skip
    assert ratios == pytest.approx(
        {
            "attn.c_attn.weight": math.sqrt(3),
            "attn.c_proj.weight": 1.0,
            "mlp.c_fc.weight": 2.0,
            "mlp.c_proj.weight": 1.0,
        }
    )


def test_real_gpt2_split_qkv_orthogonalizes_q_k_v(gpt2):
    config = MuonConfig(
        matrix=MuonSettings(lr=0.1, momentum=0.0, ns_dtype="float32"),
        routing=RoutingSettings(split_qkv=True, qkv_split_shapes=(64, 64, 64)),
    )
    groups = config.route(gpt2)
    qkv = next(g for g in groups if g["name"] == "muon_qkv_transposed")
    assert [n.split(".", 3)[-1] for n in qkv["param_names"]] == ["attn.c_attn.weight"] * 2
    opt = config.make_optimizer(groups)  # sizes fit (64, 192)
    W = gpt2.transformer.h[0].attn.c_attn.weight
    before = W.detach().clone()
    gpt2(torch.randint(0, 128, (2, 16))).logits.square().mean().backward()
    G = W.grad.clone()
    opt.step()
    blocks = [orthogonalize(G[:, i * 64 : (i + 1) * 64], dtype="float32") for i in range(3)]  # Q | K | V
    torch.testing.assert_close(W.detach(), before - 0.1 * torch.cat(blocks, dim=1), rtol=0, atol=1e-6)


@pytest.mark.distributed
def test_real_gpt2_gets_one_fsdp_unit_per_block(fsdp_units):
    pytest.importorskip("transformers")
    units = fsdp_units["transformers"]
    assert units[:2] == ["model.transformer.h.0", "model.transformer.h.1"]
