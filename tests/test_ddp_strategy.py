"""MuonDDPStrategy end to end: registered names, same parameters as one process, complete checkpoints."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from ddp_modules import TinyRegressor
from lightning.pytorch.strategies import StrategyRegistry

from lightning_muon import MuonConfig, MuonDDPStrategy

# fp32 Newton-Schulz: bf16 would turn reduction-order noise into percent-level differences.
CONFIG = MuonConfig(lr=0.02, weight_decay=0.1, ns_dtype="float32", adamw_lr=1e-2)


def _fit(tmp_path, strategy, devices: int, clip: float | None) -> tuple[TinyRegressor, pl.Trainer]:
    model = TinyRegressor(CONFIG)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        gradient_clip_val=clip,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    return model, trainer


def test_registered_names():
    assert "muon_ddp" in StrategyRegistry and "muon_ddp_spawn" in StrategyRegistry
    assert StrategyRegistry["muon_ddp_spawn"]["strategy"] is MuonDDPStrategy
    with pytest.raises(ValueError, match="muon_mode must be one of"):
        MuonDDPStrategy(muon_mode="bogus")


@pytest.mark.parametrize("clip", [None, 0.05])
def test_two_ranks_equal_one_process_and_save_every_momentum(tmp_path, clip):
    single, _ = _fit(tmp_path / "one", "auto", 1, clip)
    # Two ranks of batch 4 see the same 8 samples per step as one process of batch 8.
    _fit(tmp_path / "two", "muon_ddp_spawn", 2, clip)
    # Rank 0's final state, as saved at the end of the fit.
    ckpt = torch.load(next((tmp_path / "two").rglob("*.ckpt")), weights_only=True)
    for name, b in single.named_parameters():
        # fp32 throughout; only gradient summation order differs (~1e-7), kept there over 6 steps.
        torch.testing.assert_close(
            ckpt["state_dict"][name], b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    state = ckpt["optimizer_states"][0]
    muon_indices = [i for g in state["param_groups"] if g["algorithm"] == "muon" for i in g["params"]]
    assert len(muon_indices) == 3
    assert all("momentum_buffer" in state["state"][i] for i in muon_indices)
