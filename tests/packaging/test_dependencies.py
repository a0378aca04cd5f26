"""Every import of the shipped packages is the standard library, the project itself, or a
distribution named in ``[project].dependencies`` (a dependency's dependency does not count: what
the code imports by name it declares by name)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

from .sources import ROOT, pyproject, shipped_modules, shipped_packages


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()  # type: ignore[union-attr]


def _imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports of one file, also those inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_runtime_import_is_a_declared_dependency() -> None:
    declared = {_name(r) for r in pyproject()["project"]["dependencies"]}
    own = {name.split(".")[0] for name in shipped_packages()}
    providers = packages_distributions()
    undeclared: dict[str, set[str]] = {}
    for wheel_path, source in shipped_modules().items():
        for name in _imports(source) - own - set(sys.stdlib_module_names):
            dists = {_name(d) for d in providers.get(name, [])}
            if not dists & declared:
                where = undeclared.setdefault(f"{name} ({', '.join(sorted(dists)) or 'not installed'})", set())
                where.add(str(source.relative_to(ROOT)))
    assert undeclared == {}, f"imported but not in [project].dependencies: {undeclared}"


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom x.y import z\ndef f():\n    import psutil\n    from . import sibling\n")
    assert _imports(module) == {"os", "x", "psutil"}
