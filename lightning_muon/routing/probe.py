"""Reading a mixture of experts from its own forward: which axis of each stack meets the hidden
state, which rows pair as gate and up, and which parameters the routing depends on.

The routing asks this module where transformers' own metadata is silent (an experts module
without ``@use_experts_implementation``, a fused gate/up under any name, routers however they
are nested). Nothing is guessed from names: the model's own code is run, on stand-in values.

How (``read_moe``), for one MoE block (the nearest module around the experts that also holds
something else, the router):

1. **Stand-ins.** Every parameter and buffer of the block is replaced, for the probe only, by a
   float64 CPU tensor (``torch.func.functional_call``; float32 for a block whose own code casts
   to float32 inside): an expert stack ``(E, rows, cols)`` by one random ``(rows, cols)``
   matrix expanded over its experts (zero strides: one expert's memory), every other tensor by
   a random one of its shape (buffers keep their values). The real parameters are never read
   or written, so meta, DTensor and CUDA models probe alike. The global RNG is untouched and
   the modules run in eval mode, their own eager forward, without the hooks that wrap them
   (FSDP2's, tensor parallelism's); a forward that communicates (expert parallelism's
   collectives) is refused on the spot, not run.
2. **The block's forward** on a few random tokens. Modules that output one score per expert
   (last dim equal to an expert count) and the non-hidden tensors handed to the experts module
   (routing weights) are collected: the parameters they depend on (autograd) are the routers.
   Where the block's forward needs more than the hidden states (a decoder layer), each module
   inside it is run on the tokens alone instead.
3. **Orientation.** The experts module's own forward, on the arguments it got in step 2 (or,
   without them, the transformers calling convention ``(hidden, top_k_index, top_k_weights)``
   with each token routed to one expert), with every token's hidden state set to the unit
   vector ``e_0``, and the loss the output's coordinate 1. A stack on the input side then has a
   gradient that lives on the one input index 0, an output-side stack on the one output index
   1: the axis it lives on is the input (or output) axis. Gradient supports are exact zeros,
   whatever the activation.
4. **Gate and up.** For an input-side stack, output row 0 of the stand-in is zeroed and the
   gradients taken again: the row whose gradient vanishes with it is its partner (gate times
   up: a zero gate silences its up row). Partner ``p`` means pieces ``(p, p)``: ``p = n / 2``
   concatenated halves, ``p = 1`` interleaved pairs (GPT-OSS), other ``p`` interleaved blocks.
5. **2-D concatenations** (DBRX's ``(E * F, H)``): one token to expert 0; its gradient must stay
   inside the first ``F`` rows.

Cost: a few forwards and backwards of one MoE block on 8 tokens, in float64 on the CPU, once
per distinct block (layers of one architecture share the answer). Memory: about twice one
expert's matrices, plus the block's other tensors (router, shared experts), in float64;
blocks whose stand-ins would pass ``PROBE_MAX_ELEMENTS`` are not probed. Turn it off with
``route_parameters(..., probe_experts=False)`` (``RoutingConfig.probe_experts``): the
routing then reads transformers' metadata only and warns for every stack it cannot read.
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PROBE_MAX_ELEMENTS", "MoEReading", "StackReading", "read_moe"]

PROBE_MAX_ELEMENTS = 2**25
"""The largest number of float64 elements the stand-ins of one block may hold (256 MiB)."""
_TOKENS = 8
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_MAX_ALONE = 32  # modules run alone where the block's forward does not run (a decoder layer's)
_IN, _OUT = 0, 1  # the hidden index fed, the output index read (two, so the two sides differ)


@dataclass
class StackReading:
    """What the probe read of one stack: each piece's orientation and its gate/up pairing."""

    transposed: bool | None = None
    """Each matrix stored ``(in, out)``; None: not read."""
    side: str | None = None
    """``"input"`` (meets the hidden state), ``"output"`` (writes it), ``"both"`` or None."""
    pair: int | None = None
    """The partner offset of output row 0 (split ``(pair, pair)``), or None: no pairing seen."""
    blocks: bool | None = None
    """A 2-D candidate: True when one expert's token stays in its own block of rows."""
    why: str = ""
    """What was seen, for a warning."""


