"""Error mapping: every failure leaves as application/problem+json with a stable ``code``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import BadRequest, CoordinatorError, TooLarge, Unavailable
from ..ledger.db import classify_database_error
from ..observability.http import CLIENT_GONE_SCOPE_KEY as CLIENT_GONE
from .schemas import SchemaOut

log = logging.getLogger(__name__)

PROBLEM = "application/problem+json"
# Retry-After of a 503 while the database is away: the client backs off from there.
UNAVAILABLE_RETRY_AFTER_S = 1.0


def problem_response(err: CoordinatorError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.problem(), status_code=err.status, media_type=PROBLEM, headers=headers)


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(CoordinatorError)
    async def _coordinator_error(_: Request, exc: CoordinatorError) -> JSONResponse:
        headers = {}
        retry = exc.extra.get("retry_after_s")
        if retry is not None:
            headers["Retry-After"] = str(max(1, int(round(float(retry)))))
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if exc.status == 408:
            headers["Connection"] = "close"  # the rest of a body that came too slowly is not read
        return problem_response(exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            errors.append({"field": _field_path(e.get("loc", ())), "message": e.get("msg", "invalid"), "type": e.get("type")})
        fields = ", ".join(sorted({e["field"] for e in errors}))
        err = CoordinatorError(f"invalid request: {fields}", code="invalid_request", status=422, errors=errors)
        err.title = "Invalid request"
        return problem_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status_code, "http_error")
        err = CoordinatorError(str(exc.detail), code=code, status=exc.status_code)
        err.title = str(exc.detail)
        return problem_response(err)



class HttpMiddleware:
    """A pure ASGI middleware that acts on HTTP requests only (lifespan and the rest pass through
    to ``self.app``); a subclass sets ``app`` and implements :meth:`http`."""

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class BodyLimitMiddleware(HttpMiddleware):
    """Refuse bodies above ``max_bytes`` with 413 before the app parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
        received = 0
        too_large = False

        async def limited() -> Message:
            nonlocal received, too_large
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge()
            return msg

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        resp = problem_response(TooLarge(f"request body exceeds {self.max_bytes} bytes"))
        await send({"type": "http.response.start", "status": 413, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


class _BodyTooLarge(Exception):
    pass


def problem_for_exception(exc: BaseException) -> CoordinatorError:
    """The answer to an exception no route handled: the database being away or failing over is
    a 503 the client retries, a value it refused a 422, anything else a 500 (logged)."""
    verdict = classify_database_error(exc)
    if verdict is not None and verdict[0] == "unavailable":
        return Unavailable(f"the ledger database is not available: {verdict[1]}; retry", retry_after_s=UNAVAILABLE_RETRY_AFTER_S)
    if verdict is not None:
        return BadRequest(verdict[1])
    return CoordinatorError("unexpected server error; see the coordinator log")


class NoStore(HttpMiddleware):
    """``Cache-Control: no-store`` on every answer that does not say otherwise: answers carry run
    tokens (a run's creation, a rotation) and the ledger's state, neither for a cache to keep."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"cache-control" for name, _ in headers):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_header)


# Retry-After of a 503 while the schema is not one this release runs on (an upgrade in progress).
SCHEMA_RETRY_AFTER_S = 30
# Paths a replica answers whatever the schema: its probes, its metrics, its API description.
_SCHEMA_FREE_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc"})


class SchemaGate:
    """While the database's schema is one this release must not read or write (behind its head:
    the migration has not run; newer and not declared runnable by this release: a rollback gone
    too far), every ledger request is answered 503 ``schema_mismatch`` with ``Retry-After``,
    never run against a schema it does not know. The replica is out of the Service meanwhile
    (``/readyz``); this covers whoever reaches it directly."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = getattr(self.state, "schema", None)
        if scope["type"] != "http" or status is None or status.usable or scope.get("path") in _SCHEMA_FREE_PATHS:
            await self.app(scope, receive, send)
            return
        err = Unavailable(f"{status.message()}; this replica serves again once it is", code="schema_mismatch",
                          retry_after_s=SCHEMA_RETRY_AFTER_S, schema=SchemaOut.of(status).model_dump(mode="json"))
        await problem_response(err, {"Retry-After": str(SCHEMA_RETRY_AFTER_S)})(scope, receive, send)


class ErrorBoundary(HttpMiddleware):
    """Answers every exception that escapes the routes with a problem document, here, rather
    than letting it reach the server: Starlette's last-resort handler re-raises after it
    answers, and the server then drops the keep-alive connection the answer went out on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except ClientDisconnect:
            # The client went away before its body arrived: nobody to answer, nothing wrong here.
            scope[CLIENT_GONE] = True
            log.info("%s %s: the client disconnected before its request body arrived", scope.get("method"), scope.get("path"))
        except Exception as exc:
            err = problem_for_exception(exc)
            if err.status >= 500 and err.status != 503:
                log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            else:
                log.warning("%s %s answered %d: %s", scope.get("method"), scope.get("path"), err.status, err.detail)
            if started:
                # The answer already began: it cannot be replaced, only cut short (the server
                # closes this connection, which tells the client the body is incomplete).
                raise
            headers = {"Retry-After": str(int(UNAVAILABLE_RETRY_AFTER_S))} if err.status == 503 else None
            if err.status == 408:
                headers = {"Connection": "close"}  # the rest of a body that came too slowly is not read
            await problem_response(err, headers)(scope, receive, send)
