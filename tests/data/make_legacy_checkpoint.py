"""Writes ``legacy_checkpoint.pt``: a ``Muon`` state dict in the format of lightning_muon 0.1.0.

Run once, with ``python tests/data/make_legacy_checkpoint.py``, when the settings became typed
sections (``MuonSettings``, ``LionSettings``, ...; param groups keep ``weight_decay_method`` and
``fp32_matmul_prec``, and ``second_moment="normuon"`` is Emerging-Optimizers' form). The file
written before that, at the commit before the optimizer was split into registered algorithms
(9ae5802), held forms no release had (``weight_decay_form``, "normuon" meaning today's
"normuon_rms"), whose shims were dropped. The file holds the model and optimizer state after
three steps of every kind of group (Muon with fused-QKV splits and NorMuon, AdamW, Lion,
Schedule-Free AdamW), the gradients of two more steps, and the weights, state and param groups
those two steps gave then. ``tests/test_legacy_checkpoint.py`` loads it into today's code and
checks that the two steps give the same numbers.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from lightning_muon import LionSettings, Muon, ScheduleFreeSettings

SHAPES = {"qkv": (12, 4), "proj": (4, 4), "conv": (3, 2, 2, 2), "bias": (4,), "gain": (4,), "scale": (3,)}


def build(params: dict[str, nn.Parameter]) -> Muon:
    return Muon(
        [
            {"params": [("qkv", params["qkv"])], "algorithm": "muon", "name": "qkv", "split_sizes": [4, 4, 4]},
            {"params": [("proj", params["proj"]), ("conv", params["conv"])], "algorithm": "muon", "name": "muon",
             "second_moment": "normuon"},
            {"params": [("bias", params["bias"])], "algorithm": "adamw", "name": "adamw"},
            {"params": [("gain", params["gain"])], "algorithm": "lion", "name": "lion", "lr": 1e-3},
            {"params": [("scale", params["scale"])], "algorithm": "adamw_schedulefree", "name": "sf"},
        ],
        lr=0.02,
        weight_decay=0.01,
        ns_dtype="float32",
        adamw_lr=1e-2,
        adamw_weight_decay=0.01,
        # The values the first file's Lion and Schedule-Free groups had (AdamW's, their fallback then).
        settings=[LionSettings(weight_decay=0.01), ScheduleFreeSettings(lr=1e-2, weight_decay=0.01)],
    )  # fmt: skip


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    params = {n: nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(5)]
    opt = build(params)
    opt.train()
    for step in grads[:3]:
        for n, p in params.items():
            p.grad = step[n].clone()
        opt.step()
    saved = {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "optimizer": opt.state_dict(),
        "grads": grads[3:],
    }
    saved = copy.deepcopy(saved)  # the state as it was after three steps, not a live view
    for step in grads[3:]:
        for n, p in params.items():
            p.grad = step[n].clone()
        opt.step()
    saved["after"] = {n: p.detach().clone() for n, p in params.items()}
    saved["state_after"] = copy.deepcopy(opt.state_dict()["state"])
    saved["groups_after"] = copy.deepcopy(opt.state_dict()["param_groups"])
    torch.save(saved, Path(__file__).with_name("legacy_checkpoint.pt"))


if __name__ == "__main__":
    main()
