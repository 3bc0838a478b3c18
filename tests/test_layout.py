"""The library stands apart from the demo: no module of ``lightning_muon`` imports ``lightning_muon_demo``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "lightning_muon"
# Top-level packages the library must not import: the demo, and what only the demo needs.
FORBIDDEN = {"lightning_muon_demo", "sklearn"}
# A string that is a dotted module or class path into a forbidden package, as handed to
# importlib or jsonargparse (prose such as a docstring has spaces and does not match).
FORBIDDEN_PATH = re.compile(rf"^({'|'.join(sorted(FORBIDDEN))})(\.\w+)*$")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names, relative ones resolved."""
    package = _module_name(path.parent) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    return _imports_in(path.read_text(), package)


def _imports_in(source: str, package: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module or "")
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            names.add(f"{base}.{node.module}" if node.module else base)
    return names


def _dotted_strings(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_library_module_imports_the_demo_or_scikit_learn():
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 20  # the walk found the library
    offenders = {}
    for path in files:
        imports = {name for name in _imported_modules(path) if name.split(".")[0] in FORBIDDEN}
        paths = {text for text in _dotted_strings(path) if FORBIDDEN_PATH.match(text)}
        if imports or paths:
            offenders[str(path.relative_to(ROOT))] = sorted(imports | paths)
    assert offenders == {}


def test_the_import_walk_sees_what_the_demo_imports():
    # The check above can fail: on the demo's own files it finds the demo's imports.
    module = ROOT / "lightning_muon_demo" / "module.py"
    assert "lightning_muon_demo.models" in _imported_modules(module)
    assert FORBIDDEN_PATH.match("lightning_muon_demo.module.CharGPTModule")
    assert "lightning_muon_demo.module.CharGPTModule" in _dotted_strings(ROOT / "lightning_muon_demo" / "__init__.py")
    # Relative imports resolve against the package: two dots from lightning_muon.strategies.
    assert _imports_in("from ..x import y\nfrom . import z", "lightning_muon.strategies") == {
        "lightning_muon.x",
        "lightning_muon.strategies",
    }
