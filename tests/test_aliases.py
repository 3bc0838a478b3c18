"""Other projects' names for our settings (``lightning_muon.aliases``): each means what its source says.

A Megatron-Core optimizer block, written with the seed's ``OptimizerConfig`` names and read from
YAML, builds the optimizer our canonical names build; every Emerging-Optimizers and
torch.optim.Muon alias lands on its field; ``fp32_matmul_prec="highest"`` gives float32
Newton-Schulz as Emerging-Optimizers computes it, whatever the host's automatic dtype.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from jsonargparse_compat import instantiate
from muon_reference import newton_schulz64, random_tensors, run_steps
from torch import nn

from lightning_muon import (
    AdamWSettings,
    AdaptiveMuonSettings,
    LionSettings,
    MOPSettings,
    Muon,
    MuonConfig,
    MuonSettings,
    RoutingSettings,
    ScheduleSettings,
    ScionSettings,
    SOAPSettings,
    StateSettings,
)
from lightning_muon.algorithms import HparamError, get_algorithm
from lightning_muon.aliases import ALIASES, settings_from
from lightning_muon.megatron import MEGATRON_DEFAULTS, MEGATRON_REFUSED
from lightning_muon.newton_schulz import COEFFICIENTS

pytestmark = pytest.mark.numerics

YOU = [tuple(abc) for abc in COEFFICIENTS["you"]]
# The seed's 17 Megatron-Core names (and lr, weight_decay), each away from Megatron's default.
MEGATRON_BLOCK = """\
muon:
  megatron:
    optimizer: muon
    lr: 0.01
    min_lr: 0.001
    weight_decay: 0.05
    adam_beta1: 0.8
    adam_beta2: 0.9
    adam_eps: 1.0e-6
    muon_momentum: 0.9
    muon_nesterov: true
    muon_scale_mode: unit_rms_norm
    muon_coefficient_type: quintic
    muon_num_ns_steps: 6
    muon_extra_scale_factor: 0.5
    muon_fp32_matmul_prec: highest
    muon_split_qkv: true
    muon_tp_mode: duplicated
    muon_scalar_optimizer: lion
    lion_beta1: 0.9
    lion_beta2: 0.97
  schedule:
    falloff: cosine
"""
# The same optimizer in our names.
CANONICAL = MuonConfig(
    matrix=MuonSettings(
        lr=0.01,
        weight_decay=0.05,
        momentum=0.9,
        nesterov=True,
        adjust_lr="spectral_norm",
        ns_coefficients=[*YOU, YOU[0]],  # Emerging-Optimizers cycles "quintic" over 6 steps
        ns_steps=6,
        extra_scale_factor=0.5,
        fp32_matmul_prec="highest",
        tp_mode="duplicated",
        ns_method="standard",
    ),
    scalar=LionSettings(lr=0.01, weight_decay=0.05, betas=(0.9, 0.97)),
    routing=RoutingSettings(split_qkv=True),
    schedule=ScheduleSettings(falloff="cosine", min_lr_ratio=0.1),
)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 12)
        self.attn = nn.MultiheadAttention(12, 3, batch_first=True)
        self.mlp = nn.Linear(12, 24)
        self.out = nn.Linear(24, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.out(torch.relu(self.mlp(h)))


def _parse(text: str) -> MuonConfig:
    import jsonargparse

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--muon", type=MuonConfig)
    return instantiate(parser, parser.parse_string(text)).muon


def _train(config: MuonConfig, steps: int = 3) -> tuple[nn.Module, Muon]:
    torch.manual_seed(0)
    model = Attention()
    optimizer, scheduler = config.build(model, total_steps=10)
    x = torch.randint(0, 11, (4, 5))
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer


def _groups(optimizer: Muon) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def test_a_megatron_yaml_block_builds_the_optimizer_our_names_build():
    """All 17 of the seed's names, from YAML: the same groups, lrs and weights after 3 steps as ours."""
    config = _parse(MEGATRON_BLOCK)
    assert config.matrix == CANONICAL.matrix and config.scalar == CANONICAL.scalar
    assert config.routing == CANONICAL.routing and config.schedule == CANONICAL.schedule
    model, optimizer = _train(config)
    twin, reference = _train(CANONICAL)
    assert _groups(optimizer) == _groups(reference)
    assert {g["name"] for g in optimizer.param_groups} >= {"muon_mha_in_proj", "lion", "lion_no_decay"}
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert MuonConfig.from_any(config.to_dict()) == config  # saved in our names, read back the same


