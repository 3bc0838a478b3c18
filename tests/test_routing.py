"""Routing parameters to Muon / AdamW / Lion: default rules on real models, every matcher, errors, report."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch
from muon_reference import muon64, random_tensors
from torch import nn
from torch.testing import assert_close

from lightning_muon import LionSettings, Muon, MuonConfig, RoutingSettings, Rule, route_parameters
from lightning_muon_demo.models import CharGPT

D = 16  # model width of the small transformers below


class Encoder(nn.Module):
    """Embedding + nn.TransformerEncoder + a head called ``head_name`` (tied to the embedding if asked)."""

    def __init__(self, tie: bool = False, head_name: str = "head", vocab: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=2 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        setattr(self, head_name, nn.Linear(D, vocab, bias=False))
        if tie:
            getattr(self, head_name).weight = self.emb.weight
        self.head_name = head_name

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.head_name)(self.encoder(self.emb(idx)))


ENCODER_HIDDEN = [
    f"encoder.layers.{i}.{n}"
    for i in range(2)
    for n in ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight")
]
ENCODER_VECTORS = [
    f"encoder.layers.{i}.{n}"
    for i in range(2)
    for n in (
        "self_attn.in_proj_bias",
        "self_attn.out_proj.bias",
        "linear1.bias",
        "linear2.bias",
        "norm1.weight",
        "norm1.bias",
        "norm2.weight",
        "norm2.bias",
    )
]


def _gpt(tie_weights: bool = False, n_layer: int = 2) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=D, tie_weights=tie_weights)


def _by_name(groups) -> dict[str, dict]:
    return {g["name"]: g for g in groups}


def _names(groups) -> dict[str, list[str]]:
    return {g["name"]: list(g["param_names"]) for g in groups}


def _check_groups_are_consistent(groups, module: nn.Module) -> None:
    names = [g["name"] for g in groups]
    assert len(names) == len(set(names)), names
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    routed = [n for g in groups for n in g["param_names"]]
    assert sorted(routed) == sorted(trainable)  # each trainable tensor exactly once
    params = dict(module.named_parameters())
    for g in groups:
        assert len(g["params"]) == len(g["param_names"])
        assert all(p is params[n] for p, n in zip(g["params"], g["param_names"]))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformer_encoder_default_routing(tie):
    model = Encoder(tie=tie)
    groups = route_parameters(model)
    _check_groups_are_consistent(groups, model)
    names = _names(groups)
    # Tied: head.weight *is* emb.weight, and named_parameters lists it once as emb.weight.
    assert names["adamw"] == (["emb.weight"] if tie else ["emb.weight", "head.weight"])
    assert names["muon"] == ENCODER_HIDDEN
    assert sorted(names["adamw_no_decay"]) == sorted(ENCODER_VECTORS)
    by_name = _by_name(groups)
    assert [by_name[n]["algorithm"] for n in ("adamw", "muon", "adamw_no_decay")] == ["adamw", "muon", "adamw"]
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0
    assert "weight_decay" not in by_name["adamw"]  # takes the optimizer's adamw_weight_decay
    expected_rules = {"emb.weight": "embedding", "encoder.layers.0.linear1.weight": "hidden_matrices"}
    expected_rules |= {"encoder.layers.1.norm2.bias": "vectors"}
    if not tie:
        expected_rules["head.weight"] = "output_head"
    assert {n: groups.assignments[n] for n in expected_rules} == expected_rules


@pytest.mark.parametrize("tie_weights", [False, True], ids=["untied", "tied"])
def test_chargpt_default_routing(tie_weights):
    model = _gpt(tie_weights)
    groups = route_parameters(model)
    _check_groups_are_consistent(groups, model)
    names = _names(groups)
    head = [] if tie_weights else ["lm_head.weight"]
    assert names["adamw"] == ["tok_emb.weight", "pos_emb.weight", *head]
    hidden = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")
    assert names["muon"] == [f"blocks.{i}.{n}" for i in range(2) for n in hidden]
    vectors = ("ln1.weight", "ln1.bias", "attn.qkv.bias", "attn.proj.bias", "ln2.weight", "ln2.bias")
    vectors += ("mlp.fc1.bias", "mlp.fc2.bias")
    expected = [f"blocks.{i}.{n}" for i in range(2) for n in vectors] + ["ln_f.weight", "ln_f.bias"]
    assert names["adamw_no_decay"] == expected
    assert _by_name(groups)["adamw_no_decay"]["weight_decay"] == 0.0


def test_frozen_parameters_are_left_out():
    model = _gpt()
    model.ln_f.requires_grad_(False)
    model.blocks[1].requires_grad_(False)
    groups = route_parameters(model)
    _check_groups_are_consistent(groups, model)
    routed = {n for g in groups for n in g["param_names"]}
    assert not {n for n in routed if n.startswith(("ln_f.", "blocks.1."))}
    assert "blocks.0.attn.qkv.weight" in routed
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        route_parameters(model)


class NamedHeadFirst(nn.Module):
    """The head is registered before another Linear: only its name marks it."""

    def __init__(self, head_attr: str = "classifier") -> None:
        super().__init__()
        setattr(self, head_attr, nn.Linear(8, 3))
        self.hidden = nn.Linear(8, 8)


class KnowsItsHead(nn.Module):
    """``get_output_embeddings`` names the head; neither its name nor its position would."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_out = nn.Linear(8, 5)
        self.mixer = nn.Linear(8, 8)
        self.last = nn.Linear(8, 8)

    def get_output_embeddings(self) -> nn.Module:
        return self.proj_out


