"""Gym egress (docs/configuration.md#gym-egress): a registration names only servers where Gym may be, checked
before any connection is made, and a control connection checks the resolved address again."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from checkpoint_coordinator.app import create_app
from checkpoint_coordinator.gym import GymControlClient
from checkpoint_coordinator.gym.models import InstanceSpec
from checkpoint_coordinator.gym_runtime import current_egress, set_egress
from tests.conftest import admin_headers

from .ledger_helpers import RunApi, new_run

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def counting_server() -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP listener on 127.0.0.1 that counts the connections it was given."""
    accepted = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()


@contextlib.asynccontextmanager
async def app_client(settings: Any, database_url: str, **changes: Any) -> AsyncIterator[httpx.AsyncClient]:
    previous = current_egress()
    application = create_app(settings.model_copy(update=changes), database_url=database_url)
    try:
        async with application.router.lifespan_context(application):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://coordinator") as c:
                yield c
    finally:
        set_egress(previous)


def _register(url: str, **servers: str) -> dict[str, Any]:
    return {"instances": [{"instance_id": "math/replica-0", "control_token": "tok", "servers": {"policy_model": url, **servers}}]}


async def _refused(api: RunApi, url: str) -> dict[str, Any]:
    body = await api.post("/gym-instances", _register(url), 422)
    assert body["code"] == "gym_egress_refused", body
    assert [e["field"] for e in body["errors"]] == ["instances.0.servers.policy_model"], body
    return body


async def test_link_local_and_metadata_addresses_are_never_allowed(settings, database_url) -> None:  # type: ignore[no-untyped-def]
    async with app_client(settings, database_url, gym_allowed_networks="0.0.0.0/0,::/0") as c:
        api = await new_run(c, admin_headers())
        for url in ("http://169.254.169.254/latest", "http://[fe80::1]:80", "http://[fd00:ec2::254]", "http://0.0.0.0:8000",
                    "http://100.100.100.200", "http://[::ffff:169.254.169.254]", "http://224.0.0.1"):
            body = await _refused(api, url)
            assert "never a Gym server's address" in body["detail"], (url, body["detail"])
        assert (await api.get("/gym-instances"))["instances"] == []


async def test_the_coordinator_s_own_port_and_its_database_are_refused(settings, database_url) -> None:  # type: ignore[no-untyped-def]
    db = make_url(database_url)
    async with app_client(settings, database_url, port=18099) as c:
        api = await new_run(c, admin_headers())
        body = await _refused(api, "http://127.0.0.1:18099")
        assert "the coordinator itself" in body["detail"]
        if db.host and not db.host.startswith("/"):
            body = await _refused(api, f"http://{db.host}:{db.port or 5432}")
            assert "the coordinator's database" in body["detail"]


async def test_a_host_outside_the_list_is_refused_and_never_contacted(settings, database_url) -> None:  # type: ignore[no-untyped-def]
    async with counting_server() as (url, accepted), app_client(settings, database_url, gym_allowed_networks="10.0.0.0/8") as c:
        api = await new_run(c, admin_headers())
        body = await _refused(api, url)
        assert "outside the networks Gym servers may be in" in body["detail"]
        # A name that resolves into a range not allowed: localhost is 127.0.0.1 (and ::1).
        port = url.rsplit(":", 1)[1]
        body = await _refused(api, f"http://localhost:{port}")
        assert "outside the networks" in body["detail"]
        assert accepted[0] == 0  # no connection was made
    # Allowed by name, the same listener is reached (and answers nothing Gym would).
    async with counting_server() as (url, accepted), app_client(settings, database_url, gym_allowed_networks="localhost") as c:
        api = await new_run(c, admin_headers(), run_id="run-2")
        port = url.rsplit(":", 1)[1]
        body = await api.post("/gym-instances", _register(f"http://localhost:{port}"), 502)
        assert body["code"] == "gym_unavailable" and accepted[0] >= 1


async def test_a_name_resolving_into_a_forbidden_range_is_refused_at_registration_and_at_connect(
    settings, database_url, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """DNS stands in for a name that points at the metadata service, at registration, or only
    later (a rebinding): the connection is refused either way, with nothing sent."""
    async with counting_server() as (url, accepted), app_client(settings, database_url, gym_allowed_networks="*.gym.test,127.0.0.0/8") as c:
        port = int(url.rsplit(":", 1)[1])
        answers = {"evil.gym.test": "169.254.169.254", "good.gym.test": "127.0.0.1"}
        real = asyncio.get_running_loop().getaddrinfo

        async def fake(host: str, *args: Any, **kwargs: Any) -> Any:
            if host in answers:
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port))]
            return await real(host, *args, **kwargs)

        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake)
        api = await new_run(c, admin_headers())
        body = await _refused(api, f"http://evil.gym.test:{port}")
        assert "169.254.169.254 is never" in body["detail"]
        # Resolved to an allowed address at registration, to the metadata service at connect.
        policy = current_egress()
        assert policy is not None and await policy.resolve("good.gym.test", port) == ["127.0.0.1"]
        answers["good.gym.test"] = "169.254.169.254"
        async with GymControlClient(control_timeout_s=2, discovery_timeout_s=2, egress=policy) as gc:
            with pytest.raises(Exception) as info:
                await gc.discover_all([InstanceSpec("math/replica-0", "tok", {"policy_model": f"http://good.gym.test:{port}"})])
        part = info.value.instances["math/replica-0"]["policy_model"]  # type: ignore[attr-defined]
        assert part["class"] == "config_error" and "egress refused" in part["detail"] and not part["transient"]
        assert accepted[0] == 0


@pytest.mark.parametrize(
    "url,says",
    [
        ("http://2130706433:80", "not a canonical host"),
        ("http://0x7f.1:80", "not a canonical host"),
        ("http://127.1:80", "not a canonical host"),
        ("http://0177.0.0.1:80", "not a canonical host"),
        ("http://user:secret@127.0.0.1:8000", "must not carry a user or password"),
        ("http://127.0.0.1:99999", "not a valid URL"),
        ("http://127.0.0.1:-1", "not a valid URL"),
        ("http://127.0.0.1:8000\r\nX: y", "control characters"),
        ("http://bücher.example:80", "xn-- form"),
        ("http://127.0.0.1:0", "port must be between 1 and 65535"),
    ],
)
async def test_a_url_that_cannot_be_a_gym_server_is_a_422_naming_the_field(client, admin, url: str, says: str) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    body = await api.post("/gym-instances", _register(url), 422)
    assert body["code"] == "invalid_request", body
    assert any(e["field"].startswith("instances.0.servers") and says in e["message"] for e in body["errors"]), body
    assert "secret" not in str(body)


async def test_no_answer_carries_a_remote_body(client, admin) -> None:  # type: ignore[no-untyped-def]
    """A URL that reaches something that is not Gym: its answer (a page of 200 KB here) never
    comes back in the refusal, only its status and size."""
    page = b"<html>" + b"internal secret " * 12_800 + b"</html>"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n" % len(page) + page)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        api = await new_run(client, admin)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        body = await api.post("/gym-instances", _register(url), 502)
    finally:
        server.close()
    assert body["code"] == "gym_unavailable" and "internal secret" not in str(body) and len(str(body)) < 4000, body
    assert "HTTP 500" in body["detail"]
