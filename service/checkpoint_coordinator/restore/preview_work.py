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
from .store.rewind_work import ALL_ATTEMPTS, later_groups, source_params, work_items, work_sql


async def preview_accounting(engine: AsyncEngine, run_id: str, p: Planned) -> dict[str, Any]:
    """The plan's continued and replaced attempts and the groups admitted after the cut; the
    attempts minted after the cut in groups the cut knows are left to the applied restore."""
    rw = rewind_of(p, p.plan, p.retire, installed=p.install)
    # A transaction (``connect()`` hands out autocommit connections): every read below sees
    # one snapshot of the ledger.
    async with engine.begin() as conn:
        await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        removed = await later_groups(conn, run_id, p.snap.snapshot_id)
        rows = await fetch(conn, work_sql(ALL_ATTEMPTS, with_unknown=False), source_params(run_id, p.snap.snapshot_id, rw, removed))
    return restore_summary(work_items(rows), len(removed))
