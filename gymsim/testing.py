"""Test helpers: start an instance in-process or as a subprocess, and reach its admin API.

    with GymsimInstance.start(default_instance_config()) as gym:
        gym.servers["policy_model"]            # base URL of one server
        gym.admin("GET", "/state")             # the admin API, with the instance's token
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess as _subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from .config import GymProfile, InstanceConfig
from .server import bind_socket, build_server, ready_line
from .storage import MANIFEST, participant_dir
from .wire import capture_key, parse_capture_key

__all__ = [
    "DEFAULT_GYM_PROFILE",
    "GymsimInstance",
    "default_instance_config",
    "server_config",
    "corrupt_records_file",
    "edit_manifest",
    "participant_dir",
    "capture_key",
    "parse_capture_key",
]

START_TIMEOUT = 20.0

# The profile `default_instance_config` gives when not told otherwise. It is read at every call, so
# a fixture can run a whole suite under the other profile by patching it.
DEFAULT_GYM_PROFILE: GymProfile = "published"


def default_instance_config(
    instance_id: str = "math/replica-0",
    *,
    token: str = "tok-gymsim",
    resources_mode: str | None = "exported",
    gym_profile: GymProfile | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """A policy model, an agent and a resources server that take part, plus a judge that does not.

    The error-code spelling is the profile's unless `wire_spelling=` is given."""
    config: dict[str, Any] = {
        "instance_id": instance_id,
        "token": token,
        "gym_profile": gym_profile if gym_profile is not None else DEFAULT_GYM_PROFILE,
        "lease_grace_seconds": 600,
        "turn_seconds": 0.05,
        "default_turns": 3,
        "servers": [
            {"server_name": "policy_model", "kind": "model", "mode": "exported"},
            {"server_name": "workplace_agent", "kind": "agent", "mode": "exported"},
            {"server_name": "calendar_resources", "kind": "resources", "mode": resources_mode},
            {"server_name": "judge_model", "kind": None},
        ],
        "faults": [],
        "broken": [],
    }
    config.update(copy.deepcopy(overrides))
    return config


def server_config(config: dict[str, Any], server_name: str, **changes: Any) -> dict[str, Any]:
    """A copy of `config` with one server's entry updated (kind, mode, knobs...)."""
    config = copy.deepcopy(config)
    for server in config["servers"]:
        if server["server_name"] == server_name:
            server.update(changes)
            return config
    raise KeyError(server_name)


