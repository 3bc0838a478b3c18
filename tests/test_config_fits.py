"""configs/muon_fsdp.yaml trained as docs/cli.md runs it: 2 CPU processes, the automatic ns_dtype.

Apart from tests/test_fsdp_strategy.py because this run resolves Newton-Schulz's dtype from
the host's bf16 policy (the config leaves ``ns_dtype`` automatic), which that module's
``policy_free`` guard forbids; CI runs it under both policies.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_cli_config_fits_on_two_processes(tmp_path):
    # configs/muon_fsdp.yaml as docs/cli.md runs it (2 CPU processes, Lightning's popen launcher),
    # shrunk to 3 steps of a tiny CharGPT; validation at step 3 saves a distributed checkpoint.
    tiny = [
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        "--model.init_args.n_layer=1",
        "--model.init_args.n_embd=32",
        "--model.init_args.n_head=2",
        "--model.init_args.block_size=16",
        "--data.init_args.block_size=16",
        "--data.init_args.max_chars=20000",
        "--data.init_args.batch_size=4",
        "--data.init_args.val_samples=8",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    args = [sys.executable, "-m", "lightning_muon", "fit", f"--config={ROOT / 'configs' / 'muon_fsdp.yaml'}", *tiny]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Starting with 2 processes" in output and "FSDPCharGPT" in output
    [saved] = tmp_path.rglob("epoch=0-step=3.ckpt")
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
