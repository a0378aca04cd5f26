"""The pre-cut: a copy of the run's live groups taken in a transaction of its own while Gym
commits, so that the barrier copies only what changed after it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ...ledger.leases import Fence, fence_sql
from ...ledger.notify import _notice
from . import keys as sk
from .cut import _CUT_SETTINGS, CURRENT_XMIN_SQL, NEXT_XID_SQL, _cut_insert
from .rows import P


@dataclass(frozen=True)
class PreCut:
    """What a pre-cut copied: its groups, and its keys, with which the owner finds each Gym
    entry's ``new_keys`` (:func:`new_keys`) without a lookup in the database; ``keys_json``, the
    same keys as :func:`cut_keys` answers them (a JSON array sorted by code point), which the
    owner hands to the trainer's fetch. ``key_rows``: the writing of its key rows, when the
    caller asked not to wait for it (how many were written)."""

    groups: int
    keys: frozenset[str]
    keys_json: str
    key_rows: asyncio.Future[int] | None = field(default=None, compare=False)

class _PreCutVoid(Exception):
    """No pre-cut for this snapshot (it moved on, or already has one): roll back what the
    pre-cut's transaction wrote, its copy and its emptying of the changed-groups record."""

async def pre_cut(
    engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, *, tracked_from: int | None = None, defer_key_rows: bool = False
) -> PreCut | None:
    """Copy the run's live groups into the snapshot's cut ahead of the barrier (the runner starts
    this once the gate is closed, beside Gym's prepare and commit), so that the barrier copies only
    the groups written since. Records the copy's base (``cut_base_xid``) in the same transaction.
    Returns what it copied (:class:`PreCut`), or None when the snapshot is past the point where
    a pre-cut helps (ended, cut, already pre-cut): then nothing is written.

    No lock on the run or the snapshot row is held during the copy (the runner's phase updates
    must not wait for it); the closing conditional update decides, and a snapshot that ended
    meanwhile rolls the copy back (``end`` deletes the cut rows of every snapshot it does not
    publish, after waiting for this update's row lock). That update is fenced like a phase move:
    a copy by an owner that lost the run's lease rolls back.

    Its key rows (``snapshot_cut_keys``, against which the barrier counts the keys of the groups
    it copies again) are written by a transaction of their own once it committed, opened before
    it: about a third of the pre-cut's time, which would otherwise keep Gym parked when the
    pre-cut outlasts Gym's commit. A barrier that needs them (groups to copy again, or a Gym
    entry stored without its ``new_keys``) waits for that transaction, and copies the whole run
    when they never came; the cut's keys are read from its rows until they are in (``staging_keys.KEYS``).
    ``defer_key_rows``: return once the pre-cut committed, with their writing still going
    on (``PreCut.key_rows``, which the caller must await or cancel); otherwise they are in on return.

    ``tracked_from`` is ``tracking_horizon`` read once the snapshot's tracking phase was
    committed (the runner starts the pre-cut right then; by default it is read now)."""
    if not await _writers_see_the_tracking(engine, tracked_from):
        return None
    key_rows = await sk.KeyRowsWriter.open(engine, run_id, snapshot_id)
    try:
        taken = await _pre_cut(engine, run_id, snapshot_id, fence)
    except BaseException as e:
        await key_rows.discard()
        if isinstance(e, _PreCutVoid):
            return None
        raise
    writing = key_rows.start()
    if not defer_key_rows:
        await writing
        return taken
    return replace(taken, key_rows=writing)

