"""Probes and metrics.

``/healthz`` is the process alone (the startup and liveness probes): it never touches the
database, so a slow or absent Postgres never restarts a pod. ``/readyz`` says whether the
replica belongs in the Service: not while it drains at shutdown, nor while the schema is one its
release must not run on (deploy/README.md, "Upgrades"). A database outage leaves it ready: the
replica then answers every ledger call 503 with ``Retry-After`` itself, which trainers retry,
where an empty Service would give them connection errors.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ..ledger.schema import SchemaStatus, read_status
from ..observability import metrics
from .auth import require_metrics_token

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)


async def refresh_schema(app: FastAPI, *, timeout_s: float = 3.0) -> bool:
    """Read the schema's state into ``app.state.schema``; False when the database did not answer
    in time (the last state read stays)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with app.state.engine.connect() as conn:
                status = await read_status(conn)
    except asyncio.CancelledError:
        raise
    except Exception:
        metrics.set_database_up(False)
        return False
    metrics.set_database_up(True)
    previous: SchemaStatus | None = getattr(app.state, "schema", None)
    app.state.schema = status
    metrics.set_schema_state(status.state)
    if previous is None or (previous.state, previous.revision) != (status.state, status.revision):
        log.log(logging.INFO if status.usable else logging.WARNING, "%s", status.message())
    return True


@router.get("/healthz", operation_id="healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    operation_id="readyz",
    responses={503: {"description": "draining for shutdown, or the schema is one this release does not run on"}},
)
async def readyz(request: Request) -> Response:
    app = request.app
    if getattr(app.state, "draining", False):
        return JSONResponse({"status": "draining"}, status_code=503)
    reachable = await refresh_schema(app, timeout_s=2.0)
    status: SchemaStatus = app.state.schema
    body: dict[str, Any] = {
        "database": "ok" if reachable else "unreachable",
        "migration": status.revision,
        "head": status.head,
        "schema": status.public(),
    }
    if not status.usable:
        body.update(status="not_ready", reason=status.message())
        return JSONResponse(body, status_code=503)
    body["status"] = "ready"
    if not reachable:
        body["reason"] = "the ledger database does not answer: ledger calls answer 503 with Retry-After until it does"
    return JSONResponse(body, status_code=200)


@router.get("/metrics", operation_id="metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    require_metrics_token(request)
    payload, content_type = metrics.render_latest(request.headers.get("accept"))
    return Response(payload, media_type=content_type)
