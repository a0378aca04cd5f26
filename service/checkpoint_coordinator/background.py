"""Background work of one coordinator process: snapshot recovery, the outbox worker, run leases,
the schema watch and the drain at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from .gym_runtime import GymClients
from .ledger import leases
from .outbox import store as outbox_repo
from .ledger.schema import SchemaState, SchemaStatus, this_head
from .api.health import refresh_schema
from .observability import metrics
from .outbox.worker import OutboxDeliverer, outbox_loop
from .snapshots.events import listen
from .snapshots.pending import wait_event
from .snapshots.runner import SnapshotRunner, recover_unfinished

log = logging.getLogger(__name__)

# How often the schema (and whether the database answers) is read again.
SCHEMA_CHECK_S = 5.0
# How often the fleet's undriven runs are counted and this replica's per-run series swept.
HOUSEKEEPING_S = 30.0
# A run's series stay this long after this replica last set one, when the run has moved on to
# another replica: Prometheus scrapes the last values first.
RUN_SERIES_GRACE_S = 120.0


async def start_background(app: FastAPI) -> None:
    settings = app.state.settings
    engine = app.state.engine
    app.state.gym = GymClients()
    app.state.outbox = OutboxDeliverer(engine, app.state.gym, settings.coordinator_id, max_backoff_s=settings.outbox_max_backoff_s)
    runner = app.state.snapshots = SnapshotRunner(engine, app.state.gym, app.state.outbox, settings.coordinator_id, poll_s=settings.snapshot_poll_s)
    app.state.schema = SchemaStatus(SchemaState.unknown, this_head())
    app.state.draining = False
    app.state.drain = None
    app.state.background = []
    app.state.lease_takers = []
    if not await refresh_schema(app):
        log.warning("the ledger database does not answer yet; serving (ledger calls answer 503), the schema is read once it does")
    # The listener runs even without the background workers: the snapshots this process starts
    # learn of the trainer's handshakes through it.
    app.state.background += [
        asyncio.create_task(listen(engine, runner), name="snapshot-events"),
        asyncio.create_task(_schema_watch(app), name="schema-watch"),
        asyncio.create_task(_housekeeping(app), name="housekeeping"),
    ]
    if not settings.background_workers or app.state.draining:
        return  # draining: a SIGTERM during the start, no lease may be taken from here on

    async def lease_of(run_id: str) -> int | None:
        # On a schema this release must not write (an upgrade half done, a rollback too far) the
        # runs stay with a replica that may.
        if app.state.draining or not app.state.schema.usable:
            return None
        return await leases.acquire(engine, run_id, settings.coordinator_id, settings.ownership_lease_s)

    async def recovery_loop() -> None:
        while True:
            runner.recovery_wanted.clear()
            try:
                if app.state.schema.usable:
                    await recover_unfinished(runner, settings.ownership_lease_s)
                metrics.set_run_leases_held(await leases.held_count(engine, settings.coordinator_id))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("snapshot recovery pass failed; retrying")
            await wait_event(runner.recovery_wanted, max(1.0, settings.ownership_lease_s / 3))

    app.state.lease_takers = [
        asyncio.create_task(recovery_loop(), name="snapshot-recovery"),
        asyncio.create_task(outbox_loop(engine, app.state.outbox, poll_s=settings.outbox_poll_s, lease_of=lease_of), name="outbox"),
    ]


async def _schema_watch(app: FastAPI) -> None:
    while True:
        await asyncio.sleep(SCHEMA_CHECK_S)
        await refresh_schema(app)


async def _housekeeping(app: FastAPI) -> None:
    engine, owner = app.state.engine, app.state.settings.coordinator_id
    while True:
        try:
            metrics.set_runs_without_driver(await leases.runs_without_driver(engine))
            metrics.set_run_streaks(await leases.run_streaks(engine))
            await _sweep_run_series(engine, owner)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the database away: the next round counts again
            log.debug("housekeeping round failed: %s", e)
        await asyncio.sleep(HOUSEKEEPING_S)


async def _sweep_run_series(engine: AsyncEngine, owner: str) -> None:
    """Drop the per-run series of runs that ended or that another replica drives now: they
    would otherwise stay at their last value here for ever (an alert on a finished run)."""
    runs = metrics.runs_with_series()
    if not runs:
        return
    kept = await leases.runs_kept_by(engine, owner, sorted(runs))
    for run_id in runs - kept:
        if metrics.run_series_idle_s(run_id) >= RUN_SERIES_GRACE_S:
            metrics.forget_run(run_id)


def begin_drain(app: FastAPI, drain_s: float | None = None) -> None:
    """The process is going away (SIGTERM): stop taking run leases, give the snapshots driven
    here ``drain_s`` (``CKPTC_SHUTDOWN_DRAIN_S``) to end, and hand every run back as soon as its
    work here is over, so another replica drives it at once rather than after the lease's
    expiry. Idempotent; :func:`stop_background` waits for it."""
    if getattr(app.state, "drain", None) is not None or not hasattr(app.state, "snapshots"):
        return
    app.state.draining = True
    wait = app.state.settings.shutdown_drain_s if drain_s is None else drain_s
    app.state.drain = asyncio.create_task(_drain(app, wait), name="drain")


async def _drain(app: FastAPI, drain_s: float) -> None:
    settings = app.state.settings
    owner, ttl = settings.coordinator_id, settings.ownership_lease_s
    runner: SnapshotRunner = app.state.snapshots
    for t in app.state.lease_takers:
        t.cancel()
    for t in app.state.lease_takers:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    with contextlib.suppress(Exception):  # the next owner delivers them at once, not after the claims expire
        await outbox_repo.release_claims(app.state.engine, owner)
    await _hand_back(app, keep=runner.running_runs())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_s
    if runner.jobs and drain_s > 0:
        log.info("draining: %d snapshot(s) running here get %.0f s to end", len(runner.jobs), drain_s)
    while runner.jobs and loop.time() < deadline:
        # Renewed meanwhile (the recovery pass that did it is stopped), or they would be fenced.
        await runner.keep_leases(ttl)
        await runner.wait_any_ended(min(deadline - loop.time(), max(0.5, ttl / 3)))
        await _hand_back(app, keep=runner.running_runs())
    if runner.jobs:
        log.warning("draining: cancelling %d snapshot(s) still running (Gym resumed, ended cancelled)", len(runner.jobs))
        await runner.shutdown()
    await _hand_back(app, keep=frozenset())
    with contextlib.suppress(Exception):
        await outbox_repo.release_claims(app.state.engine, owner)


async def _hand_back(app: FastAPI, *, keep: frozenset[str]) -> None:
    try:
        released = await leases.release_held(app.state.engine, app.state.settings.coordinator_id, keep=keep)
    except Exception as e:  # the database away: the leases expire by themselves
        log.warning("draining: releasing run leases failed (%s); they expire after CKPTC_OWNERSHIP_LEASE_S", type(e).__name__)
        return
    for run_id in released:
        metrics.forget_run(run_id)
    if released:
        log.info("draining: released the lease of %d run(s): %s", len(released), ", ".join(released[:20]))


async def stop_background(app: FastAPI) -> None:
    # The drain first (with no SIGTERM before, it cancels what runs at once): the loops that take
    # leases stop before the leases are handed back.
    begin_drain(app, 0.0)
    drain = getattr(app.state, "drain", None)
    if drain is not None:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await drain
    tasks: list[asyncio.Task[None]] = [*getattr(app.state, "background", []), *getattr(app.state, "lease_takers", [])]
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
