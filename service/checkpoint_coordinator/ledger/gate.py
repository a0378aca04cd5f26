"""The run's dispatch gate (recovery-ledger.md section 5): closed by a snapshot, checked by
every dispatch."""

from __future__ import annotations

from sqlalchemy import text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ..errors import GateClosed, RunStopped
from .models import Run
from .runs import RunRow, stopped_by

_R = Run.__table__


async def require_open(conn: AsyncConnection, run: RunRow, *, retry_after_s: float) -> None:
    """Refuse a dispatch while a snapshot holds the gate (read with the run's lock): for good once
    a stopping snapshot published (until a restore or a reopen), else until the snapshot ends."""
    if run.gate_snapshot_id is not None:
        stopped = await stopped_by(conn, run.run_id, run.gate_snapshot_id)
        if stopped is not None:
            raise RunStopped(f"run {run.run_id!r} was stopped by snapshot {stopped!r}; restore it or reopen it first", snapshot_id=stopped)
        raise GateClosed(
            f"dispatch gate closed by snapshot {run.gate_snapshot_id}; retry after it reopens",
            snapshot_id=run.gate_snapshot_id,
            retry_after_s=retry_after_s,
        )


# The gate's close (``:r`` the run, ``:s`` the snapshot): the update takes the run row's lock, so it
# waits for in-flight dispatch transactions (they hold it FOR SHARE); a row comes back only for an
# open run. A snapshot runs it as a CTE of the statement that moves it to phase ``gate``.
CLOSE_GATE_SQL = "UPDATE runs SET gate_snapshot_id = :s WHERE run_id = :r AND state = 'open' RETURNING 1"


async def close_gate(conn: AsyncConnection, run_id: str, snapshot_id: str) -> bool:
    """Close the gate by itself; False when the run is not open."""
    return (await conn.execute(text(CLOSE_GATE_SQL), {"r": run_id, "s": snapshot_id})).first() is not None


async def open_gate(conn: AsyncConnection, run_id: str, snapshot_id: str) -> None:
    """Reopen the gate if (and only if) this snapshot still holds it."""
    await conn.execute(update(_R).where(_R.c.run_id == run_id, _R.c.gate_snapshot_id == snapshot_id).values(gate_snapshot_id=None))
