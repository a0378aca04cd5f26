"""The accounting summary of a plan preview (docs/accounting.md#what-a-restore-kept): what the
restore would find in flight, carry and redo if it were applied now, from the same statement the
rewind records its work with, read-only."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ..accounting.summary import restore_summary
from ..ledger.db import fetch
from .answer import rewind_of
from .plan_loading import Planned
from .store.rewind_diff import ENDED_BEFORE_CUT
from .store.rewind_work import work_items, work_sql


async def preview_accounting(engine: AsyncEngine, run_id: str, p: Planned) -> dict[str, Any]:
    """The plan's continued and replaced attempts and the groups admitted after the cut; the
    attempts minted after the cut in groups the cut knows are left to the applied restore."""
    rw = rewind_of(p, p.plan, p.retire, installed=p.install)
    sp = {"r": run_id, "s": p.snap.snapshot_id}
    # A transaction (``connect()`` hands out autocommit connections): every read below sees
    # one snapshot of the ledger.
    async with engine.begin() as conn:
        await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        removed = list(
            (
                await conn.execute(
                    text(
                        "SELECT g.group_id FROM prompt_groups g WHERE g.run_id = :r AND NOT EXISTS (SELECT 1 FROM snapshot_groups sg "
                        f"WHERE sg.run_id = :r AND sg.snapshot_id = :s AND sg.group_id = g.group_id) AND NOT ({ENDED_BEFORE_CUT})"
                    ),
                    sp,
                )
            ).scalars()
        )
        rows = await fetch(
            conn,
            work_sql("(SELECT attempt_id, group_id FROM attempts WHERE run_id = %(r)s)", with_unknown=False),
            {**sp, "cid": [int(x) for x in rw.continued_ids], "nid": [int(x) for x in rw.new_old_ids], "nwhy": list(rw.new_reasons), "rm": removed},
        )
    return restore_summary(work_items(rows), len(removed))
