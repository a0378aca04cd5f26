"""Bearer-token checks. Admin token from configuration; run tokens stored hashed.

A run token reaches only its own run. An unknown run and a wrong token answer the same 403, so a
caller cannot learn whether a run exists.

Every ``/v1`` request is authenticated before its body is read (``FastJSONRoute`` calls
:func:`authenticate` first), so nothing a caller without a valid token sends costs more than its
headers. A client that keeps failing (401/403) is refused 429 for a while, before its token is
even looked at.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..errors import Forbidden, TooManyRequests, Unauthorized
from ..ledger.runs import run_token_valid
from ..observability.metrics import record_auth_failure
from .common import RUN_ID_PATTERN

_bearer = HTTPBearer(auto_error=False, description="Admin token or the run's own token")

# Failures (401, 403) one client may have within the window (``auth_failures_per_minute``)
# before it is refused 429 until its oldest failure leaves the window (docs/configuration.md#limits).
AUTH_FAILURES_PER_WINDOW = 20
AUTH_WINDOW_S = 60.0
# Clients remembered at once; the oldest is forgotten first.
AUTH_CLIENTS_TRACKED = 10_000


class AuthThrottle:
    """Recent authentication failures per client address."""

    def __init__(self, limit: int = AUTH_FAILURES_PER_WINDOW, window_s: float = AUTH_WINDOW_S, clients: int = AUTH_CLIENTS_TRACKED) -> None:
        self.limit, self.window_s, self.clients = limit, window_s, clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> deque[float] | None:
        seen = self._failures.get(client)
        if seen is not None:
            while seen and seen[0] <= now - self.window_s:
                seen.popleft()
        return seen

    def check(self, client: str) -> None:
        """429 when ``client`` failed too often lately."""
        now = time.monotonic()
        with self._lock:
            seen = self._recent(client, now)
            if seen is not None and len(seen) >= self.limit:
                wait = seen[0] + self.window_s - now
                record_auth_failure(429)
                raise TooManyRequests(
                    f"too many refused tokens from this client; wait {wait:.0f}s", code="too_many_auth_failures", retry_after_s=max(wait, 1.0)
                )

    def failed(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            seen = self._recent(client, now)
            if seen is None:
                seen = self._failures[client] = deque()
                while len(self._failures) > self.clients:
                    self._failures.popitem(last=False)
            else:
                self._failures.move_to_end(client)
            seen.append(now)


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _throttle(request: Request) -> AuthThrottle:
    throttle = getattr(request.app.state, "auth_throttle", None)
    if throttle is None:
        limit = request.app.state.settings.auth_failures_per_minute
        throttle = request.app.state.auth_throttle = AuthThrottle(limit=limit)
    return throttle


def _bearer_token(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("send 'Authorization: Bearer <token>'")
    return token


def _is_admin(request: Request, token: str) -> bool:
    admin = request.app.state.settings.admin_token
    if admin is None:
        return False
    return hmac.compare_digest(token.encode(), admin.get_secret_value().encode())


@dataclass(frozen=True)
class Caller:
    admin: bool
    run_id: str | None


async def authenticate(request: Request) -> Caller:
    """The caller of a ``/v1`` request: for a route under a run (a ``run_id`` path parameter), the
    admin or that run's token; for any other, the admin token. Once per request."""
    known = getattr(request.state, "caller", None)
    if known is not None:
        return known
    throttle = _throttle(request)
    client = _client(request)
    throttle.check(client)
    try:
        token = _bearer_token(request)
        run_id = request.path_params.get("run_id")
        if _is_admin(request, token):
            caller = Caller(admin=True, run_id=run_id)
        elif run_id is None:
            raise Forbidden("this route needs the admin token")
        else:
            settings = request.app.state.settings
            if not await run_token_valid(request.app.state.engine, run_id, token, cache_s=settings.run_token_cache_s):
                raise Forbidden("token does not grant access to this run")
            caller = Caller(admin=False, run_id=run_id)
    except (Unauthorized, Forbidden) as e:
        throttle.failed(client)
        record_auth_failure(e.status)
        raise
    request.state.caller = caller
    return caller


async def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Caller:
    caller = await authenticate(request)
    if not caller.admin:
        raise Forbidden("this route needs the admin token")
    return caller


async def require_run_access(
    request: Request,
    run_id: str = Path(..., pattern=RUN_ID_PATTERN, max_length=128),
    creds: HTTPAuthorizationCredentials | None = Depends(_bearer),
) -> Caller:
    return await authenticate(request)


def require_metrics_token(request: Request) -> None:
    """``/metrics`` names the runs in its labels, so it is read with the metrics token
    (``CKPTC_METRICS_TOKEN``) or the admin token, like the runs themselves."""
    throttle = _throttle(request)
    client = _client(request)
    throttle.check(client)
    try:
        token = _bearer_token(request)
        metrics_token = request.app.state.settings.metrics_token
        if not (_is_admin(request, token) or (metrics_token is not None and hmac.compare_digest(token.encode(), metrics_token.get_secret_value().encode()))):
            raise Forbidden("/metrics needs the metrics token (CKPTC_METRICS_TOKEN) or the admin token")
    except (Unauthorized, Forbidden) as e:
        throttle.failed(client)
        record_auth_failure(e.status)
        raise