def test_head_by_get_output_embeddings():
    # Found on a submodule too: wrap it as a LightningModule-like container would.
    wrapper = nn.ModuleDict({"model": KnowsItsHead()})
    groups = route_parameters(wrapper)
    assert groups.assignments["model.proj_out.weight"] == "output_head"
    assert groups.assignments["model.proj_out.bias"] == "vectors"  # every bias goes without weight decay
    assert _names(groups)["muon"] == ["model.mixer.weight", "model.last.weight"]


def test_head_by_name_and_custom_head_names():
    groups = route_parameters(NamedHeadFirst("classifier"))
    assert _names(groups)["adamw"] == ["classifier.weight"]
    assert "classifier.bias" in _names(groups)["adamw_no_decay"]
    assert _names(groups)["muon"] == ["hidden.weight"]
    # A name outside DEFAULT_HEAD_NAMES is found only when listed; otherwise position decides.
    model = NamedHeadFirst("out")
    assert _names(route_parameters(model, head_names=("out",)))["muon"] == ["hidden.weight"]
    assert _names(route_parameters(model))["muon"] == ["out.weight"]  # hidden is last: it became the head


def test_head_by_position_in_a_sequential_mlp():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    names = _names(route_parameters(mlp))
    assert names == {
        "muon": ["0.weight", "2.weight"],
        "adamw_no_decay": ["0.bias", "2.bias", "4.bias"],
        "adamw": ["4.weight"],
    }
    # Without position-based detection the last Linear is one more hidden matrix.
    names = _names(route_parameters(mlp, head_by_position=False))
    assert names["muon"] == ["0.weight", "2.weight", "4.weight"]
    assert "adamw" not in names
    # Head detection by position on the encoder: "decoder" is not a head name but the last Linear.
    groups = route_parameters(Encoder(head_name="decoder"))
    assert groups.assignments["decoder.weight"] == "output_head"


class Rectangles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(4, 64, bias=False)  # (64, 4): aspect 16
        self.square = nn.Linear(64, 64, bias=False)
        self.tall = nn.Linear(64, 8, bias=False)  # (8, 64): aspect 8
        self.conv = nn.Conv2d(3, 8, 3, bias=False)  # (8, 3, 3, 3) seen as (8, 27): aspect 3.375
        self.head = nn.Linear(64, 2, bias=False)


