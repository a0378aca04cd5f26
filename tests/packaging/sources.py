"""What the project ships: the trees pyproject.toml packages, and what the Dockerfile's builder copies."""

from __future__ import annotations

import fnmatch
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def builder_copy_sources() -> list[str]:
    """The sources of the COPY instructions of the Dockerfile's first (builder) stage."""
    sources: list[str] = []
    stage = 0
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        keyword = line.split(maxsplit=1)[0].upper() if line.strip() else ""
        if keyword == "FROM":
            stage += 1
        elif stage == 1 and keyword == "COPY":
            words = shlex.split(line)
            if not any(w.startswith("--from") for w in words):
                sources += [w for w in words[1:-1] if not w.startswith("--")]
    assert sources, "the Dockerfile's builder copies nothing"
    return sources


def dockerignore_patterns() -> list[str]:
    """The ``**/name`` patterns of .dockerignore, as names to leave out at any depth."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip()[3:] for ln in lines if ln.strip().startswith("**/")]


def package_dirs() -> dict[str, str]:
    """``[tool.setuptools].package-dir``: import prefix ("" for top level) -> directory."""
    return pyproject()["tool"]["setuptools"]["package-dir"]


def pyproject() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def shipped_packages() -> dict[str, Path]:
    """Every package (a directory with ``__init__.py``) under the shipped trees -> its directory."""
    ignored = dockerignore_patterns()
    found: dict[str, Path] = {}
    for prefix, rel in package_dirs().items():
        base = ROOT / rel
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            if any(fnmatch.fnmatch(p, pat) for p in parts for pat in ignored):
                continue
            name = ".".join(([prefix] if prefix else []) + list(parts))
            if name:
                found[name] = init.parent
    return found


def shipped_modules() -> dict[str, Path]:
    """Every module file of the shipped packages, by its path inside the wheel."""
    return {
        f"{name.replace('.', '/')}/{py.name}": py
        for name, directory in shipped_packages().items()
        for py in directory.glob("*.py")
    }
