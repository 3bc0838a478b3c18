"""Our strategies destroy the default process group at exit (Lightning does it for NCCL only).

A gloo group left to interpreter finalization has aborted spawned CPU ranks after a
successful fit (SIGABRT, "terminate called without an active exception"). One process
here: the handler is registered once by each strategy's environment setup, and it destroys
an initialized group without talking to any peer.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from ddp_modules import TinyRegressor

import lightning_muon.strategies._exit as exit_module
from lightning_muon import MuonConfig

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py


@pytest.fixture
def registered(monkeypatch):
    handlers = []
    monkeypatch.setattr(exit_module, "_registered", False)
    monkeypatch.setattr(exit_module.atexit, "register", handlers.append)
    return handlers


def test_the_handler_is_registered_once_and_destroys_the_group(tmp_path, registered):
    exit_module.destroy_process_group_at_exit()
    exit_module.destroy_process_group_at_exit()
    assert registered == [exit_module._destroy]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    registered[0]()
    assert not dist.is_initialized()
    registered[0]()  # nothing left to destroy: no error


@pytest.mark.parametrize("strategy", ["muon_ddp", "muon_fsdp"])
def test_each_strategy_registers_it_when_it_starts_the_group(tmp_path, registered, strategy):
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(TinyRegressor(MuonConfig(ns_dtype="float32")))
    assert dist.is_initialized() and registered == [exit_module._destroy]
    torch.distributed.destroy_process_group()
