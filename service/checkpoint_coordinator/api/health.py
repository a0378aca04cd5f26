"""Probes and metrics.

``/healthz`` is the process alone (the startup and liveness probes): it never touches the
database, so a slow or absent Postgres never restarts a pod. ``/readyz`` says whether the
replica belongs in the Service: not while it drains at shutdown, nor while the schema is one its
release must not run on (deploy/README.md#upgrades-and-rollbacks). A database outage leaves it
ready: the replica then answers every ledger call 503 with ``Retry-After`` itself, which trainers
retry, where an empty Service would give them connection errors.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ..ledger.schema import SchemaStatus, read_status
from ..observability import metrics
from .auth import require_metrics_token
from .schemas import Healthy, NotReady, Ready, SchemaOut

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


@router.get("/healthz", operation_id="healthz", response_model=Healthy)
async def healthz() -> Healthy:
    return Healthy(status="ok")


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=Ready,
    responses={503: {"model": NotReady, "description": "draining for shutdown, or the schema is one this release does not run on"}},
)
async def readyz(request: Request) -> Response:
    app = request.app
    if getattr(app.state, "draining", False):
        return _answer(NotReady(status="draining"), 503)
    reachable = await refresh_schema(app, timeout_s=2.0)
    status: SchemaStatus = app.state.schema
    seen = {"database": "ok" if reachable else "unreachable", "migration": status.revision, "head": status.head, "schema": SchemaOut.of(status)}
    if not status.usable:
        return _answer(NotReady(**seen, status="not_ready", reason=status.message()), 503)
    unreachable = {} if reachable else {"reason": "the ledger database does not answer: ledger calls answer 503 with Retry-After until it does"}
    return _answer(Ready(**seen, status="ready", **unreachable), 200)


def _answer(body: Ready | NotReady, status_code: int) -> Response:
    return JSONResponse(body.model_dump(mode="json", by_alias=True, exclude_unset=True), status_code=status_code)


@router.get("/metrics", operation_id="metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    require_metrics_token(request)
    payload, content_type = metrics.render_latest(request.headers.get("accept"))
    return Response(payload, media_type=content_type)
