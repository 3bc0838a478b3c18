"""Mixture-of-experts stacks and their routers: found by what they are, their layouts read from the model.

Muon must orthogonalize each expert's matrices alone: flattening an ``(E, out, in)`` stack into
one ``(E, out * in)`` matrix gives no expert a Muon update. What a stack is, and how each of
its matrices is laid out, is read, never guessed from a name:

- **Which tensors are expert stacks**: a parameter of 3+ dims (not a convolution kernel, not
  named as a bias) in a module with an expert count (an int attribute whose name holds
  ``experts``: ``num_experts``, ``num_local_experts``, ``total_experts``, ``n_shared_experts``,
  ...), or, without one, whose dim 0 is the width of its block's router output; stacks may
  hold more slices than routed experts (identity "zero experts") and a single expert. A 2-D
  parameter whose dim 0 is a multiple ``k * E`` of its module's expert count (DBRX's
  ``(E * F, H)``) is one too when the probe sees one expert's token stay in its own rows.
- **Each stack's layout**, in this order:

  1. transformers' own metadata: ``@use_experts_implementation`` sets ``is_transposed``,
     ``has_gate`` and (transformers 5.24) ``is_concatenated`` on the experts module, for its
     ``gate_up_proj`` / ``up_proj`` / ``down_proj``;
  2. otherwise the probe (``probe.read_moe``): the experts module's own forward, run on
     stand-in values, shows which axis meets the hidden state and which output rows pair as
     gate and up;
  3. a user ``Rule(experts=...)`` (user rules match first, so one always wins);
  4. where none decides, the stack is routed ``(E, out, in)`` without a split and
     ``route_parameters`` warns, naming the tensor and the ``Rule`` that fixes it.

- **Routers**: every parameter the routing depends on (the probe's autograd from the router's
  scores and the routing weights handed to the experts), however nested, whatever its class
  is called. Without the probe, the parameters of ``*Router`` modules and ``gate`` /
  ``router`` Linears with one output per expert.

A fused gate/up is orthogonalized as its two matrices per expert (``split_gate_up``, the
default), as transformers 4's per-expert ``gate_proj`` and ``up_proj`` ``nn.Linear``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_muon.layout import MatrixLayout
from lightning_muon.routing.probe import MoEReading, StackReading, read_moe

__all__ = [
    "EXPERT_ORIENTATIONS",
    "ExpertStack",
    "ExpertsFound",
    "find_experts",
    "is_bias",
]

# Rule(experts=...): how a user's stack stores each expert's matrix.
EXPERT_ORIENTATIONS = {"out_in": False, "in_out": True}
# transformers' experts contract: the parameter names ``@use_experts_implementation`` describes.
_METADATA_NAMES = ("gate_up_proj", "up_proj", "down_proj")
# An expert count's name: ``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``total_experts``,
# ``moe_num_experts``, ``zero_expert_num``; not ``num_experts_per_tok`` (a top-k).
_COUNT = re.compile(r"(experts|expert_num|experts_num)$", re.IGNORECASE)
_HIDDEN_ATTRS = ("hidden_size", "hidden_dim", "d_model", "input_size", "embed_dim")


@dataclass(frozen=True)
class ExpertStack:
    """One expert stack as routed: its name, expert count, layout and the pieces Muon sees."""

    name: str
    """The parameter's full name."""
    experts: int
    """E, the number of matrices of each piece (experts, zero experts included)."""
    shape: tuple[int, ...]
    """The stored shape."""
    layout: MatrixLayout
    """How it is cut: ``batched=True``, the orientation, the gate/up split, ``blocks`` for 2-D."""
    found_by: str
    """What decided its layout: ``metadata (Class)``, ``probe (Class)``, ``rule NAME``, or ``unread (Class)``."""

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


@dataclass
class ExpertsFound:
    """What ``find_experts`` found in a module."""

    stacks: dict[int, ExpertStack] = field(default_factory=dict)
    """Parameter id -> its stack."""
    routers: set[int] = field(default_factory=set)
    """Ids of the parameters the routing depends on."""
    unread: dict[str, str] = field(default_factory=dict)
    """Parameter name -> why its layout could not be read (the stack is routed ``(E, out, in)``, warned)."""


