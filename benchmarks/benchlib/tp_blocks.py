"""``bench_tp.py``'s model: a stack of transformer blocks' matrices on a (data x tensor) mesh.

One block holds q, k, v, proj, fc1 and fc2 (k and v of grouped-query attention, a quarter of
q's rows); q, k, v and fc1 are split colwise, proj and fc2 rowwise, and the stack is placed
as Lightning's ``ModelParallelStrategy`` places it: ``parallelize_module`` on the tensor dim,
then ``fully_shard`` on the data dim. ``bench_tp.py`` times and counts its optimizer steps;
its ``--memory`` run (``memory_ranks``) measures them.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_muon.distributed.tensor_parallel import DP_DIM, TP_DIM

COLWISE = ("q", "k", "v", "fc1")


def shapes(d: int) -> dict[str, tuple[int, int]]:
    """One block's matrices, (out, in) as nn.Linear stores them."""
    return {"q": (d, d), "k": (d // 4, d), "v": (d // 4, d), "proj": (d, d), "fc1": (4 * d, d), "fc2": (d, 4 * d)}


class Block(nn.Module):
    """A transformer block's matrices (no forward needed: the benchmark only steps the optimizer)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        for name, (rows, cols) in shapes(d).items():
            setattr(self, name, nn.Linear(cols, rows, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # fully_shard needs a forward to hook; none runs here


def build_model(d: int, blocks: int, mesh, device: str) -> nn.ModuleList:
    """``blocks`` blocks of width ``d``: tensor-parallel on the mesh's tensor dim, FSDP2 on its data dim."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.ModuleList(Block(d) for _ in range(blocks)).to(device)
    plan = {n: ColwiseParallel() if n in COLWISE else RowwiseParallel() for n in shapes(d)}
    for block in model:
        parallelize_module(block, mesh[TP_DIM], plan)
        fully_shard(block, mesh=mesh[DP_DIM])
    return model
