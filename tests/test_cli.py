"""``python -m lightning_muon fit --config configs/<name>.yaml`` in a subprocess, shrunk to a few steps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_muon import MuonConfig
from lightning_muon.demo import CharGPTModule

ROOT = Path(__file__).resolve().parents[1]

# The README's configs with everything made tiny: 3 steps of a 1-layer, 32-wide model.
# Note: LightningCLI parses --trainer.limit_val_batches=1 as the float 1.0 (Trainer annotates
# it Union[float, int]), which means "all validation batches"; val_samples=8 keeps that at 2.
TINY = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.block_size=16",
    "--data.init_args.max_chars=20000",
    "--data.init_args.batch_size=4",
    "--data.init_args.val_samples=8",
]
TINY_CHARGPT = [
    "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=32",
    "--model.init_args.n_head=2",
    "--model.init_args.block_size=16",
]


def _fit(tmp_path: Path, config: str, *extra: str, pythonpath: Path | None = None) -> str:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    args = [sys.executable, "-m", "lightning_muon", "fit", f"--config={ROOT / 'configs' / config}"]
    args += [*TINY, *extra, f"--trainer.default_root_dir={tmp_path}"]
    # The timeout only guards against a hang; each run takes a few seconds.
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def _routing_table(output: str) -> dict[str, tuple[str, int]]:
    """Group -> (algorithm, tensors) from the routing report the CLI prints."""
    lines = output.splitlines()
    start = lines.index("Muon routing")
    assert lines[start + 1].split()[:4] == ["group", "algorithm", "tensors", "elements"]
    table = {}
    for line in lines[start + 2 :]:
        cells = line.split()
        if len(cells) < 4 or not cells[2].isdigit():
            break
        table[cells[0]] = (cells[1], int(cells[2]))
    return table


def _checkpoint_path(tmp_path: Path) -> Path:
    paths = sorted(tmp_path.rglob("*.ckpt"))
    assert [p.name for p in paths] == ["epoch=0-step=3.ckpt"]
    return paths[0]


def _checkpoint(tmp_path: Path) -> dict:
    return torch.load(_checkpoint_path(tmp_path), weights_only=True)


# Lightning's own instantiate_module (used by load_from_checkpoint) calls a deprecated jsonargparse API.
JSONARGPARSE_DEPRECATION = "ignore:(?s).*(instantiate_classes.. was deprecated|JsonargparseDeprecationWarning)"


@pytest.mark.filterwarnings(f"{JSONARGPARSE_DEPRECATION}:DeprecationWarning")
def test_cli_fits_configs_muon_yaml(tmp_path):
    output = _fit(tmp_path, "muon.yaml", *TINY_CHARGPT)
    # qkv, proj, fc1, fc2 on Muon; two embeddings and lm_head on AdamW; 2 LNs x 2 + 4 biases + ln_f x 2.
    assert _routing_table(output) == {"adamw": ("adamw", 3), "adamw_no_decay": ("adamw", 10), "muon": ("muon", 4)}
    checkpoint = _checkpoint(tmp_path)
    assert checkpoint["global_step"] == 3
    # LightningCLI saves the parsed arguments as hyperparameters (plus an "_instantiator"),
    # so the config is a plain dict here, not the MuonConfig the module was given.
    hparams = checkpoint["hyper_parameters"]
    config = MuonConfig.from_any(hparams["muon_config"])
    assert (config.lr, config.adjust_lr, config.falloff, config.momentum_warmup_steps) == (
        0.02,
        "match_rms_adamw",
        "wsd",
        100,
    )
    assert hparams["n_embd"] == 32
    # load_from_checkpoint rebuilds the module through the CLI's parser: the config is typed again.
    module = CharGPTModule.load_from_checkpoint(_checkpoint_path(tmp_path))
    assert module.hparams["muon_config"] == config
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(tensor, checkpoint["state_dict"][name], rtol=0, atol=0)
    # The schedule was sized from the trainer: wsd over max_steps=3 is a linear falloff.
    schedule = checkpoint["lr_schedulers"][0]["schedule"]
    assert (schedule["falloff"], schedule["total_steps"]) == ("linear", 3)
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert sorted((g["name"], g["algorithm"]) for g in groups) == [
        ("adamw", "adamw"),
        ("adamw_no_decay", "adamw"),
        ("muon", "muon"),
    ]


def test_cli_fits_configs_adamw_yaml_with_adamw_groups_only(tmp_path):
    output = _fit(tmp_path, "adamw.yaml", *TINY_CHARGPT)
    table = _routing_table(output)
    assert table == {"adamw": ("adamw", 7), "adamw_no_decay": ("adamw", 10)}  # 7: 4 hidden + 2 embeddings + head
    groups = _checkpoint(tmp_path)["optimizer_states"][0]["param_groups"]
    assert {g["algorithm"] for g in groups} == {"adamw"}
    assert {g["name"]: g["weight_decay"] for g in groups} == {"adamw": 0.01, "adamw_no_decay": 0.0}
    assert all(g["lr"] == pytest.approx(0.0) for g in groups)  # wsd ends at min_lr_ratio 0 after 3 steps


def test_cli_fits_configs_muon_schedulefree_yaml(tmp_path):
    output = _fit(tmp_path, "muon_schedulefree.yaml", *TINY_CHARGPT)
    sf = "adamw_schedulefree"
    assert _routing_table(output) == {sf: (sf, 3), f"{sf}_no_decay": (sf, 10), "muon": ("muon", 4)}
    checkpoint = _checkpoint(tmp_path)
    config = MuonConfig.from_any(checkpoint["hyper_parameters"]["muon_config"])
    assert (config.scalar_optimizer, config.falloff, config.warmup) == (sf, "constant", 30)
    # Constant falloff: the run's length is not needed, and no group decays.
    assert checkpoint["lr_schedulers"][0]["schedule"]["total_steps"] is None
    state = checkpoint["optimizer_states"][0]
    groups = {g["name"]: g for g in state["param_groups"]}
    # Saved after the validation at step 3: eval mode, three schedule-free steps counted.
    assert [(g["train_mode"], g["k"]) for g in (groups[sf], groups[f"{sf}_no_decay"])] == [(False, 3)] * 2
    assert groups[sf]["lr"] == pytest.approx(0.003 * 4 / 30)  # the next (4th) step, in a 30-step warmup
    assert all({"z", "exp_avg_sq"} <= set(state["state"][i]) for i in groups[sf]["params"])


USER_MODULE = '''
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_muon import MuonConfig, MuonModuleMixin


    class TinyLM(MuonModuleMixin, pl.LightningModule):
        """A user's own model: embedding, one hidden matrix, a head."""

        def __init__(self, vocab_size: int = 256, n_embd: int = 16, muon_config: MuonConfig | None = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.emb = nn.Embedding(vocab_size, n_embd)
            self.hidden = nn.Linear(n_embd, n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size)

        def _loss(self, batch):
            x, y = batch
            logits = self.lm_head(torch.tanh(self.hidden(self.emb(x))))
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch))
'''


def test_cli_fits_a_users_module_by_class_path(tmp_path):
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "user_tiny_lm.py").write_text(textwrap.dedent(USER_MODULE))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # muon.yaml's CharGPT arguments do not fit TinyLM and are dropped; its muon_config is kept.
    output = _fit(
        run_dir,
        "muon.yaml",
        "--model.class_path=user_tiny_lm.TinyLM",
        "--model.init_args.n_embd=24",
        "--model.init_args.muon_config.lr=0.05",
        pythonpath=package,
    )
    # adamw: emb.weight, lm_head.weight; adamw_no_decay: hidden.bias, lm_head.bias
    assert _routing_table(output) == {"adamw": ("adamw", 2), "muon": ("muon", 1), "adamw_no_decay": ("adamw", 2)}
    checkpoint = _checkpoint(run_dir)
    hparams = checkpoint["hyper_parameters"]
    assert hparams["n_embd"] == 24 and "n_layer" not in hparams
    assert (hparams["muon_config"]["lr"], hparams["muon_config"]["adjust_lr"]) == (0.05, "match_rms_adamw")
    assert checkpoint["state_dict"]["hidden.weight"].shape == (24, 24)
