"""gymsim stands in for a real Gym deployment, so it must never lean on the coordinator's code.

The thin client is what a real participant may use too: only the mail tool does (its effect
journal helper, docs/effects.md#for-participants)."""

from __future__ import annotations

import ast
from pathlib import Path

import gymsim


def test_gymsim_never_imports_the_coordinator():
    offenders = []
    for path in Path(gymsim.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            forbidden = ("checkpoint_coordinator",) if path.name == "mail.py" else ("checkpoint_coordinator", "ckpt_client")
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in forbidden]
    assert offenders == []
