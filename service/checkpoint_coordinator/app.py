"""The FastAPI application and its lifespan (engine, background workers)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from .api import health, problems, runs
from .config import Settings
from .ledger.db import make_async_engine
from .observability.http import install_http_metrics

log = logging.getLogger(__name__)

API_DESCRIPTION = """
The checkpoint coordinator keeps the recovery ledger of long multi-turn RL rollouts in Postgres,
drives consistent snapshots of NeMo Gym deployments, and answers restore plans after a crash.

Errors are `application/problem+json` documents with a stable `code`.
"""


def create_app(settings: Settings | None = None, *, database_url: str | None = None) -> FastAPI:
    settings = settings or Settings()
    url = database_url or settings.database_url_value()
    if not url:
        raise ValueError("create_app needs a database URL (the CLI starts the embedded database first)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from .server import install_accept_error_limit

        install_accept_error_limit(asyncio.get_running_loop())
        app.state.engine = make_async_engine(url, statement_timeout_s=settings.db_statement_timeout_s)
        app.state.background = []
        try:
            from .background import start_background

            await start_background(app)
            _tune_gc()
            yield
        finally:
            from .background import stop_background

            await stop_background(app)
            await app.state.engine.dispose()

    app = FastAPI(
        title="Checkpoint coordinator",
        version="0.1.0",
        description=API_DESCRIPTION,
        lifespan=lifespan,
        # No redirect of a path with a trailing slash: it answered with the request's own Host.
        redirect_slashes=False,
    )
    app.state.settings = settings
    from .gym_runtime import egress_policy, set_egress

    try:
        app.state.egress = egress_policy(settings.gym_allowed_networks, database_url=url, own_port=settings.port)
    except ValueError as e:
        raise ValueError(f"CKPTC_GYM_ALLOWED_NETWORKS: {e}") from None
    set_egress(app.state.egress)
    problems.install_problem_handlers(app)
    app.include_router(health.router)
    app.include_router(runs.router)
    for router in _feature_routers():
        app.include_router(router)
    app.add_middleware(problems.BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(problems.SchemaGate, state=app.state)
    # Outside the body limit (which answers its own 413) and inside the metrics, which count
    # the statuses it answers.
    app.add_middleware(problems.ErrorBoundary)
    app.add_middleware(problems.NoStore)
    # Outermost, so the body limit's 413 answers are counted too.
    install_http_metrics(app)
    return app


def _tune_gc() -> None:
    """A batch call allocates hundreds of thousands of short-lived objects (rows, dicts, models);
    with CPython's default thresholds (a young collection every 700 allocations) those trigger
    full collections that walk every object of the process, several times per batch: they were a
    large share of the coordinator's CPU per 8 000-row seal. Collect young objects every 50 000
    allocations instead, and leave what startup created (modules, routes, schemas) out of every
    later collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)


def _feature_routers() -> list[Any]:
    from .api import routers

    return routers.ROUTERS


