"""What every Muon strategy checks before it shards anything: Muon optimizers over the model's own parameters."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_muon.muon import Muon

__all__ = ["check_optimizers", "holds_parameters"]


def check_optimizers(optimizers: list[Any], module: nn.Module, who: str, name: str) -> None:
    """Raise unless every optimizer is a ``Muon`` whose parameters all belong to ``module``.

    A strategy that shards Muon's work has nothing to shard in a ``torch.optim`` optimizer,
    and a parameter the model does not hold (an optimizer built from another copy of the
    model, or from the parameters FSDP2 replaced when it sharded the model) would be stepped
    while the model trains another tensor.

    Args:
        optimizers: the unwrapped optimizers.
        module: the model the strategy set up (before any DDP wrapper).
        who: the strategy class, ``name`` its registered name (for messages).
    """
    for i, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, Muon):
            kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            raise TypeError(
                f"{who} ({name!r}): optimizer {i} is a {kind}, not a lightning_muon.Muon; this strategy splits "
                "Muon's Newton-Schulz work across ranks and has nothing to split in it. Build the optimizer with "
                "Muon(model.parameters(), ...) (matrices to Muon, the rest to AdamW; a group with "
                "'algorithm': 'adamw' steps exactly like torch.optim.AdamW), or use a plain strategy ('ddp', "
                "'fsdp')"
            )
    held = {id(p) for p in module.parameters()}
    sharded_model = any(isinstance(p, DTensor) for p in module.parameters())
    for optimizer in optimizers:
        for i, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) in held:
                    continue
                hint = (
                    "FSDP2 replaced the model's parameters by DTensors when it sharded the model: create the "
                    "optimizer from model.parameters() after setting the model up (fabric.setup_module(model), "
                    "then fabric.setup_optimizers(optimizer))"
                    if sharded_model and not isinstance(p, DTensor)
                    else "build the optimizer from the parameters of the model you set up"
                )
                label = optimizer.finite_checks.label(i, j)
                raise ValueError(
                    f"{who} ({name!r}): {label} is not a parameter of the model the strategy "
                    f"set up ({type(module).__name__}); {hint}"
                )


def holds_parameters(module: nn.Module, optimizer: Any) -> bool:
    """True when ``module`` holds any parameter of ``optimizer`` (the model it was made for, among several)."""
    held = {id(p) for p in module.parameters()}
    return any(id(p) in held for g in optimizer.param_groups for p in g["params"])
