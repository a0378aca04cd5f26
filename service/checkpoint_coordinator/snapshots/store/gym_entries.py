"""Each Gym instance's manifest entry of a pending snapshot, stored as its commit is answered
(joined into the snapshot's Gym manifest at its end).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ...ledger.db import JsonText, one_statement
from ...ledger.leases import Fence, Fenced, fence_sql
from .rows import P


@dataclass(frozen=True)
class GymEntry:
    """One instance's Gym manifest entry as ``snapshot_gym_entries`` keeps it while the snapshot
    is pending: its text (as the manifest holds it), and ``new_keys``, its staging keys that the
    pre-cut's key rows lack, sorted by code point (None when no pre-cut's keys were at hand: the
    barrier looks them up)."""

    instance_id: str
    entry: JsonText
    new_keys: list[str] | None

    def params(self) -> dict[str, Any]:
        return {"ei": self.instance_id, "ee": self.entry, "ek": self.new_keys}

_ENTRY_INSERT = (
    "INSERT INTO snapshot_gym_entries (run_id, snapshot_id, instance_id, entry, new_keys) "
    "SELECT :r, :s, :ei, CAST(:ee AS jsonb), CAST(:ek AS text[])"
)

_ENTRY_UPSERT = "ON CONFLICT (run_id, snapshot_id, instance_id) DO UPDATE SET entry = EXCLUDED.entry, new_keys = EXCLUDED.new_keys"

def new_keys(staging_keys: Iterable[str], pre_cut_keys: frozenset[str] | None) -> list[str] | None:
    """An entry's ``new_keys``: of its ``staging_keys``, those the pre-cut's key rows
    (``pre_cut_keys``, as :func:`pre_cut` answered them) lack, distinct and sorted by code point
    (PostgreSQL's byte order, what the barrier's ``added`` is sorted by)."""
    if pre_cut_keys is None:
        return None
    return sorted({k for k in staging_keys if k not in pre_cut_keys})

async def store_gym_entry(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, gym_entry: GymEntry) -> None:
    """Store one instance's Gym manifest entry while the snapshot is in phase ``commit`` or
    ``drain``, fenced like a phase move. :class:`Fenced` when the snapshot is no longer this
    owner's in those phases."""
    async with one_statement(engine) as conn:  # one statement: refused, it wrote nothing
        n = (
            await conn.execute(
                text(
                    # Flushed: a database crash must not lose an entry whose write was answered
                    # (nothing would write it again, and the snapshot would publish without it).
                    f"{_ENTRY_INSERT} WHERE EXISTS (SELECT 1 FROM snapshots WHERE run_id = :r AND snapshot_id = :s AND phase IN (:commit, :drain) "
                    f"AND outcome IS NULL AND owner = :fence_owner) AND {fence_sql()} {_ENTRY_UPSERT}"
                ),
                {"r": run_id, "s": snapshot_id, **gym_entry.params(), "commit": P.commit.value, "drain": P.drain.value, **fence.params()},
            )
        ).rowcount
    if n != 1:
        raise Fenced(run_id, f"snapshot {snapshot_id}: Gym entry of {gym_entry.instance_id}", fence)
