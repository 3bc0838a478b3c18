"""Checkpoints saved by lightning_muon 0.1.0 load and resume: the state-dict format is a contract.

``tests/data/legacy_checkpoint.pt`` was written by ``tests/data/make_legacy_checkpoint.py`` with
the 0.1.0 optimizer of typed settings sections (``weight_decay_method``, ``fp32_matmul_prec`` in
every Muon group; the file before it held forms no release had, whose shims were dropped). It
holds the state after three steps of every kind of group and what two more steps gave then;
today's optimizer must give the same numbers.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))

from make_legacy_checkpoint import SHAPES, build  # noqa: E402

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py


def _load() -> dict:
    return torch.load(DATA / "legacy_checkpoint.pt", weights_only=True)


def _same(got: torch.Tensor, saved: torch.Tensor) -> bool:
    """Equal to the saved numbers, up to the CPU's own BLAS and reduction kernels.

    The state-dict format is the contract, not the kernels: MKL and ATen pick AVX2 or AVX-512
    code paths by host, which round Newton-Schulz's matmuls and NorMuon's sums differently
    (measured: 1 ulp, 1.2e-7, after two steps on an AVX-512 host against the AVX2 host that
    wrote the file; bit for bit there). A wrong group key or state entry moves far more.
    """
    got, saved = torch.as_tensor(got), torch.as_tensor(saved)
    if got.dtype != saved.dtype or got.shape != saved.shape:
        return False
    if not got.is_floating_point():
        return torch.equal(got, saved)
    return bool(((got - saved).abs() <= 1e-6 * (1 + saved.abs())).all())


def _resume(saved: dict, optimizer_state: dict) -> tuple[dict[str, nn.Parameter], torch.optim.Optimizer]:
    params = {n: nn.Parameter(saved["params"][n].clone()) for n in SHAPES}
    opt = build(params)
    opt.load_state_dict(optimizer_state)
    for step in saved["grads"]:
        for n, p in params.items():
            p.grad = step[n].clone()
        opt.step()
    return params, opt


def test_a_checkpoint_of_version_0_1_resumes_as_it_did():
    saved = _load()
    groups = saved["optimizer"]["param_groups"]
    assert [g["algorithm"] for g in groups] == ["muon", "muon", "adamw", "lion", "adamw_schedulefree"]
    params, opt = _resume(saved, saved["optimizer"])
    for n, p in params.items():
        assert _same(p.detach(), saved["after"][n]), n
    state = opt.state_dict()["state"]
    assert set(state) == set(saved["state_after"])
    for i, entries in saved["state_after"].items():
        assert set(state[i]) == set(entries), i  # the same state keys per parameter
        for key, value in entries.items():
            assert _same(state[i][key], value), (i, key)
    # The group keys of 0.1.0 are all still there, with the values they had then.
    for old, new in zip(saved["groups_after"], opt.state_dict()["param_groups"]):
        assert {k: new[k] for k in old} == old


def test_a_checkpoint_older_than_a_knob_takes_its_default():
    """Groups saved before a knob existed (here: tp_mode, ns_method, sign_momentum, fp32_matmul_prec) get its
    default."""
    saved = _load()
    older = copy.deepcopy(saved["optimizer"])
    knobs = ("tp_mode", "ns_method", "sign_momentum", "fp32_matmul_prec")
    for group in older["param_groups"]:
        if group["algorithm"] == "muon":
            for key in knobs:
                del group[key]
    params, opt = _resume(saved, older)
    for n, p in params.items():
        assert _same(p.detach(), saved["after"][n]), n
    muon_groups = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    assert {tuple(g[k] for k in knobs) for g in muon_groups} == {("duplicated", "auto", False, "medium")}
