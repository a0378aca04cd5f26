"""Ownership of a run's background work (snapshots, outbox), section 2.

One row per run: owner, epoch, expiry. Taking the lease from another owner (only once it
expired) bumps the epoch, so a replica that lost it can tell and stops writing.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


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


async def holds(conn: AsyncConnection, run_id: str, owner: str, epoch: int) -> bool:
    """Inside a write transaction: does ``owner`` still hold the lease at ``epoch``? (row-locked)"""
    row = (
        await conn.execute(
            text("SELECT owner, epoch, expires_at > now() AS live FROM ownership_leases WHERE run_id = :r FOR SHARE"), {"r": run_id}
        )
    ).first()
    return row is not None and row.owner == owner and int(row.epoch) == epoch and bool(row.live)


async def release(engine: AsyncEngine, run_id: str, owner: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE ownership_leases SET expires_at = now() WHERE run_id = :r AND owner = :o"), {"r": run_id, "o": owner})


async def held_count(engine: AsyncEngine, owner: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM ownership_leases WHERE owner = :o AND expires_at > now()"), {"o": owner})).scalar() or 0)
