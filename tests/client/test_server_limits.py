"""What a client can hold of the server (docs/configuration.md#limits): connections are capped, a request head
and a request body each have a deadline, and health probes answer while idle connections are held."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_TOKEN

from .conftest import LiveServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def limited(settings: Any, database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    from checkpoint_coordinator.app import create_app

    tight = settings.model_copy(update={"max_connections": 24, "header_timeout_s": 1.0, "body_timeout_s": 1.0})
    server = LiveServer(lambda: create_app(tight, database_url=database_url), tmp_path / "checkpoints", database_url=database_url, settings=tight)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _connect(server: LiveServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return s


def _closed_within(s: socket.socket, seconds: float) -> float:
    """Seconds until the server closed ``s`` (recv answers b''), failing after ``seconds``."""
    start = time.monotonic()
    s.settimeout(seconds)
    while True:
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            return time.monotonic() - start
        if not data:
            return time.monotonic() - start


def _until_closed(s: socket.socket, seconds: float = 10) -> bytes:
    """Everything the server sends until it closes ``s`` (an answer's head and body may arrive
    apart)."""
    s.settimeout(seconds)
    chunks = []
    while data := s.recv(4096):
        chunks.append(data)
    return b"".join(chunks)


def test_an_idle_connection_and_a_trickling_head_are_closed(limited: LiveServer) -> None:
    idle = _connect(limited)
    trickle = _connect(limited)
    trickle.sendall(b"GET /healthz HTTP/1.1\r\n")
    start = time.monotonic()
    for byte in b"Host: x\r\nX-Slow: 1234567890\r\n":  # one byte every 0.1 s: never a whole head
        try:
            trickle.sendall(bytes([byte]))
        except OSError:
            break  # closed under it: what this test waits for
        time.sleep(0.1)
        if time.monotonic() - start > 5:
            break
    assert _closed_within(idle, 10) < 10
    assert _closed_within(trickle, 10) < 10
    idle.close()
    trickle.close()


def test_probes_answer_while_idle_connections_are_held_and_the_cap_refuses_one_more(limited: LiveServer) -> None:
    held = [_connect(limited) for _ in range(16)]
    try:
        for path in ("/healthz", "/readyz"):
            assert httpx.get(f"{limited.url}{path}", timeout=5).status_code == 200
        # Up to the cap (24); one more connection is answered 503 and closed at once.
        more = [_connect(limited) for _ in range(8)]
        held += more
        time.sleep(0.2)
        extra = _connect(limited)
        answer = _until_closed(extra, 5)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
    finally:
        for s in held:
            s.close()
    # Their slots are free again: the probes answer.
    deadline = time.monotonic() + 10
    while httpx.get(f"{limited.url}/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _metrics(server: LiveServer) -> str:
    return httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).text


def test_a_slow_body_is_a_408_and_a_body_cut_short_is_no_server_error(limited: LiveServer) -> None:
    head = (
        "POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: 200\r\n\r\n"
    ).encode()
    slow = _connect(limited)
    slow.sendall(head + b'{"run_id": ')
    answer = _until_closed(slow)
    slow.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["code"] == "request_timeout"
    # A client that goes away mid-body: counted as 499, never as a 500.
    gone = _connect(limited)
    gone.sendall(head + b'{"run_id": "r')
    gone.close()
    deadline = time.monotonic() + 10
    while 'status="499"' not in _metrics(limited):
        assert time.monotonic() < deadline, [m for m in _metrics(limited).splitlines() if "http_request_seconds_count" in m]
        time.sleep(0.05)
    assert 'route="/v1/runs",status="500"' not in _metrics(limited)