@dataclass
class MoEReading:
    """What the probe read of one MoE block."""

    stacks: dict[str, StackReading] = field(default_factory=dict)
    """Parameter name (relative to the block) -> reading."""
    routers: set[str] = field(default_factory=set)
    """Names (relative to the block) of the parameters the routing depends on."""
    score_widths: set[int] = field(default_factory=set)
    """The widths of the router outputs (one score per expert) that depend on them."""
    failure: str | None = None
    """Why the block's layouts could not be read (None: they were)."""


def read_moe(
    block: nn.Module,
    experts: Sequence[nn.Module],
    stacks: dict[str, tuple[int, ...] | None],
    counts: Iterable[int],
    hidden_sizes: Iterable[int],
    max_elements: int = PROBE_MAX_ELEMENTS,
) -> MoEReading:
    """Probe one MoE block (module docstring).

    Args:
        block: the block around the experts (its router and the experts modules inside).
        experts: the modules that own expert stacks (their forwards are the experts' own).
        stacks: the stacks to read, by name relative to ``block``: ``None`` for a stack of 3+
            dims, or ``(E,)`` for a 2-D candidate concatenating ``E`` experts along dim 0.
        counts: expert counts, for recognising a router's one score per expert.
        hidden_sizes: widths the hidden state may have, tried in order.
        max_elements: the stand-ins' size limit.
    """
    reading = MoEReading()
    counts = {c for c in counts if c >= 1}
    widths = list(dict.fromkeys(h for h in hidden_sizes if h >= 2))
    names = dict(block.named_parameters(remove_duplicate=False))
    full = sum(p.numel() for n, p in names.items() if n not in stacks or stacks[n] is not None)
    full += sum(math.prod(p.shape[-2:]) for n, p in names.items() if n in stacks and stacks[n] is None)
    if full > max_elements:
        reading.failure = f"its stand-ins would hold {full:,} float64 elements (more than {max_elements:,})"
        return reading
    with _probing(block, experts):
        probe = _Probe(block, experts, stacks, counts, widths)
        try:
            probe.run(reading)
        except Exception as err:  # the model's own code, on stand-ins: it never fails the routing
            reading.failure = f"the probe stopped on {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return reading


class _probing:
    """Eval mode, the experts' own (eager) forward, the caller's RNG and grad mode restored after."""

    def __init__(self, block: nn.Module, experts: Sequence[nn.Module]) -> None:
        self.block, self.experts = block, experts

    def __enter__(self) -> None:
        self.training = [(m, m.training) for m in self.block.modules()]
        self.block.train(False)
        # The probe runs the modules' own forward, not what wraps them: FSDP2's unshard, tensor
        # parallelism's input and output redistribution and any user hook are set aside, and put back after.
        self.hooks = [(m, {k: getattr(m, k) for k in _HOOK_DICTS}) for m in self.block.modules()]
        for m, _ in self.hooks:
            for k in _HOOK_DICTS:
                setattr(m, k, type(getattr(m, k))())
        self.patched = []
        for m in self.experts:
            forward = getattr(type(m).forward, "__wrapped__", None)  # transformers' experts-implementation dispatch
            if forward is not None and "forward" not in m.__dict__:
                m.forward = types.MethodType(forward, m)
                self.patched.append(m)
        self.rng = torch.random.fork_rng(devices=[])
        self.rng.__enter__()
        self.grad = torch.enable_grad()
        self.grad.__enter__()
        self.no_comm = _NoCollectives()
        self.no_comm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.no_comm.__exit__(*exc)
        self.grad.__exit__(*exc)
        self.rng.__exit__(*exc)
        for m in self.patched:
            del m.forward
        for m, mode in self.training:
            m.training = mode
        for m, hooks in self.hooks:
            for k, v in hooks.items():
                setattr(m, k, v)


