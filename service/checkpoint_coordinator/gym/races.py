"""Awaiting one thing unless another ends first, with nothing left running behind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any


async def unless_set(aw: Awaitable[Any], event: asyncio.Event) -> asyncio.Future[Any]:
    """Await ``aw`` until it ends or ``event`` is set, whichever comes first. In the second case,
    or when this wait is cancelled itself, ``aw`` is cancelled and awaited: nothing it started
    outlives the wait. Returns its task, done or cancelled."""
    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    return task


async def first_of(*aws: Awaitable[Any]) -> None:
    """Until the first of ``aws`` ends; the others are cancelled and awaited, so none outlives
    the wait (nor leaves its failure unretrieved)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
