"""What a pending snapshot reads while it waits: the attempts still owed by the trainer (the
drain) and its own row's progress (handshakes, abort requests, the deadline).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ...domain.levels import RestoreLevel
from ...domain.snapshot_state import (
    AttemptStatus,
    GroupStatus,
)
from ...errors import NotFound
from ...ledger.db import read_rows
from .rows import awaiting

_CANDIDATES_SQL = (
    "SELECT a.gym_instance_id, a.rollout_id, a.gym_attempt FROM attempts a JOIN prompt_groups g "
    "ON g.run_id = a.run_id AND g.group_id = a.group_id "
    f"WHERE a.run_id = %(r)s AND a.is_current AND g.restore_level = '{RestoreLevel.turn}' AND g.status = '{GroupStatus.generating}' "
    "AND a.gym_instance_id IS NOT NULL "
    f"AND (a.status = '{AttemptStatus.dispatched}' OR (a.status = '{AttemptStatus.reserved}' AND (a.gym_owned OR a.gym_attempt > 0)))"
)

async def candidates(engine: AsyncEngine, run_id: str) -> dict[str, list[tuple[str, int]]]:
    """Per instance, the live turn-level attempts Gym may hold state for (docs/gym-protocol.md#commit-scopes).
    Tens of thousands of rows while Gym may wait for them: plain driver tuples, no row objects."""
    out: dict[str, list[tuple[str, int]]] = {}
    for iid, rollout_id, attempt in await read_rows(engine, _CANDIDATES_SQL, {"r": run_id}):
        out.setdefault(iid, []).append((rollout_id, attempt))
    return out

async def still_pending(engine: AsyncEngine, run_id: str, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
    """Which of these (rollout_id, gym_attempt) are still on the wire: unique-index lookups only,
    so a drain pass costs time in the number pending, never in the number of live rollouts."""
    if not keys:
        return set()
    # One statement on the binary read path (no SQLAlchemy text() parameter handling).
    rows = await read_rows(
        engine,
        "SELECT a.rollout_id, a.gym_attempt FROM unnest(%(ro)s::text[]) AS t(ro) "
        "JOIN attempts a ON a.run_id = %(r)s AND a.rollout_id = t.ro "
        "WHERE a.is_current AND a.status = 'dispatched'",
        {"r": run_id, "ro": [k[0] for k in keys]},
    )
    wanted = set(keys)
    return {(r[0], r[1]) for r in rows} & wanted

@dataclass(frozen=True)
class SnapshotProgress:
    """The few columns the runner polls; the full row carries the manifest and staging keys
    (megabytes at 10 000 episodes), too heavy to read on every event and every fallback poll."""

    phase: str
    outcome: str | None
    abort_requested: str | None
    cut_taken: bool
    captured: bool

    @property
    def awaiting(self) -> str | None:
        return awaiting(self.phase, self.outcome, cut_taken=self.cut_taken, captured=self.captured)

async def poll(engine: AsyncEngine, run_id: str, snapshot_id: str) -> SnapshotProgress:
    async with engine.connect() as conn:
        r = (
            await conn.execute(
                text(
                    "SELECT phase, outcome, abort_requested, cut_at IS NOT NULL, data_plane_ref IS NOT NULL "
                    "FROM snapshots WHERE run_id = :r AND snapshot_id = :s"
                ),
                {"r": run_id, "s": snapshot_id},
            )
        ).first()
    if r is None:
        raise NotFound(f"snapshot {snapshot_id!r} not found in run {run_id!r}", code="snapshot_not_found")
    return SnapshotProgress(*r)
