"""The client stays thin: importing it pulls in none of the service's stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ckpt_client

FORBIDDEN = ("fastapi", "sqlalchemy", "pydantic", "checkpoint_coordinator", "starlette", "uvicorn")


def test_clean_interpreter_imports_client_without_service_stack() -> None:
    code = (
        "import sys, ckpt_client\n"
        "from ckpt_client import CoordinatorClient, AsyncCoordinatorClient\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_client_sources_import_only_httpx_and_the_standard_library() -> None:
    pkg = Path(ckpt_client.__file__).parent
    stdlib = set(sys.stdlib_module_names)
    for path in pkg.glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside the package
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in stdlib or top == "httpx", f"{path.name} imports {name}"
