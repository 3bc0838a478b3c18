"""The README's set-up commands and CI stay in step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = _bash_blocks(readme)
    test_commands = [b for b in blocks if b.endswith("python -m pytest -q")]
    assert len(test_commands) == 1, "README must show exactly one test command"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_commands[0] in ci_lines


def test_readme_main_job_command_points_at_an_existing_entry_point():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    main_jobs = [b for b in blocks if b.startswith("python3 -m venv") and "pytest" not in b]
    assert len(main_jobs) == 1
    script = main_jobs[0].rsplit("&& python ", 1)[1].split()[0]
    assert (ROOT / script).is_file(), script
