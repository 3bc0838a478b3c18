"""benchmarks/gpu_check.sh cannot rot unseen: it parses, and what it names exists.

The script runs only where a GPU is lent (and, shrunk, by hand with ``--smoke``), so a
renamed file, flag or marker would surface there, in a session's scarce device time. These
checks read the script: ``bash -n``, every repository file path it names (``.py`` and
``.yaml``), every ``--flag`` it passes to a Python script (defined in that script or a module
beside or below it: a benchmark's flags may come from ``benchmarks/benchlib/``), and every
pytest marker it selects with ``-m``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
# A repository-relative path: not part of a longer word, path or variable ($OUT/x.py).
PATH = r"(?:[\w.-]+/)*[\w-]+\.(?:py|yaml)"
FILE_PATH = re.compile(rf"(?<![\w./${{}}-])({PATH})\b")
FLAG = re.compile(r"\s(--[a-z][\w-]*)")
MARKER_EXPRESSION = re.compile(r"""\s-m\s+("[^"]*"|'[^']*'|\S+)""")


def _text() -> str:
    return SCRIPT.read_text()


def _commands(text: str) -> list[str]:
    """The script's logical lines (backslash continuations joined), comments left out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    result = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_every_file_it_names_exists():
    named = set(FILE_PATH.findall(_text()))
    # The steps it must keep: the parse below is not vacuous.
    assert {"benchmarks/bench_optimizer.py", "examples/muon_vs_adamw/main.py", "tests/test_cuda.py"} <= named
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"gpu_check.sh names files that do not exist: {missing}"


def test_every_flag_it_passes_to_a_python_script_exists():
    checked = 0
    for command in _commands(_text()):
        scripts = [p for p in FILE_PATH.findall(command) if p.endswith(".py")]
        if not scripts or command.startswith("if ") or "pytest" in command:
            continue
        script = ROOT / scripts[0]
        if not script.is_file():
            continue  # test_every_file_it_names_exists reports it
        sources = script.read_text() + "".join(p.read_text() for p in script.parent.rglob("*.py") if p != script)
        after = command.split(scripts[0], 1)[1]
        for flag in FLAG.findall(after):
            assert f'"{flag}"' in sources, f"{scripts[0]} defines no {flag} (gpu_check.sh: {command})"
            checked += 1
    assert checked >= 10


def test_every_marker_it_selects_is_registered():
    block = (ROOT / "pyproject.toml").read_text().split("\nmarkers = [", 1)[1].split("\n]", 1)[0]
    registered = set(re.findall(r'^\s*"(\w+):', block, flags=re.M))
    selected = set()
    for command in _commands(_text()):
        if " pytest " in command:  # pytest's -m, not python's (-m pytest)
            for expression in MARKER_EXPRESSION.findall(command.split(" pytest ", 1)[1]):
                selected |= set(re.findall(r"\w+", expression.strip("\"'"))) - {"and", "or", "not"}
    assert {"cuda", "numerics", "distributed"} <= selected
    assert selected <= registered, f"unregistered markers: {sorted(selected - registered)}"
