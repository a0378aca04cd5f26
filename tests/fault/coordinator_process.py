"""Run the coordinator as a real process (so crash tests can SIGKILL it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ..conftest import ADMIN_TOKEN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CoordinatorProcess:
    def __init__(self, database_url: str, log_dir: Path, *, coordinator_id: str = "crash-test", port: int | None = None, **env: str) -> None:
        self.database_url = database_url
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "CKPTC_DATABASE_URL": database_url,
            "CKPTC_ADMIN_TOKEN": ADMIN_TOKEN,
            "CKPTC_COORDINATOR_ID": coordinator_id,
            "CKPTC_OUTBOX_POLL_S": "0.05",
            "CKPTC_OWNERSHIP_LEASE_S": "3",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 30) -> None:
        self.starts += 1
        log = open(self.log_dir / f"coordinator-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "checkpoint_coordinator.cli", "serve", "--port", str(self.port), "--no-migrate"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}: {(self.log_dir / f'coordinator-{self.starts}.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("coordinator did not become ready")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, nothing is flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
