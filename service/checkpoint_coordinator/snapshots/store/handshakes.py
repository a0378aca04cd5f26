"""The trainer's handshakes that are not the barrier: an abort request and the data-plane capture.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ...domain.vocabulary import RunState
from ...errors import Conflict
from ...ledger.db import one_statement
from ...ledger.notify import _notice, _notify
from ...ledger.runs import lock_run
from .rows import (
    _COLS,
    _COLS_NONE,
    SnapshotNotAwaiting,
    SnapshotRow,
    _j,
    _notified_row,
    get,
)


async def request_abort(engine: AsyncEngine, run_id: str, snapshot_id: str, reason: str, detail: str | None) -> SnapshotRow:
    """The trainer gives up on a snapshot (its capture failed, or it cancels): the runner resumes
    Gym and ends it. Refused once the capture was reported: the snapshot is then as good as published."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        snap = await get(conn, run_id, snapshot_id, for_update=True, columns=_COLS_NONE)
        if snap.outcome is not None:
            return snap
        if snap.data_plane_ref is not None:
            raise SnapshotNotAwaiting(f"snapshot {snapshot_id!r} already has its capture; it will publish", phase=snap.phase)
        d = dict(snap.detail or {})
        if detail:
            d["abort_detail"] = detail[:4096]
        r = (
            await conn.execute(
                text(f"UPDATE snapshots SET abort_requested = COALESCE(abort_requested, :a), detail = CAST(:d AS jsonb) WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS}"),
                {"r": run_id, "s": snapshot_id, "a": reason, "d": _j(d)},
            )
        ).one()
        await _notify(conn, run_id, [snapshot_id])
        return SnapshotRow(**dict(r._mapping))

# The capture of a snapshot that awaits it, in one statement (the run's row read-locked first, as
# every writer of the run does); it matches nothing in every other case, which the transaction
# of ``captured`` then answers.
_CAPTURED_SQL = (
    f"WITH run AS (SELECT 1 FROM runs WHERE run_id = :r AND state = '{RunState.open}' FOR SHARE), "
    "u AS (UPDATE snapshots SET data_plane_ref = CAST(:ref AS jsonb) WHERE run_id = :r AND snapshot_id = :s "
    f"AND data_plane_ref IS NULL AND outcome IS NULL AND cut_at IS NOT NULL AND EXISTS (SELECT 1 FROM run) RETURNING {_COLS}) "
    "SELECT u.*, pg_notify(:ch, :np) AS notified FROM u"
)

async def captured(engine: AsyncEngine, run_id: str, snapshot_id: str, reference: dict[str, Any]) -> SnapshotRow:
    """The trainer saved its data plane. The usual case is one round trip while Gym is parked;
    a repeat, a conflict or a snapshot not awaiting it is answered by the full check."""
    params = {"r": run_id, "s": snapshot_id, "ref": _j(reference), **_notice(run_id, snapshot_id)}
    async with one_statement(engine) as conn:
        r = (await conn.execute(text(_CAPTURED_SQL), params)).first()
    if r is not None:
        return _notified_row(r)
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        # Neither the staging keys nor the manifest: the answer, once captured, shows neither.
        snap = await get(conn, run_id, snapshot_id, for_update=True, columns=_COLS_NONE)
        if snap.data_plane_ref is not None:
            if snap.data_plane_ref != reference:
                raise Conflict("a different data-plane reference was already reported", code="capture_conflict")
            return snap
        if snap.outcome is not None or snap.cut_at is None:
            raise SnapshotNotAwaiting(
                f"snapshot {snapshot_id!r} is not awaiting a capture (phase {snap.phase}, outcome {snap.outcome})",
                phase=snap.phase, outcome=snap.outcome, reason=snap.reason,
            )
        r = (
            await conn.execute(
                text(f"UPDATE snapshots SET data_plane_ref = CAST(:ref AS jsonb) WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS}"),
                {"r": run_id, "s": snapshot_id, "ref": _j(reference)},
            )
        ).one()
        await _notify(conn, run_id, [snapshot_id])
        return SnapshotRow(**dict(r._mapping))