def is_bias(name: str) -> bool:
    """A parameter named as a bias: ``bias``, or ending in ``_bias`` (GPT-OSS's ``gate_up_proj_bias``)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf.endswith("_bias")


def find_experts(module: nn.Module, split_gate_up: bool = True, probe: bool = True) -> ExpertsFound:
    """The expert stacks of ``module`` with their layouts, and its routers (module docstring).

    Args:
        module: the model.
        split_gate_up: cut a fused gate/up into its two matrices per expert.
        probe: read what metadata does not say from the model's forward (``probe`` module);
            False reads metadata only and leaves every other stack unread (warned).
    """
    found = ExpertsFound()
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    parents = {id(c): m for m in module.modules() for c in m.children()}
    candidates = _candidates(module, parents)
    blocks: dict[int, list[_Candidate]] = {}
    block_of: dict[int, nn.Module] = {}
    for c in candidates:
        block = _block_of(c.owner, parents, {id(x.param) for x in candidates})
        blocks.setdefault(id(block), []).append(c)
        block_of[id(block)] = block
    cache: dict[tuple, MoEReading] = {}
    for key, members in blocks.items():
        block = block_of[key]
        prefix = names[id(block)]
        rel = {c.name[len(prefix) + 1 :] if prefix else c.name: c for c in members}
        counts = {n for c in members for n in c.counts} | {c.param.shape[0] for c in members if c.blocks is None}
        needs = [c for c in members if c.blocks is not None or _metadata(c, split_gate_up) is None]
        reading = MoEReading()
        if probe:
            sig = (
                type(block),
                tuple((n, tuple(c.param.shape), c.blocks) for n, c in rel.items()),
                tuple(sorted(counts)),
            )
            if sig not in cache:
                stacks = {n: (c.blocks,) if c.blocks is not None else None for n, c in rel.items()}
                cache[sig] = read_moe(block, [c.owner for c in members], stacks, counts, _hidden_sizes(block, members))
            reading = cache[sig]
            params = dict(block.named_parameters(remove_duplicate=False))
            found.routers |= {id(params[n]) for n in reading.routers}
        elif needs or members:
            found.routers |= _routers_by_shape(block, counts)
        for n, c in rel.items():
            if n in reading.routers:
                continue  # a 2-D candidate the routing depends on: a router
            stack = _stack(c, reading.stacks.get(n), reading, split_gate_up, probe)
            if isinstance(stack, ExpertStack):
                found.stacks[id(c.param)] = stack
            elif stack is not None:
                found.stacks[id(c.param)] = ExpertStack(
                    c.name, c.param.shape[0], tuple(c.param.shape), MatrixLayout(batched=True), f"unread ({c.cls})"
                )
                found.unread[c.name] = stack
    found.routers -= set(found.stacks)
    return found


# ---------------------------------------------------------------------- candidates


@dataclass
class _Candidate:
    name: str
    param: Tensor
    owner: nn.Module
    counts: set[int]
    blocks: int | None  # a 2-D candidate: experts along dim 0
    cls: str = ""


def _expert_counts(m: nn.Module) -> set[int]:
    """The values of ``m``'s int attributes named for experts (``num_experts``, ``n_routed_experts``, ...)."""
    out = set()
    for attr, value in vars(m).items():
        if _COUNT.search(attr) and isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            out.add(value)
    return out


