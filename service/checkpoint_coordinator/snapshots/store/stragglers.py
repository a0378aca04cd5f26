"""Which episodes blocked the run's last snapshots, each of them (docs/ledger.md#stragglers).

Each snapshot that ended without its cut because of them recorded its blockers
(``snapshot_blockers``, written by its end). A straggler is a current, dispatched attempt named
by each of the run's ``max_blocking_snapshots`` most recent ended snapshots that were not aborted
while Gym's prepare still waited, none of them published, all taken since the run's last applied
restore (a restore starts the count again: the blocked episodes it found belong to the lineage it
ended). The gate of the next snapshot gives them up (``phases.close_gate_in``).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ...domain.config import RecoveryConfig
from ...domain.snapshot_state import SnapshotOutcome, SnapshotTiming
from ...domain.vocabulary import AttemptStatus, RestoreRecordState

__all__ = ["find_stragglers"]

_DEFAULT_MAX = RecoveryConfig.model_fields["max_blocking_snapshots"].default

# One statement: the run's ended snapshots since its last applied restore, newest first (the
# order of the history), those aborted before Gym's prepare answered left out (a train step or the
# trainer ended them while Gym was still waiting for its episodes, so they say nothing about any;
# ``phase_timings`` holds ``prepare`` once it answered ready), the newest ``n`` of them, and the
# attempts each of those names; the instance is the one the newest snapshot recorded. Only a
# failed snapshot records blockers, and an abort leaves the count of failures as it was, so fewer
# than ``n`` failures since the last publication (the run's streak) means none: then the statement
# reads the run row alone, which is every gate's cost on a healthy run.
_FIND_SQL = (
    "WITH run AS (SELECT n, since FROM (SELECT COALESCE(CAST(config->>'max_blocking_snapshots' AS int), :dflt) AS n, "
    "  consecutive_snapshot_failures AS failures FROM runs WHERE run_id = :r) AS c "
    f"  CROSS JOIN LATERAL (SELECT COALESCE(max(ended_at), '-infinity') AS since FROM restores WHERE run_id = :r AND state = '{RestoreRecordState.applied}') AS x "
    "  WHERE c.n > 0 AND c.failures >= c.n), "
    "recent AS (SELECT s.snapshot_id, s.outcome, row_number() OVER (ORDER BY s.created_at DESC, s.snapshot_id DESC) AS k "
    "  FROM snapshots s, run WHERE s.run_id = :r AND s.outcome IS NOT NULL AND s.created_at > run.since "
    f"  AND (s.outcome <> '{SnapshotOutcome.aborted}' OR s.phase_timings -> '{SnapshotTiming.prepare}' IS NOT NULL)), "
    "last AS (SELECT recent.* FROM recent, run WHERE recent.k <= run.n), "
    f"streak AS (SELECT count(*) = (SELECT n FROM run) AND NOT bool_or(outcome = '{SnapshotOutcome.published}') AS unbroken FROM last) "
    "SELECT b.rollout_id, (array_agg(b.instance_id ORDER BY l.k))[1] FROM snapshot_blockers b "
    "JOIN last l ON l.snapshot_id = b.snapshot_id JOIN attempts a ON a.run_id = b.run_id AND a.attempt_id = b.attempt_id "
    f"WHERE b.run_id = :r AND (SELECT unbroken FROM streak) AND a.is_current AND a.status = '{AttemptStatus.dispatched}' "
    "GROUP BY b.rollout_id HAVING count(*) = (SELECT n FROM run) ORDER BY 1"
)


async def find_stragglers(conn: AsyncConnection, run_id: str) -> dict[str, str | None]:
    """rollout id -> the instance that reported it, for every straggler of the run now (none
    when ``max_blocking_snapshots`` is 0)."""
    rows = (await conn.execute(text(_FIND_SQL), {"r": run_id, "dflt": _DEFAULT_MAX})).all()
    return {r[0]: r[1] for r in rows}
