"""Background work of one coordinator process: snapshot recovery, the outbox worker, run leases."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from .gym_runtime import GymClients
from .ledger import leases
from .observability import metrics
from .outbox.worker import OutboxDeliverer, outbox_loop
from .snapshots.events import listen
from .snapshots.pending import wait_event
from .snapshots.runner import SnapshotRunner, recover_unfinished

log = logging.getLogger(__name__)


async def start_background(app: FastAPI) -> None:
    settings = app.state.settings
    engine = app.state.engine
    app.state.gym = GymClients()
    app.state.outbox = OutboxDeliverer(engine, app.state.gym, settings.coordinator_id, max_backoff_s=settings.outbox_max_backoff_s)
    runner = app.state.snapshots = SnapshotRunner(engine, app.state.gym, app.state.outbox, settings.coordinator_id, poll_s=settings.snapshot_poll_s)
    app.state.background = []
    # The listener runs even without the background workers: the snapshots this process starts
    # learn of the trainer's handshakes through it.
    app.state.background.append(asyncio.create_task(listen(engine, runner), name="snapshot-events"))
    if not settings.background_workers:
        return

    async def lease_of(run_id: str) -> int | None:
        return await leases.acquire(engine, run_id, settings.coordinator_id, settings.ownership_lease_s)

    async def recovery_loop() -> None:
        while True:
            runner.recovery_wanted.clear()
            try:
                await recover_unfinished(runner, settings.ownership_lease_s)
                metrics.set_run_leases_held(await leases.held_count(engine, settings.coordinator_id))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("snapshot recovery pass failed; retrying")
            await wait_event(runner.recovery_wanted, max(1.0, settings.ownership_lease_s / 3))

    app.state.background += [
        asyncio.create_task(recovery_loop(), name="snapshot-recovery"),
        asyncio.create_task(outbox_loop(engine, app.state.outbox, poll_s=settings.outbox_poll_s, lease_of=lease_of), name="outbox"),
    ]


async def stop_background(app: FastAPI) -> None:
    # The loops first: a recovery pass running beside the runner's shutdown could start a
    # snapshot after the shutdown took its list of jobs.
    tasks: list[asyncio.Task[None]] = getattr(app.state, "background", [])
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    runner = getattr(app.state, "snapshots", None)
    if runner is not None:
        await runner.shutdown()
    gym = getattr(app.state, "gym", None)
    if gym is not None:
        await gym.aclose()