def _candidates(module: nn.Module, parents: dict[int, nn.Module]) -> list[_Candidate]:
    out = []
    for prefix, m in module.named_modules():
        params = [(leaf, p) for leaf, p in m.named_parameters(recurse=False) if not is_bias(leaf)]
        if not params or isinstance(m, nn.modules.conv._ConvNd):
            continue
        parent = parents.get(id(m))
        counts = _expert_counts(m) | (_expert_counts(parent) if parent is not None else set())
        for leaf, p in params:
            name = f"{prefix}.{leaf}" if prefix else leaf
            if p.ndim >= 3 and (counts or p.shape[0] >= 2):
                out.append(_Candidate(name, p, m, counts, None, type(m).__name__))
            elif p.ndim == 2 and not type(m).__module__.startswith("torch.nn"):  # not a Linear, an Embedding, ...
                own = _expert_counts(m)  # the module's own count: a router beside its block's count is not one
                per = [e for e in sorted(own, reverse=True) if e >= 2 and p.shape[0] % e == 0 and p.shape[0] // e >= 2]
                if per:
                    out.append(_Candidate(name, p, m, counts, per[0], type(m).__name__))
    return out


def _block_of(owner: nn.Module, parents: dict[int, nn.Module], stack_ids: set[int]) -> nn.Module:
    """The nearest module around ``owner`` that also holds something other than expert stacks (its router)."""
    m = owner
    while id(m) in parents:
        parent = parents[id(m)]
        others = [p for p in parent.parameters() if id(p) not in stack_ids]
        if others:
            return parent
        m = parent
    return m


def _hidden_sizes(block: nn.Module, members: list[_Candidate]) -> list[int]:
    """Widths the hidden state may have: the modules' own words for it, then the stacks' sides."""
    sizes = []
    for m in (*(c.owner for c in members), block):
        for holder in (m, getattr(m, "config", None)):
            for attr in _HIDDEN_ATTRS:
                value = getattr(holder, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    sizes.append(value)
    sides = Counter(d for c in members for d in (c.param.shape[-2:] if c.blocks is None else c.param.shape[1:]))
    sizes += [d for d, _ in sides.most_common()]
    return list(dict.fromkeys(sizes))


# ---------------------------------------------------------------------- layouts


def _metadata(c: _Candidate, split_gate_up: bool) -> MatrixLayout | None:
    """The layout transformers' ``@use_experts_implementation`` metadata gives ``c``, or None."""
    leaf = c.name.rsplit(".", 1)[-1]
    transposed = getattr(c.owner, "is_transposed", None)
    if c.blocks is not None or leaf not in _METADATA_NAMES or not isinstance(transposed, bool):
        return None
    fused = leaf == "gate_up_proj" and bool(getattr(c.owner, "has_gate", True))
    if not (split_gate_up and fused):
        return MatrixLayout(batched=True, transposed=transposed)
    concatenated = getattr(c.owner, "is_concatenated", None)
    if not isinstance(concatenated, bool):
        return None  # transformers before 5.24 does not say how gate and up are laid out: the probe reads it
    out = c.param.shape[-1] if transposed else c.param.shape[-2]
    sizes = (out // 2, out // 2) if concatenated else (1, 1)
    return MatrixLayout(sizes, batched=True, transposed=transposed)


def _stack(
    c: _Candidate,
    r: StackReading | None,
    reading: MoEReading,
    split_gate_up: bool,
    probed: bool,
) -> ExpertStack | str | None:
    """The stack ``c`` is, or a warning (its layout was not read), or None (not a stack)."""
    shape = tuple(c.param.shape)
    meta = _metadata(c, split_gate_up)
    if meta is not None:
        return ExpertStack(c.name, meta.matrix_form(shape)[0], shape, meta, f"metadata ({c.cls})")
    why = (r.why if r is not None and r.why else reading.failure) or (
        "the probe is off" if not probed else "the probe did not read it"
    )
    if c.blocks is not None:  # a 2-D candidate is a stack only when the probe saw it
        if r is not None and r.blocks and r.transposed is not None:
            layout = _read_layout(r.transposed, r.pair, split_gate_up, blocks=c.blocks)
            return ExpertStack(c.name, c.blocks, shape, layout, f"probe ({c.cls})")
        if r is not None and r.blocks is False and r.transposed is not None:
            return None  # one expert's token spread over every row: a plain matrix
        return (
            f"{c.name} {shape} may concatenate {c.blocks} experts along dim 0 ({why}); it is routed as one matrix. "
            f"If it does, route it with Rule(name=..., algorithm='muon', names={c.name!r}, experts='out_in', "
            f"options={{'blocks': {c.blocks}}}) (experts='in_out' when each expert is stored (in, out))"
        )
    if not c.counts and c.param.shape[0] not in reading.score_widths:
        return None  # no expert count, and no router scoring as many experts: not a mixture of experts
    leaf = c.name.rsplit(".", 1)[-1]
    meta_transposed = getattr(c.owner, "is_transposed", None) if leaf in _METADATA_NAMES else None
    transposed = meta_transposed if isinstance(meta_transposed, bool) else (r.transposed if r is not None else None)
    fused = leaf == "gate_up_proj" and isinstance(meta_transposed, bool) and bool(getattr(c.owner, "has_gate", True))
    pair = r.pair if r is not None and r.transposed == transposed else None
    if transposed is not None and not (split_gate_up and fused and pair is None):
        layout = _read_layout(transposed, pair, split_gate_up)
        how = "metadata and probe" if isinstance(meta_transposed, bool) else "probe"
        return ExpertStack(c.name, layout.matrix_form(shape)[0], shape, layout, f"{how} ({c.cls})")
    out = shape[-2]
    return (
        f"the layout of expert stack {c.name} {shape} could not be read ({why}); it is routed as {shape[0]} "
        f"(out, in) matrices without a gate/up split. If that is wrong, route it with Rule(name=..., "
        f"algorithm='muon', names={c.name!r}, experts='in_out' (or 'out_in'), options={{'split_sizes': "
        f"[{out // 2}, {out // 2}]}} for a fused gate/up)"
    )


def _read_layout(transposed: bool, pair: int | None, split_gate_up: bool, blocks: int | None = None) -> MatrixLayout:
    sizes = (pair, pair) if split_gate_up and pair is not None else None
    return MatrixLayout(sizes, batched=True, transposed=bool(transposed), blocks=blocks)


# ---------------------------------------------------------------------- routers without the probe


def _routers_by_shape(block: nn.Module, counts: set[int]) -> set[int]:
    """Without the probe: matrices of ``*Router`` modules, and ``gate``/``router`` Linears with E outputs."""
    ids = set()
    for name, m in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if type(m).__name__.endswith(("Router", "router")):
            ids |= {id(p) for p in m.parameters() if p.ndim >= 2}
        elif isinstance(m, nn.Linear) and leaf in ("gate", "router") and m.out_features in counts:
            ids.add(id(m.weight))
    return ids