async def _pre_cut(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence) -> PreCut:
    p = {"r": run_id, "s": snapshot_id}
    # Few round trips: this copy runs beside Gym's commit, and when it outlasts the commit the
    # move to data_plane (Gym parked) waits for it.
    async with engine.begin() as conn:
        # Not flushed at its commit (``synchronous_commit``): the flushed commits after it (the
        # move to data_plane, which waits for this copy, and the barrier) come later in the log
        # and flush it too. A crash that loses it leaves no ``cut_base_xid``: the barrier then
        # copies the whole run and answers the whole key list, also to a trainer that fetched
        # these keys and asked for the delta. The base is this statement's xmin, taken before
        # the copy's own statement snapshot: anything the copy saw that this base does not is
        # counted as changed at the barrier, never the other way round.
        # The recorded groups are emptied here, before the copy's statement: what was recorded
        # before the copy's snapshot is in the copy; what is written after it stays recorded (the
        # snapshot is in a tracking phase) and is copied again at the barrier. A writer still
        # open on a record holds this statement back until it commits, so that the copy sees
        # its write (in the copy's own statement, the copy's snapshot would be older than it).
        st = (
            await conn.execute(
                text(
                    "WITH d AS (DELETE FROM snapshot_changed_groups WHERE run_id = :r) "
                    f"SELECT outcome, phase, cut_at, cut_base_xid, {CURRENT_XMIN_SQL} AS base, set_config('synchronous_commit', 'off', true), "
                    f"{_CUT_SETTINGS} FROM snapshots WHERE run_id = :r AND snapshot_id = :s"
                ),
                p,
            )
        ).first()
        if st is None or st.outcome is not None or st.cut_at is not None or st.cut_base_xid is not None or st.phase == P.data_plane:
            raise _PreCutVoid()  # rolls the emptying of the record back
        # Its size comes back with the copy, so that the barrier's counts need no pass over it.
        copied = (
            await conn.execute(
                text(f"WITH ins AS ({_cut_insert(only_named_groups=False)} RETURNING cardinality(siblings) AS n) "
                     "SELECT count(*) AS groups, COALESCE(sum(ins.n), 0) AS siblings FROM ins"),
                p,
            )
        ).one()
        n, sibs = int(copied.groups), int(copied.siblings)
        # Its keys, for the owner (``PreCut``); their rows come after the commit.
        inserted = (await conn.execute(text(sk.PRE_CUT_KEYS_SQL), p)).one()
        keys = int(inserted.n)
        done = (
            await conn.execute(
                text(
                    "UPDATE snapshots SET cut_base_xid = :b, counts = COALESCE(counts, '{}'::jsonb) || jsonb_build_object('cut_pre_cut_groups', CAST(:n AS bigint), "
                    "'cut_pre_cut_siblings', CAST(:sib AS bigint), 'cut_pre_cut_keys', CAST(:keys AS bigint)) "
                    "WHERE run_id = :r AND snapshot_id = :s AND outcome IS NULL "
                    f"AND cut_at IS NULL AND cut_base_xid IS NULL AND phase <> :dp AND owner = :fence_owner AND {fence_sql()} "
                    # A waiting trainer fetches the pre-cut's keys.
                    "RETURNING pg_notify(:ch, :np)"
                ),
                {**p, "b": st.base, "n": n, "sib": sibs, "keys": keys, "dp": P.data_plane.value, **fence.params(), **_notice(run_id, snapshot_id, progress=True)},
            )
        ).all()
        if len(done) != 1:
            raise _PreCutVoid()
    return PreCut(n, frozenset(json.loads(inserted.keys)), inserted.keys)

# How long the pre-cut waits for the transactions that were writing when the snapshot entered a
# tracking phase; past it no pre-cut is taken (the barrier copies the whole run).
PRE_CUT_WAIT_S = 2.0

async def tracking_horizon(engine: AsyncEngine) -> int:
    """The next transaction id: read after a snapshot's tracking phase was committed, every
    transaction below it may have written without seeing that phase."""
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT {NEXT_XID_SQL}"))).scalar())

async def _writers_see_the_tracking(engine: AsyncEngine, horizon: int | None) -> bool:
    """Wait until every transaction below ``horizon`` has ended: a statement of one of them may
    have written without seeing the tracking phase (and recorded nothing). Every later statement
    records its groups."""
    async with engine.connect() as conn:
        if horizon is None:
            horizon = (await conn.execute(text(f"SELECT {NEXT_XID_SQL}"))).scalar()
        deadline = time.monotonic() + PRE_CUT_WAIT_S
        while (await conn.execute(text(f"SELECT {CURRENT_XMIN_SQL}"))).scalar() < horizon:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
    return True
