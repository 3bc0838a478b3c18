"""``Muon.add_param_group`` with a group given without an algorithm: routed, split, lrs by rule (``added_groups``).

The rule under test: part ``k`` of a split group given lr ``x`` gets ``x * B_k / B_0``, with
``B_k`` the lr its route starts from and ``B_0`` the one the first group started from; the
parts of the first group's algorithm come last. Lightning's ``BackboneFinetuning`` in a real
fit is in tests/test_lightning_tools.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_muon import (
    AdamWSettings,
    LionSettings,
    Muon,
    MuonConfig,
    RoutingSettings,
    Rule,
    configure_muon_optimizers,
)
from lightning_muon.schedules import LRSchedule, MuonScheduler


class Backboned(nn.Module):
    """A backbone (embedding, hidden Linear, LayerNorm) and a head of two Linears."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))


def _summary(optimizer: Muon) -> list[tuple]:
    return [(g.get("name"), g["algorithm"], g["lr"], len(g["params"])) for g in optimizer.param_groups]


def test_a_mixed_group_is_split_with_the_lrs_in_the_optimizers_relation():
    model = Backboned()
    opt = Muon(model.head.parameters(), lr=0.02, adamw_lr=3e-4)  # groups "muon" (2 matrices), "adamw" (2 biases)
    hidden, norm = model.backbone[1], model.backbone[2]
    opt.add_param_group({"params": [hidden.weight, hidden.bias, norm.weight, norm.bias], "lr": 1e-3})
    # x = 1e-3 on the first group's (Muon's) scale: AdamW's part gets 1e-3 * 3e-4 / 0.02; Muon's part comes last.
    assert _summary(opt) == [
        ("muon", "muon", 0.02, 2),
        ("adamw", "adamw", 3e-4, 2),
        ("pg2.adamw", "adamw", 1e-3 * 3e-4 / 0.02, 3),
        ("pg2.muon", "muon", 1e-3, 1),
    ]
    assert opt.param_groups[3]["params"] == [hidden.weight]
    assert opt.param_groups[2]["params"] == [hidden.bias, norm.weight, norm.bias]
    # Without an lr, each part starts where a group of its algorithm starts.
    opt.add_param_group({"params": model.backbone[0].parameters(), "name": "embedding"})  # one route: no split
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))]})
    assert _summary(opt)[4:] == [
        ("embedding", "muon", 0.02, 1),
        ("pg5.adamw", "adamw", 3e-4, 1),
        ("pg5.muon", "muon", 0.02, 1),
    ]
    # Each part steps by its algorithm.
    for p in model.head.parameters():
        p.grad = torch.ones_like(p)
    for p in (hidden.weight, hidden.bias):
        p.grad = torch.ones_like(p)
    opt.step()
    assert set(opt.state[hidden.weight]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq"} <= set(opt.state[hidden.bias])


def test_the_lr_is_read_on_the_first_groups_scale_as_backbone_finetuning_computes_it():
    # An AdamW first group, mid-warmup: BackboneFinetuning passes 0.1 x param_groups[0]["lr"].
    model = Backboned()
    head = model.head[1]
    opt = Muon([{"params": [head.weight, head.bias], "algorithm": "adamw"}], lr=0.02, adamw_lr=3e-4)
    scheduler = MuonScheduler(opt, LRSchedule.create("constant", warmup=4))
    opt.step()  # no gradients: nothing moves
    scheduler.step()  # step 1 of a 4-step warmup: every lr is at 2/4 of its start
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4 / 2)
    hidden, norm = model.backbone[1], model.backbone[2]
    opt.add_param_group({"params": [hidden.weight, norm.weight], "lr": 0.1 * opt.param_groups[0]["lr"]})
    # B_0 is the first group's start (initial_lr, recorded by the scheduler): each part gets a
    # tenth of what a group of its algorithm has now, and the AdamW part (the first group's
    # algorithm) comes last, where BackboneFinetuning's later epochs move the lr.
    (_, muon_part, adamw_part) = opt.param_groups
    assert (muon_part["name"], muon_part["algorithm"], adamw_part["name"]) == ("pg1.muon", "muon", "pg1.adamw")
    assert muon_part["lr"] == pytest.approx(0.1 * 0.02 / 2)
    assert adamw_part["lr"] == pytest.approx(0.1 * 3e-4 / 2)
    # The scheduler drives the groups it was made with; added ones keep their lr (BackboneFinetuning moves it).
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4 * 3 / 4)
    assert (muon_part["lr"], adamw_part["lr"]) == pytest.approx((0.1 * 0.02 / 2, 0.1 * 3e-4 / 2))