def test_max_aspect_ratio_sends_rectangular_matrices_to_adamw():
    model = Rectangles()
    assert _names(route_parameters(model))["muon"] == ["wide.weight", "square.weight", "tall.weight", "conv.weight"]
    groups = route_parameters(model, max_aspect_ratio=8)
    assert _names(groups)["muon"] == ["square.weight", "tall.weight", "conv.weight"]  # 8 is not more than 8
    assert groups.assignments["wide.weight"] == "aspect_ratio"
    assert _names(groups)["adamw"] == ["wide.weight", "head.weight"]
    groups = route_parameters(model, max_aspect_ratio=3)
    assert _names(groups)["muon"] == ["square.weight"]
    with pytest.raises(ValueError, match=r"max_aspect_ratio must be >= 1 or None, got 0\.5"):
        route_parameters(model, max_aspect_ratio=0.5)


def test_glob_names_and_options_split_qkv():
    model = _gpt()
    qkv = Rule(name="qkv", algorithm="muon", names="*.attn.qkv.weight", options={"split_sizes": [D, D, D]})
    groups = route_parameters(model, rules=[qkv])
    by_name = _by_name(groups)
    assert by_name["qkv"]["param_names"] == ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"]
    assert by_name["qkv"]["split_sizes"] == [D, D, D]
    assert by_name["qkv"]["algorithm"] == "muon"
    assert "blocks.0.attn.qkv.weight" not in by_name["muon"]["param_names"]
    optimizer = Muon(groups)
    assert next(g for g in optimizer.param_groups if g["name"] == "qkv")["split_sizes"] == (D, D, D)


def test_regex_and_several_globs():
    model = _gpt()
    groups = route_parameters(
        model,
        rules=[
            Rule(name="fc", algorithm="adamw", regex=r"mlp\.fc\d\.weight$", options={"lr": 1e-3}),
            Rule(name="attn", algorithm="muon", names=("*.attn.qkv.weight", "blocks.1.attn.proj.w*")),
        ],
    )
    names = _names(groups)
    assert names["fc"] == [f"blocks.{i}.mlp.fc{j}.weight" for i in range(2) for j in (1, 2)]
    assert names["attn"] == ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight"]
    assert names["muon"] == ["blocks.0.attn.proj.weight"]
    assert _by_name(groups)["fc"]["lr"] == 1e-3


@pytest.mark.parametrize("module_types", [nn.LayerNorm, "LayerNorm", "torch.nn.LayerNorm", ("Embedding", nn.LayerNorm)])
def test_module_types_by_class_name_and_dotted_path(module_types):
    model = _gpt()
    groups = route_parameters(model, rules=[Rule(name="norms", algorithm="lion", module_types=module_types)])
    expected = [f"blocks.{i}.{ln}.{w}" for i in range(2) for ln in ("ln1", "ln2") for w in ("weight", "bias")]
    expected += ["ln_f.weight", "ln_f.bias"]
    names = _names(groups)["norms"]
    if isinstance(module_types, tuple):  # the Embedding alternative matched too
        assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
        names = names[2:]
    assert names == expected
    assert _by_name(groups)["norms"]["algorithm"] == "lion"


def test_module_types_match_subclasses_and_combine_with_ndim():
    # out_proj is a NonDynamicallyQuantizableLinear, an nn.Linear subclass; in_proj_weight
    # belongs to MultiheadAttention itself and does not match.
    model = Encoder()
    rule = Rule(name="linears", algorithm="adamw", module_types=nn.Linear, min_ndim=2)
    names = _names(route_parameters(model, rules=[rule]))
    linears = [n for n in ENCODER_HIDDEN if "in_proj" not in n]
    assert names["linears"] == [*linears, "head.weight"]
    assert names["muon"] == [n for n in ENCODER_HIDDEN if "in_proj" in n]