class _NoCollectives(TorchDispatchMode):
    """Refuses every collective: a forward that communicates (expert parallelism) fails the probe on this
    rank alone, where running it would leave the other ranks waiting."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            raise RuntimeError(f"{func} is a collective; the probe runs one rank's forward alone")
        return func(*args, **(kwargs or {}))


class _StandIns:
    """The stand-in values of a block's parameters and buffers (``read_moe`` step 1)."""

    def __init__(self, block: nn.Module, stacks: dict[str, tuple[int, ...] | None], inside: set[int]) -> None:
        self.block, self.stacks, self.inside = block, stacks, inside
        self.prefix = {id(m): n for n, m in block.named_modules(remove_duplicate=False)}
        self.gen = torch.Generator().manual_seed(0)
        self.params = dict(block.named_parameters(remove_duplicate=False))
        self.buffers = dict(block.named_buffers(remove_duplicate=False))
        self.dtype = torch.float64

    def make(
        self, edit: tuple[str, Callable[[Tensor], None]] | None = None, zero_biases: bool = False
    ) -> tuple[dict, dict]:
        """``(substitutes for functional_call, the leaves whose gradients are read)``, reproducibly random.

        ``edit``: ``(name, fn)``, ``fn`` changes the stand-in of parameter ``name`` in place (a zeroed row).
        ``zero_biases``: the experts' other parameters (their biases) are zeros, so that a zeroed row of
        a stack gives a zero pre-activation.
        """
        self.gen.manual_seed(0)
        subs, leaves = {}, {}
        for name, p in self.params.items():
            if name in self.stacks and self.stacks[name] is None:  # one expert's values, expanded over the experts
                rows, cols = p.shape[-2:]
                t = torch.randn((1,) * (p.ndim - 2) + (rows, cols), generator=self.gen, dtype=self.dtype)
            else:
                t = torch.randn(tuple(p.shape), generator=self.gen, dtype=self.dtype)
            t /= math.sqrt(p.shape[-1]) if p.ndim >= 2 else 10.0
            if edit is not None and edit[0] == name:
                edit[1](t)
            if zero_biases and name not in self.stacks and self._inside(name):
                t.zero_()
            leaves[name] = t.requires_grad_(True)
            subs[name] = t.expand(p.shape) if t.shape != p.shape else t
        for name, b in self.buffers.items():
            dtype = self.dtype if b.is_floating_point() else b.dtype
            local = b.to_local() if hasattr(b, "to_local") else b
            if b.is_meta or tuple(local.shape) != tuple(b.shape):
                subs[name] = torch.zeros(b.shape, dtype=dtype)
            else:
                subs[name] = local.detach().to("cpu", dtype).clone()
        return subs, leaves

    def for_module(self, module: nn.Module, subs: dict[str, Tensor]) -> dict[str, Tensor]:
        prefix = self.prefix[id(module)]
        cut = len(prefix) + 1 if prefix else 0
        return {n[cut:]: t for n, t in subs.items() if not prefix or n.startswith(prefix + ".")}

    def _inside(self, name: str) -> bool:
        owner = name.rpartition(".")[0]
        module = self.block.get_submodule(owner)
        return id(module) in self.inside


