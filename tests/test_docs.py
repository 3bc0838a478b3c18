"""The documentation runs and its links resolve.

Every ```python block of README.md and docs/*.md runs, in order, one namespace per page:
a page is read top to bottom, so a later block may use what an earlier one defined (the
README's quickstart model, a routing page's tiny LM). Each page runs in the test's own
temporary directory (conftest.py), and algorithms a page registers are forgotten after it.

A block that cannot run here is marked on the line right before its fence::

    <!-- not run: <reason>; tested by tests/<file>.py::<test name> -->

The reason must say it needs a GPU or several processes, and the named test must exist:
that test runs the same thing. A ```yaml block with a ``muon_config`` (under
``model.init_args``, as LightningCLI reads it) must make a valid ``MuonConfig``.

Every relative link of README.md, docs/*.md, benchmarks/README.md, studies/ (its README and
results) and examples/*/README.md must reach an existing file, and a ``#anchor`` into a
Markdown file one of its headings.
"""

from __future__ import annotations

import ast
import re
import sys
import types
from pathlib import Path

import pytest
import yaml

from lightning_muon import MuonConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [
    *PAGES,
    ROOT / "benchmarks" / "README.md",
    ROOT / "studies" / "README.md",
    *sorted((ROOT / "studies" / "results").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]

FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>[^;]+); tested by (?P<test>tests/[\w/]+\.py::\w+) -->$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """(line of the fence, language, source, the not-run marker's line or None) per fenced block."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, language = i, match.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = lines[start - 1] if start and lines[start - 1].startswith("<!-- not run") else None
        out.append((start + 1, language, "\n".join(lines[start + 1 : end]) + "\n", marker))
        i = end + 1
    return out


def _test_exists(reference: str) -> bool:
    file, name = reference.split("::")
    path = ROOT / file
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, monkeypatch: pytest.MonkeyPatch):
    # A module of its own, as a script would be: dataclasses and pickling look classes up there.
    module = types.ModuleType(f"docs_{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    ran = 0
    for line, language, source, marker in _blocks(page):
        if marker is not None:
            match = NOT_RUN.match(marker)
            assert language == "python", f"{page.name}:{line}: a not-run marker before a {language!r} block"
            assert match, f"{page.name}:{line}: malformed marker {marker!r}"
            assert re.search(r"\bGPUs?\b|several processes", match["reason"]), f"{page.name}:{line}: {marker}"
            assert _test_exists(match["test"]), f"{page.name}:{line}: no test {match['test']}"
            continue
        if language == "yaml":
            _check_muon_config(yaml.safe_load(source), f"{page.name}:{line}")
        if language != "python":
            continue
        # dont_inherit: none of this file's __future__ imports (the page runs as written).
        code = compile(source, f"{page.relative_to(ROOT)}, block at line {line}", "exec", dont_inherit=True)
        exec(code, namespace)  # the documentation's own code
        ran += 1
    assert ran or "```python" not in page.read_text(), page


def _check_muon_config(document, where: str) -> None:
    """A YAML example's ``model.init_args.muon_config`` builds a ``MuonConfig`` (fields checked)."""
    config = (((document or {}).get("model") or {}).get("init_args") or {}).get("muon_config")
    if config is not None:
        try:
            MuonConfig.from_any(config)
        except ValueError as err:
            raise AssertionError(f"{where}: the YAML's muon_config is refused: {err}") from None


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are code
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.relative_to(ROOT)}: no heading for #{anchor} in {file}"


def test_the_checks_above_can_fail(tmp_path):
    """A marker naming a missing test, a bad reason, a broken link: each is caught."""
    assert _test_exists("tests/test_docs.py::test_python_blocks_run")
    assert not _test_exists("tests/test_docs.py::test_that_does_not_exist")
    assert not _test_exists("tests/no_such_file.py::test_x")
    good = "<!-- not run: needs several processes; tested by tests/test_sharded.py::test_x -->"
    assert NOT_RUN.match(good) and not NOT_RUN.match("<!-- not run: slow -->")
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- not run: a GPU; tested by tests/a.py::b -->\n```python\nx = 1\n```\n[a](missing.md)\n")
    marker = "<!-- not run: a GPU; tested by tests/a.py::b -->"
    assert _blocks(page) == [(3, "python", "x = 1\n", marker)]
    assert LINK.findall(page.read_text()) == ["missing.md"]
    assert _anchors(ROOT / "docs" / "routing.md") >= {"rules", "fused-qkv-per-head-splits"}
    matrix = {"class_path": "MuonSettings", "init_args": {"ns_coefficients": "keller", "coefficient_type": "cans"}}
    clash = {"model": {"init_args": {"muon_config": {"matrix": matrix}}}}
    with pytest.raises(
        AssertionError,
        match=r"page\.md:1: the YAML's muon_config is refused: MuonConfig\.matrix: coefficient_type='cans' "
        r"\(Emerging-Optimizers' name for ns_coefficients\) and ns_coefficients='keller' disagree",
    ):
        _check_muon_config(clash, "page.md:1")


def _architecture_mismatch(text: str, root: Path) -> tuple[list[str], list[str]]:
    """The file table of docs/architecture.md against the tree under ``root``: (paths it names that do not exist,
    modules it does not name). A module counts as named by its path, or by its file name on a line that names its
    folder (``lightning_muon/strategies/ddp_core.py, fsdp_core.py``); a package's ``__init__.py`` needs no line."""
    stale = [
        t
        for t in re.findall(r"[\w./]+\.py", text)
        if "/" in t and not ((root / t).exists() or (root / "lightning_muon" / t).exists())
    ]
    lines = text.splitlines()
    missing = []
    for module in sorted([*root.glob("lightning_muon/**/*.py"), *root.glob("lightning_muon_demo/**/*.py")]):
        rel = module.relative_to(root).as_posix()
        if module.name == "__init__.py" and module.parent.name != "lightning_muon" or rel in text:
            continue
        folder = module.parent.relative_to(root).as_posix() + "/"
        if not any(folder in line and re.search(rf"\b{re.escape(module.name)}\b", line) for line in lines):
            missing.append(rel)
    return stale, missing


def test_the_architecture_page_names_every_module_and_only_modules_that_exist(tmp_path):
    stale, missing = _architecture_mismatch((ROOT / "docs" / "architecture.md").read_text(), ROOT)
    assert stale == [] and missing == [], f"docs/architecture.md: stale {stale}, unnamed {missing}"
    # The check can fail both ways.
    (tmp_path / "lightning_muon" / "sub").mkdir(parents=True)
    (tmp_path / "lightning_muon" / "sub" / "new.py").write_text("")
    (tmp_path / "lightning_muon" / "sub" / "__init__.py").write_text("")
    assert _architecture_mismatch("lightning_muon/gone.py  a module\n", tmp_path) == (
        ["lightning_muon/gone.py"],
        ["lightning_muon/sub/new.py"],
    )
