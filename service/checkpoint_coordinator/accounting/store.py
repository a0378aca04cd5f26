"""A run's accounting read from the ledger (docs/accounting.md): set-based SQL over the run's
groups and attempts and what its restores recorded, in one read-only snapshot of the database,
so it holds right after a crash of any component (nothing is kept in memory)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.vocabulary import AttemptStatus as A
from ..domain.vocabulary import GroupStatus as G
from ..domain.vocabulary import RestoreRecordState, WorkFate, WorkReason
from ..errors import NotFound
from ..ledger.db import fetch
from .sql import LIVE_FATE, LIVE_REASON, WORK_SECONDS_SUM
from .summary import WorkItem, prompt_buckets, restore_summary, work_totals

# One pass over the run's attempts: the work of each (fate, reason). Reserved rows hold none.
# The pass groups by the columns the fate and reason are made of, and the few groups get their
# fate and reason after it, instead of both CASEs on every row.
_LIVE_WORK = (
    f"SELECT {LIVE_FATE} AS fate, {LIVE_REASON} AS reason, sum(a.n)::bigint, sum(a.seconds) FROM ("
    f"SELECT a.status, a.is_current, a.end_reason, a.failure_class, count(*) AS n, {WORK_SECONDS_SUM} AS seconds "
    f"FROM attempts a WHERE a.run_id = %(r)s AND a.status <> '{A.reserved}' GROUP BY 1, 2, 3, 4) AS a GROUP BY 1, 2"
)
# Sealed rows of abandoned groups were counted as trained above: their work was not trained.
_SEALED_IN_ABANDONED = (
    f"SELECT count(*), {WORK_SECONDS_SUM} FROM prompt_groups g JOIN attempts a ON a.run_id = g.run_id "
    f"AND a.group_id = g.group_id AND a.is_current WHERE g.run_id = %(r)s AND g.status = '{G.abandoned}' "
    f"AND a.status = '{A.sealed}' AND a.end_reason IS NULL"
)



async def run_accounting(engine: AsyncEngine, run_id: str) -> dict[str, Any]:
    """Buckets of the run's groups, its rollout-seconds by fate, and what each restore kept."""
    # A transaction (``connect()`` hands out autocommit connections): every read below sees
    # one snapshot of the ledger.
    async with engine.begin() as conn:
        await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        p = {"r": run_id}
        if not await fetch(conn, "SELECT 1 FROM runs WHERE run_id = %(r)s", p):
            raise NotFound(f"run {run_id!r} not found", code="run_not_found")
        ((admitted,),) = await fetch(conn, "SELECT COALESCE(sum(groups), 0) FROM group_admissions WHERE run_id = %(r)s", p)
        groups = await fetch(conn, "SELECT status, abandon_reason, count(*) FROM prompt_groups WHERE run_id = %(r)s GROUP BY 1, 2", p)
        rewound = dict(
            await fetch(conn, "SELECT restore_id, count(*) FROM restore_rewound_groups WHERE run_id = %(r)s GROUP BY 1", p)
        )
        live = [(f, why, int(n), float(sec)) for f, why, n, sec in await fetch(conn, _LIVE_WORK, p) if f is not None]
        ((n_ab, sec_ab),) = await fetch(conn, _SEALED_IN_ABANDONED, p)
        restored = await fetch(
            conn,
            "SELECT restore_id, snapshot_id, ended_at, (result -> 'answer') ? 'accounting' FROM restores "
            f"WHERE run_id = %(r)s AND state = '{RestoreRecordState.applied}' ORDER BY ended_at, restore_id",
            p,
        )
        work = await fetch(
            conn,
            "SELECT restore_id, instance_id, restore_level, fate, reason, found, kept, attempts, seconds FROM restore_work "
            "WHERE run_id = %(r)s ORDER BY restore_id, item",
            p,
        )
    if n_ab:
        live.append((WorkFate.trained.value, None, -int(n_ab), -float(sec_ab)))
        live.append((WorkFate.redone.value, WorkReason.abandoned.value, int(n_ab), float(sec_ab)))
    by_restore: dict[str, list[WorkItem]] = {}
    for row in work:
        by_restore.setdefault(row[0], []).append(WorkItem(*row[1:]))
    recorded_rows = [(w.fate, w.reason, int(w.attempts), float(w.seconds)) for ws in by_restore.values() for w in ws if not w.kept]
    restores = [
        {
            "restore_id": rid,
            "snapshot_id": sid,
            "applied_at": ended.isoformat() if ended is not None else None,
            "recorded": bool(recorded),
            **restore_summary(by_restore.get(rid, []), int(rewound.get(rid, 0))),
        }
        for rid, sid, ended, recorded in restored
    ]
    return {
        "run_id": run_id,
        "as_of": datetime.now(timezone.utc).isoformat(),
        "prompts": prompt_buckets(int(admitted), [(s, why, int(n)) for s, why, n in groups], {k: int(v) for k, v in rewound.items()}),
        "work": work_totals(live + recorded_rows),
        "restores": restores,
    }
