"""The server's own guards that need no socket: the connection cap follows the open-file limit,
and the loop's accept errors are logged once per interval, not once per attempt."""

from __future__ import annotations

import asyncio
import logging
import resource

import pytest

from checkpoint_coordinator import server


def test_the_connection_cap_stays_below_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (200, 4096))
    assert server.max_connections(512) == 200 - server.DESCRIPTOR_RESERVE
    monkeypatch.setattr(resource, "getrlimit", lambda _: (65536, 65536))
    assert server.max_connections(512) == 512


def test_accept_errors_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        server.install_accept_error_limit(loop, every_s=3600)
        caplog.set_level(logging.ERROR)
        for _ in range(1000):
            loop.call_exception_handler({"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")})
        said = [r for r in caplog.records if "socket.accept()" in r.getMessage()]
        assert len(said) == 1
        loop.call_exception_handler({"message": "something else", "exception": RuntimeError("x")})
        assert any("something else" in r.getMessage() for r in caplog.records)  # other errors still said
    finally:
        loop.close()
