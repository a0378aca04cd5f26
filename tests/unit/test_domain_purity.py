"""The domain is pure: it imports nothing that does I/O, reads clocks or draws randomness
(docs/architecture.md#layering). That it imports nothing of the project outside
``domain/`` is one of the edges test_layering.py checks, relative imports resolved."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import checkpoint_coordinator.domain as domain

DOMAIN_DIR = Path(domain.__file__).parent

# Standard-library modules with no I/O, clock or randomness, plus pydantic for the config model.
ALLOWED = {
    "__future__",
    "collections",
    "collections.abc",
    "dataclasses",
    "enum",
    "functools",
    "itertools",
    "json",
    "math",
    "operator",
    "re",
    "types",
    "typing",
    "pydantic",
}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def modules() -> list[Path]:
    return sorted(p for p in DOMAIN_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_domain_module_imports_only_pure_modules() -> None:
    offenders = []
    for path in modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    continue  # the project's own modules: test_layering.py
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name not in ALLOWED and name.split(".")[0] not in ALLOWED:
                    offenders.append(f"{path.relative_to(DOMAIN_DIR)}: import {name}")
    assert not offenders, offenders


def test_no_io_builtins_are_called() -> None:
    offenders = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                offenders.append(f"{path.relative_to(DOMAIN_DIR)}:{node.lineno} {node.func.id}()")
    assert not offenders, offenders


def test_every_module_imports_cleanly() -> None:
    for info in pkgutil.walk_packages([str(DOMAIN_DIR)], prefix="checkpoint_coordinator.domain."):
        importlib.import_module(info.name)
