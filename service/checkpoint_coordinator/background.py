"""Background work of one coordinator process: the outbox worker and snapshot recovery."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

log = logging.getLogger(__name__)


async def start_background(app: FastAPI) -> None:
    app.state.background = []


async def stop_background(app: FastAPI) -> None:
    tasks: list[asyncio.Task[None]] = getattr(app.state, "background", [])
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
