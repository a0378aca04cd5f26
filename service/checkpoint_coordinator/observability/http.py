"""HTTP request metrics for the FastAPI app, labelled by route *template*.

Install with one line in the app factory::

    install_http_metrics(app)

Each request is recorded in ``ckptc_http_request_seconds`` with the template of
the route that served it (``/v1/runs/{run_id}``), never the raw path, which would
carry run and rollout ids. A path no route matches is recorded as ``unmatched``.
The middleware also mirrors the answer of the readiness route into
``ckptc_ready``: the kubelet probes ``/readyz`` every few seconds, so the gauge
stays current without the handler knowing about metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from checkpoint_coordinator.observability import metrics

UNMATCHED = "unmatched"
log = logging.getLogger(__name__)


def _template_of(route: Any) -> str | None:
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return path if isinstance(path, str) and path else None


def _match_routes(routes: Iterable[Any], scope: Scope, prefix: str) -> str | None:
    """Find the template of the route that would serve ``scope``.

    Used only when the framework did not leave the selected route in the scope
    (plain Starlette routes such as ``/docs``); walks mounts recursively. A
    method-mismatch (partial) match still names the template: a 405 on a known
    route is about that route, not an unknown path.
    """
    partial: str | None = None
    for route in routes:
        matches = getattr(route, "matches", None)
        if matches is None:
            continue
        try:
            match, child_scope = matches(scope)
        except Exception:  # a route type we do not understand must not break requests
            continue
        if match is Match.NONE:
            continue
        if isinstance(route, Mount):
            sub_scope = dict(scope)
            sub_scope.update(child_scope)
            mount_prefix = prefix + route.path
            if route.routes:
                inner = _match_routes(route.routes, sub_scope, mount_prefix)
                if inner is None:
                    continue  # a routed sub-app that has no such path: unknown path
                template = inner
            else:
                template = mount_prefix + "/{path}"  # an opaque ASGI app (static files)
        else:
            base = _template_of(route)
            if base is None:
                continue
            template = prefix + base
        if match is Match.FULL:
            return template
        if partial is None:
            partial = template
    return partial


# Set in the request's scope by a handler that waited on purpose (a long poll): its time is the
# wait asked for, so it is recorded under its own route label, apart from the route's answers.
LONG_POLL_SCOPE_KEY = "ckptc.long_poll"
# Set in the scope when the client went away mid-request (``api.problems.CLIENT_GONE``): counted
# as 499, the client closing its request, not as the 500 an unanswered request would be.
CLIENT_GONE_SCOPE_KEY = "ckptc.client_gone"
CLIENT_CLOSED_REQUEST = 499
LONG_POLL_SUFFIX = "?wait_s"


class HttpMetricsMiddleware:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streaming bodies)."""

    def __init__(self, app: ASGIApp, readiness_path: str | None = "/readyz", root_app: Any = None) -> None:
        self.app = app
        self.readiness_path = readiness_path
        # The application object whose route table resolves templates the router
        # did not record in the scope; defaults to the wrapped app.
        self._root_app = root_app if root_app is not None else app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        original_scope = dict(scope)
        status_code = 500  # an exception before the response started becomes a 500 upstream
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - start
            if scope.get(CLIENT_GONE_SCOPE_KEY):
                status_code = CLIENT_CLOSED_REQUEST
            try:
                route = self._route_template(scope, original_scope)
                if scope.get(LONG_POLL_SCOPE_KEY):
                    route += LONG_POLL_SUFFIX
                metrics.observe_http_request(route, scope.get("method", "GET"), status_code, elapsed)
                if self.readiness_path is not None and route == self.readiness_path:
                    metrics.set_ready(200 <= status_code < 300)
            except Exception:  # a metrics bug must never fail a request or mask the app's own error
                log.exception("recording HTTP request metrics failed")

    def _route_template(self, scope: Scope, original_scope: Scope) -> str:
        # The router leaves the selected route in the scope for FastAPI routes;
        # inside a mount its template is relative to the mount's root_path.
        selected = scope.get("route")
        template = _template_of(selected) if selected is not None else None
        if template is not None:
            base_root = original_scope.get("root_path", "") or ""
            mount_prefix = (scope.get("root_path", "") or "")[len(base_root):]
            return mount_prefix + template
        routes = getattr(self._root_app, "routes", None)
        if routes:
            found = _match_routes(routes, original_scope, "")
            if found is not None:
                return found
        return UNMATCHED


def install_http_metrics(app: Any, readiness_path: str | None = "/readyz") -> None:
    """Add the request-metrics middleware to a FastAPI/Starlette app and set build info.

    Call once, before the app starts serving. ``readiness_path`` is the route whose
    status feeds ``ckptc_ready`` (``None`` to disable).
    """
    app.add_middleware(HttpMetricsMiddleware, readiness_path=readiness_path, root_app=app)
    metrics.set_build_info()


async def metrics_endpoint(request: Request) -> Response:
    """A ready-made ``/metrics`` endpoint: ``app.add_route("/metrics", metrics_endpoint)``."""
    body, content_type = metrics.render_latest(request.headers.get("accept"))
    return Response(content=body, headers={"Content-Type": content_type})
