"""Notifications of snapshot events on one PostgreSQL channel: a trainer handshake, a phase move, a
new snapshot for an owner on another replica. The transaction that records the event notifies
in the same commit, so the owner (on whichever replica) and the trainers waiting on the snapshot
learn of it at once.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

#: The channel a trainer handshake (barrier, capture, abort, train-step announce) notifies in the
#: transaction that records it; the owner of the snapshot LISTENs on it, on whichever replica.
NOTIFY_CHANNEL = "ckptc_snapshot"

# Marks the notification of a new snapshot (ids hold no space): only that one makes a replica
# that does not drive the snapshot look for work; a handshake concerns its owner alone.
CREATED_MARK = "new "

# Marks a notification of progress the owner wrote itself (a phase move, the pre-cut): it
# concerns only the trainers waiting on the snapshot (``GET ...?wait_s=``), not the owner.
PROGRESS_MARK = "moved "

def notify_payload(run_id: str, snapshot_id: str, *, created: bool = False, progress: bool = False) -> str:
    return f"{CREATED_MARK if created else PROGRESS_MARK if progress else ''}{run_id}/{snapshot_id}"

def _notice(run_id: str, snapshot_id: str, *, progress: bool = False) -> dict[str, str]:
    """The parameters of a ``pg_notify(:ch, :np)`` that rides on a statement."""
    return {"ch": NOTIFY_CHANNEL, "np": notify_payload(run_id, snapshot_id, progress=progress)}

def parse_notify_payload(payload: str) -> tuple[str, str, str]:
    """``(run_id, snapshot_id, kind)`` of a notification, kind ``created``, ``progress`` or ``handshake``."""
    kind = "handshake"
    for mark, name in ((CREATED_MARK, "created"), (PROGRESS_MARK, "progress")):
        if payload.startswith(mark):
            kind, payload = name, payload.removeprefix(mark)
            break
    run_id, _, snapshot_id = payload.partition("/")
    return run_id, snapshot_id, kind

async def notify_created(conn: AsyncConnection, run_id: str, snapshot_id: str) -> None:
    """A snapshot created here for an owner on another replica: its listener starts it."""
    await _notify(conn, run_id, [snapshot_id], created=True)

async def _notify(conn: AsyncConnection, run_id: str, snapshot_ids: list[str], *, created: bool = False) -> None:
    if snapshot_ids:
        await conn.execute(
            text("SELECT pg_notify(:ch, p) FROM unnest(CAST(:ps AS text[])) AS p"),
            {"ch": NOTIFY_CHANNEL, "ps": [notify_payload(run_id, s, created=created) for s in snapshot_ids]},
        )
