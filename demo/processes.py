"""The processes the demo starts and must stop again: embedded PostgreSQL, the coordinator and
gymsim instances.

Every child runs in its own session (so a Ctrl-C in the terminal reaches only the demo, which
then stops its children in order) and, on Linux, asks the kernel for SIGTERM when the demo dies,
so even a demo killed with SIGKILL does not leave servers behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil

__all__ = [
    "StartupError",
    "free_port",
    "EmbeddedPostgres",
    "ManagedProcess",
    "CoordinatorProcess",
    "GymProcess",
]

_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A component did not start; the message says which, and ends with its log's last lines."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None


# Loaded here, not in the child: between fork and exec only the bare call is safe.
_LIBC = _load_libc()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class EmbeddedPostgres:
    """The embedded PostgreSQL in ``data_dir/pgdata`` that the coordinator's ``serve --data-dir``
    starts, migrates and stops.

    The demo only watches it: its pid for the summary, and an end of last resort should the
    coordinator die without stopping it (killed after a shutdown that hung). A server that was
    already running when the demo began belongs to someone else and is never stopped."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.pgdata = data_dir / "pgdata"
        self._foreign = False

    def note_before_start(self) -> None:
        self._foreign = self._postmaster() is not None

    @property
    def pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _postmaster(self) -> psutil.Process | None:
        """The running server of this data directory (a stale pid file names another process)."""
        pid = self.pid
        if pid is None:
            return None
        try:
            proc = psutil.Process(pid)
            # PostgreSQL runs in its data directory: a reused pid has another working directory.
            if proc.status() != psutil.STATUS_ZOMBIE and Path(proc.cwd()).resolve() == self.pgdata.resolve():
                return proc
        except (psutil.Error, OSError):
            pass
        return None

    def stop(self, timeout: float = 30.0) -> None:
        if self._foreign:
            return
        proc = self._postmaster()
        if proc is None:
            return
        # SIGINT is PostgreSQL's fast shutdown: sessions are ended, the data stays consistent.
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(10)


class ManagedProcess:
    """One child process with its log file; stopped with SIGTERM, then SIGKILL."""

    name: str

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self, argv: list[str], env: Mapping[str, str] | None = None, *, stdout: Any = None) -> subprocess.Popen[bytes]:
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                argv,
                env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL,
                stdout=stdout if stdout is not None else log,
                stderr=log,
                start_new_session=True,
                preexec_fn=_die_with_parent if _LIBC is not None else None,
            )
        finally:
            log.close()  # the child holds its own descriptor
        return self.proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        return _tail(self.log_path, lines)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing runs on the way out."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def _failed(self, what: str) -> StartupError:
        code = self.proc.poll() if self.proc is not None else None
        state = f"exited with status {code}" if code is not None else "is still running"
        tail = self.log_tail()
        return StartupError(f"{self.name} {what} ({state}); log {self.log_path}" + (f":\n{tail}" if tail else ""))


class CoordinatorProcess(ManagedProcess):
    """``python -m checkpoint_coordinator.cli serve`` on a loopback port, with the embedded
    PostgreSQL it starts (and migrates) in ``data_dir/pgdata``."""

    def __init__(self, log_path: Path, data_dir: Path, admin_token: str, *, extra_env: Mapping[str, str] | None = None) -> None:
        super().__init__("coordinator", log_path)
        self.data_dir = data_dir
        self.admin_token = admin_token
        self.extra_env = dict(extra_env or {})
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        # The port is picked free and handed over; another process could take it in between,
        # so a start that dies on the bind is tried again on a new port.
        for _ in range(3):
            self.port = free_port()
            env = {
                **os.environ,
                **self.extra_env,
                # Secrets go through the environment, never the command line (visible in ps).
                "CKPTC_ADMIN_TOKEN": self.admin_token,
            }
            # The demo's own database, whatever the user's environment points at.
            env.pop("CKPTC_DATABASE_URL", None)
            argv = [sys.executable, "-m", "checkpoint_coordinator.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--data-dir", str(self.data_dir)]
            self._spawn(argv, env)
            if self._wait_ready(timeout):
                return
            if "address already in use" not in self.log_tail(40).lower():
                break
        raise self._failed(f"did not become ready on {self.url} within {timeout:.0f}s")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if not self.alive():
                    return False
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{self.url}/readyz").status_code == 200:
                        return True
                time.sleep(0.1)
        return False


class GymProcess(ManagedProcess):
    """One gymsim instance (policy model, agent, resources and a judge) in one process."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, generation: int = 1) -> None:
        self.config = config
        self.instance_id: str = config["instance_id"]
        self.token: str = config["token"]
        slug = self.instance_id.replace("/", "_")
        super().__init__(f"gymsim {self.instance_id}", workdir / f"gymsim-{slug}-{generation}.log")
        self.config_path = workdir / f"gymsim-{slug}-{generation}.json"
        self.servers: dict[str, str] = {}
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self.config_path.write_text(json.dumps(self.config))
        argv = [sys.executable, "-m", "gymsim", "serve", "--config", str(self.config_path), "--port", "0", "--host", "127.0.0.1"]
        proc = self._spawn(argv, stdout=subprocess.PIPE)
        line = self._read_line(proc, timeout)
        if not line:
            self.stop(2)
            raise self._failed(f"did not announce itself within {timeout:.0f}s")
        try:
            ready = json.loads(line)
            self.port = int(ready["port"])
            self.servers = dict(ready["servers"])
        except (ValueError, KeyError, TypeError) as e:
            self.stop(2)
            raise StartupError(f"{self.name} announced something unreadable: {line[:200]!r} ({e})") from e

    @staticmethod
    def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
        """The first stdout line, or '' when the process ends or the time is up (never blocks longer)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ""
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.2))
            if not ready:
                if proc.poll() is not None:
                    return ""
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return ""
            buf += chunk
        return buf.split(b"\n", 1)[0].decode(errors="replace")

    def registration(self) -> dict[str, Any]:
        """What the coordinator needs to register this instance."""
        return {"instance_id": self.instance_id, "control_token": self.token, "servers": dict(self.servers)}

    def admin(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        with httpx.Client(timeout=timeout, trust_env=False) as http:
            r = http.request(method, f"{self.base_url}/admin{path}", json=body, headers={"Authorization": f"Bearer {self.token}"})
        r.raise_for_status()
        return r.json()