def test_attributes_min_max_ndim():
    model = _gpt()
    model.blocks[0].attn.proj.weight.no_muon = True
    model.blocks[1].mlp.fc2.weight.expert = True
    with pytest.warns(UserWarning, match="rule 'too_many_dims' matches no tensor"):  # no 3-D tensor here
        groups = route_parameters(
            model,
            rules=[
                Rule(name="flagged", algorithm="adamw", attributes=("no_muon", "expert")),
                Rule(name="vectors_lion", algorithm="lion", max_ndim=1),
                Rule(name="too_many_dims", algorithm="adamw", min_ndim=3),
                Rule(name="matrices", algorithm="muon", names="blocks.*", min_ndim=2, max_ndim=2),
            ],
        )
    names = _names(groups)
    assert names["flagged"] == ["blocks.0.attn.proj.weight", "blocks.1.mlp.fc2.weight"]
    assert names["vectors_lion"] == [n for n, p in model.named_parameters() if p.ndim == 1]
    assert "too_many_dims" not in names  # CharGPT has no 3-D tensor
    assert names["matrices"] == [
        "blocks.0.attn.qkv.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc2.weight",
        "blocks.1.attn.qkv.weight",
        "blocks.1.attn.proj.weight",
        "blocks.1.mlp.fc1.weight",
    ]
    assert names["adamw"] == ["tok_emb.weight", "pos_emb.weight", "lm_head.weight"]  # defaults still apply
    conv = nn.Conv1d(2, 4, 3)
    assert _names(route_parameters(conv, rules=[Rule(name="too_many_dims", algorithm="adamw", min_ndim=3)])) == {
        "too_many_dims": ["weight"],
        "adamw_no_decay": ["bias"],
    }


def test_predicate_and_named_predicate_callables():
    model = _gpt()
    groups = route_parameters(
        model,
        rules=[
            Rule(name="wide_fc1", algorithm="adamw", predicate=lambda p: tuple(p.shape) == (4 * D, D)),
            Rule(
                name="block1",
                algorithm="muon",
                named_predicate=lambda p, n: n.startswith("blocks.1.") and p.ndim == 2,
            ),
        ],
    )
    names = _names(groups)
    assert names["wide_fc1"] == ["blocks.0.mlp.fc1.weight", "blocks.1.mlp.fc1.weight"]
    assert names["block1"] == ["blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight", "blocks.1.mlp.fc2.weight"]
    assert names["muon"] == ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc2.weight"]


