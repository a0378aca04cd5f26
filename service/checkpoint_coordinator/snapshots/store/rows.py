"""A snapshot's row as read: its columns, what it waits for, and the reads of one or all of a
run's snapshots. The record the API answers is built from it in the API (``api/schemas.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.gym_manifest import MANIFEST_SCHEMA_VERSION
from ...domain.snapshot_state import (
    SnapshotOutcome,
    SnapshotPhase,
)
from ...errors import Conflict, NotFound
from ...ledger.db import JsonText, dump_json
from ...ledger.runs import lock_run
from . import keys as sk

P = SnapshotPhase

TERMINAL = tuple(o.value for o in SnapshotOutcome)

def _notified_row(r: Any) -> SnapshotRow:
    """The row of a statement that answered ``SELECT u.*, pg_notify(...) AS notified``."""
    return SnapshotRow(**{k: v for k, v in r._mapping.items() if k != "notified"})

def awaiting(phase: str, outcome: str | None, *, cut_taken: bool, captured: bool) -> str | None:
    """The trainer handshake a snapshot waits for: the barrier, then the capture, both only in
    phase ``data_plane`` of an open snapshot."""
    if outcome is not None or phase != P.data_plane:
        return None
    if not cut_taken:
        return "barrier"
    return None if captured else "capture"

class SnapshotNotAwaiting(Conflict):
    code = "snapshot_not_awaiting"

_BASE_COLS = (
    "snapshot_id, anchor_step, stop, deadline_at, phase, outcome, reason, detail, owner, gym_checkpoint_id, snapshot_dir, phase_timings, "
    "data_plane_ref, counts, gym_parked_seconds, gym_restarted_episodes, resume_failure, "
    "abort_requested, cut_at, created_at, published_at, ended_at"
)

# A pending snapshot's Gym manifest is its entries, joined here (at its end, or for a reader that
# asks for it); NULL when it has none. Complete only from the move to data_plane on (which
# waits for every instance's entry): ``_COMPLETE_ENTRIES`` says so.
_COMPLETE_ENTRIES = f"(snapshots.phase = '{P.data_plane}' OR snapshots.cut_at IS NOT NULL)"

_ENTRIES_MANIFEST = (
    "(SELECT jsonb_build_object('checkpoint_id', snapshots.gym_checkpoint_id, 'instances', jsonb_object_agg(ge.instance_id, ge.entry), "
    f"'schema_version', {MANIFEST_SCHEMA_VERSION}) FROM snapshot_gym_entries ge "
    "WHERE ge.run_id = snapshots.run_id AND ge.snapshot_id = snapshots.snapshot_id HAVING count(*) > 0)"
)

# The Gym manifest and the cut's staging keys (megabytes for a big run) are read only when they
# are answered: the keys while the snapshot awaits its capture (the API's snapshot record), the
# manifest on request; decoding them on every status read was most of its cost.
_KEYS_WHEN_AWAITING_CAPTURE = (
    f"CASE WHEN outcome IS NULL AND phase = '{P.data_plane}' AND cut_at IS NOT NULL AND data_plane_ref IS NULL "
    f"THEN {sk.KEYS} END AS cut_staging_keys"
)

# The episodes that kept an ended snapshot from its cut (docs/ledger.md#stragglers): how many, and
# the first ten rollout ids; NULL while it runs (they are recorded by its end).
_BLOCKERS_OF = "FROM snapshot_blockers b WHERE b.run_id = snapshots.run_id AND b.snapshot_id = snapshots.snapshot_id"
_BLOCKERS = (
    f"CASE WHEN snapshots.outcome IS NOT NULL THEN (SELECT count(*) {_BLOCKERS_OF}) END AS blocker_count, "
    f"CASE WHEN snapshots.outcome IS NOT NULL THEN ARRAY(SELECT b.rollout_id {_BLOCKERS_OF} ORDER BY b.rollout_id LIMIT 10) END AS blocker_sample"
)

_COLS = f"{_BASE_COLS}, CAST(NULL AS jsonb) AS gym_manifest, {_KEYS_WHEN_AWAITING_CAPTURE}, {_BLOCKERS}"

_COLS_WITH_KEYS = f"{_BASE_COLS}, CAST(NULL AS jsonb) AS gym_manifest, {sk.KEYS} AS cut_staging_keys, cut_keys_added, cut_keys_removed"

_COLS_FULL = (
    f"{_BASE_COLS}, COALESCE(gym_manifest, CASE WHEN {_COMPLETE_ENTRIES} THEN {_ENTRIES_MANIFEST} END) AS gym_manifest, "
    f"{sk.KEYS} AS cut_staging_keys, {_BLOCKERS}"
)

# Only what ``SnapshotRow`` does not need at all.
_COLS_NONE = f"{_BASE_COLS}, CAST(NULL AS jsonb) AS gym_manifest, CAST(NULL AS text[]) AS cut_staging_keys"

@dataclass
class SnapshotRow:
    snapshot_id: str
    anchor_step: int
    stop: bool
    deadline_at: datetime | None
    phase: str
    outcome: str | None
    reason: str | None
    detail: dict[str, Any] | None
    owner: str
    gym_checkpoint_id: str | None
    snapshot_dir: str | None
    phase_timings: dict[str, Any]
    gym_manifest: dict[str, Any] | None
    cut_staging_keys: list[str] | None
    data_plane_ref: dict[str, Any] | None
    counts: dict[str, Any]
    gym_parked_seconds: float | None
    gym_restarted_episodes: int | None
    resume_failure: dict[str, Any] | None
    abort_requested: str | None
    cut_at: datetime | None
    created_at: datetime
    published_at: datetime | None
    ended_at: datetime | None
    # What the barrier added to and removed from the pre-cut's keys (``take_cut``); None without a pre-cut.
    cut_keys_added: list[str] | None = None
    cut_keys_removed: list[str] | None = None
    # The episodes that blocked it, once it ended: their count and the first ten rollout ids.
    blocker_count: int | None = None
    blocker_sample: list[str] | None = None

    @property
    def terminal(self) -> bool:
        return self.outcome is not None

    @property
    def awaiting(self) -> str | None:
        return awaiting(self.phase, self.outcome, cut_taken=self.cut_at is not None, captured=self.data_plane_ref is not None)

    @property
    def watch_token(self) -> str:
        """What a trainer waits on changing (``GET ...?wait_s=&watch_token=``): the phase, the
        outcome, the handshake awaited, and whether the pre-cut's keys can be fetched."""
        pre_cut = 1 if (self.counts or {}).get("cut_pre_cut_keys") is not None else 0
        return f"{self.phase}.{self.outcome or '-'}.{self.awaiting or '-'}.{pre_cut}"

