"""Shared pieces of the benchmarks: an embedded Postgres in a temp dir and a coordinator process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from checkpoint_coordinator.ledger.db import ensure_runtime_dir  # noqa: E402

ensure_runtime_dir()

ADMIN = "bench-admin-token-0123456789abcdef012345"


class Postgres:
    def __init__(self, settings: dict[str, str] | None = None) -> None:
        from checkpoint_coordinator.ledger.db import migrate, start_embedded

        self.dir = Path(tempfile.mkdtemp(prefix="ckptc-bench-"))
        self.emb = start_embedded(self.dir, settings=settings)
        self.url = self.emb.url
        migrate(self.url)

    def close(self) -> None:
        self.emb.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Coordinator:
    """``ckpt-coordinator serve`` as a process (or ``argv``, a command that serves on ``port``), with
    its peak RSS sampled while it runs."""

    def __init__(self, database_url: str, *, argv: list[str] | None = None, port: int | None = None,
                 start_timeout_s: float = 30.0, **env: str) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "checkpoint_coordinator.cli", "serve", "--port", str(self.port), "--no-migrate"],
            env={**os.environ, "CKPTC_DATABASE_URL": database_url, "CKPTC_ADMIN_TOKEN": ADMIN, "CKPTC_LOG_LEVEL": "WARNING",
                 "CKPTC_MAX_BODY_BYTES": str(64 * 1024 * 1024), **env},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.peak_rss = 0
        self.rss_samples: list[int] = []
        self._stop = threading.Event()
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}")
            time.sleep(0.05)
        else:
            self.close()
            raise RuntimeError("coordinator did not start")
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()

    def _sample(self) -> None:
        p = psutil.Process(self.proc.pid)
        while not self._stop.is_set():
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                return
            self.rss_samples.append(rss)
            self.peak_rss = max(self.peak_rss, rss)
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def mib(n: float) -> str:
    return f"{n / (1024 * 1024):.0f} MiB"
