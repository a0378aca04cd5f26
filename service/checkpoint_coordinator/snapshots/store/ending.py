"""A snapshot's end (published, failed or aborted) with its bookkeeping: the gate, the run's
streaks, retention, the cut's and the entries' rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.snapshot_state import (
    SnapshotOutcome,
    SnapshotPhase,
    SnapshotReason,
)
from ...ledger.leases import Fence, Fenced
from ...ledger.notify import _notify
from ...ledger.runs import lock_run
from ...ledger.runs import open_gate as _open_gate_of_run
from . import keys as sk
from .cut import delete_cut_rows
from .phases import _FENCED_MOVE
from .rows import _COLS, _ENTRIES_MANIFEST, SnapshotRow, _j


class Streaks(NamedTuple):
    """A run's snapshots in a row since its last published one: lost to a train step, failed."""

    losses: int
    failures: int

async def end(
    engine: AsyncEngine,
    run_id: str,
    snapshot_id: str,
    outcome: SnapshotOutcome | str,
    reason: SnapshotReason | str,
    *,
    fence: Fence,
    expected: SnapshotPhase,
    detail: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    gym_parked_seconds: float | None = None,
    gym_restarted_episodes: int | None = None,
    resume_failure: dict[str, Any] | None = None,
    keep_latest_k: int = 2,
    keep_gate: bool = False,
    keep_gym_manifest: bool | None = None,
    blockers: Sequence[tuple[str, str]] = (),
) -> tuple[SnapshotRow, Streaks]:
    """End a snapshot (published, failed or aborted) in one transaction with its bookkeeping:
    reopen the gate if still held, count consecutive losses and failures, apply retention on
    publish. Fenced like every phase move (from ``expected``). Returns (row, the run's streaks
    after this).
    ``keep_gym_manifest``: join its Gym entries into ``gym_manifest`` (the snapshot reached
    ``data_plane``, so every instance's entry is in); by default only when it publishes.
    ``blockers``: (instance, rollout id) of the episodes that kept it from its cut, recorded
    with it (docs/ledger.md#stragglers)."""
    outcome, reason = SnapshotOutcome(outcome), SnapshotReason(reason)
    if keep_gym_manifest is None:
        keep_gym_manifest = outcome is SnapshotOutcome.published
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True, allow_closed=True)
        phase = SnapshotPhase(outcome.value)
        r = (
            await conn.execute(
                text(_END_SQL),
                {
                    "r": run_id, "s": snapshot_id, "ph": phase.value, "o": outcome.value, "rs": reason.value, "d": _j(detail), "t": _j(timings),
                    "gp": gym_parked_seconds, "gr": gym_restarted_episodes, "rf": _j(resume_failure),
                    "published": outcome is SnapshotOutcome.published, "expected": expected.value, "keep_manifest": keep_gym_manifest,
                    **fence.params(),
                },
            )
        ).first()
        if r is None:
            raise Fenced(run_id, f"snapshot {snapshot_id}: {expected} -> {outcome}/{reason}", fence)
        if blockers:
            await conn.execute(text(_BLOCKERS_SQL), {"r": run_id, "s": snapshot_id, "i": [b[0] for b in blockers], "ro": [b[1] for b in blockers]})
        await _notify(conn, run_id, [snapshot_id])  # its waiting trainers, and an owner elsewhere
        if not (keep_gate and outcome is SnapshotOutcome.published):
            await _open_gate_of_run(conn, run_id, snapshot_id)
        streaks = await _count_streaks(conn, run_id, outcome, reason)
        await _drop_pending_rows(conn, run_id, snapshot_id, outcome, keep_latest_k)
        return SnapshotRow(**dict(r._mapping)), streaks


# The end of a snapshot: its outcome and what it ran with, fenced like every phase move.
_END_SQL = (
    "UPDATE snapshots SET phase = :ph, outcome = :o, reason = :rs, "
    # What was recorded before (the trainer's abort detail) stays beside the end's.
    "detail = CASE WHEN CAST(:d AS jsonb) IS NULL THEN detail ELSE COALESCE(detail, '{}'::jsonb) || CAST(:d AS jsonb) END, "
    "phase_timings = COALESCE(CAST(:t AS jsonb), phase_timings), gym_parked_seconds = COALESCE(:gp, gym_parked_seconds), "
    "gym_restarted_episodes = COALESCE(:gr, gym_restarted_episodes), resume_failure = COALESCE(CAST(:rf AS jsonb), resume_failure), "
    "ended_at = now(), published_at = CASE WHEN :published THEN now() ELSE NULL END, "
    # The cut's keys, rows while it was pending (after Gym was resumed: off the park).
    f"cut_staging_keys = CASE WHEN :published THEN {sk.KEYS} ELSE cut_staging_keys END, "
    # Its Gym manifest, entries while it was pending (joined after Gym was resumed),
    # kept when complete (``keep_gym_manifest``).
    f"gym_manifest = CASE WHEN :keep_manifest THEN COALESCE(gym_manifest, {_ENTRIES_MANIFEST}) ELSE gym_manifest END "
    f"WHERE {_FENCED_MOVE} RETURNING {_COLS}"
)


