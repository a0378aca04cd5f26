"""The wheel as the image builds it, and one fresh venv per session that has only that wheel and
the dependencies it declares.

The wheel is built from a copy of exactly what the Dockerfile's builder stage copies (minus what
.dockerignore drops), never from the worktree itself: setuptools reuses ``build/lib`` in place, so
an in-tree build can carry modules deleted since and hide a missing package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .sources import ROOT, builder_copy_sources, dockerignore_patterns

PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="session")
def built_wheel() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="ckptc-wheel-"))
    try:
        src = work / "src"
        src.mkdir()
        ignore = shutil.ignore_patterns(*dockerignore_patterns())
        for source in builder_copy_sources():
            path = ROOT / source.rstrip("/")
            if path.is_dir():
                shutil.copytree(path, src / path.name, ignore=ignore)
            else:
                shutil.copy2(path, src / path.name)
        out = work / "wheels"
        # "./src" or an absolute path: a bare word would be a requirement name on the index.
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(src)],
            capture_output=True, text=True, timeout=600, env=PIP_ENV,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (wheel,) = out.glob("checkpoint_coordinator-*.whl")
        yield wheel
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def wheel_venv(built_wheel: Path) -> Iterator[Path]:
    """A new venv (no system site-packages) with the wheel and its dependencies from the index."""
    work = Path(tempfile.mkdtemp(prefix="ckptc-venv-"))
    try:
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        proc = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(built_wheel)],
            capture_output=True, text=True, timeout=900, env=PIP_ENV,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield venv
    finally:
        shutil.rmtree(work, ignore_errors=True)
