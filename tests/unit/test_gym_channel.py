"""One control call on the wire: retries, timeouts, reply cap and error parsing
(docs/gym-protocol.md#transport, docs/gym-protocol.md#error-codes).

These use httpx.MockTransport in place of a participant: the behaviours under test (a refused
connection, a reply lost on the wire, a proxy's bare 502) are transport events, not protocol
states, and a mock makes them exact and fast.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from pydantic import SecretStr

from checkpoint_coordinator.gym.channel import CallFailed, ControlChannel, Target, encode_body
from checkpoint_coordinator.gym.clock import ManualClock
from checkpoint_coordinator.gym.errors import FailureClass
from checkpoint_coordinator.gym.models import RenewReply, StatusReply

TARGET = Target("math/replica-0", "policy_model", "http://gym.test/s/policy_model", SecretStr("tok-123"))
RENEW = {"checkpoint_id": "snap-1-00000000", "deadline_ts": 0.0}


def channel(handler: Callable[[httpx.Request], httpx.Response], *, cap: int = 1 << 20, timeout: float = 1.0) -> tuple[ControlChannel, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return ControlChannel(http, ManualClock(), control_timeout_s=timeout, max_reply_bytes=cap), http


async def renew(ch: ControlChannel) -> RenewReply:
    return await ch.post(TARGET, "renew", dict(RENEW, deadline_ts=ch.clock.time() + 1), ch.clock.time() + 1, RenewReply)


async def test_http_error_reply_is_never_resent() -> None:
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(409, json={"error": {"code": "checkpoint_invalid_phase", "detail": "no"}})

    ch, http = channel(handler)
    with pytest.raises(CallFailed) as info:
        await renew(ch)
    await http.aclose()
    assert len(calls) == 1
    part = info.value.part
    assert part["code"] == "invalid_phase" and part["wire_code"] == "checkpoint_invalid_phase"
    assert part["class"] == "unavailable" and part["http_status"] == 409


async def test_connection_refused_tried_three_times_then_unavailable() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("refused", request=request)

    ch, http = channel(handler)
    with pytest.raises(CallFailed) as info:
        await renew(ch)
    await http.aclose()
    assert calls == 3
    assert info.value.failure_class is FailureClass.UNAVAILABLE and info.value.part["http_status"] is None


async def test_lost_reply_is_resent_with_the_same_body() -> None:
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        if len(bodies) == 1:
            raise httpx.RemoteProtocolError("server disconnected without a response", request=request)
        return httpx.Response(200, json={"lease_expires_at": 123.0})

    ch, http = channel(handler)
    reply = await renew(ch)
    await http.aclose()
    assert reply.lease_expires_at == 123.0
    assert len(bodies) == 2 and bodies[0] == bodies[1]
    assert bodies[0].startswith(b"{") and json.loads(bodies[0])["checkpoint_id"] == "snap-1-00000000"


async def test_timeout_without_reply_gives_up_at_budget_and_is_not_resent() -> None:
    calls = 0

    async def slow(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        await asyncio.sleep(5)
        return httpx.Response(200, json={"lease_expires_at": 1.0})

    http = httpx.AsyncClient(transport=httpx.MockTransport(slow))
    clock = ManualClock()
    ch = ControlChannel(http, clock, control_timeout_s=0.1, max_reply_bytes=1 << 20)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(CallFailed) as info:
        # deadline now + 0.1, grace min(0.1, 5) = 0.1: give up after 0.2 s.
        await ch.post(TARGET, "renew", RENEW, clock.time() + 0.1, RenewReply)
    await http.aclose()
    assert 0.15 < loop.time() - started < 1.5
    assert calls == 1 and info.value.failure_class is FailureClass.UNAVAILABLE


@pytest.mark.parametrize(
    "status,body,expected",
    [
        (200, b"not json", FailureClass.PROTOCOL_ERROR),
        (200, b'{"lease_expires_at": "soon"}', FailureClass.PROTOCOL_ERROR),
        (200, b'{"lease_expires_at": true}', FailureClass.PROTOCOL_ERROR),
        (422, b'{"detail": [{"loc": ["body", "x"], "msg": "extra"}]}', FailureClass.PROTOCOL_ERROR),
        (401, b"", FailureClass.CONFIG_ERROR),
        (502, b"<html>bad gateway</html>", FailureClass.UNAVAILABLE),
        (504, b"", FailureClass.UNAVAILABLE),
    ],
)
async def test_reply_classification(status: int, body: bytes, expected: FailureClass) -> None:
    ch, http = channel(lambda request: httpx.Response(status, content=body))
    with pytest.raises(CallFailed) as info:
        await renew(ch)
    await http.aclose()
    assert info.value.failure_class is expected
    assert "tok-123" not in json.dumps(info.value.part) and "tok-123" not in str(info.value)


async def test_reply_over_the_cap_is_response_too_large_declared_or_chunked() -> None:
    big = json.dumps({"lease_expires_at": 1.0, "padding": "x" * 5000}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 100):
            yield big[i : i + 100]

    for make in (lambda r: httpx.Response(200, content=big), lambda r: httpx.Response(200, content=chunks())):
        ch, http = channel(make, cap=1000)
        with pytest.raises(CallFailed) as info:
            await renew(ch)
        await http.aclose()
        assert info.value.part["code"] == "response_too_large"
        assert info.value.failure_class is FailureClass.PROTOCOL_ERROR and not info.value.part["transient"]
    # At the cap or below it is accepted, unknown fields and all.
    ch, http = channel(lambda r: httpx.Response(200, content=big), cap=len(big))
    assert (await renew(ch)).lease_expires_at == 1.0
    await http.aclose()


async def test_status_get_carries_bearer_and_no_body() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"kind": "model", "instance": "policy_model", "phase": "idle"})

    ch, http = channel(handler)
    status, content = await ch.get_status(TARGET, 1.0)
    await http.aclose()
    assert status == 200 and StatusReply.model_validate_json(content).kind == "model"
    assert seen[0].method == "GET" and seen[0].headers["authorization"] == "Bearer tok-123"
    assert seen[0].url.path == "/s/policy_model/ng-control/v1/checkpoint/status"


def test_a_body_is_compact_json_and_a_non_finite_deadline_is_refused_before_sending() -> None:
    body = {"checkpoint_id": "c\u00e9", "deadline_ts": 1733333333.25, "episode_ids": [{"rollout_id": 'r"1', "attempt": 2}]}
    assert encode_body(body) == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match="deadline_ts"):
            encode_body({**body, "deadline_ts": bad})
