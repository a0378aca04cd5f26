"""Only the pending-snapshot package writes a snapshot's phase or outcome.

The store's phase and outcome writers are called from ``snapshots/pending/`` alone, and no SQL
outside the snapshots' store sets either column. Imported snapshots (a legacy ledger's, already
published) are inserted by the restore's import, the one other ``INSERT INTO snapshots``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service" / "checkpoint_coordinator"
WRITERS = {"create_in", "move", "move_in", "take_over", "close_gate", "close_gate_in", "publish_phase", "end"}
_SETS_PHASE = re.compile(r"UPDATE\s+snapshots\s+SET[^;]*?\b(phase|outcome)\s*=", re.I | re.S)


def _rel(p: Path) -> str:
    return p.relative_to(SERVICE).as_posix()


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = list(path.relative_to(SERVICE.parent).with_suffix("").parts)[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _store_aliases(path: Path, tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to the snapshots' store (or one of its modules), and writer functions
    imported from it."""
    store = "checkpoint_coordinator.snapshots.store"
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(path, node)
            for a in node.names:
                full = f"{mod}.{a.name}"
                if full == store or full.startswith(store + "."):
                    modules.add(a.asname or a.name)
                elif (mod == store or mod.startswith(store + ".")) and a.name in WRITERS:
                    functions.add(a.asname or a.name)
    return modules, functions


def writer_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules, functions = _store_aliases(path, tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in WRITERS and isinstance(f.value, ast.Name) and f.value.id in modules:
            found.append(f"{_rel(path)}:{node.lineno} {f.value.id}.{f.attr}")
        elif isinstance(f, ast.Name) and f.id in functions:
            found.append(f"{_rel(path)}:{node.lineno} {f.id}")
    return found


def test_only_the_pending_snapshot_package_calls_the_phase_and_outcome_writers() -> None:
    calls = [c for p in SERVICE.rglob("*.py") for c in writer_calls(p)]
    outside = [c for c in calls if not c.startswith(("snapshots/pending/", "snapshots/store/"))]
    assert not outside, f"a snapshot's phase or outcome written outside snapshots/pending/: {outside}"
    assert any(c.startswith("snapshots/pending/") for c in calls), "the scan found no writer call at all"


def test_no_sql_outside_the_snapshots_store_sets_a_phase_or_outcome() -> None:
    offenders = [_rel(p) for p in SERVICE.rglob("*.py") if _SETS_PHASE.search(p.read_text()) and not _rel(p).startswith("snapshots/store/")]
    assert not offenders, offenders
    inserts = {_rel(p) for p in SERVICE.rglob("*.py") if "INSERT INTO snapshots " in p.read_text()}
    assert inserts == {"snapshots/store/phases.py", "restore/store/imports.py"}, inserts


def test_the_scan_sees_a_writer_called_from_elsewhere(tmp_path: Path) -> None:
    stray = SERVICE / "restore" / "_scan_probe.py"
    stray.write_text("from ..snapshots import store as repo\n\nasync def f(e):\n    await repo.end(e, 'r', 's', 'failed', 'x')\n")
    try:
        assert writer_calls(stray) == ["restore/_scan_probe.py:4 repo.end"]
    finally:
        stray.unlink()
