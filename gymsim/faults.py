"""Fault injection: a registry of faults and the ASGI layer that applies them.

The layer sits outside the web framework so that it can do what a framework never does on its own:
drop a connection without any reply (`reset`), or run the operation and then drop the reply
(`lost_reply`, "executed but the caller timed out").
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .config import FaultSpec
from .wire import ProtocolError, parse_capture_key

if TYPE_CHECKING:
    from .instance import Instance

Send = Callable[[dict[str, Any]], Awaitable[None]]

_ROUTES = [
    (re.compile(r"^/s/([^/]+)/ng-control/v1/checkpoint/([a-z]+)$"), None),
    (re.compile(r"^/s/([^/]+)/run$"), "run"),
    (re.compile(r"^/s/([^/]+)/ng-rollout/[^/]+/v1/chat/completions$"), "chat"),
    (re.compile(r"^/s/([^/]+)/v1/chat/completions$"), "chat"),
    (re.compile(r"^/s/([^/]+)/sessions/[^/]+/mutate$"), "mutate"),
    (re.compile(r"^/s/([^/]+)/sessions/[^/]+$"), "session"),
]


def classify(path: str) -> tuple[str, str] | None:
    """(server_name, op) of a request path, or None for paths faults never apply to (admin)."""
    for pattern, op in _ROUTES:
        match = pattern.match(path)
        if match:
            return match.group(1), op or match.group(2)
    return None


_EPISODE_IN_PATH = re.compile(r"^/s/[^/]+/(?:ng-rollout|sessions)/([^/]+)(?:/|$)")


def rollout_of(path: str) -> str | None:
    """The rollout id a data-plane path names (in its capture key), or None."""
    match = _EPISODE_IN_PATH.match(path)
    return parse_capture_key(match.group(1))[0] if match else None


@dataclass
class ActiveFault:
    spec: FaultSpec
    remaining: int | None


class FaultRegistry:
    def __init__(self, specs: list[FaultSpec]) -> None:
        self._faults: list[ActiveFault] = []
        self.add(specs)

    def add(self, specs: list[FaultSpec]) -> None:
        self._faults.extend(ActiveFault(spec, spec.times) for spec in specs)

    def clear(self) -> None:
        self._faults.clear()

    def take(self, server_name: str, op: str, rollout_id: str | None = None) -> FaultSpec | None:
        """The first live fault for (server, op) (and, for a fault that names one, the request's
        rollout); using it counts against its `times`."""
        for fault in self._faults:
            if fault.spec.rollout_id is not None and fault.spec.rollout_id != rollout_id:
                continue
            if fault.spec.server_name == server_name and fault.spec.op == op and fault.remaining != 0:
                if fault.remaining is not None:
                    fault.remaining -= 1
                return fault.spec
        return None

    def describe(self) -> list[dict[str, Any]]:
        return [
            {**f.spec.model_dump(exclude_none=True), "remaining": f.remaining}
            for f in self._faults
            if f.remaining != 0
        ]


class Connection:
    """Access to the raw connection of one request, so a handler or a fault can drop it."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.dropped = False

    async def send(self, message: dict[str, Any]) -> None:
        if not self.dropped:
            await self._send(message)

    async def drop(self) -> None:
        """Close the socket with no (further) reply; the client sees a connection error."""
        if self.dropped:
            return
        self.dropped = True
        # uvicorn's send is a bound method of its request cycle, which owns the transport.
        transport = getattr(getattr(self._send, "__self__", None), "transport", None)
        if transport is not None:
            transport.abort()
            # Let the server see the disconnect before the app returns, so it sends nothing more.
            for _ in range(3):
                await asyncio.sleep(0)
            return
        raise ConnectionAbortedError("gymsim dropped the connection")


def _json_message(status: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = json.dumps(body).encode()
    return [
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        },
        {"type": "http.response.body", "body": raw},
    ]


class FaultMiddleware:
    def __init__(self, app, instance: "Instance") -> None:
        self.app = app
        self.instance = instance

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        connection = Connection(send)
        scope = {**scope, "gymsim.connection": connection}
        target = classify(scope["path"])
        fault = self.instance.faults.take(*target, rollout_of(scope["path"])) if target else None
        if fault is None:
            await self.app(scope, receive, connection.send)
            return
        if fault.type == "delay":
            await self.instance.clock.sleep(fault.seconds or 0.0)
            await self.app(scope, receive, connection.send)
        elif fault.type == "error":
            status = fault.status or 500
            detail = fault.detail or f"injected error on {fault.op}"
            for message in _json_message(status, {"error": {"code": fault.code or "checkpoint_error", "detail": detail}}):
                await connection.send(message)
        elif fault.type == "refuse":
            error = ProtocolError(fault.code or "checkpoint_error", fault.detail or f"injected refusal of {fault.op}")
            status = fault.status or error.status
            spelling = self.instance.config.spelling_for(fault.server_name)
            for message in _json_message(status, error.envelope(spelling)):
                await connection.send(message)
        elif fault.type == "slow_reply":
            # The operation runs at once; its reply reaches the caller `seconds` later.
            held: list[dict[str, Any]] = []

            async def hold(message: dict[str, Any]) -> None:
                held.append(message)

            await self.app(scope, receive, hold)
            await self.instance.clock.sleep(fault.seconds or 0.0)
            for message in held:
                await connection.send(message)
        elif fault.type == "hang":
            # A tool that never answers: no reply at all, until the caller goes away (a retire
            # cancels the episode that waits on it) or the server stops.
            while (await receive())["type"] != "http.disconnect":
                pass
        elif fault.type == "reset":
            await connection.drop()
        elif fault.type == "lost_reply":
            # The operation runs to completion; only its reply is lost.
            async def swallow(message: dict[str, Any]) -> None:
                return None

            await self.app(scope, receive, swallow)
            await connection.drop()