@pytest.mark.parametrize(
    ("block", "matrix", "scalar"),
    [
        (
            dict(optimizer="adaptive_muon", lr=0.02, adaptive_muon_moment2_method="normuon", adaptive_muon_beta2=0.9,
                 adaptive_muon_eps=1e-6, adam_beta1=0.85, adam_beta2=0.98, adam_eps=1e-7),
            AdaptiveMuonSettings(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=False, adjust_lr="spectral",
                                 ns_coefficients="you", ns_method="standard", tp_mode="blockwise",
                                 second_moment="normuon", second_moment_beta2=0.9, second_moment_eps=1e-6),
            AdamWSettings(lr=0.02, weight_decay=0.01, betas=(0.85, 0.98), eps=1e-7),
        ),
        (
            dict(optimizer="soap", lr=0.003, weight_decay=0.0, soap_shampoo_beta=0.9, soap_precondition_frequency=3,
                 soap_use_kl_shampoo=False, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-7),
            SOAPSettings(lr=0.003, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-7, shampoo_beta=0.9,
                         precondition_frequency=3, use_kl_shampoo=False),
            AdamWSettings(lr=0.003, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-7),
        ),
    ],
    ids=["adaptive_muon", "soap"],
)  # fmt: skip
def test_megatron_emerging_optimizers_and_their_defaults(block, matrix, scalar):
    """Megatron's adaptive_muon and soap blocks, with its defaults for the names left out (nesterov False,
    spectral scale, blockwise TP, adam_beta2 0.999 unless given)."""
    config = MuonConfig.from_megatron({**block, "muon_split_qkv": False})
    assert (config.matrix, config.scalar) == (matrix, scalar)


