"""The wheel a pip user gets: built from this tree, installed into a fresh venv outside the repository, run.

The fresh venv borrows this environment's packages (torch, lightning, ...) through a
``.pth`` line instead of downloading them; its own site-packages holds only the wheel, and
comes first on its path. The run names a bundled config by its short name, from a folder
with no ``configs/``, so the config can only come from inside the installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

from test_cli import TINY, TINY_CHARGPT

ROOT = Path(__file__).resolve().parents[1]
# What setup.py and pyproject.toml build the wheel from.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "lightning_muon", "lightning_muon_demo", "configs")


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    # The timeout only guards against a hang: the build takes seconds, the fit about ten.
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def test_the_wheel_ships_the_configs_and_runs_one_by_name_from_a_fresh_venv(tmp_path):
    # Build from a copy: a build writes build/ and *.egg-info next to its sources.
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, source, cwd=tmp_path)
    (wheel,) = wheels.glob("lightning_muon-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("lightning_muon/configs/")}
    assert shipped == {f"lightning_muon/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this tree on the path
    purelib = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path, env=env).strip()
    )
    borrowed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "borrowed_from_the_test_environment.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    _run(*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path, env=env)

    run = tmp_path / "elsewhere"
    run.mkdir()
    where = _run(
        python,
        "-c",
        "import lightning_muon.bundled_configs as b; print(b.__file__); print(b.config_dir())",
        cwd=run,
        env=env,
    )
    assert all(Path(line).is_relative_to(purelib) for line in where.split()), where  # the wheel's, not this tree's
    output = _run(
        python, "-m", "lightning_muon", "fit", "--config", "muon", *TINY, *TINY_CHARGPT,
        f"--trainer.default_root_dir={run}", cwd=run, env=env,
    )  # fmt: skip
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in output
    assert sorted(p.name for p in run.rglob("*.ckpt")) == ["epoch=0-step=3.ckpt"]
