"""Every example runs: each script is started as a user would, with a short budget.

Each runs as ``__main__`` in a process of its own, with its own working directory and
arguments, forked from the suite's server that imported torch and Lightning already
(``dist_utils.run_main``); the README's main job starts a fresh interpreter, as its command does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dist_utils import run_main

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path, fresh: bool = False) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if fresh:
        proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    else:
        proc = run_main(args[0], list(args[1:]), cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_example_has_a_readme_and_a_config():
    folders = [p for p in (ROOT / "examples").iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert len(folders) >= 8
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
        "--model.muon_config.matrix.init_args.lr=0.03",
        f"--trainer.default_root_dir={tmp_path}",
        cwd=tmp_path,
    )
    # The CLI saved the config it ran with, the override included, beside the section's other settings.
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())["model"]["muon_config"]
    assert saved["matrix"]["class_path"].rpartition(".")[2] == "MuonSettings"
    assert (saved["matrix"]["init_args"]["lr"], saved["matrix"]["init_args"]["momentum"]) == (0.03, 0.95)
    assert saved["schedule"]["falloff"] == "cosine"


def test_main_job_writes_report_plot_and_json(tmp_path):
    out = tmp_path / "run"
    stdout = _run(
        str(ROOT / "examples/muon_vs_adamw/main.py"),
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--out",
        str(out),
        cwd=tmp_path,
        fresh=True,
    )
    assert f"report: {out / 'report.md'}" in stdout and f"plot:   {out / 'loss_curves.png'}" in stdout
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())
    for name in ("muon", "adamw"):
        assert report["runs"][name]["steps"] == [3, 6]
        assert all(math.isfinite(v) for v in report["runs"][name]["val_loss"])
    summary = report["summary"]
    assert summary["adamw_best_val_loss"] == min(report["runs"]["adamw"]["val_loss"])
    text = (out / "report.md").read_text()
    assert "| 6 |" in text and "AdamW's best validation loss" in text
    # The spectra summary of the Muon run: one row per hidden matrix of the 2-layer model.
    assert text.count("| model.blocks.") == 8


def test_spectra_example_writes_a_tensorboard_event_file(tmp_path):
    script = str(ROOT / "examples/spectra_tensorboard/train.py")
    out = _run(script, "--max-steps", "3", "--logdir", "tb", "--save-heatmap", "heat.png", cwd=tmp_path)
    assert "tensorboard --logdir tb" in out
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert (tmp_path / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # read back from the event file


@pytest.mark.parametrize("strategy", ["muon_ddp", "muon_fsdp"])
def test_distributed_example_runs_on_two_processes(tmp_path, strategy):
    out = _run(str(ROOT / "examples/distributed/train.py"), "--strategy", strategy, "--max-steps", "2", cwd=tmp_path)
    assert f"{strategy} on 2 processes: validation loss" in out


@pytest.mark.distributed
def test_tensor_parallel_example_runs_on_four_processes(tmp_path):
    # A 2 x 2 (data x tensor) mesh; tp_mode from the command line over the config's, 2 steps.
    args = [
        str(ROOT / "examples/tensor_parallel/main.py"),
        "fit",
        f"--config={ROOT / 'examples/tensor_parallel/config.yaml'}",
        "--trainer.strategy.tp_mode=distributed",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    proc = run_main(args[0], args[1:], tmp_path, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Muon on a 2 x 2 (data x tensor) mesh, tp_mode='distributed'" in output
    assert "`max_steps=2` reached" in output


def test_qk_clip_example_writes_report_and_plot(tmp_path):
    out = tmp_path / "run"
    # A threshold under the fresh model's logits (~0.1), so both clipped runs act from step 1.
    args = ("--steps", "2", "--threshold", "0.05", "--accelerator", "cpu", "--out", str(out))
    stdout = _run(str(ROOT / "examples/qk_clip/main.py"), *args, cwd=tmp_path)
    assert "QKClip(threshold=0.05, cap_forward=True): max logit" in stdout
    assert (out / "max_logit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())
    runs = report["runs"]
    assert [len(r["max_logit"]) for r in runs.values()] == [2, 2, 2]
    assert all(math.isfinite(r["val_loss"]) for r in runs.values())
    capped = runs["QKClip(threshold=0.05, cap_forward=True)"]
    assert min(capped["forward_max_logit"]) > 0.05 and max(capped["max_logit"]) == 0.05
    assert runs["without QK-clip"]["max_logit"] == runs["without QK-clip"]["forward_max_logit"]


@pytest.mark.distributed
def test_litgpt_example_runs_on_two_fabric_processes(tmp_path):
    # litgpt's GPT under L.Fabric(strategy="muon_ddp"): Fabric re-runs the script for rank 1.
    out = tmp_path / "run"
    args = ("--steps", "4", "--eval-every", "2", "--out", str(out))
    stdout = _run(str(ROOT / "examples/litgpt/main.py"), *args, cwd=tmp_path)
    assert "muon_qkv        muon       qkv_names" in stdout  # the routing report, Q, K, V apart
    assert f"report: {out / 'report.md'}" in stdout
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())
    assert report["where"] == "2 process(es), strategy MuonDDPStrategy"
    for name in ("muon", "adamw"):
        steps, losses = zip(*report["curves"][name])
        assert steps == (0, 2, 4) and all(math.isfinite(v) for v in losses)
    assert report["curves"]["muon"][0] == report["curves"]["adamw"][0]  # the same initial model


@pytest.mark.distributed
def test_moe_example_runs_on_two_fsdp_processes(tmp_path):
    # A transformers Mixtral (fused expert stacks) under muon_fsdp on 2 gloo processes, one lr each, 4 steps.
    out = tmp_path / "run"
    args = ("--strategy", "muon_fsdp", "--devices", "2", "--max-steps", "4", "--eval-every", "2",
            "--val-samples", "16", "--muon-lr", "0.02", "--adamw-lr", "0.003", "--out", str(out))  # fmt: skip
    stdout = _run(str(ROOT / "examples/moe/main.py"), *args, cwd=tmp_path)
    # The routing report, once (rank 0): each stack a batch of per-expert matrices, gate and up apart.
    assert stdout.count("Expert stacks (4)") == 1
    assert "model.model.layers.0.mlp.experts.gate_up_proj  E=4  (4, 256, 64)" in stdout
    assert "4x128x64 + 4x128x64" in stdout and "muon_experts " in stdout
    assert f"loss curves: {out / 'loss_curves.png'}" in stdout
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())
    assert report["where"].endswith("2 process(es), strategy muon_fsdp")
    assert [(r["name"], r["lr"], r["steps"]) for r in report["runs"]] == [
        ("muon", 0.02, [2, 4]),
        ("adamw", 0.003, [2, 4]),
    ]
    assert all(math.isfinite(v) for r in report["runs"] for v in r["val_loss"])