def test_megatron_defaults_fill_what_the_block_leaves_out():
    config = MuonConfig.from_megatron({"optimizer": "muon", "lr": 1e-3})
    assert config.matrix == MuonSettings(
        lr=1e-3, weight_decay=0.01, momentum=0.95, nesterov=False, adjust_lr="spectral", ns_coefficients="you",
        ns_method="standard", tp_mode="blockwise", fp32_matmul_prec="medium",
    )  # fmt: skip
    assert config.scalar == AdamWSettings(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    assert config.routing.split_qkv is True and config.schedule.min_lr_ratio == 0.0


def test_a_megatron_object_with_the_names_as_attributes_loads_too():
    class OptimizerConfig:  # Megatron's is a dataclass of these attributes
        def __init__(self) -> None:
            self.optimizer, self.lr, self.muon_momentum, self.muon_split_qkv = "muon", 0.01, 0.9, False

    assert MuonConfig.from_megatron(OptimizerConfig()).matrix.momentum == 0.9


# Each Megatron name: a value away from Megatron's default, and where it lands (section, field, value).
MEGATRON_NAMES = {
    "lr": (0.5, [("matrix", "lr", 0.5), ("scalar", "lr", 0.5)]),
    "weight_decay": (0.2, [("matrix", "weight_decay", 0.2), ("scalar", "weight_decay", 0.2)]),
    "min_lr": (0.05, [("schedule", "min_lr_ratio", 0.05 / 0.1)]),
    "adam_beta1": (0.8, [("scalar", "betas", (0.8, 0.999))]),
    "adam_beta2": (0.95, [("scalar", "betas", (0.9, 0.95))]),
    "adam_eps": (1e-6, [("scalar", "eps", 1e-6)]),
    "muon_momentum": (0.8, [("matrix", "momentum", 0.8)]),
    "muon_nesterov": (True, [("matrix", "nesterov", True)]),
    "muon_scale_mode": ("shape_scaling", [("matrix", "adjust_lr", "original")]),
    "muon_coefficient_type": ("simple", [("matrix", "ns_coefficients", "keller")]),
    "muon_num_ns_steps": (7, [("matrix", "ns_steps", 7)]),
    "muon_extra_scale_factor": (0.2, [("matrix", "extra_scale_factor", 0.2)]),
    "muon_fp32_matmul_prec": ("high", [("matrix", "fp32_matmul_prec", "high")]),
    "muon_split_qkv": (False, [("routing", "split_qkv", False)]),
    "muon_tp_mode": ("distributed", [("matrix", "tp_mode", "distributed")]),
    "muon_scalar_optimizer": ("lion", [("scalar", "betas", (0.95, 0.98))]),
    "decoupled_weight_decay": (True, []),  # the default: AdamW
}


@pytest.mark.parametrize("name", sorted(MEGATRON_NAMES))
def test_each_megatron_name_lands_on_its_field(name):
    value, landings = MEGATRON_NAMES[name]
    assert value != MEGATRON_DEFAULTS[name] or not landings
    config = MuonConfig.from_megatron({"optimizer": "muon", "lr": 0.1, name: value})
    for section, field, expected in landings:
        got = getattr(getattr(config, section), field)
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, (section, field)


def test_the_lion_and_state_names_land_on_their_fields():
    config = MuonConfig.from_megatron(
        {"optimizer": "muon", "lr": 0.1, "muon_scalar_optimizer": "lion", "lion_beta1": 0.9, "lion_beta2": 0.95,
         "use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "torch.bfloat16",
         "main_params_dtype": "fp32", "main_grads_dtype": "fp32"}
    )  # fmt: skip
    assert config.scalar == LionSettings(lr=0.1, weight_decay=0.01, betas=(0.9, 0.95))
    assert config.state == StateSettings(
        exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16", main_params_dtype="float32"
    )


# Each alias: a value, and the field and value it means (set far from the field's default).
ALIAS_VALUES = {
    "num_ns_steps": (ScionSettings, 7, "ns_steps", 7),
    "coefficient_type": (ScionSettings, "simple", "ns_coefficients", "keller"),
    "scale_mode": (MOPSettings, "unit_rms_norm", "adjust_lr", "spectral_norm"),
    "moment2_method": (AdaptiveMuonSettings, "normuon", "second_moment", "normuon"),
    "beta2": (AdaptiveMuonSettings, 0.8, "second_moment_beta2", 0.8),
    "eps": (AdaptiveMuonSettings, 1.0, "second_moment_eps", 1.0),  # above the moments: it shows
    "adjust_lr_fn": (MuonSettings, "match_rms_adamw", "adjust_lr", "match_rms_adamw"),
}
# An alias whose name another algorithm's alias takes too: torch.optim.Muon's eps, on "muon" only.
SHARED_NAME_VALUES = {
    "eps": (MuonSettings, 10.0, "ns_eps", 10.0),  # above the momentum's norm: Newton-Schulz's input stays small
}
ALIAS_CASES = [(name, *case) for table in (ALIAS_VALUES, SHARED_NAME_VALUES) for name, case in table.items()]


def test_every_alias_is_tested():
    assert {(name, field) for name, _, _, field, _ in ALIAS_CASES} == {(a.name, a.field) for a in ALIASES}


@pytest.mark.parametrize(
    ("alias", "cls", "value", "field", "canonical"), ALIAS_CASES, ids=[f"{c[0]}-{c[1].algorithm}" for c in ALIAS_CASES]
)
def test_every_alias_sets_its_field_and_steps_the_same(alias, cls, value, field, canonical):
    """The alias gives the settings its field gives, unlike the defaults; in a param group it steps the same."""
    assert settings_from(cls, {alias: value}, "test") == cls(**{field: canonical}) != cls()
    torch.manual_seed(0)
    w0 = torch.randn(6, 10, dtype=torch.float64)
    grads = [[torch.randn(6, 10, dtype=torch.float64)] for _ in range(3)]
    results = []
    for key, v in ((alias, value), (field, canonical), (None, None)):
        p = nn.Parameter(w0.clone())
        group = {"params": [p], "algorithm": cls.algorithm, "lr": 0.01, **({key: v} if key else {})}
        if cls.algorithm == "adaptive_muon" and key != "moment2_method" and field != "second_moment":
            group["second_moment"] = "normuon"  # AdamW-like per-element moments cancel the eps and beta2 less
        optimizer = Muon([group])
        assert all(k in optimizer.param_groups[0] for k in (field,)) and alias not in optimizer.param_groups[0]
        run_steps(optimizer, [p], grads)
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])  # the alias changed the step


