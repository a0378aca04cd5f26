"""The HTTP server the coordinator runs under: uvicorn, with limits on what a client can hold.

uvicorn alone keeps a connection that sends nothing open for ever and accepts connections until
the process runs out of file descriptors (then ``/readyz`` stops answering and the accept loop
logs a traceback per attempt). Here (docs/configuration.md#limits):

* at most ``max_connections`` connections are open at once (never more than the descriptors the
  process may open, less a reserve for the database and files); one more is answered 503 and
  closed;
* a connection must send a whole request head within ``header_timeout_s`` of opening, and of
  each answer (between requests uvicorn's keep-alive timeout also closes an idle one);
* a request body must arrive within ``body_timeout_s`` of its head (``BodyDeadline``);
* the event loop's "out of system resource" accept errors are logged once per ten seconds.

At SIGTERM (``CoordinatorServer``) the app is told at once, so its background work drains
(deploy/README.md#probes-and-shutdown) while the requests in flight finish, not after them.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import Settings
from .api.problems import HttpMiddleware
from .errors import RequestTimeout

__all__ = [
    "BodyDeadline", "CoordinatorServer", "HTTP_DRAIN_S", "guarded_protocol", "install_accept_error_limit", "max_connections", "server_config",
]

log = logging.getLogger("checkpoint_coordinator.server")

# Descriptors kept for everything that is not a client connection (database pool, listeners,
# log files, the embedded PostgreSQL's pipes, Gym control connections).
DESCRIPTOR_RESERVE = 128
# How long requests in flight at SIGTERM may run on: one that fans out to Gym (a restore, a
# registration) takes up to a control timeout (60 s by default) and its reply grace (5 s).
HTTP_DRAIN_S = 65.0
_REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"


def max_connections(configured: int) -> int:
    """``configured``, but never more than the open-file limit allows beside the reserve."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(8, min(configured, soft - DESCRIPTOR_RESERVE))


def guarded_protocol(limit: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a connection cap and a deadline for each request head."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limit:
                self._refused = True
                transport.write(_REFUSED)
                transport.close()
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._disarm_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not None and self.cycle is not cycle:
                self._disarm_head_timer()  # a whole request head arrived: the app has it now

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is being served: its body has a deadline of its own
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


class BodyDeadline(HttpMiddleware):
    """A request whose body has not all arrived ``timeout_s`` after the app asked for it first is
    answered 408 ``request_timeout`` (the app's error boundary answers the ``RequestTimeout``
    raised to it) and its connection closed."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline: float | None = None
        body_done = False

        async def bounded() -> Message:
            nonlocal deadline, body_done
            if body_done:
                return await receive()  # waiting for the disconnect: no deadline
            loop = asyncio.get_running_loop()
            deadline = deadline if deadline is not None else loop.time() + self.timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(f"the request body did not arrive within {self.timeout_s:g}s") from None
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, bounded, send)


def install_accept_error_limit(loop: asyncio.AbstractEventLoop, every_s: float = 10.0) -> None:
    """Log the loop's accept errors (out of descriptors or memory) once per ``every_s``, with
    how many were left out, instead of one traceback per attempt; any other error as before."""
    previous = loop.get_exception_handler()
    # None until the first report: a machine up for less than ``every_s`` must still report.
    state: dict[str, Any] = {"last": None, "skipped": 0}

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "accept" not in str(context.get("message", "")):
            if previous is not None:
                previous(lp, context)
            else:
                lp.default_exception_handler(context)
            return
        now = time.monotonic()
        if state["last"] is not None and now - state["last"] < every_s:
            state["skipped"] += 1
            return
        log.error("%s: %s (%d more since the last report)", context.get("message"), context.get("exception"), state["skipped"])
        state["last"], state["skipped"] = now, 0

    loop.set_exception_handler(handler)


class CoordinatorServer(uvicorn.Server):
    """uvicorn's server, calling ``on_exit`` on the event loop at the first SIGTERM or SIGINT
    (the app's drain: run leases handed back, snapshots finished or cancelled) beside its own
    graceful close of the connections."""

    def __init__(self, config: uvicorn.Config, on_exit: Any = None) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._on_exit is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_exit)


def server_config(app: Any, settings: Settings, *, host: str, port: int, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration every coordinator runs under."""
    overrides.setdefault("timeout_graceful_shutdown", HTTP_DRAIN_S)
    return uvicorn.Config(
        BodyDeadline(app, settings.body_timeout_s),
        host=host,
        port=port,
        http=guarded_protocol(max_connections(settings.max_connections), settings.header_timeout_s),
        timeout_keep_alive=settings.keep_alive_s,
        # Headers of a request larger than this are refused (h11's default is 16 KiB).
        h11_max_incomplete_event_size=64 * 1024,
        log_config=None,
        **overrides,
    )
