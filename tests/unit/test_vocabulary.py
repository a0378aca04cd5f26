"""One vocabulary: the ledger's and Gym's words come from ``domain/`` enums, nowhere else.

Outside ``domain/`` (and ``migrations/``, whose revisions are frozen history), none of these words
may appear as a string literal, nor quoted inside SQL: a run's state, an outbox item's state and
op, a restore record's state, a restore level, a Gym participant's kind, a Gym operation. Dict
keys, subscripts and ``.get`` names are field names, not words of the vocabulary, and are not
checked; nor are docstrings, ``__all__`` and OpenAPI tags. ``status`` is left out: it is also a
column and a field name everywhere.

Beside it: one string-enum base (``domain.vocabulary.StrEnum``) and no class name defined twice.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from checkpoint_coordinator.domain.levels import RestoreLevel
from checkpoint_coordinator.domain.vocabulary import (
    GymOperation,
    OutboxOp,
    OutboxState,
    ParticipantKind,
    RestoreRecordState,
    RunState,
)

SERVICE = Path(__file__).resolve().parents[2] / "service" / "checkpoint_coordinator"
WORDS = {
    str(w) for e in (RunState, OutboxState, OutboxOp, RestoreRecordState, RestoreLevel, ParticipantKind, GymOperation) for w in e
} - {"status", "failed", "abandoned", "unknown", "discover"}
_QUOTED = re.compile(r"'(" + "|".join(sorted(WORDS)) + r")'")


def _exempt(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and isinstance(body[0], ast.Expr):
            out.add(id(body[0].value))
        if isinstance(n, ast.Dict):
            out.update(id(k) for k in n.keys if k is not None)
        if isinstance(n, ast.Subscript):
            out.add(id(n.slice))
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "pop", "setdefault") and n.args:
                out.add(id(n.args[0]))
            for kw in n.keywords:
                if kw.arg == "tags":
                    out.update(id(c) for c in ast.walk(kw.value))
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            out.update(id(c) for c in ast.walk(n.value))
    return out


def vocabulary_literals(source: str, name: str) -> list[str]:
    tree = ast.parse(source)
    skip = _exempt(tree)
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip:
            if n.value in WORDS:
                found.append(f"{name}:{n.lineno} {n.value!r}")
            found.extend(f"{name}:{n.lineno} SQL '{m.group(1)}'" for m in _QUOTED.finditer(n.value))
    return found


def _modules() -> list[tuple[str, Path]]:
    return [(p.relative_to(SERVICE).as_posix(), p) for p in sorted(SERVICE.rglob("*.py"))]


def test_no_vocabulary_word_is_spelled_out_of_domain() -> None:
    found = [hit for rel, p in _modules() if not rel.startswith(("domain/", "migrations/")) for hit in vocabulary_literals(p.read_text(), rel)]
    assert not found, "use the domain's enums (domain/vocabulary.py, domain/levels.py):\n" + "\n".join(found)


def test_the_check_sees_a_literal_and_a_quoted_word() -> None:
    probe = (
        "def f(run):\n"
        "    if run.state == 'closed':\n"
        "        return \"SELECT 1 FROM outbox_items WHERE state = 'pending'\"\n"
        "    return {'open': 1}['open']\n"
    )
    assert vocabulary_literals(probe, "probe.py") == ["probe.py:2 'closed'", "probe.py:3 SQL 'pending'"]


def test_one_string_enum_base() -> None:
    offenders = []
    for rel, p in _modules():
        if rel == "domain/vocabulary.py":
            continue
        text = p.read_text()
        if re.search(r"^\s*(from enum import|import enum)", text, re.M) or re.search(r"\(str, (enum\.)?Enum\)", text):
            offenders.append(rel)
    assert not offenders, f"string enums derive from domain.vocabulary.StrEnum: {offenders}"


def test_no_class_name_is_defined_twice() -> None:
    names = Counter(
        n.name for _, p in _modules() for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef) and n.col_offset == 0
    )
    assert not [n for n, c in names.items() if c > 1]
