"""`ckpt-coordinator serve` on its embedded PostgreSQL: Ctrl-C and SIGTERM stop the database
cleanly, a restart finds the runs, and a second serve on the same data directory shares it safely."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from ..conftest import ADMIN_TOKEN
from .coordinator_process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _serve(data_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTC_DATABASE_URL"}
    env.update({"CKPTC_DATA_DIR": str(data_dir), "CKPTC_ADMIN_TOKEN": ADMIN_TOKEN, "CKPTC_COORDINATOR_ID": f"serve-{port}"})
    return subprocess.Popen([sys.executable, "-m", "checkpoint_coordinator.cli", "serve", "--port", str(port)], env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "serve exited early"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("not ready")


def _postmasters(pgdata: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if p.info.get("name") == "postgres" and any(str(pgdata) in c for c in cmd):
            out.append(p)
    return out


def _wait_gone(pgdata: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _postmasters(pgdata) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _postmasters(pgdata), "embedded PostgreSQL still running"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_stops_embedded_postgres_and_restart_finds_runs(sig: signal.Signals, tmp_path: Path) -> None:
    data = tmp_path / "data"
    pgdata = (data / "pgdata").resolve()
    port = free_port()
    proc = _serve(data, port, tmp_path / "serve.log")
    try:
        _ready(port, proc)
        h = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/runs", json={"run_id": "kept", "checkpoint_root": "/tmp/kept"}, headers=h)
        assert r.status_code == 201
        assert _postmasters(pgdata)
        proc.send_signal(sig)
        assert proc.wait(90) == 0
        _wait_gone(pgdata)
        assert "Traceback" not in (tmp_path / "serve.log").read_text()

        proc = _serve(data, port, tmp_path / "serve.log")
        _ready(port, proc)
        runs = httpx.get(f"http://127.0.0.1:{port}/v1/runs", headers=h).json()["runs"]
        assert [x["run_id"] for x in runs] == ["kept"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(90)
        _wait_gone(pgdata)


def test_second_serve_on_same_data_dir_shares_it_without_corruption(tmp_path: Path) -> None:
    data = tmp_path / "data"
    pgdata = (data / "pgdata").resolve()
    p1, p2 = free_port(), free_port()
    a = _serve(data, p1, tmp_path / "a.log")
    b = None
    h = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        _ready(p1, a)
        b = _serve(data, p2, tmp_path / "b.log")
        _ready(p2, b)
        assert len({p.pid for p in _postmasters(pgdata) if p.ppid() == 1 or "postgres" in p.name()}) >= 1
        assert httpx.post(f"http://127.0.0.1:{p2}/v1/runs", json={"run_id": "from-b", "checkpoint_root": "/tmp/b"}, headers=h).status_code == 201
        assert httpx.get(f"http://127.0.0.1:{p1}/v1/runs", headers=h).json()["runs"][0]["run_id"] == "from-b"
        b.send_signal(signal.SIGTERM)
        assert b.wait(90) == 0
        # the first server still has its database: the second did not stop it under its feet
        assert httpx.post(f"http://127.0.0.1:{p1}/v1/runs", json={"run_id": "from-a", "checkpoint_root": "/tmp/a"}, headers=h).status_code == 201
        assert httpx.get(f"http://127.0.0.1:{p1}/readyz").status_code == 200
    finally:
        for p in (b, a):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(90)
        _wait_gone(pgdata)
