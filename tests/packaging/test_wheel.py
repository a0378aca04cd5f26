"""The built wheel holds every package and module of the shipped trees, and what it installs runs.

Forgetting a package in pyproject.toml (as the demo once was) or leaving a
runtime import undeclared (as ``psutil`` once was) passes every in-tree test and breaks only the
installed package; these tests look at the installed package.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from .sources import shipped_modules, shipped_packages


def test_every_package_and_module_is_in_the_wheel(built_wheel: Path) -> None:
    names = set(zipfile.ZipFile(built_wheel).namelist())
    packages = shipped_packages()
    assert {"checkpoint_coordinator.api", "ckpt_demo", "ckpt_launcher"} <= set(packages)  # the finder sees the trees at all
    missing = sorted(n for n in packages if f"{n.replace('.', '/')}/__init__.py" not in names)
    assert missing == [], f"package directories left out of the wheel (add them to pyproject.toml): {missing}"
    missing_modules = sorted(set(shipped_modules()) - names)
    assert missing_modules == [], missing_modules
    assert "ckptc_migrations/script.py.mako" in names, "alembic's template is package data"


def test_the_wheel_declares_its_console_script(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as z:
        (entry_points,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(entry_points).decode()
    assert "ckpt-coordinator = ckpt_launcher:main" in text


def _run(venv: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout,
                          env=env or {**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_installed_wheel_imports_everything_and_helps(wheel_venv: Path) -> None:
    # Every shipped module imports with nothing but the declared dependencies installed.
    modules = sorted(p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in shipped_modules())
    # (__main__ modules run on import; alembic's env.py needs a migration context)
    code = ("import importlib, sys\n"
            "for m in sys.argv[1:]:\n"
            "    if not m.endswith('.__main__') and m != 'ckptc_migrations.env':\n"
            "        importlib.import_module(m)\n")
    proc = _run(wheel_venv, "python", "-c", code, *modules)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _run(wheel_venv, "python", "-m", "pip", "check").returncode == 0
    # httpcore imports sniffio for every lock and event it sets up; without it each import is a
    # failed search of sys.path on the event loop (a declared dependency for that reason).
    assert _run(wheel_venv, "python", "-c", "import sniffio").returncode == 0

    demo = _run(wheel_venv, "ckpt-coordinator", "demo", "--help")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert demo.stdout.startswith("usage: ckpt-coordinator demo")
    assert "--steps" in demo.stdout and "Exit status" in demo.stdout
    serve = _run(wheel_venv, "ckpt-coordinator", "serve", "--help")
    assert serve.returncode == 0, serve.stderr[-3000:]
    assert serve.stdout.startswith("usage: ckpt-coordinator serve") and "--no-migrate" in serve.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_demo_runs_from_the_installed_wheel(wheel_venv: Path) -> None:
    # HOME, the data dir and TMPDIR all point into one directory removed afterwards: the demo
    # must leave nothing in it (its work directory is temporary) and nothing running.
    with tempfile.TemporaryDirectory(prefix="ckptc-demo-home-", ignore_cleanup_errors=True) as home:
        summary = Path(home) / "summary.json"
        env = {**os.environ, "HOME": home, "CKPTC_DATA_DIR": f"{home}/data", "TMPDIR": home,
               "PYTHONUNBUFFERED": "1"}
        env.pop("XDG_RUNTIME_DIR", None)
        started = time.monotonic()
        proc = _run(wheel_venv, "ckpt-coordinator", "demo", "--steps", "2", "--groups", "4", "--quiet",
                    "--json-summary", str(summary), env=env, timeout=540)
        print(f"\ndemo from the installed wheel: exit {proc.returncode} in {time.monotonic() - started:.1f}s")
        assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        assert "OK in" in proc.stdout
        s = json.loads(summary.read_text())
        assert s["ok"] is True and s["groups"]["consumed"] == s["groups"]["expected"] == 8
        check = _run(wheel_venv, "python", "-c",
                     "import json, sys; from ckpt_demo.runner import pids_alive; "
                     "print(pids_alive(json.load(open(sys.argv[1]))['processes']))", str(summary))
        assert check.stdout.strip() == "[]", check.stdout + check.stderr
        assert s["workdir"] and not Path(s["workdir"]).exists()
        assert sorted(p.name for p in Path(home).iterdir() if p != summary) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_side_effects_demo_runs_from_the_installed_wheel(wheel_venv: Path) -> None:
    # gymsim's mail tool imports the thin client's effect journal helper: both must be installed
    # and the demo's Gym processes must find them.
    with tempfile.TemporaryDirectory(prefix="ckptc-demo-home-", ignore_cleanup_errors=True) as home:
        summary = Path(home) / "summary.json"
        env = {**os.environ, "HOME": home, "CKPTC_DATA_DIR": f"{home}/data", "TMPDIR": home, "PYTHONUNBUFFERED": "1"}
        env.pop("XDG_RUNTIME_DIR", None)
        proc = _run(wheel_venv, "ckpt-coordinator", "demo", "--scenario", "side-effects", "--quiet",
                    "--json-summary", str(summary), env=env, timeout=540)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        s = json.loads(summary.read_text())
        assert s["ok"] is True and "mails per episode" in proc.stdout
        assert s["workdir"] and not Path(s["workdir"]).exists()
        assert sorted(p.name for p in Path(home).iterdir() if p != summary) == []
