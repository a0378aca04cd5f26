"""The pending snapshot's writes made outside its own task: its creation with the gate's close in
the request's transaction, and a takeover after its owner died (docs/architecture.md#the-pending-snapshot).

They live here, beside the state machine, so that one module writes every phase and outcome, each
checked against the phase table (``check_snapshot_transition``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ...domain.snapshot_state import (
    SnapshotPhase,
    SnapshotReason,
    check_snapshot_transition,
)
from ...gym.clock import Clock
from ...gym.context import checkpoint_id_for
from ...gym_runtime import load_topology
from ...ledger.leases import Fence
from ...ledger.runs import RunRow
from ...observability import metrics
from .. import store as repo
from .support import Opened, SnapshotContext, outcome_of

log = logging.getLogger("checkpoint_coordinator.snapshots.pending")
P = SnapshotPhase


@dataclass(frozen=True)
class Created:
    row: repo.SnapshotRow
    created: bool
    opened: Opened | None  # the gate closed in the request's transaction (the owner is this replica)


async def create_in_request(
    conn: AsyncConnection, run: RunRow, snapshot_id: str, anchor_step: int, *, owner: str, me: str, epoch: int | None,
    snapshot_dir: str, stop: bool, deadline_s: float | None, requested_at: float, clock: Clock,
) -> Created:
    """Create the snapshot (idempotent by id) in the request's transaction, for ``owner``. ``me``
    holds the run's lease at ``epoch`` (None: another replica does): a new snapshot then has its
    gate closed here too (and, with nothing owed to Gym, moves on to prepare), and what its owner
    starts from is read in the same transaction. Created for another owner, that owner is notified."""
    run_id = run.run_id
    row, created = await repo.create_in(conn, run_id, snapshot_id, anchor_step, owner, snapshot_dir, stop=stop, deadline_s=deadline_s)
    if not created:
        return Created(row, False, None)
    if epoch is None:
        if owner != me:
            await repo.notify_created(conn, run_id, snapshot_id)
        return Created(row, True, None)
    fence = Fence(me, epoch)
    check_snapshot_transition(P.requested, P.gate)
    checkpoint_id = checkpoint_id_for(snapshot_id)
    gate = await repo.close_gate_in(conn, run_id, snapshot_id, fence, prepare_as=checkpoint_id)
    if gate.prepared:
        check_snapshot_transition(P.gate, P.prepare)
    row = await repo.get(conn, run_id, snapshot_id)
    topology = await load_topology(conn, run_id)
    left = await repo.deadline_left_s(conn, run_id, snapshot_id)
    return Created(row, True, Opened(run, row, topology, left, clock.time(), gate, checkpoint_id, requested_at))


async def take_over(ctx: SnapshotContext, run_id: str, snapshot_id: str, fence: Fence, phase: SnapshotPhase) -> None:
    """Make this replica the owner of a snapshot whose owner lost the run's lease (its phase
    unchanged; the write is fenced by the lease this replica now holds)."""
    if phase.terminal:
        raise ValueError(f"snapshot {snapshot_id} already ended ({phase})")
    await ctx.store.take_over(run_id, snapshot_id, fence, phase)


async def end_orphan(
    ctx: SnapshotContext, run_id: str, snapshot_id: str, fence: Fence, phase: SnapshotPhase, *,
    previous_owner: str, gym_checkpoint_id: str | None, abort_requested: str | None,
) -> None:
    """End a snapshot its owner left unfinished (it died): Gym resumed when it may be parked, then
    the abort asked for before the owner died, or ``coordinator_restart``. Raises ``Fenced`` when
    the run's lease moved on meanwhile."""
    store = ctx.store
    detail: dict[str, Any] = {"phase_at_restart": phase.value, "previous_owner": previous_owner}
    if gym_checkpoint_id:
        run = await store.run(run_id)
        topology = await store.topology(run_id)
        assert ctx.gym is not None
        report = await ctx.gym.for_run(run_id, run.config).resume(gym_checkpoint_id, topology, raise_on_failure=False)
        if report.failure is not None:
            detail["resume_failure"] = report.failure.to_dict()
            log.warning("resume of %s after restart failed; Gym leases will reopen it: %s", gym_checkpoint_id, report.failure)
    reason = SnapshotReason(abort_requested or SnapshotReason.coordinator_restart)
    outcome = outcome_of(reason)
    check_snapshot_transition(phase, P(outcome.value), reason=reason)
    # In data_plane or later every instance's Gym entry was stored: the manifest is kept
    # (``resume`` may be an abort from before data_plane: not kept).
    _, streaks = await store.end(run_id, snapshot_id, outcome, reason, fence=fence, expected=phase, detail=detail,
                                 keep_gym_manifest=phase in (P.data_plane, P.publish))
    metrics.record_snapshot_outcome(outcome, reason, run_id)
    metrics.set_snapshot_failures(run_id, streaks.failures)
    log.warning("snapshot %s of run %s was unfinished at %s; Gym resumed, ended %s/%s", snapshot_id, run_id, phase, outcome, reason)
