"""Train steps: the trainer's announcements of a committed step, which abort a snapshot anchored
before them, and their history.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.snapshot_state import (
    SnapshotReason,
)
from ...errors import Conflict
from ...ledger.notify import _notify
from ...ledger.runs import lock_run

# The run's newest train step of its current lineage (a restore retires the discarded ones).
_NEWEST_STEP_SQL = "SELECT max(step) FROM train_steps WHERE run_id = :r AND retired_at IS NULL"

async def newest_train_step(conn: AsyncConnection, run_id: str) -> int | None:
    return (await conn.execute(text(_NEWEST_STEP_SQL), {"r": run_id})).scalar()

async def announce_train_step(engine: AsyncEngine, run_id: str, step: int, checkpoint_ref: str | None) -> tuple[dict[str, Any], list[str]]:
    """Create-or-return the train step; abort every snapshot of the run that is older and not cut
    yet (train step wins). Returns the step and the snapshot ids asked to abort."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        r = (
            await conn.execute(
                text(
                    "INSERT INTO train_steps (run_id, step, checkpoint_ref) VALUES (:r, :s, :c) "
                    "ON CONFLICT (run_id, step) WHERE retired_at IS NULL DO NOTHING RETURNING step, checkpoint_ref, announced_at"
                ),
                {"r": run_id, "s": step, "c": checkpoint_ref},
            )
        ).first()
        created = r is not None
        if r is None:
            r = (
                await conn.execute(
                    text("SELECT step, checkpoint_ref, announced_at FROM train_steps WHERE run_id = :r AND step = :s AND retired_at IS NULL"),
                    {"r": run_id, "s": step},
                )
            ).one()
            if r.checkpoint_ref != checkpoint_ref and checkpoint_ref is not None:
                raise Conflict(f"train step {step} was announced with another checkpoint reference", code="train_step_conflict")
        aborted = (
            await conn.execute(
                text(
                    "UPDATE snapshots SET abort_requested = :why WHERE run_id = :r AND outcome IS NULL AND cut_at IS NULL "
                    "AND anchor_step < :s AND abort_requested IS NULL AND NOT stop RETURNING snapshot_id"
                ),
                {"r": run_id, "s": step, "why": SnapshotReason.train_step_committed.value},
            )
        ).scalars().all()
        await _notify(conn, run_id, list(aborted))
        return {"step": r.step, "checkpoint_ref": r.checkpoint_ref, "announced_at": r.announced_at.isoformat(), "created": created}, list(aborted)

async def list_train_steps(engine: AsyncEngine, run_id: str, *, include_retired: bool) -> list[dict[str, Any]]:
    """The run's train-step announces, oldest first; retired ones (a restore discarded their
    lineage) name the restore that retired them."""
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        rows = (
            await conn.execute(
                text(
                    "SELECT step, checkpoint_ref, announced_at, retired_at, retired_by_restore FROM train_steps WHERE run_id = :r "
                    + ("" if include_retired else "AND retired_at IS NULL ")
                    + "ORDER BY announce_id"
                ),
                {"r": run_id},
            )
        ).all()
    return [
        {
            "step": r.step,
            "checkpoint_ref": r.checkpoint_ref,
            "announced_at": r.announced_at.isoformat(),
            "retired_at": r.retired_at.isoformat() if r.retired_at else None,
            "retired_by_restore": r.retired_by_restore,
        }
        for r in rows
    ]
