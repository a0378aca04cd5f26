"""Every import edge of docs/architecture.md#layering, read from the source.

``api -> snapshots/restore/outbox -> domain, ledger, gym``; ``domain`` imports nothing of the
project; ``ledger`` and ``gym`` import neither each other nor anything above them; ``clients`` and
``gymsim`` import nothing of the service (``gymsim`` uses the client's effect journal helper); the
service imports neither ``clients``, ``gymsim`` nor the demo; the demo imports ``clients`` and
``gymsim`` and starts the service as a process.

Every ``import`` counts wherever it stands (inside functions, under ``TYPE_CHECKING``), relative
imports are resolved, and so is ``importlib.import_module("...")`` or ``__import__("...")`` with a
literal name: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The service's top-level modules and subpackages, by layer. A new one fails the test until it
# is placed here: code outside every layer would be outside every rule.
SERVICE_AREAS = {
    "api": "api",
    "snapshots": "snapshots",
    "restore": "restore",
    "outbox": "outbox",
    "rollouts": "rollouts",
    "domain": "domain",
    "ledger": "ledger",
    "gym": "gym",
    # Builds the Gym clients and reads a run's registered topology for the choreographies: it
    # joins the Gym client and the ledger, below the choreographies, above both.
    "accounting": "accounting",
    "effects": "effects",
    "gym_runtime": "runtime",
    # Cross-cutting support every layer but the domain may use; it may use only the domain, so
    # that allowing it from below opens no path upwards.
    "observability": "support",
    "config": "support",
    "errors": "support",
    "recovery_config": "support",
    "__init__": "support",
    # Composition roots: they wire the layers together, and nothing in the layers imports them.
    "app": "entry",
    "cli": "entry",
    "background": "entry",
    "server": "entry",
}

# The other import packages of the distribution (pyproject's package-dir), by area.
PACKAGE_AREAS = {
    "ckpt_client": "clients",
    "gymsim": "gymsim",
    "ckpt_demo": "demo",
    "ckpt_launcher": "launcher",
    "ckptc_migrations": "migrations",
}

_MIDDLE = {"snapshots", "restore", "outbox", "rollouts", "accounting", "effects"}
_BELOW = {"domain", "ledger", "gym", "support", "runtime"}
_SERVICE = set(SERVICE_AREAS.values())

# area -> the areas it may import (its own included). Anything not listed is forbidden.
MAY_IMPORT: dict[str, set[str]] = {
    "domain": {"domain"},
    "support": {"support", "domain"},
    # The ledger runs the migrations: it finds the alembic scripts through their package.
    "ledger": {"ledger", "domain", "support", "migrations"},
    "gym": {"gym", "domain", "support"},
    "runtime": {"runtime", "gym", "ledger", "domain", "support"},
    # The choreographies may use one another (a snapshot queues outbox items), never the API.
    **{m: _MIDDLE | _BELOW for m in _MIDDLE},
    "api": {"api"} | _MIDDLE | _BELOW,
    "entry": _SERVICE,
    # Migrations read the models and the vocabulary, nothing that runs.
    "migrations": {"migrations", "ledger", "domain", "support"},
    "clients": {"clients"},
    # gymsim's mail tool plays a participant that guards its effect with the thin client's
    # effect journal helper (docs/effects.md#for-participants); the service stays out of reach.
    "gymsim": {"gymsim", "clients"},
    "demo": {"demo", "clients", "gymsim"},
    # The console script joins the service's command line with the tools beside it; the
    # operator commands are HTTP clients, so they live in the client and the launcher lists them.
    "launcher": {"launcher", "entry", "demo", "gymsim", "clients"},
}

# Edges today's code still breaks while other work fixes them: (file, forbidden area) -> why.
# The test passes with these present and fails once one no longer occurs, so each entry is removed
# with the code that needed it. Keep it empty when nothing breaks a rule.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    path: str  # relative to the repository
    line: int
    source: str  # importing module
    target: str  # imported module, absolute
    source_area: str
    target_area: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} ({self.source_area}) imports {self.target} ({self.target_area})"


def package_trees(root: Path = ROOT) -> dict[str, Path]:
    """Top-level import package -> its directory, as pyproject.toml's package-dir maps them."""
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    trees: dict[str, Path] = {}
    for prefix, rel in dirs.items():
        base = root / rel
        if prefix:
            trees[prefix] = base
        else:
            trees.update({d.name: d for d in base.iterdir() if (d / "__init__.py").is_file()})
    return trees


