"""Every example runs: each script is started as a user would, with a short budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_example_has_a_readme_and_a_config():
    folders = [p for p in (ROOT / "examples").iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert len(folders) >= 5
    for folder in folders:
        assert (folder / "README.md").is_file(), folder
        configs = list(folder.glob("*.yaml")) + list(folder.glob("config*.py"))
        assert configs or folder.name == "quickstart", f"{folder.name} has no config"


@pytest.mark.parametrize(
    ("script", "expect"),
    [
        ("examples/add_mixin/train.py", "Muon (mixin added): validation loss"),
        ("examples/manual_optimization/train.py", "optimizers: Muon/muon, Muon/adamw"),
        ("examples/digits_convnet/train.py", "adamw: validation loss"),
    ],
)
def test_script_examples_run(tmp_path, script, expect):
    out = _run(str(ROOT / script), "--max-epochs", "1", cwd=tmp_path)
    assert expect in out


def test_lightning_cli_example_runs_from_its_yaml(tmp_path):
    _run(
        str(ROOT / "examples/lightning_cli/main.py"),
        "fit",
        "--config",
        str(ROOT / "examples/lightning_cli/config.yaml"),
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3",
        "--model.muon_config.lr=0.03",
        f"--trainer.default_root_dir={tmp_path}",
        cwd=tmp_path,
    )
    # The CLI saved the config it ran with, the override included.
    saved = next(tmp_path.rglob("config.yaml")).read_text()
    assert "lr: 0.03" in saved