class _Probe:
    def __init__(
        self,
        block: nn.Module,
        experts: Sequence[nn.Module],
        stacks: dict[str, tuple[int, ...] | None],
        counts: set[int],
        widths: list[int],
    ) -> None:
        self.block, self.experts, self.stacks, self.counts, self.widths = block, experts, stacks, counts, widths
        self.inside = {id(m) for e in experts for m in e.modules()}
        self.values = _StandIns(block, stacks, self.inside)
        self.params = self.values.params
        self.calls = _Calls(self)
        self.block_out: tuple | None = None
        self.width: int | None = None
        self.convention: tuple[nn.Module, str] | None = None

    def callers(self, owner: nn.Module) -> list[nn.Module]:
        """``owner``, then the modules around it up to (not including) the block; the block if it owns stacks."""
        chain = _ancestors(self.block, owner)
        return [owner, *reversed(chain[1:])]

    # ------------------------------------------------------------------ the passes

    def run(self, reading: MoEReading) -> None:
        captured = self.block_pass(reading)
        if captured is None:  # a model that casts to float32 inside (routers "in fp32") refuses float64 stand-ins
            self.values.dtype = torch.float32
            captured = self.block_pass(reading) or None
            if captured is None:
                self.values.dtype = torch.float64
        by_owner: dict[int, list[str]] = {}
        owners = {}
        for name in self.stacks:
            owner_name = name.rpartition(".")[0]
            owner = self.block.get_submodule(owner_name)
            by_owner.setdefault(id(owner), []).append(name)
            owners[id(owner)] = owner
        for key, names in by_owner.items():
            self.read_orientation(owners[key], names, captured, reading)
        self.read_pairs(reading)
        self.read_blocks(reading)

    def block_pass(self, reading: MoEReading) -> dict[int, tuple[tuple, dict]] | None:
        """Step 2: the block's forward on random tokens; the routers, and the experts' arguments.

        Returns the arguments every module on the way to a stack got, by module id (None when
        the block's forward did not run).
        """
        for width in self.widths:
            for shape in ((1, _TOKENS, width), (_TOKENS, width)):
                subs, leaves = self.values.make()
                captured: dict[int, tuple[tuple, dict]] = {}
                scores: list[Tensor] = []
                handles = self._hooks(captured, scores)
                x = torch.randn(shape, generator=self.values.gen, dtype=self.values.dtype)
                try:
                    out = torch.func.functional_call(self.block, subs, (x,), strict=False, tie_weights=False)
                except Exception:
                    continue
                finally:
                    for h in handles:
                        h.remove()
                if not all(id(self.callers(e)[-1]) in captured for e in self.experts):
                    continue
                # What the block hands the experts (the outermost module on the way to them) besides the hidden state
                tops = {id(self.callers(e)[-1]): self.callers(e)[-1] for e in self.experts}
                routing = [
                    t for key in tops if key in captured for t in _tensors(captured[key])[1:] if t.is_floating_point()
                ]
                self._routers(scores + routing, leaves, reading)
                self.width = width
                self.block_out = (subs, x, out)
                return captured
        # Without the block's forward: the modules inside it (two levels down), outside the experts, each
        # on the tokens alone.
        near = [m for name, m in self.block.named_modules() if name and name.count(".") < 2]
        for m in near[:_MAX_ALONE]:
            if id(m) in self.inside or not any(True for _ in m.parameters()):
                continue
            for width in self.widths:
                subs, leaves = self.values.make()
                x = torch.randn(_TOKENS, width, generator=self.values.gen, dtype=self.values.dtype)
                try:
                    out = torch.func.functional_call(
                        m, self.values.for_module(m, subs), (x,), strict=False, tie_weights=False
                    )
                except Exception:
                    continue
                self._routers([t for t in _tensors(out) if self._is_score(t)], leaves, reading)
                break
        return None

    def _hooks(self, captured: dict, scores: list[Tensor]) -> list:
        handles = []
        on_path = {id(m) for e in self.experts for m in self.callers(e)}

        def capture(module, args, kwargs):
            captured.setdefault(id(module), (args, kwargs))

        def record(module, args, output):
            scores.extend(t for t in _tensors(output) if self._is_score(t))

        for m in self.block.modules():
            if id(m) in on_path and m is not self.block:
                handles.append(m.register_forward_pre_hook(capture, with_kwargs=True))
            elif id(m) not in self.inside and m is not self.block:
                handles.append(m.register_forward_hook(record))
        return handles

    def _is_score(self, t: Tensor) -> bool:
        return t.is_floating_point() and t.ndim >= 1 and t.shape[-1] in self.counts and t.requires_grad

    def _routers(self, outputs: list[Tensor], leaves: dict[str, Tensor], reading: MoEReading) -> None:
        outputs = [t for t in outputs if t.requires_grad]
        candidates = {  # a 2-D candidate may be a router after all: it is a candidate here too
            n: t for n, t in leaves.items() if self.stacks.get(n, ()) is not None and self.params[n].ndim >= 2
        }
        if not outputs or not candidates:
            return
        loss = sum(t.square().sum() for t in outputs)
        grads = torch.autograd.grad(loss, list(candidates.values()), allow_unused=True, retain_graph=True)
        found = {n for n, g in zip(candidates, grads) if g is not None and bool(g.ne(0).any())}
        reading.routers |= found
        for t in outputs:
            if found and self._is_score(t):
                grads = torch.autograd.grad(
                    t.square().sum(), [candidates[n] for n in found], allow_unused=True, retain_graph=True
                )
                if any(g is not None and bool(g.ne(0).any()) for g in grads):
                    reading.score_widths.add(t.shape[-1])

    # ------------------------------------------------------------------ orientation

    def read_orientation(self, owner: nn.Module, names: list[str], captured: dict | None, reading: MoEReading) -> None:
        """Step 3, for the stacks of one module: the first caller on the way up that uses them."""
        why = "its forward did not run on a probe input"
        for caller in self.callers(owner):
            grads = None
            for call in self.calls.for_orientation(caller, captured):
                subs, leaves = self.values.make()
                self.calls.last = None
                try:
                    out = call(self.values.for_module(caller, subs))
                    y = _first_float(out)
                    if y is None or y.shape[-1] <= _OUT:
                        continue
                    loss = y.reshape(-1, y.shape[-1])[:, _OUT].sum()
                    used = list(names)
                    found = torch.autograd.grad(loss, [leaves[n] for n in used], allow_unused=True)
                except Exception as err:  # the model's own code refused this input
                    why = f"its forward raised {type(err).__name__} on a probe input"
                    continue
                grads = dict(zip(used, found))
                if all(g is None for g in grads.values()):
                    grads = None
                    continue
                if self.calls.last is not None and self.convention is None:  # the later passes call it alike
                    self.convention, self.width = self.calls.last[:2], self.width or self.calls.last[2]
                break
            if grads is None:
                continue
            for n in names:
                reading.stacks[n] = _orientation(grads.get(n), self.params[n], self.stacks[n])
            return
        for n in names:
            reading.stacks[n] = StackReading(why=why)

    # ------------------------------------------------------------------ gate and up

    def read_pairs(self, reading: MoEReading) -> None:
        """Step 4: for every input-side stack with an even output axis, the partner of output row 0."""
        for name, r in reading.stacks.items():
            if r.side not in ("input", "both"):  # "both": a one-layer experts module whose caller may split it
                continue
            n = self._outputs(name, r)
            base = self._row_grads(name, r, None) if n >= 2 and n % 2 == 0 else None
            if base is None:
                continue
            for row in (0, n - 1):
                zeroed = self._row_grads(name, r, row)
                if zeroed is None:
                    break
                vanished = [i for i in range(n) if i != row and base[i] and not zeroed[i]]
                if len(vanished) != 1:
                    continue
                offset = abs(vanished[0] - row)
                if n % (2 * offset) == 0 and (row // offset) % 2 != (vanished[0] // offset) % 2:
                    r.pair = offset
                else:
                    r.why = f"output rows {row} and {vanished[0]} pair, which no (p, p) split describes"
                break

    def _outputs(self, name: str, r: StackReading) -> int:
        """Outputs of each matrix of stack ``name``."""
        p = self.params[name]
        rows, cols = (p.shape[0] // self.stacks[name][0], p.shape[1]) if self.stacks[name] else p.shape[-2:]
        return cols if r.transposed else rows

    def _row_grads(self, name: str, r: StackReading, row: int | None) -> list[bool] | None:
        """Per output row of stack ``name`` (over every expert): does its gradient have a nonzero entry,
        with output ``row`` of every expert zeroed (None: nothing zeroed). Read through the block's forward
        where it ran (a gate/up split outside the experts module shows there), else the experts' own."""
        blocks = self.stacks[name]

        def as_matrices(t: Tensor) -> Tensor:  # (B, rows, cols), outputs on dim 1
            m = t.view(blocks[0], -1, t.shape[-1]) if blocks else t.reshape(-1, *t.shape[-2:])
            return m.transpose(1, 2) if r.transposed else m

        def zero(t: Tensor) -> None:
            as_matrices(t)[:, row].zero_()

        subs, leaves = self.values.make(None if row is None else (name, zero), zero_biases=True)
        try:
            if self.block_out is not None:
                out = torch.func.functional_call(
                    self.block, subs, (self.block_out[1],), strict=False, tie_weights=False
                )
            else:
                owner = self.block.get_submodule(name.rpartition(".")[0])
                caller, convention = self.convention or self.calls.routed_calls(owner)[0]
                experts = max(self.counts) if self.counts else 1
                out = self.calls.routed(
                    caller, self.values.for_module(caller, subs), self._widths()[0], experts, range(_TOKENS), convention
                )
            y = _first_float(out)
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
            (g,) = torch.autograd.grad((y * w).sum(), [leaves[name]], allow_unused=True)
        except Exception:
            return None
        if g is None:
            return None
        return as_matrices(g.ne(0)).any(dim=2).any(dim=0).tolist()

    def _widths(self) -> list[int]:
        """The hidden widths to try: the one the block's forward ran with (or the orientation's) first."""
        first = [w for w in (self.width,) if w is not None]
        return list(dict.fromkeys(first + self.widths)) or [2]

    # ------------------------------------------------------------------ 2-D concatenations

    def read_blocks(self, reading: MoEReading) -> None:
        """Step 5: one token routed to expert 0 leaves its gradient in the first block of rows."""
        for name, kind in self.stacks.items():
            r = reading.stacks.get(name)
            if kind is None or r is None or r.transposed is None:
                continue
            (experts,) = kind
            owner = self.block.get_submodule(name.rpartition(".")[0])
            r.blocks = False
            r.why = r.why or "no forward routes one token to one expert"
            for (caller, convention), width in ((c, w) for c in self.calls.routed_calls(owner) for w in self._widths()):
                subs, leaves = self.values.make()
                try:
                    out = self.calls.routed(
                        caller, self.values.for_module(caller, subs), width, experts, [0], convention
                    )
                    y = _first_float(out)
                    (g,) = torch.autograd.grad(y.reshape(-1, y.shape[-1]).sum(), [leaves[name]], allow_unused=True)
                except Exception:
                    continue
                if g is None:
                    continue
                rows = g.ne(0).any(dim=1).nonzero().flatten()
                per = self.params[name].shape[0] // experts
                r.blocks = bool(rows.numel()) and int(rows.max()) < per
                r.why = "" if r.blocks else "one token to expert 0 moved rows outside its block"
                break


class _Calls:
    """Ways to run an experts module's forward alone: with the arguments the block gave it, or in a calling
    convention of experts modules (``_CONVENTIONS``)."""

    def __init__(self, probe: _Probe) -> None:
        self.probe = probe
        self.last: tuple | None = None
        """``(module, convention, width)`` of the last routed call made with ``note=True``."""

    def for_orientation(self, module: nn.Module, captured: dict | None) -> list[Callable[[dict], Any]]:
        """Ways to run ``module``'s forward with one-hot hidden states: its captured arguments, then the
        transformers experts convention."""
        calls = []
        if captured is not None and id(module) in captured:
            args, kwargs = captured[id(module)]
            fed, fed_kw = list(args), dict(kwargs)
            at = next((i for i, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()), None)
            key = next((k for k, a in kwargs.items() if torch.is_tensor(a) and a.is_floating_point()), None)
            if at is not None:
                fed[at] = _one_hot_rows(args[at])
            elif key is not None:
                fed_kw[key] = _one_hot_rows(kwargs[key])
            if at is not None or key is not None:
                calls.append(
                    lambda subs, a=tuple(fed), k=fed_kw: torch.func.functional_call(
                        module, subs, a, k, strict=False, tie_weights=False
                    )
                )
        experts = max(self.probe.counts) if self.probe.counts else 1
        for convention in _conventions(module):
            for width in self.probe.widths:
                calls.append(
                    lambda subs, w=width, c=convention: self.routed(
                        module, subs, w, experts, range(_TOKENS), c, note=True
                    )
                )
        return calls

    def routed(
        self,
        module: nn.Module,
        subs: dict,
        width: int,
        experts: int,
        tokens: Iterable[int],
        convention: str,
        note: bool = False,
    ) -> Any:
        """``module``'s forward in a calling convention of experts modules (``_CONVENTIONS``), token ``t`` to
        expert ``t % experts``, every token's hidden state ``e_0``."""
        tokens = list(tokens)
        chosen = [t % experts for t in tokens]
        if convention == "alone":  # (E * k, H): each expert's k rows in turn; a row without a token is zero
            k = max(chosen.count(e) for e in set(chosen))
            hidden = torch.zeros(experts * k, width, dtype=self.probe.values.dtype)
            for e in set(chosen):
                hidden[e * k : e * k + chosen.count(e), _IN] = 1.0
            args: tuple = (hidden,)
        else:
            hidden = torch.zeros(len(tokens), width, dtype=self.probe.values.dtype)
            hidden[:, _IN] = 1.0
            if convention == "index":
                weights = torch.ones(len(tokens), 1, dtype=hidden.dtype)
                args = (hidden, torch.tensor([[e] for e in chosen]), weights)
            elif convention == "dense":
                args = (hidden, nn.functional.one_hot(torch.tensor(chosen), experts).to(hidden.dtype))
            else:  # "counts": tokens sorted by expert (all alike here), and how many each expert takes
                args = (hidden, torch.bincount(torch.tensor(chosen), minlength=experts))
        out = torch.func.functional_call(module, subs, args, strict=False, tie_weights=False)
        if note:
            self.last = (module, convention, width)
        return out

    def routed_calls(self, owner: nn.Module) -> list[tuple[nn.Module, str]]:
        """``(caller, convention)`` pairs to run the experts of ``owner`` without the block."""
        return [(m, c) for m in self.probe.callers(owner) for c in _conventions(m)]


# ---------------------------------------------------------------------- supports


def _orientation(grad: Tensor | None, p: Tensor, kind: tuple[int, ...] | None) -> StackReading:
    """The orientation a gradient's support shows (step 3)."""
    if grad is None:
        return StackReading(why="the experts' forward does not use it")
    g = grad.ne(0)
    if kind is not None:  # a 2-D candidate: its blocks side by side
        (experts,) = kind
        g = g.view(experts, -1, g.shape[-1]).any(dim=0)
    else:
        g = g.reshape(-1, *g.shape[-2:]).any(dim=0)  # (rows, cols): the matrix every expert shares
    rows = g.any(dim=1).nonzero().flatten().tolist()
    cols = g.any(dim=0).nonzero().flatten().tolist()
    if not rows:
        return StackReading(why="its gradient is zero on the probe input")
    one_row, one_col = len(rows) == 1, len(cols) == 1
    if one_row and one_col:  # a single layer: reads index 0, writes index 1
        if (rows[0], cols[0]) == (_OUT, _IN):
            return StackReading(transposed=False, side="both")
        if (rows[0], cols[0]) == (_IN, _OUT):
            return StackReading(transposed=True, side="both")
    elif one_col and cols[0] == _IN:
        return StackReading(transposed=False, side="input")
    elif one_row and rows[0] == _IN:
        return StackReading(transposed=True, side="input")
    elif one_row and rows[0] == _OUT:
        return StackReading(transposed=False, side="output")
    elif one_col and cols[0] == _OUT:
        return StackReading(transposed=True, side="output")
    return StackReading(
        why=f"its gradient spans {len(rows)} rows and {len(cols)} columns: neither axis meets the hidden state alone"
    )


def _one_hot_rows(t: Tensor) -> Tensor:
    out = torch.zeros_like(t)
    out[..., _IN] = 1.0
    return out


def _tensors(out: Any) -> list[Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _tensors(item)]
    return [getattr(out, k) for k in getattr(out, "__dataclass_fields__", {}) if torch.is_tensor(getattr(out, k))]


def _first_float(out: Any) -> Tensor | None:
    return next((t for t in _tensors(out) if t.is_floating_point() and t.ndim >= 1), None)


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    """The modules from ``root`` down to ``target``'s parent (``root`` first); empty if ``target`` is ``root``."""
    path = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    name = path.get(id(target), "")
    chain, parts = [root], [p for p in name.split(".") if p] if name else []
    module = root
    for part in parts[:-1]:
        module = getattr(module, part)
        chain.append(module)
    return chain if parts else []


_CONVENTIONS = {  # how experts modules are called, by their number of positional arguments
    "index": 3,  # transformers: (hidden (T, H), top_k_index (T, k), top_k_weights (T, k))
    "dense": 2,  # (hidden (T, H), weights (T, E)), zero for the experts a token skips
    "counts": 2,  # torchtitan: (hidden sorted by expert (T, H), num_tokens_per_expert (E,))
    "alone": 1,  # Llama 4: (hidden (E * k, H)), each expert's k rows in turn
}


def _conventions(module: nn.Module) -> list[str]:
    """The calling conventions ``module``'s forward can take, by its signature."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return []
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return [c for c, n in _CONVENTIONS.items() if len(required) <= n <= len(positional)]
