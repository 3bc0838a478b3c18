"""Mixture-of-experts stacks: found by what they are, routed as batches of per-expert matrices.

Since transformers 5, MoE models keep their experts as fused 3-D parameters in one module
(73 model files). Muon must orthogonalize each expert's matrices alone: flattening an
``(E, out, in)`` stack into one ``(E, out * in)`` matrix gives no expert a Muon update.

Found here:

- transformers' expert modules: a module with an int ``num_experts`` holding 3-D
  ``gate_up_proj`` / ``down_proj`` (or any 3-D parameter with ``num_experts`` rows). Their
  orientation is the module's ``is_transposed`` (GPT-OSS: ``(E, in, out)``, used as
  ``x @ W[e]``), else ``(E, out, in)`` (Mixtral, Qwen3-MoE, DeepSeek-V3: ``F.linear(x, W[e])``).
- torchtitan-style grouped experts: ``w1`` / ``w2`` / ``w3`` stacks ``(E, out, in)`` in a module
  with ``num_experts``.
- a user's own, through ``Rule(experts="out_in" | "in_out")``.

A fused ``gate_up_proj`` holds two matrices per expert along its output axis: the gate
rows then the up rows (Mixtral: ``F.linear(x, W[e]).chunk(2, -1)``), or interleaved (GPT-OSS:
``gate = y[..., ::2]``, ``up = y[..., 1::2]``; the classes in ``INTERLEAVED_GATE_UP``). With
``split_gate_up`` (the default) each is its own matrix, as in transformers 4 where every
expert had its own ``gate_proj`` and ``up_proj`` ``nn.Linear``.

Routers (``*Router`` modules, or an ``nn.Linear`` named ``gate``/``router`` with ``E`` outputs
beside an expert stack) are found too; the default rules keep them on the scalar algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_muon.layout import MatrixLayout

__all__ = [
    "EXPERT_ORIENTATIONS",
    "FUSED_GATE_UP_NAMES",
    "INTERLEAVED_GATE_UP",
    "ROUTER_NAMES",
    "ExpertStack",
    "expert_layout",
    "find_expert_stacks",
    "find_routers",
    "is_bias",
]

# Rule(experts=...): how a user's stack stores each expert's matrix.
EXPERT_ORIENTATIONS = {"out_in": False, "in_out": True}
# Parameter names of a fused gate and up projection (two matrices per expert).
FUSED_GATE_UP_NAMES = ("gate_up_proj", "w13")
# Expert module classes whose fused gate/up interleave their outputs (gate 2j, up 2j + 1);
# the others concatenate them (gate rows, then up rows). Read from transformers 5.3's sources.
INTERLEAVED_GATE_UP = ("GptOssExperts",)
# Attribute names of a router Linear beside the experts (transformers 4 layouts, torchtitan).
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class ExpertStack:
    """One expert stack as routed: its name, expert count, layout and the pieces Muon sees."""

    name: str
    """The parameter's full name."""
    experts: int
    """E, the number of experts (the product of the leading dims)."""
    shape: tuple[int, ...]
    """The stored shape."""
    layout: MatrixLayout
    """How it is cut: ``batched=True``, the orientation, and the gate/up split if any."""
    found_by: str
    """What recognised it: the module class, or the user's rule."""

    @property
    def pieces(self) -> list[tuple[int, ...]]:
        """The ``(E, rows, cols)`` batches Newton-Schulz sees (one per piece of the split)."""
        return self.layout.piece_shapes(self.shape)

    def describe(self) -> str:
        pieces = " + ".join("x".join(str(d) for d in p) for p in self.pieces)
        face = "in,out" if self.layout.transposed else "out,in"
        split = ""
        if self.layout.split_sizes is not None:
            split = ", gate/up interleaved" if self.layout.split_sizes == (1, 1) else ", gate/up split"
        return f"{self.name}  E={self.experts}  {tuple(self.shape)} ({face}{split}) -> {pieces}  [{self.found_by}]"


def expert_layout(name: str, p: Tensor, transposed: bool, split_gate_up: bool, interleaved: bool) -> MatrixLayout:
    """The layout of one stack: a batch of matrices, its orientation, and its fused gate/up split."""
    leaf = name.rsplit(".", 1)[-1]
    out = p.shape[-1] if transposed else p.shape[-2]
    if split_gate_up and leaf in FUSED_GATE_UP_NAMES and out % 2 == 0:
        sizes = (1, 1) if interleaved else (out // 2, out // 2)
        return MatrixLayout(sizes, batched=True, transposed=transposed)
    return MatrixLayout(batched=True, transposed=transposed)


def _num_experts(m: nn.Module) -> int | None:
    for attr in ("num_experts", "num_local_experts"):
        value = getattr(m, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def find_expert_stacks(module: nn.Module, split_gate_up: bool = True) -> dict[int, ExpertStack]:
    """The expert stacks among ``module``'s trainable parameters, by parameter id.

    A stack is a parameter with 3 dims whose dim 0 is its module's ``num_experts``, and whose
    name is not a bias (biases go to the scalar algorithm, whatever their ndim).
    """
    stacks: dict[int, ExpertStack] = {}
    for prefix, m in module.named_modules():
        experts = _num_experts(m)
        if experts is None:
            continue
        transposed = bool(getattr(m, "is_transposed", False))
        interleaved = type(m).__name__ in INTERLEAVED_GATE_UP
        for leaf, p in m.named_parameters(recurse=False):
            if not p.requires_grad or p.ndim != 3 or p.shape[0] != experts or is_bias(leaf):
                continue
            name = f"{prefix}.{leaf}" if prefix else leaf
            layout = expert_layout(name, p, transposed, split_gate_up, interleaved)
            stacks[id(p)] = ExpertStack(name, experts, tuple(p.shape), layout, type(m).__name__)
    return stacks


def find_routers(module: nn.Module, stacks: dict[int, ExpertStack]) -> set[int]:
    """Ids of router weights: ``*Router`` modules' matrices, and ``gate``/``router`` Linears with E outputs.

    A Linear counts when it sits beside (in the same parent as) an expert module, or a list of
    expert modules (transformers 4's ``experts``), and has as many outputs as there are experts.
    """
    ids: set[int] = set()
    for m in module.modules():
        if type(m).__name__.endswith(("Router", "router")):
            ids |= {id(p) for p in m.parameters(recurse=False) if p.ndim >= 2}
    for parent in module.modules():
        experts = _experts_beside(parent, stacks)
        if experts is None:
            continue
        for attr in ROUTER_NAMES:
            child = getattr(parent, attr, None)
            if isinstance(child, nn.Linear) and child.out_features == experts:
                ids.add(id(child.weight))
    return ids


def _experts_beside(parent: nn.Module, stacks: dict[int, ExpertStack]) -> int | None:
    """The expert count of an expert module (or list of expert modules) that is a child of ``parent``."""
    for child in parent.children():
        for p in child.parameters(recurse=False):
            if id(p) in stacks:
                return stacks[id(p)].experts
        if isinstance(child, nn.ModuleList) and len(child) > 1 and _num_experts(parent) == len(child):
            return len(child)
    return _num_experts(parent)


def is_bias(name: str) -> bool:
    """A parameter named as a bias: ``bias``, or ending in ``_bias`` (GPT-OSS's ``gate_up_proj_bias``)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf.endswith("_bias")