def test_an_alias_and_its_field_given_apart_disagree_naming_both():
    with pytest.raises(HparamError, match=r"num_ns_steps=7 \(Emerging-Optimizers' name for ns_steps\) and ns_steps=5"):
        settings_from(ScionSettings, {"num_ns_steps": 7, "ns_steps": 5}, "test")
    assert settings_from(ScionSettings, {"num_ns_steps": 7, "ns_steps": 7}, "test").ns_steps == 7
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(HparamError, match=r"param group 0.*scale_mode='spectral'.*and adjust_lr='none'"):
        Muon([{"params": [p], "algorithm": "scion", "scale_mode": "spectral", "adjust_lr": "none"}])
    with pytest.raises(HparamError, match=r"adjust_lr_fn='match_rms_adamw'.*and adjust_lr='spectral'"):
        Muon([p], adjust_lr="spectral", adjust_lr_fn="match_rms_adamw")
    with pytest.raises(HparamError, match=r"megatron and matrix both set the matrix section \(matrix\.momentum=0\.5"):
        MuonConfig(matrix=MuonSettings(momentum=0.5), megatron={"optimizer": "muon", "lr": 0.02})


def test_coefficient_type_schedules_are_emerging_optimizers():
    """quintic and aol cycle their tuples over num_ns_steps; cans and deepseekv4 repeat their last; custom
    takes the coefficients beside it; polar_express is Megatron's rounding of the paper's."""
    steps = lambda name, n: settings_from(ScionSettings, {"coefficient_type": name, "num_ns_steps": n}, "t")
    assert steps("quintic", 10).ns_coefficients == YOU * 2
    assert len(steps("aol", 8).ns_coefficients) == 8 and steps("aol", 8).ns_coefficients[4] == (4.0098, -7.0585, 2.4635)
    assert (steps("cans", 7).ns_coefficients, steps("deepseekv4", 10).ns_coefficients) == ("cans", "deepseekv4")
    assert steps("polar_express", 8).ns_coefficients == "polar_express_megatron"
    custom = [(3.0, -3.2, 1.2)]
    given = {"coefficient_type": "custom", "ns_coefficients": custom}
    assert settings_from(ScionSettings, given, "t").ns_coefficients == custom
    with pytest.raises(HparamError, match=r"coefficient_type .*'custom' needs ns_coefficients as a list"):
        settings_from(ScionSettings, {"coefficient_type": "custom"}, "t")


# ------------------------------------------------------------------------------ fp32_matmul_prec


