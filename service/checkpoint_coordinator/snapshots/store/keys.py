"""A snapshot's staging keys in SQL: those of its Gym manifest, of its cut rows and of the key
rows (``snapshot_cut_keys``) against which the barrier counts what changed since the pre-cut, and
the transaction that writes a pre-cut's key rows once the pre-cut committed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


def manifest_key_rows(manifest: str) -> str:
    """FROM items yielding ``k``, one row per (instance, staging key) of the Gym manifest ``manifest``."""
    return (
        f"jsonb_each(CASE WHEN jsonb_typeof({manifest} -> 'instances') = 'object' THEN {manifest} -> 'instances' ELSE '{{}}'::jsonb END) "
        "AS i(iid, inst), "
        "jsonb_array_elements_text(CASE WHEN jsonb_typeof(i.inst -> 'staging_keys') = 'array' THEN i.inst -> 'staging_keys' ELSE '[]'::jsonb END) AS k(k)"
    )


def entry_key_rows(run: str, snap: str, *, where: str = "") -> str:
    """A SELECT yielding ``k``, every staging key of the snapshot's Gym entries (its manifest
    while it is pending, ``snapshot_gym_entries``)."""
    return (
        "SELECT k FROM snapshot_gym_entries ge, jsonb_array_elements_text(ge.entry -> 'staging_keys') AS k(k) "
        f"WHERE ge.run_id = {run} AND ge.snapshot_id = {snap}{where}"
    )


def manifest_keys(run: str, snap: str, manifest: str, *, entries_where: str = "") -> str:
    """A SELECT yielding ``k``, every staging key of a snapshot's Gym manifest: the one stored
    whole (``manifest``, its column) and the per-instance entries of a pending one (those
    ``entries_where`` keeps)."""
    return f"SELECT k FROM {manifest_key_rows(manifest)} UNION ALL {entry_key_rows(run, snap, where=entries_where)}"


def cut_row_keys(run: str, snap: str) -> str:
    """A SELECT yielding ``k``, the distinct staging keys of a snapshot's cut rows, in the "C"
    collation (the key rows' own)."""
    return (
        "SELECT DISTINCT x.k COLLATE \"C\" AS k FROM snapshot_cut_groups c, unnest(c.staging_keys) AS x(k) "
        f"WHERE c.run_id = {run} AND c.snapshot_id = {snap}"
    )


def key_rows(run: str, snap: str) -> str:
    return f"SELECT ck.key AS k FROM snapshot_cut_keys ck WHERE ck.run_id = {run} AND ck.snapshot_id = {snap}"


# A pending snapshot's cut keys are its groups' keys and its Gym manifest's; a published one's
# are in ``cut_staging_keys``; one that ended otherwise has none. Sorted by code point. The
# groups' keys are read from the key rows (``snapshot_cut_keys``, an index) of a cut taken on a
# pre-cut (``cut_recopied_groups``) once they are in, else from the cut rows themselves: a
# pre-cut's key rows are written after it commits, by a transaction of their own (``pre_cut``),
# and may come after the barrier, or not at all; a whole-run cut writes none.
KEY_ROWS_KEPT = f"(snapshots.counts ? 'cut_recopied_groups' AND EXISTS ({key_rows('snapshots.run_id', 'snapshots.snapshot_id')}))"
KEYS = (
    "COALESCE(cut_staging_keys, CASE WHEN cut_at IS NOT NULL AND outcome IS NULL THEN (SELECT COALESCE(array_agg(u.k ORDER BY u.k), '{}') FROM ("
    f"{key_rows('snapshots.run_id', 'snapshots.snapshot_id')} AND {KEY_ROWS_KEPT} "
    f"UNION SELECT cr.k FROM ({cut_row_keys('snapshots.run_id', 'snapshots.snapshot_id')}) cr WHERE NOT {KEY_ROWS_KEPT} "
    f"UNION SELECT mk.k COLLATE \"C\" FROM ({manifest_keys('snapshots.run_id', 'snapshots.snapshot_id', 'snapshots.gym_manifest')}) mk"
    ") u) END)"
)


def not_pre_cut_keys(keys: str) -> str:
    """A SELECT yielding ``k``, the distinct keys of the SELECT ``keys`` (a column ``k``) that
    none of the snapshot's key rows hold, in byte order's collation. One index probe per key,
    written as a scalar subquery so that the planner cannot make it a merge or hash join over
    every key row: those rows were inserted moments ago (after the pre-cut), their statistics do
    not show them, and such a plan read all of them, far slower than the probes."""
    return (
        f"SELECT m.k FROM (SELECT DISTINCT x.k COLLATE \"C\" AS k FROM ({keys}) x) m WHERE "
        "(SELECT true FROM snapshot_cut_keys ck WHERE ck.run_id = :r AND ck.snapshot_id = :s AND ck.key = m.k LIMIT 1) IS NULL"
    )


def snapshot_manifest_keys(*, entries_where: str = "") -> str:
    """The staging keys of snapshot ``:s``'s Gym manifest, one row per (instance, key)."""
    return (
        f"SELECT mk.k FROM snapshots sn, LATERAL ({manifest_keys(':r', ':s', 'sn.gym_manifest', entries_where=entries_where)}) mk "
        "WHERE sn.run_id = :r AND sn.snapshot_id = :s"
    )


MANIFEST_KEYS = snapshot_manifest_keys()
# The Gym manifest's keys the pre-cut's key rows lack: looked up when each entry was stored
# (``new_keys``), else (no pre-cut was in then, or a manifest stored whole) here.
MANIFEST_NEW_KEYS = (
    "SELECT u.k FROM snapshot_gym_entries ge, unnest(ge.new_keys) AS u(k) WHERE ge.run_id = :r AND ge.snapshot_id = :s AND ge.new_keys IS NOT NULL "
    f"UNION ALL {not_pre_cut_keys(snapshot_manifest_keys(entries_where=' AND ge.new_keys IS NULL'))}"
)
# The pre-cut's key rows: every key of its groups, with how many of them name it. Counted by
# hashing, inserted in the key index's order (byte order), so that the insert appends to the
# index's rightmost pages instead of touching random ones.
# Written only while the snapshot is pending and its cut, if taken, was taken on the pre-cut
# (a whole-run cut reads its keys from its rows, ``KEYS``).
INSERT_KEYS_SQL = (
    "INSERT INTO snapshot_cut_keys (run_id, snapshot_id, key, refs) SELECT :r, :s, y.k, y.n FROM ("
    "SELECT x.k COLLATE \"C\" AS k, count(*) AS n FROM ("
    "SELECT k FROM snapshot_cut_groups c, unnest(c.staging_keys) AS k WHERE c.run_id = :r AND c.snapshot_id = :s"
    ") x GROUP BY x.k) y WHERE EXISTS (SELECT 1 FROM snapshots sn WHERE sn.run_id = :r AND sn.snapshot_id = :s AND sn.outcome IS NULL "
    "AND (sn.cut_at IS NULL OR sn.counts ? 'cut_recopied_groups')) ORDER BY y.k"
)
# The pre-cut's keys, one JSON array sorted as ``cut_keys`` sorts them, read from its cut rows
# (the key rows come after it, ``INSERT_KEYS_SQL``).
PRE_CUT_KEYS_JSON = f"SELECT CAST(COALESCE(json_agg(y.k ORDER BY y.k), '[]') AS text) FROM ({cut_row_keys(':r', ':s')}) y"
PRE_CUT_KEYS_SQL = f"SELECT count(*) AS n, CAST(COALESCE(json_agg(y.k ORDER BY y.k), '[]') AS text) AS keys FROM ({cut_row_keys(':r', ':s')}) y"

# The lock the writer of a pre-cut's key rows holds from before the pre-cut commits until its
# own transaction ends; a barrier that counts keys against those rows waits for it (shared).
KEY_ROWS_LOCK = "hashtextextended('ckptc pre-cut key rows ' || :r || '/' || :s, 0)"
# How long a barrier waits for them (they normally come soon after the pre-cut); past it
# the barrier copies the whole run, which needs none. No writer ever waits on their row locks:
# a barrier changes them only once their writer has ended, and deletes leave unseen rows alone.
KEY_ROWS_WAIT_S = 10.0
# How long a snapshot's end waits for them, to delete them; past it, a writer that stopped
# answering may leave them behind, unread, until the run's next snapshot ends.
END_KEY_ROWS_WAIT_S = 2.0


async def key_rows_in(conn: AsyncConnection, run_id: str, snapshot_id: str, keys: int | None, *, wait_s: float = KEY_ROWS_WAIT_S) -> bool:
    """Wait (within ``wait_s``) until the writer of the pre-cut's key rows has ended; whether
    they are in (all of them: one transaction writes them)."""
    p = {"r": run_id, "s": snapshot_id}
    deadline = time.monotonic() + wait_s
    # Tried rather than waited for: a wait would hold this transaction's locks (the run, the
    # snapshot row) for as long as a writer that stopped answering keeps its own.
    while not (await conn.execute(text(f"SELECT pg_try_advisory_xact_lock_shared({KEY_ROWS_LOCK})"), p)).scalar():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return not keys or bool((await conn.execute(text(f"SELECT EXISTS ({key_rows(':r', ':s')})"), p)).scalar())


class KeyRowsWriter:
    """The transaction that writes a pre-cut's key rows, after the pre-cut committed: opened (and
    the lock ``KEY_ROWS_LOCK`` taken) before the pre-cut, so that no barrier finds the pre-cut
    without it."""

    def __init__(self, conn: AsyncConnection, params: dict[str, Any]) -> None:
        self.conn = conn
        self.params = params
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    async def open(cls, engine: AsyncEngine, run_id: str, snapshot_id: str) -> KeyRowsWriter:
        # A READ COMMITTED transaction, as ``LedgerEngine.begin`` opens, left open past this call.
        conn = await engine.connect().start()
        p = {"r": run_id, "s": snapshot_id}
        try:
            await conn.execution_options(isolation_level="READ COMMITTED")
            await conn.begin()
            await conn.execute(
                text(f"SELECT pg_advisory_xact_lock({KEY_ROWS_LOCK}), set_config('synchronous_commit', 'off', true)"),
                p,
            )
        except BaseException:
            await conn.close()
            raise
        return cls(conn, p)

    def start(self) -> asyncio.Future[int]:
        """Write them and commit, in a task: how many there are (0: the snapshot ended, or its
        cut was taken without them, meanwhile). Cancelled, even before it ran, it rolls back."""
        task = asyncio.ensure_future(self._write())
        task.add_done_callback(self._close_if_never_ran)
        return task

    async def _write(self) -> int:
        try:
            n = (await self.conn.execute(text(INSERT_KEYS_SQL), self.params)).rowcount
            await self.conn.commit()
            return int(n)
        finally:
            await self.discard()

    def _close_if_never_ran(self, task: asyncio.Future[int]) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.conn.close())

    async def discard(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.conn.close())
        await asyncio.shield(self._closing)
