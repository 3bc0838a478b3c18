"""Every mixture-of-experts family of the installed transformers, routed right or warned.

``moe_zoo.families()`` finds the families by reading transformers' sources, so a new release
is covered on its own; each is built tiny, routed with ``route_parameters``, and every expert
stack's cut is compared with the truth of its own module's forward (``moe_zoo.truth``, a
method independent of the routing's probe). A family is right when every stack's matrices,
their orientation and their gate/up split equal the truth, warned when the routing named a
stack it could not read, and no router may be orthogonalized. The table is printed (``-s``).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import moe_zoo
import pytest
import torch
from torch import nn

from lightning_muon import Muon, route_parameters
from lightning_muon.algorithms import orthogonalizes
from lightning_muon.layout import layout_of

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free, pytest.mark.slow]

MAX_UNBUILT = 3


@dataclass
class Outcome:
    family: moe_zoo.Family
    right: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    """Routers the routing sent to Muon."""

    @property
    def status(self) -> str:
        if self.family.error:
            return "not built"
        if self.wrong or self.routers:
            return "WRONG"
        return "warned" if self.warned else "right"


def _warned_about(name: str, messages: list[str]) -> bool:
    return any(f"{name} (" in m or f"{name}'" in m for m in messages)


def route_and_check(family: moe_zoo.Family) -> Outcome:
    outcome = Outcome(family)
    model = moe_zoo.build(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = route_parameters(model)
    messages = [str(w.message) for w in caught if "route_parameters" in str(w.message)]
    group_of = {n: g for g in groups for n in g["param_names"]}
    try:
        modules = moe_zoo.truth(model, family)
    except moe_zoo.TruthError as err:
        family.error = str(err)
        return outcome
    for module in modules:
        for stack in module.stacks:
            want = stack.cut()
            group = group_of.get(stack.name)
            if group is None:
                continue  # frozen
            got = moe_zoo.routed_cut(layout_of(group), stack.shape) if orthogonalizes(group) else None
            if want is not None and got == want:
                outcome.right.append(stack.name)
            elif _warned_about(stack.name, messages):
                outcome.warned.append(stack.name)
            elif want is None and not orthogonalizes(group):
                outcome.right.append(stack.name)  # not a matrix the truth could read, and not given to Muon
            else:
                outcome.wrong.append(f"{stack.name}: routed {group['name']} {layout_of(group)}, truth {stack}")
        for name in sorted(module.routers):
            if name in group_of and orthogonalizes(group_of[name]):
                outcome.routers.append(name)
    return outcome


@pytest.fixture(scope="module")
def families() -> list[moe_zoo.Family]:
    return moe_zoo.families()


@pytest.fixture(scope="module")
def zoo(families) -> list[Outcome]:
    return [route_and_check(f) if not f.error else Outcome(f) for f in families]


def test_every_family_is_right_or_warned(zoo):
    import transformers

    lines = [f"MoE zoo, transformers {transformers.__version__}: family  status  stacks right/warned"]
    for o in zoo:
        extra = f"  ({o.family.error})" if o.family.error else ""
        lines.append(f"  {o.family.name:<36} {o.status:<9} {len(o.right)}/{len(o.warned)}{extra}")
        lines += [f"      wrong: {w}" for w in o.wrong] + [f"      router to Muon: {r}" for r in o.routers]
        lines += [f"      warned: {w}" for w in o.warned]
    counts = {s: sum(o.status == s for o in zoo) for s in ("right", "warned", "WRONG", "not built")}
    lines.append(
        f"{len(zoo)} families: {counts['right']} right, {counts['warned']} warned, {counts['WRONG']} wrong, "
        f"{counts['not built']} not built"
    )
    print("\n".join(lines))
    assert len(zoo) >= 20, "too few families found: the enumeration is broken"
    assert counts["WRONG"] == 0, "\n".join(lines)
    assert counts["not built"] <= MAX_UNBUILT, "\n".join(lines)
    assert sum(len(o.warned) for o in zoo) <= sum(len(o.right) for o in zoo) // 4, "most stacks must be read"


# One family per storage class, for a step-by-step check against per-expert nn.Linear pieces; the
# first one the installed transformers builds, else a replica of the class (moe_zoo.replica).
STORAGE = {
    "in_out_without_metadata": ["llama4_text"],
    "fused_gate_up_other_name": ["jetmoe"],
    "other_count_more_slices": ["longcat_flash"],
    "concatenated_2d": ["dbrx", "replica:concat"],
    "shared_stacks": ["inkling_text", "replica:shared"],
    "one_expert": ["mixtral:1"],
}
HP = dict(lr=0.05, weight_decay=0.1, ns_dtype="float32", adjust_lr="original")


def _family_for(kind: str, families: dict[str, moe_zoo.Family]):
    """The first family of storage class ``kind`` that builds and whose truth reads: (family, model, truths)."""
    for choice in STORAGE[kind]:
        if choice.startswith("replica:"):
            family, model = moe_zoo.replica(choice.split(":")[1])
        else:
            name, _, experts = choice.partition(":")
            family = families.get(name)
            if family is None or family.error:
                continue
            if experts:  # the same family with one expert (and top-1 routing)
                values = {**family.config.to_dict(), "num_local_experts": 1, "num_experts_per_tok": 1}
                family = moe_zoo.Family(
                    family.folder, f"{name} (1 expert)", family.experts_classes, type(family.config)(**values),
                    family.model_class,
                )  # fmt: skip
            model = moe_zoo.build(family)
        try:
            truths = [s for m in moe_zoo.truth(copy.deepcopy(model), family) for s in m.stacks]
        except moe_zoo.TruthError:  # transformers 5.3's DBRX forward fails on its own tiny config
            continue
        return family, model, truths
    raise AssertionError(f"no family of storage class {kind!r} builds and runs, and it has no replica")


@pytest.mark.parametrize("kind", sorted(STORAGE))
def test_each_storage_class_steps_like_one_linear_per_expert(kind, families):
    """3 Muon steps on the routed stacks equal 3 steps on every expert's pieces as separate (out, in) matrices."""
    family, model, truths = _family_for(kind, {f.name: f for f in families})
    print(f"{kind}: {family.name}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = route_parameters(model)
    params = dict(model.named_parameters())
    stacks = {t.name: (params[t.name], t.pieces()) for t in truths if t.pieces() is not None}
    assert stacks, f"{family.name}: the truth read no stack"
    warned = [str(w.message) for w in caught if any(_warned_about(name, [str(w.message)]) for name in stacks)]
    assert not warned, warned  # read, not warned
    reference = {
        name: [nn.Parameter(p.detach().reshape(-1)[idx].clone()) for idx in pieces]
        for name, (p, pieces) in stacks.items()
    }
    ours = Muon(groups, **HP)
    ref = Muon([{"params": [q for qs in reference.values() for q in qs], "algorithm": "muon"}], **HP)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = None
        for name, (p, pieces) in stacks.items():
            g = torch.randn(p.shape, generator=gen)
            p.grad = g
            for q, idx in zip(reference[name], pieces):
                q.grad = g.reshape(-1)[idx].clone()
        ours.step()
        ref.step()
    for name, (p, pieces) in stacks.items():
        for q, idx in zip(reference[name], pieces):
            got = p.detach().reshape(-1)[idx]
            error = float((got - q.detach()).norm() / q.detach().norm())
            assert error < 1e-6, (family.name, name, tuple(idx.shape), error)