def _scion64(w0: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float) -> torch.Tensor:
    """Emerging-Optimizers' Scion in float64 (its defaults: quintic, 5 steps, radius 1, no Nesterov)."""
    W, B = w0.clone(), torch.zeros_like(w0)
    rows, cols = W.shape
    for G in grads:
        B = momentum * B + (1 - momentum) * G
        W = (1 - lr) * W - lr * math.sqrt(rows / cols) * newton_schulz64(B, YOU, 5)
    return W


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_fp32_matmul_prec_highest_is_float32_newton_schulz_on_a_bf16_host(monkeypatch, precision):
    """With the host's automatic dtype bf16 and ns_dtype unset, "highest" and "high" steps as Emerging-Optimizers
    computes in float32 (to float32 rounding); "medium" keeps the automatic bf16 (1e-3 off); ns_dtype wins."""
    monkeypatch.setenv("LIGHTNING_MUON_FAST_BF16", "1")  # every host picks bf16 when nothing says otherwise
    (w0,) = random_tensors([(24, 16)], seed=3, dtype=torch.float64)
    grads = [random_tensors([(24, 16)], seed=10 + t, dtype=torch.float64)[0] for t in range(5)]
    reference = _scion64(w0, grads, lr=0.05, momentum=0.9)

    def run(**group) -> float:
        p = nn.Parameter(w0.float())
        run_steps(Muon([{"params": [p], "algorithm": "scion", "lr": 0.05, "momentum": 0.9, **group}]), [p],
                  [[g.float()] for g in grads])  # fmt: skip
        return (p.detach().double() - reference).abs().max().item()

    assert run(fp32_matmul_prec=precision) < 3e-6
    assert run(fp32_matmul_prec="medium") > 1e-4
    assert run(fp32_matmul_prec=precision, ns_dtype="bfloat16") > 1e-4  # our ns_dtype, set, wins


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("make", "field", "match"),
    [
        (lambda: MuonConfig(matrix={"class_path": "AdaptiveMuonSettings", "init_args": {"moment2_method": "x"}}),
         "moment2_method", r"moment2_method \(Emerging-Optimizers' name for second_moment\) must be one of"),
        (lambda: MuonConfig(matrix={"class_path": "MOPSettings", "init_args": {"scale_mode": "bogus"}}),
         "scale_mode", r"scale_mode \(.*\) must be one of \('shape_scaling', 'spectral', 'unit_rms_norm', 'nucl"),
        (lambda: MuonConfig(matrix=MOPSettings(adjust_lr="bogus")), "adjust_lr", r"MOPSettings\.adjust_lr must"),
        (lambda: MuonSettings(adjust_lr="nuclear_norm"), "adjust_lr", r"MuonSettings\.adjust_lr must be one of"),
        (lambda: Muon([nn.Parameter(torch.ones(2, 2))], adamw_lr=-1.0), "adamw_lr", r"Muon\(\): adamw_lr must be"),
        (lambda: Muon([nn.Parameter(torch.ones(2, 2))], ns_steps=0), "ns_steps", r"Muon\(\): ns_steps must be"),
        (lambda: MuonConfig(megatron={"optimizer": "muon", "lr": 0.1, "muon_num_ns_steps": 0}),
         "muon_num_ns_steps", r"megatron: muon_num_ns_steps must be a positive int"),
        (lambda: MuonConfig(megatron={"optimizer": "adaptive_muon", "lr": 0.1, "adaptive_muon_beta2": 2}),
         "adaptive_muon_beta2", r"megatron: adaptive_muon_beta2 must be a finite number in \[0.0, 1.0\)"),
        (lambda: MuonConfig(megatron={"optimizer": "muon", "lr": 0.1, "muon_scale_mode": "rms"}),
         "muon_scale_mode", r"megatron: muon_scale_mode must be one of"),
        (lambda: MuonConfig(megatron={"optimizer": "adam", "lr": 0.1}), "optimizer", r"optimizer must name"),
        (lambda: MuonConfig(megatron={"optimizer": "muon"}), "lr", r"megatron: lr is required"),
        (lambda: MuonConfig(megatron={"optimizer": "muon", "lr": 0.1, "muon_momentom": 0.9}),
         "muon_momentom", r"\['muon_momentom'\] are not Megatron-Core OptimizerConfig names"),
        (lambda: MuonConfig(matrix={"class_path": "MuonSettings", "init_args": {"lrr": 0.1}}),
         "lrr", r"\['lrr'\] are not settings of 'muon'; did you mean 'lr'\?"),
        (lambda: get_algorithm("scion").make_settings({"weight_decay": 0.5}), "weight_decay", r"fixed at 1.0"),
    ],
)  # fmt: skip
def test_errors_name_the_field_as_written(make, field, match):
    with pytest.raises(HparamError, match=match) as info:
        make()
    assert info.value.field == field


@pytest.mark.parametrize("name", sorted(MEGATRON_REFUSED))
def test_megatron_names_we_do_not_implement_are_refused_with_what_to_use(name):
    with pytest.raises(HparamError, match=rf"Megatron's \['{name}'\] are not implemented here \({name}: use ") as info:
        MuonConfig.from_megatron({"optimizer": "muon", "lr": 0.1, name: copy.copy(MEGATRON_REFUSED)})
    assert info.value.field == name