class GymsimInstance:
    """One running instance. In-process it is uvicorn in a background thread; otherwise a process."""

    def __init__(self, config: InstanceConfig, *, port: int, servers: dict[str, str], host: str = "127.0.0.1") -> None:
        self.config = config
        self.instance_id = config.instance_id
        self.token = config.token
        self.port = port
        self.base_url = f"http://{host}:{port}"
        self.servers = dict(servers)
        self._process: _subprocess.Popen | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._instance = None
        self._config_file: str | None = None
        self._http = httpx.Client(timeout=30.0)

    # ------------------------------------------------------------------ start

    @classmethod
    def start(
        cls, config: "dict[str, Any] | InstanceConfig", *, subprocess: bool = False, port: int = 0
    ) -> "GymsimInstance":
        parsed = InstanceConfig.coerce(config)
        if subprocess:
            return cls._start_process(parsed, port)
        return cls._start_thread(parsed, port)

    @classmethod
    def _start_thread(cls, config: InstanceConfig, port: int) -> "GymsimInstance":
        sock = bind_socket("127.0.0.1", port)
        server, instance = build_server(config, sock)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=f"gymsim-{config.instance_id}", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.request_exit(force=True)
                raise RuntimeError(f"gymsim instance {config.instance_id} did not start")
            time.sleep(0.01)
        line = ready_line(instance)
        gym = cls(config, port=line["port"], servers=line["servers"])
        gym._server, gym._thread, gym._instance = server, thread, instance
        return gym

    @classmethod
    def _start_process(cls, config: InstanceConfig, port: int) -> "GymsimInstance":
        handle = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="gymsim-", delete=False)
        with handle:
            handle.write(config.model_dump_json())
        process = _subprocess.Popen(
            [sys.executable, "-m", "gymsim", "serve", "--config", handle.name, "--port", str(port), "--host", "127.0.0.1"],
            stdout=_subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT)
        if not lines or not lines[0].strip():
            process.kill()
            process.wait()
            os.unlink(handle.name)
            raise RuntimeError(f"gymsim process for {config.instance_id} did not announce itself")
        ready = json.loads(lines[0])
        gym = cls(config, port=ready["port"], servers=ready["servers"])
        gym._process, gym._config_file = process, handle.name
        return gym

    # ------------------------------------------------------------------ use

    def url(self, server_name: str) -> str:
        return self.servers[server_name]

    def admin(self, method: str, path: str, json: Any = None) -> dict:
        """Call the admin API (`/state`, `/faults`, ...; a leading `/admin` is optional)."""
        if not path.startswith("/admin"):
            path = "/admin" + (path if path.startswith("/") else "/" + path)
        response = self._http.request(
            method, self.base_url + path, json=json, headers={"Authorization": f"Bearer {self.token}"}
        )
        response.raise_for_status()
        return response.json()

    def reset(self) -> None:
        """Fresh participants, the configured faults and knobs, clock offset 0 (no restart)."""
        self.admin("POST", "/reset")

    def state(self, server_name: str | None = None) -> dict:
        state = self.admin("GET", "/state")
        return state["servers"][server_name] if server_name else state

    def control(self, server_name: str, op: str, body: Any = None, *, token: str | None = None) -> httpx.Response:
        """One control call with the instance's token (or `token`), for tests and tools."""
        url = f"{self.servers[server_name]}/ng-control/v1/checkpoint/{op}"
        headers = {"Authorization": f"Bearer {self.token if token is None else token}"}
        if op == "status":
            return self._http.get(url, headers=headers)
        return self._http.post(url, json=body, headers=headers)

    # ------------------------------------------------------------------ stop

    def kill(self) -> None:
        """Abrupt end: SIGKILL the process, or stop the in-process server and drop all its state."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.send_signal(signal.SIGKILL)
            self._process.wait()
        elif self._server is not None:
            # Work is cancelled first (clients see their connections drop), so a normal exit is
            # immediate; a forced one would skip the app's shutdown and leave its tasks dangling.
            self._cancel_work()
            self._server.request_exit()
            self._thread.join(10)
            self._instance = None
        self._cleanup()

    def stop(self) -> None:
        """Graceful end: running episodes are cancelled, then the server shuts down."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.send_signal(signal.SIGTERM)
                try:
                    self._process.wait(10)
                except _subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
        elif self._server is not None:
            self._cancel_work()
            self._server.request_exit()
            self._thread.join(10)
        self._cleanup()

    def _cancel_work(self) -> None:
        # Parked /run calls would otherwise hold the shutdown for its whole grace period.
        instance = self._instance
        loop = getattr(instance, "loop", None)
        if loop is None or self._thread is None or not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(instance.stop(), loop).result(5)
        except Exception:  # the server is going away regardless
            pass

    def _cleanup(self) -> None:
        self._http.close()
        if self._config_file is not None:
            try:
                os.unlink(self._config_file)
            except OSError:
                pass
            self._config_file = None
        if self._process is not None and self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> "GymsimInstance":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._process is not None and self._process.poll() is not None:
            self._cleanup()
            return
        if self._thread is not None and not self._thread.is_alive():
            self._cleanup()
            return
        self.stop()



# ---------------------------------------------------------------------- files


def corrupt_records_file(checkpoint_dir: str | os.PathLike, kind: str, participant_name: str, how: str = "flip") -> Path:
    """Tamper with a committed records file: `flip` a byte, `append` a line or `truncate` the last line."""
    directory = participant_dir(checkpoint_dir, kind, participant_name)
    manifest = json.loads((directory / MANIFEST).read_text())
    path = directory / manifest["records_file"]
    data = path.read_bytes()
    if how == "flip":
        if not data:
            raise ValueError("an empty records file has no byte to flip; use 'append'")
        index = len(data) // 2
        data = data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]
    elif how == "append":
        data += b'{"episode_id":{"rollout_id":"intruder","attempt":0},"kind":"' + kind.encode() + b'","state":{}}\n'
    elif how == "truncate":
        data = b"".join(data.splitlines(keepends=True)[:-1])
    else:
        raise ValueError(f"unknown corruption {how!r}")
    path.write_bytes(data)
    return path


def edit_manifest(checkpoint_dir: str | os.PathLike, kind: str, participant_name: str, /, **changes: Any) -> Path:
    """Rewrite fields of a committed manifest in place (tests of the reader's checks)."""
    path = participant_dir(checkpoint_dir, kind, participant_name) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))
    return path