def test_the_module_router_applies_the_configs_rules_to_an_unfrozen_backbone():
    model = Backboned()
    model.backbone.requires_grad_(False)
    config = MuonConfig(
        scalar=AdamWSettings(weight_decay=0.1),
        routing=RoutingSettings(
            rules=[Rule(name="hidden", algorithm="muon", names="backbone.1.weight", options={"lr": 0.01})]
        ),
    )
    opt = configure_muon_optimizers(model, config)["optimizer"]
    assert [g["name"] for g in opt.param_groups] == ["muon", "adamw_no_decay", "adamw"]  # the head
    model.backbone.requires_grad_(True)
    opt.add_param_group({"params": model.backbone.parameters(), "lr": 0.1 * opt.param_groups[0]["lr"]})
    parts = {g["name"]: g for g in opt.param_groups[3:]}
    # As the rules route a model trained whole: the embedding to AdamW with its weight decay,
    # the norm to AdamW without, the hidden matrix by the user's rule at its own lr.
    assert list(parts) == ["pg3.adamw", "pg3.adamw_no_decay", "pg3.hidden"]
    assert parts["pg3.adamw"]["param_names"] == ["backbone.0.weight"]
    assert parts["pg3.adamw_no_decay"]["param_names"] == ["backbone.1.bias", "backbone.2.weight", "backbone.2.bias"]
    assert parts["pg3.hidden"]["param_names"] == ["backbone.1.weight"]
    assert (parts["pg3.adamw"]["weight_decay"], parts["pg3.adamw_no_decay"]["weight_decay"]) == (0.1, 0.0)
    assert parts["pg3.hidden"]["lr"] == pytest.approx(0.1 * 0.01)  # x * B_k / B_0 with B_k the rule's lr
    assert parts["pg3.adamw"]["lr"] == pytest.approx(0.1 * 3e-4)


def test_a_tensor_outside_the_module_takes_the_flat_rule_with_the_scalar_optimizer():
    model = Backboned()
    opt = configure_muon_optimizers(model, MuonConfig(scalar=LionSettings()))["optimizer"]
    extra = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))]
    opt.add_param_group({"params": extra})
    # The first group is Lion's (the embedding): Lion's part comes last. The optimizer's groups
    # are named, so the parts are too (torch wants all or none), after the part.
    assert [(g["name"], g["algorithm"], g["param_names"]) for g in opt.param_groups[-2:]] == [
        ("pg3.muon", "muon", ["pg3.muon.0"]),
        ("pg3.lion", "lion", ["pg3.lion.0"]),
    ]


def test_the_given_keys_go_to_the_parts_whose_algorithm_has_them():
    model = Backboned()
    opt = Muon(model.head.parameters())
    hidden = model.backbone[1]
    opt.add_param_group(
        {"params": [hidden.weight, hidden.bias], "weight_decay": 0.1, "betas": (0.8, 0.9), "nesterov": False, "tag": 7}
    )
    adamw_part, muon_part = opt.param_groups[2:]
    assert (adamw_part["weight_decay"], adamw_part["betas"], adamw_part["tag"]) == (0.1, (0.8, 0.9), 7)
    assert (muon_part["weight_decay"], muon_part["nesterov"], muon_part["tag"]) == (0.1, False, 7)
    assert "nesterov" not in adamw_part and "betas" not in muon_part
    with pytest.raises(
        ValueError, match=r"param group 4: \['r'\] set no hyperparameter of the algorithms .*adamw.*muon"
    ):
        opt.add_param_group({"params": [model.backbone[2].weight, nn.Parameter(torch.zeros(2, 2))], "r": 1.0})


def test_a_group_of_one_algorithm_is_added_as_given():
    opt = Muon([nn.Parameter(torch.zeros(4, 4))], lr=0.02, adamw_lr=3e-4)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))], "lr": 1e-3})  # all vectors: its lr is AdamW's
    assert _summary(opt)[1] == (None, "adamw", 1e-3, 1)
