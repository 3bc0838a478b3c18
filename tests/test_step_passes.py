"""One bf16 ``Muon.step`` makes no more full-size passes over memory than torch.optim.Muon + AdamW.

Timing bf16 needs a fast-bf16 host; counting does not. A dispatch mode sees every aten op
the step runs and counts, per op, the elements of the full-size tensors it writes, plus
those of the full-size tensors it reads in another dtype than it writes (the kernel converts
them first, one more pass: a bf16 update added into a float32 weight). Divided by the
parameters' elements, that is the number of full-size passes, whether the matrices go one
by one or stacked in a batch. Matrix products, the
Newton-Schulz work itself, are counted apart: both sides run the same ones. Reductions that
read a full-size tensor into a small result (norms, the finiteness check) are counted apart
too.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_muon import Muon

pytestmark = pytest.mark.numerics

MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.01


class PassCounter(TorchDispatchMode):
    """Counts elements moved in full-size tensors (at least ``min_numel`` elements) per kind of op."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.elementwise: collections.Counter[str] = collections.Counter()
        self.matmul: collections.Counter[str] = collections.Counter()
        self.reduction: collections.Counter[str] = collections.Counter()

    def _big(self, tree) -> list[Tensor]:
        return [t for t in tree_leaves(tree) if isinstance(t, Tensor) and t.numel() >= self.min_numel]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in ("new_empty", "empty_like", "zeros_like", "empty", "empty_strided"):
            return out  # no data moved (zeros_like runs only on the first step)
        schema = func._schema
        mutated = [
            a
            for arg, a in zip(schema.arguments, args)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, (Tensor, list))
        ]
        written = self._big(mutated) + ([] if mutated else self._big(out))
        read = self._big((args, kwargs))
        base = name.removeprefix("_foreach_").rstrip("_")
        if base in MATMULS:
            self.matmul[name] += _numel(written)
        elif written:
            dtypes = {t.dtype for t in written}
            self.elementwise[name] += _numel(written) + _numel([t for t in read if t.dtype not in dtypes])
        elif read:
            self.reduction[name] += _numel(read)
        return out

    def passes(self, kind: str, numel: int) -> float:
        """Full-size passes of one kind: elements moved / elements of the parameters."""
        return sum(getattr(self, kind).values()) / numel


def _numel(tensors: list[Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def gpt_like(d: int, layers: int, seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """(hidden matrices, other tensors) of a small GPT, with fixed random gradients."""
    gen = torch.Generator().manual_seed(seed)

    def make(*shape: int) -> Tensor:
        p = (0.02 * torch.randn(shape, generator=gen)).requires_grad_()
        p.grad = torch.randn(shape, generator=gen)
        return p

    hidden, other = [], [make(128, d)]
    for _ in range(layers):
        hidden += [make(3 * d, d), make(d, d), make(4 * d, d), make(d, 4 * d)]
        other += [make(d), make(d), make(d), make(d)]
    return hidden, other + [make(d), make(128, d)]


def count_step(step, min_numel: int) -> PassCounter:
    step()  # state is created on the first step; count a steady-state one
    counter = PassCounter(min_numel)
    with counter:
        step()
    return counter


# d=48: every matrix is small and goes into a batched stack. d=224: qkv (150,528 elements,
# past BATCH_MAX_ELEMENTS and the only one of its shape) runs alone, from a Nesterov update
# made in bf16 and iterated in place; fc1 and fc2 (200,704 each) share a bf16 stack, which
# reaches that far in half precision on a CPU (``stacks``), cast from float32 on the way in.
@pytest.mark.parametrize(("d", "layers"), [(48, 2), (224, 1)])
def test_bf16_step_makes_no_more_passes_than_torch_muon_plus_adamw(d, layers):
    hidden, other = gpt_like(d=d, layers=layers)
    min_numel = min(p.numel() for p in hidden + other)
    ref_muon = torch.optim.Muon(
        hidden, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY, adjust_lr_fn="original"
    )
    ref_adamw = torch.optim.AdamW(other, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    ref = count_step(lambda: (ref_muon.step(), ref_adamw.step()), min_numel)

    hidden, other = gpt_like(d=d, layers=layers)
    ours_opt = Muon(
        [
            {"params": hidden, "algorithm": "muon", "ns_coefficients": "keller", "ns_dtype": "bfloat16"},
            {"params": other, "algorithm": "adamw"},
        ],
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        adamw_lr=3e-4,
        adamw_betas=(0.9, 0.95),
    )
    ours = count_step(ours_opt.step, min_numel)

    n_hidden, n_all = sum(p.numel() for p in hidden), sum(p.numel() for p in hidden + other)
    mine = {kind: ours.passes(kind, n_all) for kind in ("matmul", "elementwise", "reduction")}
    theirs = {kind: ref.passes(kind, n_all) for kind in ("matmul", "elementwise", "reduction")}
    print(f"full-size passes per step, ours: {mine}; torch.optim.Muon + AdamW: {theirs}")
    # The same Newton-Schulz products write the same elements, batched or not.
    assert ours.matmul.total() == ref.matmul.total() > 0
    # Elementwise: momentum (2), cast to bf16 (1), normalize (1), weight decay (1), the bf16
    # update added into the fp32 weight (2, its conversion included) per matrix on both
    # sides, and AdamW's own; ours must not add any.
    assert ours.elementwise.total() <= ref.elementwise.total(), (ours.elementwise, ref.elementwise)
    # Reductions: the Frobenius norm per matrix on both sides; ours also checks every gradient
    # for NaN/inf once (one read each, aminmax), which torch's optimizers do not do.
    assert ours.reduction.total() <= ref.reduction.total() + n_all, (ours.reduction, ref.reduction)
    # The counter is not blind: the Muon side alone is at least the 7 passes listed above.
    assert ref.elementwise.total() >= 7 * n_hidden
