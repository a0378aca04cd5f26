"""Ownership of a run's background work (snapshots, outbox; docs/ledger.md#fencing-and-concurrency).

One row per run: owner, epoch, expiry. Taking the lease from another owner (only once it
expired) bumps the epoch, so a replica that lost it can tell and stops writing: every background
write (a snapshot's phase, an outbox claim or acknowledgement) carries ``fence_sql`` in its own
statement and raises :class:`Fenced` when it matched nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .. import errors
from ..domain.vocabulary import OutboxState, RunState


async def acquire(engine: AsyncEngine, run_id: str, owner: str, ttl_s: float) -> int | None:
    """Take or renew the run's lease; the epoch held, or None when another live owner has it."""
    async with engine.begin() as conn:
        return await acquire_in(conn, run_id, owner, ttl_s)


async def acquire_in(conn: AsyncConnection, run_id: str, owner: str, ttl_s: float) -> int | None:
    row = (
        await conn.execute(
            text(
                "INSERT INTO ownership_leases (run_id, owner, epoch, expires_at) "
                "VALUES (:r, :o, 1, now() + make_interval(secs => :ttl)) "
                "ON CONFLICT (run_id) DO UPDATE SET "
                "  epoch = CASE WHEN ownership_leases.owner = EXCLUDED.owner THEN ownership_leases.epoch ELSE ownership_leases.epoch + 1 END, "
                "  owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at "
                "WHERE ownership_leases.owner = EXCLUDED.owner OR ownership_leases.expires_at < now() "
                "RETURNING epoch"
            ),
            {"r": run_id, "o": owner, "ttl": ttl_s},
        )
    ).first()
    return None if row is None else int(row[0])


@dataclass(frozen=True)
class Fence:
    """The lease a background write must still hold: its owner at its lease epoch, unexpired.
    The lease epoch counts the run's changes of owner replica; the run's own ``epoch`` counts its
    restores (its lineage): two different counters (docs/ledger.md#lineage-and-epochs)."""

    owner: str
    lease_epoch: int

    def params(self) -> dict[str, Any]:
        return {"fence_owner": self.owner, "fence_epoch": self.lease_epoch}


class Fenced(errors.FencedWrite):
    """A background write found its lease gone (taken over, or expired unrenewed): the writer
    stops driving the run's work; whoever holds the lease now finishes it."""

    title = "Run lease lost by this replica"

    def __init__(self, run_id: str, what: str, fence: Fence) -> None:
        super().__init__(f"run {run_id}: {what} refused: {fence.owner} no longer holds the run's lease at epoch {fence.lease_epoch}")
        self.run_id = run_id
        self.what = what
        self.fence = fence


def fence_sql(run: str = ":r") -> str:
    """A condition for the WHERE of a background write: the writer still holds the run's lease.
    FOR SHARE makes a takeover (which updates the lease row) wait for this write, and this write
    wait for a takeover in flight, so the two never interleave. A transaction that also locks
    the run row (a foreign key to ``runs`` does too) locks it before this: a snapshot request
    holds it FOR UPDATE while it upserts the lease."""
    return (
        f"EXISTS (SELECT 1 FROM ownership_leases fl WHERE fl.run_id = {run} AND fl.owner = :fence_owner "
        "AND fl.epoch = :fence_epoch AND fl.expires_at > now() FOR SHARE)"
    )


async def release_held(engine: AsyncEngine, owner: str, *, keep: frozenset[str] = frozenset()) -> list[str]:
    """End every live lease ``owner`` holds but those of ``keep`` (a replica going away): another
    replica takes each run at its next request instead of after the lease's expiry. The runs'
    unfinished snapshots are announced as created, so the replicas' recovery starts or ends
    those at once (a snapshot requested elsewhere while this replica held the lease names it
    as owner). The released run ids."""
    from .notify import NOTIFY_CHANNEL, notify_payload

    async with engine.begin() as conn:
        rows = (
            await conn.execute(
                text(
                    "WITH released AS (UPDATE ownership_leases SET expires_at = now() "
                    "  WHERE owner = :o AND expires_at > now() AND NOT (run_id = ANY(CAST(:keep AS text[]))) RETURNING run_id) "
                    "SELECT r.run_id, s.snapshot_id FROM released r LEFT JOIN snapshots s ON s.run_id = r.run_id AND s.outcome IS NULL"
                ),
                {"o": owner, "keep": sorted(keep)},
            )
        ).all()
        notes = [notify_payload(r.run_id, r.snapshot_id, created=True) for r in rows if r.snapshot_id is not None]
        if notes:
            await conn.execute(text("SELECT pg_notify(:ch, p) FROM unnest(CAST(:ps AS text[])) AS p"), {"ch": NOTIFY_CHANNEL, "ps": notes})
    return sorted({r.run_id for r in rows})


async def held_count(engine: AsyncEngine, owner: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM ownership_leases WHERE owner = :o AND expires_at > now()"), {"o": owner})).scalar() or 0)


async def runs_without_driver(engine: AsyncEngine) -> int:
    """Open runs with work owed (a snapshot not ended, outbox items due for a minute) whose lease
    no replica holds: nobody is driving them (every replica's background workers off, or failing)."""
    async with engine.connect() as conn:
        return int(
            (
                await conn.execute(
                    text(
                        f"SELECT count(*) FROM runs r WHERE r.state = '{RunState.open}' "
                        "AND (EXISTS (SELECT 1 FROM snapshots s WHERE s.run_id = r.run_id AND s.outcome IS NULL) "
                        "  OR (r.gate_snapshot_id IS NULL AND EXISTS (SELECT 1 FROM outbox_items o WHERE o.run_id = r.run_id "
                        f"      AND o.state = '{OutboxState.pending}' AND o.next_attempt_at <= now() - interval '1 minute'))) "
                        "AND NOT EXISTS (SELECT 1 FROM ownership_leases l WHERE l.run_id = r.run_id AND l.expires_at > now())"
                    )
                )
            ).scalar()
            or 0
        )


async def runs_kept_by(engine: AsyncEngine, owner: str, run_ids: list[str]) -> set[str]:
    """Of ``run_ids``, the open runs ``owner`` was the last to hold the lease of (or nobody was)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT r.run_id FROM runs r LEFT JOIN ownership_leases l ON l.run_id = r.run_id "
                f"WHERE r.run_id = ANY(CAST(:runs AS text[])) AND r.state = '{RunState.open}' AND (l.owner IS NULL OR l.owner = :o)"
            ),
            {"runs": run_ids, "o": owner},
        )
        return {r[0] for r in rows}


async def run_streaks(engine: AsyncEngine) -> dict[str, tuple[int, int, int]]:
    """Every open run with snapshots lost or failed in a row: ``{run: (losses, failures, the
    run's loss warning threshold)}`` (at most the open runs; the others have none)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT run_id, consecutive_snapshot_losses, consecutive_snapshot_failures, "
                "COALESCE((config->>'snapshot_loss_warn_after')::int, 3) FROM runs "
                f"WHERE state = '{RunState.open}' AND (consecutive_snapshot_losses > 0 OR consecutive_snapshot_failures > 0)"
            )
        )
        return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}