def modules(trees: Mapping[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's ``__init__``)."""
    found: dict[str, tuple[Path, bool]] = {}
    for top, base in trees.items():
        for path in base.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _literal_import(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("x")``, ``import_module("x")`` or ``__import__("x")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in ("import_module", "__import__") and node.args:
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
            return first.value
    return None


def imports_of(path: Path, module: str, is_package: bool, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, absolute module) for every import in the file, at any depth."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise AssertionError(f"{path}:{node.lineno}: relative import above the top-level package")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                # `from pkg import sub` depends on pkg.sub when that is a module of its own.
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if sub in known else base
        elif isinstance(node, ast.Call):
            target = _literal_import(node)
            if target is not None:
                yield node.lineno, target


def area_of(module: str) -> str | None:
    """The module's area, None for the standard library and third-party packages."""
    top, _, rest = module.partition(".")
    if top == "checkpoint_coordinator":
        first = rest.partition(".")[0] or "__init__"
        if first not in SERVICE_AREAS:
            raise AssertionError(
                f"checkpoint_coordinator.{first} belongs to no layer: place it in SERVICE_AREAS of {Path(__file__).name}"
            )
        return SERVICE_AREAS[first]
    return PACKAGE_AREAS.get(top)


def edges(trees: Mapping[str, Path], root: Path = ROOT) -> list[Edge]:
    mods = modules(trees)
    unknown = sorted(set(trees) - set(PACKAGE_AREAS) - {"checkpoint_coordinator"})
    assert not unknown, f"import packages of no area (add them to PACKAGE_AREAS): {unknown}"
    out = []
    for module, (path, is_package) in sorted(mods.items()):
        source_area = area_of(module)
        assert source_area is not None, module
        for line, target in imports_of(path, module, is_package, set(mods)):
            target_area = area_of(target)
            if target_area is not None:
                rel = path.relative_to(root) if path.is_relative_to(root) else path
                out.append(Edge(str(rel), line, module, target, source_area, target_area))
    return out


def violations(trees: Mapping[str, Path], root: Path = ROOT) -> list[Edge]:
    return [e for e in edges(trees, root) if e.target_area not in MAY_IMPORT[e.source_area]]


# --------------------------------------------------------------------------------------------


def test_every_area_has_rules() -> None:
    assert set(MAY_IMPORT) == _SERVICE | set(PACKAGE_AREAS.values())


def test_every_import_follows_the_direction_of_imports() -> None:
    found = violations(package_trees())
    unexpected = [str(e) for e in found if (e.path, e.target_area) not in KNOWN_VIOLATIONS]
    assert unexpected == [], "imports against docs/architecture.md#layering:\n" + "\n".join(unexpected)


def test_known_violations_still_occur() -> None:
    """An allow-list entry whose import is gone is removed, so the rule holds again for that file."""
    found = {(e.path, e.target_area) for e in violations(package_trees())}
    stale = sorted(set(KNOWN_VIOLATIONS) - found)
    assert stale == [], f"no longer violated, remove from KNOWN_VIOLATIONS: {stale}"


def test_the_scan_sees_the_service_and_every_package_beside_it() -> None:
    trees = package_trees()
    assert {"checkpoint_coordinator", *PACKAGE_AREAS} == set(trees)
    seen = {(e.source_area, e.target_area) for e in edges(trees)}
    # Edges that exist by design: a scan that resolves nothing would pass every rule.
    assert {("entry", "api"), ("ledger", "domain"), ("demo", "clients"), ("demo", "gymsim"), ("launcher", "entry")} <= seen


def test_the_client_depends_on_httpx_only() -> None:
    trees = package_trees()
    mods = modules({"ckpt_client": trees["ckpt_client"]})
    outside = set()
    for module, (path, is_package) in mods.items():
        for _, target in imports_of(path, module, is_package, set(mods)):
            top = target.partition(".")[0]
            if top not in sys.stdlib_module_names and top not in ("ckpt_client", "httpx"):
                outside.add(f"{path.name}: {target}")
    assert outside == set()


def test_the_scan_catches_lazy_relative_and_dynamic_imports(tmp_path: Path) -> None:
    files = {
        "checkpoint_coordinator/__init__.py": "",
        "checkpoint_coordinator/ledger/__init__.py": "",
        "checkpoint_coordinator/ledger/db.py": "from ..domain import rules\n",
        "checkpoint_coordinator/domain/__init__.py": "",
        # Inside a function and relative, two levels up: domain -> ledger.
        "checkpoint_coordinator/domain/rules.py": "def f():\n    from ..ledger import db\n",
        # `from pkg import sub`: the root package's __init__ is support, but this is the API.
        "checkpoint_coordinator/gym/__init__.py": "from checkpoint_coordinator import api\n",
        "checkpoint_coordinator/api/__init__.py": "import ckpt_demo\n",
        "ckpt_demo/__init__.py": "import importlib\n\ndef g():\n    return importlib.import_module('checkpoint_coordinator.ledger.db')\n",
        "ckpt_client/__init__.py": "import typing\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    trees = {"checkpoint_coordinator": tmp_path / "checkpoint_coordinator", "ckpt_demo": tmp_path / "ckpt_demo",
             "ckpt_client": tmp_path / "ckpt_client"}
    found = {(e.source, e.target, e.line) for e in violations(trees, tmp_path)}
    assert found == {
        ("checkpoint_coordinator.domain.rules", "checkpoint_coordinator.ledger.db", 2),
        ("checkpoint_coordinator.gym", "checkpoint_coordinator.api", 1),
        ("checkpoint_coordinator.api", "ckpt_demo", 1),
        ("ckpt_demo", "checkpoint_coordinator.ledger.db", 4),
    }
