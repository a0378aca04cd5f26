"""Requesting a snapshot: the one entry point the API calls."""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from ..gym_runtime import load_topology
from ..ledger import leases
from ..ledger.runs import RunRow, get_run, lock_run
from . import store as repo
from .pending import create_in_request
from .runner import SnapshotRunner

log = logging.getLogger(__name__)


async def request_snapshot(
    engine: AsyncEngine, runner: SnapshotRunner, run_id: str, snapshot_id: str, anchor_step: int, *,
    lease_ttl_s: float, stop: bool = False, deadline_s: float | None = None,
) -> tuple[repo.SnapshotRow, bool]:
    """Create the snapshot (idempotent by id) and have its owner drive it; (row, created).

    One transaction takes (or renews) the run's lease when no other live replica holds it, picks
    the owner (the lease holder: any replica may take the request) and creates the row; the
    owner learns of a row created elsewhere by its notification. Created on its owner's replica,
    the same transaction closes the gate (and, with nothing owed to Gym, moves on to prepare) and
    reads what the owner starts from (:class:`Opened`): Gym's prepare follows the request's
    commit, not a second flushed transaction and the reads beside it."""
    clock = runner.ctx.clock
    requested_at = clock.time()
    async with engine.connect() as conn:
        run = await get_run(conn, run_id)
    snapshot_dir = str(Path(run.checkpoint_root) / "snapshots" / snapshot_id)
    async with engine.begin() as conn:
        # The run before the lease, as every fenced write that locks both takes them.
        run = await lock_run(conn, run_id, for_update=True)
        epoch = await leases.acquire_in(conn, run_id, runner.owner, lease_ttl_s)
        owner = runner.owner if epoch is not None else (await repo.lease_owner(conn, run_id) or runner.owner)
        made = await create_in_request(
            conn, run, snapshot_id, anchor_step, owner=owner, me=runner.owner, epoch=epoch,
            snapshot_dir=snapshot_dir, stop=stop, deadline_s=deadline_s, requested_at=requested_at, clock=clock,
        )
    if made.opened is not None and epoch is not None:
        runner.start(run_id, snapshot_id, epoch, opened=made.opened)
    row, created = made.row, made.created
    return row, created


async def reopen(engine: AsyncEngine, runner: SnapshotRunner, run_id: str) -> RunRow:
    """Lift a stopping snapshot's stop (dispatch accepted again), then resume its Gym checkpoint
    on the instances it left parked, best effort: their leases reopen them anyway. The run as it
    stands after it."""
    stopped = await repo.reopen(engine, run_id)
    if stopped is not None and stopped.gym_checkpoint_id:
        async with engine.connect() as conn:
            run = await get_run(conn, run_id)
            topology = await load_topology(conn, run_id)
        parked = {iid: inst for iid, inst in topology.items() if ((stopped.detail or {}).get("stop_honoured") or {}).get(iid)}
        if parked:
            report = await runner.gym.for_run(run_id, run.config).resume(stopped.gym_checkpoint_id, parked, raise_on_failure=False)
            if report.failure is not None:
                log.warning("run %s reopened; resuming Gym after stop %s failed, its leases will reopen it: %s", run_id, stopped.snapshot_id, report.failure)
        log.info("run %s reopened after stopping snapshot %s", run_id, stopped.snapshot_id)
    async with engine.connect() as conn:
        return await get_run(conn, run_id)