def test_predicates_as_dotted_import_paths(tmp_path, monkeypatch):
    (tmp_path / "routing_user_predicates.py").write_text(
        textwrap.dedent(
            """
            def is_fc2(param, name):
                return name.endswith("mlp.fc2.weight")

            def is_square(param):
                return param.ndim == 2 and param.shape[0] == param.shape[1]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rules = [
        Rule(name="fc2", algorithm="adamw", named_predicate="routing_user_predicates.is_fc2"),
        # AND: a glob and a predicate path must both match (proj is square; qkv is not).
        Rule(name="square_attn", algorithm="muon", names="*.attn.*", predicate="routing_user_predicates.is_square"),
        # A third-party function works the same way.
        Rule(name="ln1", algorithm="lion", names="*.ln1.*", predicate="torch.is_floating_point"),
    ]
    assert rules[0].named_predicate == "routing_user_predicates.is_fc2"  # kept as plain data
    names = _names(route_parameters(_gpt(), rules=rules))
    assert names["fc2"] == ["blocks.0.mlp.fc2.weight", "blocks.1.mlp.fc2.weight"]
    assert names["square_attn"] == ["blocks.0.attn.proj.weight", "blocks.1.attn.proj.weight"]
    assert names["ln1"] == [f"blocks.{i}.ln1.{w}" for i in range(2) for w in ("weight", "bias")]


def test_matchers_are_anded_and_the_first_matching_rule_wins():
    model = _gpt()
    rules = [
        # Only block LayerNorms: the glob excludes ln_f, the type excludes block biases.
        Rule(name="block_norms", algorithm="lion", names="blocks.*", module_types="LayerNorm"),
        # Also matches the block LayerNorms, but comes second.
        Rule(name="all_vectors", algorithm="adamw", max_ndim=1, options={"weight_decay": 0.5}),
        # A user rule placed before the defaults overrides the default head rule.
        Rule(name="head", algorithm="adamw", names="lm_head.weight", options={"lr": 1e-4}),
    ]
    groups = route_parameters(model, rules=rules)
    names = _names(groups)
    norms = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")
    assert names["block_norms"] == [f"blocks.{i}.{n}" for i in range(2) for n in norms]
    assert "ln_f.weight" in names["all_vectors"] and "blocks.0.attn.qkv.bias" in names["all_vectors"]
    assert not set(names["block_norms"]) & set(names["all_vectors"])
    assert "adamw_no_decay" not in names  # every vector went to a user rule first
    assert names["head"] == ["lm_head.weight"]
    assert groups.assignments["lm_head.weight"] == "head"
    by_name = _by_name(groups)
    assert by_name["all_vectors"]["weight_decay"] == 0.5
    # Options become hyperparameters of the optimizer's groups.
    optimizer = Muon(groups, adamw_lr=3e-3, adamw_weight_decay=0.1)
    pg = {g["name"]: g for g in optimizer.param_groups}
    assert (pg["head"]["lr"], pg["head"]["weight_decay"]) == (1e-4, 0.1)
    assert (pg["all_vectors"]["lr"], pg["all_vectors"]["weight_decay"]) == (3e-3, 0.5)
    assert pg["block_norms"]["algorithm"] == "lion"


def test_rules_given_as_dicts_and_shared_groups():
    model = _gpt()
    rules = [
        {"name": "q", "algorithm": "muon", "names": "blocks.0.*", "min_ndim": 2, "group": "block0"},
        {"name": "r", "algorithm": "muon", "names": "blocks.1.attn.*", "min_ndim": 2, "group": "block0"},
        {"name": "norms", "algorithm": "adamw", "module_types": ["LayerNorm"], "options": {"lr": 0.01}},
    ]
    groups = route_parameters(model, rules=rules)
    names = _names(groups)
    # Two rules that agree on algorithm and options share one group.
    assert names["block0"] == [
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc2.weight",
        "blocks.1.attn.qkv.weight",
        "blocks.1.attn.proj.weight",
    ]
    assert groups.assignments["blocks.0.attn.qkv.weight"] == "q"
    assert groups.assignments["blocks.1.attn.qkv.weight"] == "r"
    assert names["muon"] == ["blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc2.weight"]
    assert _by_name(groups)["norms"]["lr"] == 0.01


def test_rules_sharing_a_group_with_different_settings_raise():
    a = Rule(name="a", algorithm="adamw", group="g", names="blocks.0.*", options={"lr": 0.1})
    b = Rule(name="b", algorithm="adamw", group="g", names="blocks.1.*", options={"lr": 0.2})
    with pytest.raises(ValueError, match=r"rules disagree on group 'g'.*from rule 'b'"):
        route_parameters(_gpt(), rules=[a, b])
    c = Rule(name="c", algorithm="lion", group="g", names="blocks.1.*", options={"lr": 0.1})
    with pytest.raises(ValueError, match=r"rules disagree on group 'g'.*'lion'.*from rule 'c'"):
        route_parameters(_gpt(), rules=[a, c])
    # A user rule may not join a default group with other settings either.
    d = Rule(name="d", algorithm="muon", group="muon", names="blocks.0.*", min_ndim=2, options={"lr": 0.5})
    with pytest.raises(ValueError, match=r"rules disagree on group 'muon'.*from rule 'hidden_matrices'"):
        route_parameters(_gpt(), rules=[d])


def test_scalar_algorithm_lion():
    model = _gpt()
    groups = route_parameters(model, scalar_algorithm="lion")
    by_name = _by_name(groups)
    assert sorted(by_name) == ["lion", "lion_no_decay", "muon"]
    assert by_name["lion"]["algorithm"] == by_name["lion_no_decay"]["algorithm"] == "lion"
    assert by_name["lion_no_decay"]["weight_decay"] == 0.0
    assert by_name["lion"]["param_names"] == ["tok_emb.weight", "pos_emb.weight", "lm_head.weight"]
    assert by_name["muon"]["algorithm"] == "muon"
    optimizer = Muon(groups, settings=[LionSettings(lr=1e-4)])
    assert {g["name"]: g["lr"] for g in optimizer.param_groups if g["algorithm"] == "lion"} == {
        "lion": 1e-4,
        "lion_no_decay": 1e-4,
    }
    with pytest.raises(
        ValueError,
        match=r"scalar_algorithm must be one of \('adamw', 'lion', 'adamw_schedulefree', 'laprop'\), got 'sgd'",
    ):
        route_parameters(model, scalar_algorithm="sgd")


def test_scalar_algorithm_adamw_schedulefree():
    model = _gpt()
    by_name = _by_name(route_parameters(model, scalar_algorithm="adamw_schedulefree"))
    assert sorted(by_name) == ["adamw_schedulefree", "adamw_schedulefree_no_decay", "muon"]
    assert by_name["adamw_schedulefree"]["algorithm"] == "adamw_schedulefree"
    assert by_name["adamw_schedulefree_no_decay"]["algorithm"] == "adamw_schedulefree"
    assert by_name["adamw_schedulefree_no_decay"]["weight_decay"] == 0.0
    assert by_name["adamw_schedulefree"]["param_names"] == ["tok_emb.weight", "pos_emb.weight", "lm_head.weight"]
    assert by_name["muon"]["algorithm"] == "muon"


@pytest.mark.parametrize(
    ("tie_weights", "pattern", "kind", "name"),
    [
        (False, "tok_emb.weight", "embedding", "tok_emb.weight"),
        (False, "lm_head.weight", "output head", "lm_head.weight"),
        (True, "tok_emb.weight", "embedding", "tok_emb.weight"),  # the tied head is the embedding
    ],
)
def test_user_rule_sending_embedding_or_head_to_muon_warns(tie_weights, pattern, kind, name):
    rule = Rule(name="everything_muon", algorithm="muon", names=pattern)
    with pytest.warns(UserWarning, match=rf"rule 'everything_muon' sends the {kind} '{name}' to Muon"):
        groups = route_parameters(_gpt(tie_weights), rules=[rule])
    assert _names(groups)["everything_muon"] == [name]


def test_user_rule_sending_a_vector_to_muon_raises():
    rule = Rule(name="biases", algorithm="muon", names="*.bias")
    with pytest.raises(ValueError, match=r"rule 'biases' sends the 1-D parameter 'blocks.0.ln1.bias' to Muon"):
        route_parameters(_gpt(), rules=[rule])


def test_no_matching_rule_raises_naming_the_parameter():
    rule = Rule(name="matrices", algorithm="adamw", min_ndim=2)
    with pytest.raises(ValueError, match=r"no rule matches parameter 'blocks.0.ln1.weight' of shape \(16,\)"):
        route_parameters(_gpt(), rules=[rule], default_rules=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(name="", algorithm="adamw"), ValueError, r"Rule\.name must be a non-empty string"),
        (dict(name="r", algorithm="sgd"), ValueError, r"Rule 'r': algorithm must be one of .*'sgd'"),
        (dict(name="r", algorithm="adamw", regex="("), ValueError, r"Rule 'r': regex '\(' is invalid"),
        (dict(name="r", algorithm="adamw", options=[("lr", 1)]), ValueError, r"Rule 'r': options must be a dict"),
        (dict(name="r", algorithm="adamw", options={"params": []}), ValueError, r"options may not set 'params'"),
        (dict(name="r", algorithm="adamw", options={"algorithm": "muon"}), ValueError, r"may not set .*'algorithm'"),
        (dict(name="r", algorithm="adamw", predicate="nodots"), ValueError, r"Rule 'r': predicate must be a call"),
        (
            dict(name="r", algorithm="adamw", predicate="no_such_module_xyz.fn"),
            ValueError,
            r"Rule 'r': predicate 'no_such_module_xyz.fn' cannot be imported",
        ),
        (dict(name="r", algorithm="adamw", named_predicate=3), ValueError, r"Rule 'r': named_predicate must be"),
        (dict(name="r", algorithm="adamw", module_types=[3]), ValueError, r"Rule 'r': module_types entries must"),
        (
            dict(name="r", algorithm="adamw", module_types="torch.nn.NoSuchNorm"),
            ValueError,
            r"Rule 'r': module_types entry 'torch.nn.NoSuchNorm' cannot be imported",
        ),
        (dict(name="r", algorithm="adamw", nmes="*"), TypeError, r"unexpected keyword argument 'nmes'"),
    ],
)
def test_bad_rule_arguments_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        Rule(**kwargs)
    if error is ValueError:  # the same through a dict given to route_parameters
        with pytest.raises(error, match=match):
            route_parameters(_gpt(n_layer=1), rules=[kwargs])


def test_report_lists_groups_algorithms_counts_and_examples():
    model = _gpt()
    groups = route_parameters(model, rules=[Rule(name="qkv", algorithm="muon", names="*.qkv.weight")])
    report = groups.report()
    lines = report.splitlines()
    assert lines[0] == "Muon routing"
    assert lines[1].split() == ["group", "algorithm", "rule", "layout", "tensors", "elements", "examples"]
    rows: dict[str, list[str]] = {}
    for line in lines[2:]:  # one row per group and rule
        rows.setdefault(line.split()[0], []).append(line)
    assert sorted(rows) == ["adamw", "adamw_no_decay", "muon", "qkv"]
    for g in groups:
        cells = [row.split() for row in rows[g["name"]]]
        assert all(c[1] == g["algorithm"] for c in cells)
        assert all(c[3] == ("out,in" if g["algorithm"] == "muon" else "-") for c in cells)
        assert sum(int(c[4]) for c in cells) == len(g["params"])
        assert sum(int(c[5].replace(",", "")) for c in cells) == sum(p.numel() for p in g["params"])
    # The rule that chose each parameter, with how the head was found; up to three example
    # names, then "..." when there are more.
    (qkv,) = rows["qkv"]
    assert qkv.split()[2] == "qkv" and qkv.endswith("blocks.0.attn.qkv.weight, blocks.1.attn.qkv.weight")
    embedding, head = rows["adamw"]
    assert embedding.split()[2] == "embedding" and embedding.endswith("tok_emb.weight, pos_emb.weight")
    assert head.split()[2] == "output_head:get_output_embeddings()" and head.endswith("lm_head.weight")
    (muon,) = rows["muon"]
    assert muon.endswith("blocks.0.attn.proj.weight, blocks.0.mlp.fc1.weight, blocks.0.mlp.fc2.weight, ...")
    assert "lm_head.weight" in groups.report(max_examples=5)


def test_muon_trains_on_the_routed_groups():
    model = _gpt()
    groups = route_parameters(model)
    optimizer = Muon(groups, lr=0.02, adamw_lr=1e-3)
    assert [g["name"] for g in optimizer.param_groups] == [g["name"] for g in groups]
    assert [g["algorithm"] for g in optimizer.param_groups] == [g["algorithm"] for g in groups]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model.loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n
    # Muon keeps momentum buffers for its matrices, AdamW moments for the rest.
    for g in optimizer.param_groups:
        keys = {"momentum_buffer"} if g["algorithm"] == "muon" else {"step", "exp_avg", "exp_avg_sq"}
        assert all(set(optimizer.state[p]) == keys for p in g["params"]), g["name"]


# ------------------------------------------------------- Megatron's split_qkv


class _GQAttention(nn.Module):
    def __init__(self, d: int = 8, groups: int = 2, heads_per_group: int = 2, head_dim: int = 2) -> None:
        super().__init__()
        self.linear_qkv = nn.Linear(d, groups * (heads_per_group + 2) * head_dim)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)


def test_split_qkv_routes_fused_qkv_weights_with_megatron_split():
    """split_qkv + qkv_split_shapes: the fused weight (by name or is_qkv) is split as Megatron does."""
    model = _GQAttention()
    config = MuonConfig(routing=RoutingSettings(split_qkv=True, qkv_split_shapes=[4, 2, 2]))
    groups = config.route(model)
    qkv = next(g for g in groups if g["name"] == "muon_qkv")
    assert qkv["param_names"] == ["linear_qkv.weight"] and qkv["split_sizes"] == [4, 2, 2]
    assert groups.assignments["proj.weight"] == "hidden_matrices"
    # Megatron's attribute works whatever the name.
    other = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    other[0].weight.is_qkv = True
    groups = config.route(other)
    assert groups.assignments["0.weight"] == "split_qkv"
    # Stepping the routed model: the QKV weight moves as the formula with Megatron's row layout says.
    W0 = model.linear_qkv.weight.detach().double().clone()
    model = model.double()
    opt = config.make_optimizer(config.route(model))
    grads = random_tensors([W0.shape] * 3, seed=21, dtype=torch.float64)
    for g in grads:
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        model.linear_qkv.weight.grad = g.clone()
        opt.step()
    W_ref, _, _ = muon64(W0, grads, lr=0.02, momentum=0.95, weight_decay=0.0, split_sizes=(4, 2, 2))
    assert_close(model.linear_qkv.weight.detach(), W_ref, atol=1e-12, rtol=0)


def test_split_qkv_without_shapes_warns_naming_the_fused_weights_it_leaves_whole():
    """split_qkv alone: a fused QKV weight other than nn.MultiheadAttention's cannot be split, is orthogonalized whole,
    and the routing warns naming it (its rows per query group are not known)."""
    config = MuonConfig(routing=RoutingSettings(split_qkv=True))
    with pytest.warns(UserWarning, match=r"split_qkv: \['linear_qkv\.weight'\] look like fused QKV weights, but "
                      r"routing\.qkv_split_shapes is not set, so they are orthogonalized whole"):  # fmt: skip
        groups = config.route(_GQAttention())
    assert groups.assignments["linear_qkv.weight"] == "hidden_matrices"
    assert not any("split_sizes" in g for g in groups)
    # Nothing to warn about where nothing looks fused.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.route(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)))


def test_a_rule_that_routes_nothing_warns_and_shows_in_the_report():
    """Names are relative to the module routed: a LightningModule holding a Hugging Face model adds ``model.``."""

    class Holder(nn.Module):  # as a LightningModule holds a transformers model: self.model
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt()

    holder = Holder()
    rule = Rule(name="q_lion", algorithm="lion", names="blocks.*.attn.qkv.weight")
    with pytest.warns(UserWarning, match=r"rule 'q_lion' matches no tensor: .* it would match "
                      r"'model\.blocks\.0\.attn\.qkv\.weight' written as 'blocks\.0\.attn\.qkv\.weight'"):  # fmt: skip
        groups = route_parameters(holder, rules=[rule])
    assert groups.idle_rules == [rule]
    row = next(line for line in groups.report().splitlines() if " q_lion " in line)
    assert row.split()[:6] == ["q_lion", "lion", "q_lion", "-", "0", "0"] and "(matches no tensor)" in row
    # The same rule written from the LightningModule's names routes and stays quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = route_parameters(
            holder, rules=[Rule(name="q_lion", algorithm="lion", names="model.blocks.*.attn.qkv.weight")]
        )
    assert fixed.idle_rules == [] and len(_names(fixed)["q_lion"]) == len(holder.model.blocks)
    # A rule for frozen tensors (a backbone unfrozen later) is not idle; one whose tensors an
    # earlier rule took says so.
    for p in holder.model.blocks.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        route_parameters(
            holder, rules=[Rule(name="backbone", algorithm="lion", names="model.blocks.*")], head_by_position=True
        )
    first = Rule(name="first", algorithm="adamw", names="model.lm_head.*")
    shadowed = Rule(name="shadowed", algorithm="lion", names="model.lm_head.weight")
    with pytest.warns(UserWarning, match="rule 'shadowed' matches no tensor that an earlier rule did not take first"):
        route_parameters(holder, rules=[first, shadowed])
