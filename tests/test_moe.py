"""Mixture-of-experts models: transformers 5's fused expert stacks get, expert by expert and
piece by piece, the update Muon gives transformers 4's layout (one ``nn.Linear`` per gate,
up and down projection of every expert); biases and routers go where the routing says."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.testing import assert_close
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_muon import (
    Muon,
    MuonConfig,
    MuonHyperballSettings,
    MuonModuleMixin,
    MuonSettings,
    Rule,
    route_parameters,
)
from lightning_muon.layout import MatrixLayout

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]

H, INTER, E = 32, 24, 4  # hidden size, expert intermediate size, experts
COMMON = dict(hidden_size=H, num_attention_heads=4, vocab_size=64, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": dict(COMMON, intermediate_size=INTER, num_hidden_layers=1, num_key_value_heads=2, num_local_experts=E),
    "qwen3_moe": dict(
        COMMON,
        intermediate_size=INTER,
        moe_intermediate_size=INTER,
        num_hidden_layers=1,
        num_key_value_heads=2,
        num_experts=E,
        head_dim=8,
    ),
    "deepseek_v3": dict(
        COMMON,
        intermediate_size=48,
        moe_intermediate_size=INTER,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        n_routed_experts=E,
        n_shared_experts=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_group=2,
        topk_group=1,
    ),
    "gpt_oss": dict(
        COMMON, intermediate_size=INTER, num_hidden_layers=1, num_key_value_heads=2, num_local_experts=E, head_dim=8
    ),
}
VARIANTS = {
    "muon": {},
    # Our forms: Emerging-Optimizers' keep one NorMuon statistic per output and one NAMO scale per
    # expert for a split gate/up stack, where separate Linears would take their own.
    "normuon": dict(second_moment="normuon_rms"),
    "adamuon": dict(second_moment="adamuon_rms"),
    "cautious": dict(weight_decay_method="cautious"),
    "hyperball": dict(algorithm="muon_hyperball"),  # each expert's gate, up and down on its own sphere
    "hyperball-radius": dict(algorithm="muon_hyperball", hyperball_radius=2.0),
}
HP = dict(lr=0.05, weight_decay=0.1, ns_dtype="float32", adjust_lr="original")


def optimizer(params, algorithm: str, options: dict) -> Muon:
    """``Muon`` whose ``algorithm`` groups start from HP and ``options`` (Muon's keywords, or the settings of
    muon_hyperball, which Muon's keywords do not set)."""
    if algorithm == "muon":
        return Muon(params, **HP, **options)
    return Muon(params, settings=[MuonHyperballSettings(**HP, **options)])


def tiny(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **CONFIGS[model_type]))
    with torch.no_grad():
        for p in model.parameters():  # transformers leaves some stacks uninitialised on CPU
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def linear_pieces(name: str, w: torch.Tensor, transposed: bool, interleaved: bool) -> list[torch.Tensor]:
    """Transformers 4's per-expert ``nn.Linear`` weights ``(out, in)`` of one stack, in a fixed order.

    Views where the stack is (out, in) and concatenated; otherwise copies (compared, not stepped).
    """
    out = []
    for e in range(w.shape[0]):
        m = w[e].T if transposed else w[e]  # (out, in), as nn.Linear stores it
        if name.endswith("gate_up_proj"):
            half = m.shape[0] // 2
            out += [m[0::2], m[1::2]] if interleaved else [m[:half], m[half:]]
        else:
            out.append(m)
    return out


