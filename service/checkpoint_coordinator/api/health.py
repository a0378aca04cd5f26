"""Probes and metrics. /healthz never touches the database (a liveness probe must not restart a
pod because Postgres is slow); /readyz checks the database and the migration head."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy import text

from ..ledger.db import head_revision
from .auth import require_metrics_token

router = APIRouter(tags=["health"])


@router.get("/healthz", operation_id="healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", operation_id="readyz", responses={503: {"description": "database unreachable or not at head"}})
async def readyz(request: Request) -> Response:
    engine = request.app.state.engine
    body: dict[str, Any] = {"database": "unreachable", "migration": None, "head": head_revision()}
    try:
        async with asyncio.timeout(3):
            async with engine.connect() as conn:
                body["migration"] = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
                body["database"] = "ok"
    except Exception as e:  # any failure means "not ready"; say which kind, never the URL
        body["error"] = type(e).__name__
    ready = body["database"] == "ok" and body["migration"] == body["head"]
    body["status"] = "ready" if ready else "not_ready"
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", operation_id="metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    from ..observability.metrics import render_latest

    require_metrics_token(request)
    payload, content_type = render_latest(request.headers.get("accept"))
    return Response(payload, media_type=content_type)