# The episodes that blocked a snapshot, as the attempts they name (a name that is no rollout id
# of the run, such as a Gym worker's, is left out); one row per rollout, its first instance.
_BLOCKERS_SQL = (
    "INSERT INTO snapshot_blockers (run_id, snapshot_id, rollout_id, attempt_id, instance_id) "
    "SELECT DISTINCT ON (a.rollout_id) :r, :s, a.rollout_id, a.attempt_id, t.i "
    "FROM unnest(CAST(:i AS text[]), CAST(:ro AS text[])) AS t(i, ro) JOIN attempts a ON a.run_id = :r AND a.rollout_id = t.ro "
    "ORDER BY a.rollout_id, t.i ON CONFLICT DO NOTHING"
)


async def _count_streaks(conn: AsyncConnection, run_id: str, outcome: SnapshotOutcome, reason: SnapshotReason) -> Streaks:
    """The run's losses and failures in a row, counted on (or reset by a published snapshot)."""
    if outcome is SnapshotOutcome.published:
        losses_sql = failures_sql = "0"
    else:
        losses_sql = "consecutive_snapshot_losses + 1" if reason is SnapshotReason.train_step_committed else "consecutive_snapshot_losses"
        failures_sql = "consecutive_snapshot_failures + 1" if outcome is SnapshotOutcome.failed else "consecutive_snapshot_failures"
    streaks = (
        await conn.execute(
            text(
                f"UPDATE runs SET consecutive_snapshot_losses = {losses_sql}, consecutive_snapshot_failures = {failures_sql} "
                "WHERE run_id = :r RETURNING consecutive_snapshot_losses, consecutive_snapshot_failures"
            ),
            {"r": run_id},
        )
    ).one()
    return Streaks(int(streaks[0]), int(streaks[1]))


async def _drop_pending_rows(conn: AsyncConnection, run_id: str, snapshot_id: str, outcome: SnapshotOutcome, keep_latest_k: int) -> None:
    """Retention on publish, and the rows a snapshot keeps only while it is pending: the cut of
    one that did not publish, the changed groups, its Gym entries, the key rows."""
    # The pre-cut's key rows may still be being written: their writer ends first, or rows it
    # wrote after this delete would stay behind (bounded: it normally ends well within the wait).
    await sk.key_rows_in(conn, run_id, snapshot_id, None, wait_s=sk.END_KEY_ROWS_WAIT_S)
    if outcome is SnapshotOutcome.published:
        gone = (
            await conn.execute(
                text(
                    "DELETE FROM snapshots WHERE run_id = :r AND outcome = :pub AND snapshot_id NOT IN ("
                    " SELECT snapshot_id FROM snapshots WHERE run_id = :r AND outcome = :pub ORDER BY published_at DESC, snapshot_id DESC LIMIT :k) "
                    "RETURNING snapshot_id"
                ),
                {"r": run_id, "k": keep_latest_k, "pub": SnapshotOutcome.published.value},
            )
        ).scalars().all()
        # The cut tables have no foreign key to snapshots (it slowed the cut): their rows go here.
        await delete_cut_rows(conn, run_id, list(gone))
    else:
        # Only a published snapshot is ever restored from or exported: the cut (or pre-cut) of a
        # failed or aborted one (a data-plane failure after the barrier, a lost resume, a train
        # step during commit) would otherwise stay forever, a copy of every live row per loss.
        # The snapshot row stays, for history.
        await delete_cut_rows(conn, run_id, [snapshot_id])
    await conn.execute(text("DELETE FROM snapshot_changed_groups WHERE run_id = :r"), {"r": run_id})
    await conn.execute(text("DELETE FROM snapshot_gym_entries WHERE run_id = :r AND snapshot_id = :s"), {"r": run_id, "s": snapshot_id})
    # The one place key rows go. They are read only for the run's one pending snapshot, this
    # one: those a writer committed after an earlier end stopped waiting for it go too.
    await conn.execute(text("DELETE FROM snapshot_cut_keys WHERE run_id = :r"), {"r": run_id})
