"""An error answer never breaks the keep-alive connection it went out on, and the database
being away is a 503 the client retries, never a 500."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import Request

from ..conftest import ADMIN_TOKEN


@pytest.fixture
def served(settings, database_url: str) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """The real app behind a real HTTP server (keep-alive is a property of the connection),
    with two probe routes: one that fails unexpectedly and one that tells the client's port."""
    from checkpoint_coordinator.app import create_app

    app = create_app(settings, database_url=database_url)

    @app.get("/test/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/test/peer")
    async def peer(request: Request) -> dict[str, Any]:
        return {"port": request.client.port if request.client else None}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("server did not start")
        threading.Event().wait(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)


async def test_an_unexpected_error_answers_500_and_keeps_the_connection(served: str) -> None:
    async with httpx.AsyncClient(base_url=served, limits=httpx.Limits(max_connections=1)) as c:
        before = (await c.get("/test/peer")).json()["port"]
        r = await c.get("/test/boom")
        assert r.status_code == 500
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["code"] == "internal_error" and "a bug" not in r.text  # no stack trace, no message
        after = await c.get("/test/peer")
        assert after.status_code == 200 and after.json()["port"] == before  # the same connection


async def test_refusals_keep_the_connection(served: str) -> None:
    async with httpx.AsyncClient(base_url=served, limits=httpx.Limits(max_connections=1)) as c:
        before = (await c.get("/test/peer")).json()["port"]
        assert (await c.get("/v1/runs/nope", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).status_code in (403, 404)
        assert (await c.post("/v1/runs", content=b"{", headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"})).status_code == 422
        assert (await c.get("/test/peer")).json()["port"] == before


def test_database_errors_are_classified() -> None:
    import psycopg
    from sqlalchemy import exc

    from checkpoint_coordinator.api.problems import problem_for_exception

    def wrapped(e: Exception) -> Exception:
        return exc.OperationalError("SELECT 1", {}, e)

    lost = problem_for_exception(wrapped(psycopg.OperationalError("connection refused")))
    assert lost.status == 503 and lost.code == "unavailable"
    for cls in (psycopg.errors.AdminShutdown, psycopg.errors.SerializationFailure, psycopg.errors.CannotConnectNow):
        assert problem_for_exception(wrapped(cls("x"))).status == 503, cls
    read_only = exc.InternalError("INSERT", {}, psycopg.errors.ReadOnlySqlTransaction("read-only"))
    assert problem_for_exception(read_only).status == 503  # a demoted primary after a failover
    assert problem_for_exception(exc.TimeoutError("QueuePool limit")).status == 503
    refused = problem_for_exception(exc.DataError("INSERT", {}, psycopg.errors.NumericValueOutOfRange("out of range")))
    assert refused.status == 422 and refused.code == "invalid_request"
    assert problem_for_exception(RuntimeError("bug")).status == 500