def stacks_of(model: nn.Module) -> dict[str, tuple[nn.Parameter, bool, bool]]:
    """Expert stacks by name: (parameter, transposed, interleaved gate/up), read from the modules."""
    found = {}
    for prefix, m in model.named_modules():
        if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts"):
            transposed = bool(getattr(m, "is_transposed", False))
            interleaved = type(m).__name__ == "GptOssExperts"
            for leaf in ("gate_up_proj", "down_proj"):
                found[f"{prefix}.{leaf}"] = (getattr(m, leaf), transposed, interleaved)
    return found


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_expert_stacks_step_like_one_linear_per_expert(model_type, variant):
    model = tiny(model_type)
    stacks = stacks_of(model)
    assert len(stacks) == 2
    algorithm = VARIANTS[variant].get("algorithm", "muon")
    options = {k: v for k, v in VARIANTS[variant].items() if k != "algorithm"}
    groups = route_parameters(model, matrix_algorithm=algorithm)
    # Reference: transformers 4's layout, every expert's gate, up and down its own matrix.
    reference = {
        name: [nn.Parameter(m.detach().clone()) for m in linear_pieces(name, p.detach(), t, il)]
        for name, (p, t, il) in stacks.items()
    }
    ours = optimizer(groups, algorithm, options)
    reference_group = {"params": [q for qs in reference.values() for q in qs], "algorithm": algorithm}
    ref = optimizer([reference_group], algorithm, options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for name, (p, t, il) in stacks.items():
            g = torch.randn(p.shape, generator=gen)
            p.grad = g
            for q, gq in zip(reference[name], linear_pieces(name, g, t, il)):
                q.grad = gq.contiguous()
        ours.step()
        ref.step()
    for name, (p, t, il) in stacks.items():
        got = torch.stack([m.contiguous() for m in linear_pieces(name, p.detach(), t, il)])
        want = torch.stack([q.detach() for q in reference[name]])
        errors = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)  # per expert and piece
        assert errors.max() < 1e-6, (name, errors.max())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_routing_of_moe_models(model_type):
    model = tiny(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tensor is flattened silently, nothing else warns
        groups = route_parameters(model)
    by_name = {n: g for g in groups for n in g["param_names"]}
    stacks = stacks_of(model)
    for name, (_, transposed, interleaved) in stacks.items():
        group = by_name[name]
        assert group["algorithm"] == "muon" and group["batched"] is True and group["transposed"] is transposed
        if name.endswith("gate_up_proj"):
            assert group["split_sizes"] == ((1, 1) if interleaved else (INTER, INTER))
        else:
            assert group.get("split_sizes") is None
        assert groups.experts[name].experts == E
    for name, _ in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias" or leaf.endswith("_bias"):
            assert by_name[name]["name"] == "adamw_no_decay", name  # GPT-OSS's (E, 2I) bias stacks too
        if ".router." in name or name.endswith("mlp.gate.weight"):
            assert by_name[name]["algorithm"] == "adamw", name
    report = groups.report()
    assert f"Expert stacks ({len(stacks)})" in report
    for name in stacks:
        assert f"{name}  E={E}" in report
    # The pieces' shapes are in the report: E x rows x cols, per piece.
    gate_up = next(n for n in stacks if n.endswith("gate_up_proj"))
    piece = f"{E}x{H}x{INTER}" if stacks[gate_up][1] else f"{E}x{INTER}x{H}"
    assert f"-> {piece} + {piece}" in report


def test_router_rule_sends_routers_to_muon_and_gate_up_can_stay_fused():
    model = tiny("mixtral")
    groups = route_parameters(model, router_algorithm="muon", split_gate_up=False)
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert by_name["model.layers.0.mlp.gate.weight"]["algorithm"] == "muon"
    assert by_name["model.layers.0.mlp.experts.gate_up_proj"].get("split_sizes") is None


def test_user_rule_names_its_own_expert_stacks():
    class Grouped(nn.Module):  # torchtitan's GroupedExperts shape, without num_experts
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(3, 8, 6))  # (E, out, in)
            self.w2 = nn.Parameter(torch.randn(3, 6, 8))
            self.head = nn.Linear(6, 5)

    model = Grouped()
    with pytest.warns(UserWarning, match=r"neither a conv kernel nor a known expert stack: w1 \(3, 8, 6\)"):
        route_parameters(model)
    rule = Rule(name="my_experts", algorithm="muon", names=("w1", "w2"), experts="out_in")
    groups = route_parameters(model, rules=[rule])
    (group,) = [g for g in groups if g["name"] == "my_experts"]
    assert group["batched"] is True and group["transposed"] is False
    assert groups.experts["w1"].found_by == "rule my_experts"
    with pytest.raises(ValueError, match="experts must be one of"):
        Rule(name="bad", algorithm="muon", experts="rows")
    with pytest.raises(ValueError, match="experts= needs a Muon algorithm"):
        Rule(name="bad", algorithm="adamw", experts="out_in")


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts: ``w1``, ``w3`` ``(E, dim, hidden)`` and ``w2`` ``(E, hidden, dim)``, used as
    ``x @ w[e]`` (each stored ``(in, out)``), on tokens sorted by expert with their counts."""

    def __init__(self, num_experts=4, dim=8, hidden=12):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.randn(num_experts, dim, hidden))

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for e, chunk in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            h = nn.functional.silu(chunk @ self.w1[e]) * (chunk @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs)


class TitanMoE(nn.Module):
    """A router nested in a module of another name, top-1 routing, tokens sorted for the experts."""

    def __init__(self, experts: nn.Module | None = None):
        super().__init__()
        self.router = nn.Module()
        self.router.gate = nn.Linear(8, 4, bias=False)
        self.experts = experts if experts is not None else GroupedExperts()
        self.output = nn.Linear(8, 10)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.router.gate(flat).softmax(-1).max(dim=-1)
        order = index.argsort()
        counts = torch.bincount(index, minlength=4)
        out = torch.empty_like(flat)
        out[order] = self.experts(flat[order], counts) * weights[order, None]
        return self.output(out.view_as(x))


def test_torchtitan_grouped_experts_are_read_from_their_forward():
    model = TitanMoE()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read, nothing warned
        groups = route_parameters(model)
    by_name = {n: g for g in groups for n in g["param_names"]}
    for leaf in ("w1", "w2", "w3"):  # (E, in, out): transposed, and w1, w3 are whole matrices (no gate/up split)
        group = by_name[f"experts.{leaf}"]
        assert (group["batched"], group["transposed"], group.get("split_sizes")) == (True, True, None), leaf
        assert groups.experts[f"experts.{leaf}"].found_by == "probe (GroupedExperts)"
    assert by_name["router.gate.weight"]["algorithm"] == "adamw"  # nested, found by what it does


def test_a_stack_whose_layout_cannot_be_read_is_warned_and_a_rule_settles_it():
    class Opaque(nn.Module):  # an expert count and stacks, but a forward the probe cannot call
        def __init__(self):
            super().__init__()
            self.num_experts = 3
            self.w1 = nn.Parameter(torch.randn(3, 8, 6))
            self.head = nn.Linear(6, 5)

        def forward(self, tokens_by_expert: list):
            raise NotImplementedError

    with pytest.warns(UserWarning, match=r"layout of expert stack w1 \(3, 8, 6\) could not be read .*Rule\(name="):
        groups = route_parameters(Opaque())
    assert groups.experts["w1"].found_by == "unread (Opaque)"
    rule = Rule(name="my_experts", algorithm="muon", names="w1", experts="in_out")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = route_parameters(Opaque(), rules=[rule])
    (group,) = [g for g in groups if g["name"] == "my_experts"]
    assert group["batched"] is True and group["transposed"] is True
    assert groups.experts["w1"].found_by == "rule my_experts"
    with pytest.raises(ValueError, match="experts must be one of"):
        Rule(name="bad", algorithm="muon", experts="rows")
    with pytest.raises(ValueError, match="experts= needs a Muon algorithm"):
        Rule(name="bad", algorithm="adamw", experts="out_in")


def test_without_the_probe_metadata_alone_decides_and_the_rest_is_warned():
    # transformers' metadata gives the orientation (and, from 5.24, how gate and up are laid out; the
    # suite's 5.3 does not say: the fused gate/up is kept whole here).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = route_parameters(tiny("mixtral"), probe_experts=False, split_gate_up=False)
    assert groups.experts["model.layers.0.mlp.experts.gate_up_proj"].found_by == "metadata (MixtralExperts)"
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert by_name["model.layers.0.mlp.gate.weight"]["algorithm"] == "adamw"
    with pytest.warns(UserWarning, match="could not be read \\(the probe is off\\)"):
        route_parameters(TitanMoE(), probe_experts=False)


def test_the_probe_leaves_the_model_and_the_rng_as_they_were():
    model = TitanMoE().train()
    model.router.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.random.get_rng_state()
    route_parameters(model)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n
    assert model.training and model.experts.training and not model.router.training
    assert "forward" not in vars(model.experts)  # the eager forward put in place for the probe is gone


def test_a_model_on_the_meta_device_routes_like_the_real_one():
    with torch.device("meta"):
        meta = TitanMoE()
    real = route_parameters(TitanMoE())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routed = route_parameters(meta)
    assert {n: s.layout for n, s in routed.experts.items()} == {n: s.layout for n, s in real.experts.items()}


def test_2d_expert_concatenations_are_refused_under_fsdp_with_a_clear_error():
    from lightning_muon.distributed.fsdp import _check_group

    group = {"params": [], "batched": True, "blocks": 4, "transposed": False, "split_sizes": None}
    with pytest.raises(ValueError, match="concatenates 4 experts .*train it under muon_ddp"):
        _check_group(group, "param group 0 ('muon_experts_2d')", [])


def test_layout_of_gpt_oss_gate_up_cuts_interleaved_columns():
    w = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # (E, in, out): out = [g0 u0 g1 u1]
    gate, up = MatrixLayout((1, 1), batched=True, transposed=True).views(w)
    assert_close(gate, w[..., 0::2])
    assert_close(up, w[..., 1::2])
    mixtral = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # (E, out, in): [gate rows | up rows]
    gate, up = MatrixLayout((2, 2), batched=True).views(mixtral)
    assert_close(gate, mixtral[:, :2])
    assert_close(up, mixtral[:, 2:])


def test_spectra_log_every_expert_and_piece():
    """UpdateSpectrumMonitor's collector measures each expert's gate, up and down matrix on its own."""
    from lightning_muon.callbacks._spectra import SpectrumCollector

    model = tiny("mixtral")
    optimizer = Muon(route_parameters(model), **HP)
    collector = SpectrumCollector([optimizer], model, names=["*experts*"])
    optimizer.register_update_hook(collector.observe)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    records = {r.name: r.scalars for r in collector.collect()}
    gate_up, down = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    # Gate pieces of experts 0..3, then up pieces; then the 4 down matrices: 12 matrices, not 2.
    assert sorted(records) == sorted([f"{gate_up}[{i}]" for i in range(2 * E)] + [f"{down}[{i}]" for i in range(E)])
    for name, scalars in records.items():
        # Each is one (24 x 32) or (32 x 24) orthogonalized update, scaled by lr and its own
        # shape: stable rank about 19 of 24 (measured), where a flattened (E, 2I H) stack has
        # rank E = 4 at most; sigma_max within Polar Express's band (measured 1.11-1.14) of
        # lr * sqrt(max(1, fan_out / fan_in)).
        assert scalars["stable_rank"] > 4 * E, name
        scale = HP["lr"] * (1.0 if "gate_up" in name else (H / INTER) ** 0.5)
        assert scale < scalars["sigma_max"] < 1.2 * scale, name


class MoELM(MuonModuleMixin, pl.LightningModule):
    """A tiny transformers MoE causal LM on one fixed batch, trained by the mixin's hybrid Muon."""

    def __init__(self, model_type: str) -> None:
        super().__init__()
        self.model = tiny(model_type)
        self.muon_config = MuonConfig(matrix=MuonSettings(**HP))

    def train_dataloader(self):
        ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(5))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("model_type", ["mixtral"])  # Qwen3-MoE normalizes q and k: QKClip refuses it
def test_qk_clip_clips_attention_of_moe_models_trained_with_the_mixin(tmp_path, model_type):
    from lightning_muon import QKClip

    module = MoELM(model_type)
    q_before = module.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[QKClip(threshold=1e-3)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset and logging notices
        trainer.fit(module)
    groups = {g["name"]: g for g in trainer.optimizers[0].param_groups}
    assert {"muon_experts", "adamw"} <= set(groups) and any(n.startswith("muon_experts_gate_up") for n in groups)
    q_after = module.model.model.layers[0].self_attn.q_proj.weight.detach()
    assert q_after.norm() < 0.5 * q_before.norm()  # a tau far under every head's logits shrinks Q
