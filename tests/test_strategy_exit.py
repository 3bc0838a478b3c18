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
from lightning_muon import MuonConfig, MuonSettings

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
    # The group's worker threads, idle between collectives once they have settled: just after
    # the group starts one may still be running (seen on a busy 16-core machine under xdist).
    exit_module._wait_for_gloo_workers()
    workers = exit_module._gloo_workers()
    assert workers and all(state.startswith("S") for state, *_ in workers.values()), workers
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
    trainer.fit(TinyRegressor(MuonConfig(matrix=MuonSettings(ns_dtype="float32"))))
    assert dist.is_initialized() and registered == [exit_module._destroy]
    torch.distributed.destroy_process_group()


def test_the_wait_lets_gloo_workers_settle_and_gives_up_on_busy_ones(monkeypatch):
    # The atexit handler sleeps, the GIL free, until the gloo worker threads have stopped
    # moving: a thread still freeing a finished work's tensors needs the GIL, and would
    # abort the process if finalization had begun (see _exit's docstring).
    snapshots = iter(
        [{"1": ("S (sleeping)", "5", "0")}, {"1": ("R (running)", "6", "0")}] + [{"1": ("S (sleeping)", "7", "0")}] * 9
    )
    sleeps = []
    monkeypatch.setattr(exit_module, "_gloo_workers", lambda: next(snapshots))
    monkeypatch.setattr(exit_module.time, "sleep", sleeps.append)
    exit_module._wait_for_gloo_workers()
    # Moved once (running, one more switch), then quiet: two unchanged polls after it.
    assert len(sleeps) == 1 + 1 + exit_module._QUIET_POLLS
    busy = {"1": ("R (running)", "1", "0")}
    clock = iter(range(100))
    monkeypatch.setattr(exit_module, "_gloo_workers", lambda: busy)
    monkeypatch.setattr(exit_module.time, "monotonic", lambda: next(clock) * exit_module._POLL_S * 10)
    sleeps.clear()
    exit_module._wait_for_gloo_workers()  # a thread that never settles: the limit ends the wait
    assert 0 < len(sleeps) <= exit_module._LIMIT_S / (exit_module._POLL_S * 10)
    monkeypatch.setattr(exit_module, "_gloo_workers", lambda: {})
    sleeps.clear()
    exit_module._wait_for_gloo_workers()  # no gloo group: nothing to wait for
    assert sleeps == []