def _j(v: Any) -> str | None:
    return None if v is None else v if isinstance(v, JsonText) else dump_json(v)

async def get(
    conn: AsyncConnection, run_id: str, snapshot_id: str, *, for_update: bool = False, with_manifest: bool = False, columns: str | None = None
) -> SnapshotRow:
    """The snapshot row; ``gym_manifest`` only ``with_manifest``, ``cut_staging_keys`` only when
    the API's record answers them (awaiting capture, or ``with_manifest``)."""
    cols = columns or (_COLS_FULL if with_manifest else _COLS)
    return SnapshotRow(**await _read_row(conn, run_id, snapshot_id, cols, " FOR UPDATE" if for_update else ""))

async def _read_row(conn: AsyncConnection, run_id: str, snapshot_id: str, select: str, lock: str = "", *, with_: str = "") -> dict[str, Any]:
    """The snapshot row's ``select`` list, by name; :class:`NotFound` when there is none.
    ``with_``: a WITH clause for the statement (it may use ``:r`` and ``:s``)."""
    r = (
        await conn.execute(text(f"{with_}SELECT {select} FROM snapshots WHERE run_id = :r AND snapshot_id = :s{lock}"), {"r": run_id, "s": snapshot_id})
    ).first()
    if r is None:
        raise NotFound(f"snapshot {snapshot_id!r} not found in run {run_id!r}", code="snapshot_not_found")
    return dict(r._mapping)

async def lease_owner(conn: AsyncConnection, run_id: str) -> str | None:
    return (await conn.execute(text("SELECT owner FROM ownership_leases WHERE run_id = :r AND expires_at > now()"), {"r": run_id})).scalar()

async def deadline_left_s(conn: AsyncConnection, run_id: str, snapshot_id: str) -> float | None:
    """Seconds until the snapshot's deadline (negative once past), by the database's clock (its
    current time: ``now()`` would be the time the caller's transaction began)."""
    v = (
        await conn.execute(
            text("SELECT EXTRACT(EPOCH FROM deadline_at - clock_timestamp()) FROM snapshots WHERE run_id = :r AND snapshot_id = :s"), {"r": run_id, "s": snapshot_id}
        )
    ).scalar()
    return None if v is None else float(v)

async def list_snapshots(engine: AsyncEngine, run_id: str, *, limit: int, before: str | None) -> list[SnapshotRow]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        if before is not None:
            await get(conn, run_id, before, columns=_COLS_NONE)  # an unknown cursor is a 404, not an empty page
        rows = (
            await conn.execute(
                text(
                    f"SELECT {_COLS} FROM snapshots WHERE run_id = :r "
                    # The key of the order: snapshots created in the same instant are not skipped.
                    + ("AND (created_at, snapshot_id) < (SELECT created_at, snapshot_id FROM snapshots WHERE run_id = :r AND snapshot_id = :b) " if before else "")
                    + "ORDER BY created_at DESC, snapshot_id DESC LIMIT :l"
                ),
                {"r": run_id, "b": before, "l": limit},
            )
        ).all()
    return [SnapshotRow(**dict(r._mapping)) for r in rows]

async def unfinished(engine: AsyncEngine) -> list[tuple[str, str, str, str | None, str, str | None]]:
    """(run_id, snapshot_id, owner, gym_checkpoint_id, phase, abort_requested) of every
    non-terminal snapshot."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT run_id, snapshot_id, owner, gym_checkpoint_id, phase, abort_requested FROM snapshots WHERE outcome IS NULL")
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]
