"""The ledger cut: the run's live groups, each with its siblings' current attempts, copied into
``snapshot_cut_groups`` in one ``INSERT ... SELECT`` at the trainer's barrier (only the groups
changed since the pre-cut, when there is one), and the cut's staging keys.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.snapshot_state import (
    AttemptStatus,
    GroupStatus,
)
from ...errors import NotFound
from ...ledger.models import SNAPSHOT_GROUP_COLUMNS, SNAPSHOT_SIBLING_FIELDS
from ...ledger.notify import _notice
from ...ledger.runs import lock_run
from . import keys as sk
from .rows import (
    _COLS_NONE,
    _COLS_WITH_KEYS,
    P,
    SnapshotNotAwaiting,
    SnapshotRow,
    _j,
    _notified_row,
    _read_row,
    get,
)
from .train_steps import _NEWEST_STEP_SQL

_BARRIER_READS = frozenset(
    {"cut_base_xid", "cut_xmin", "cut_system_id", "pre_cut_groups", "pre_cut_siblings", "newest_step", "recorded", "pre_cut_keys", "unfound_keys"}
)

async def take_cut(engine: AsyncEngine, run_id: str, snapshot_id: str, *, full_keys: bool = True) -> SnapshotRow:
    """The trainer holds its data-plane barrier: copy the live ledger into the snapshot, in one
    transaction, and record the staging keys that must exist. Idempotent.

    When the runner took a pre-cut (``pre_cut``, beside Gym's prepare and commit), only the
    groups written since are copied again: those ``snapshot_changed_groups`` recorded as they
    were written; their keys are counted into the pre-cut's key rows (waiting for them, which
    are written after the pre-cut; without them the whole run is copied), and what they and the
    Gym manifest's keys added and removed is recorded (``cut_keys_added``, ``cut_keys_removed``):
    the barrier's work and its delta answer grow with what changed, not with the run. Otherwise
    the whole run is copied (one row per group, its siblings in an array; its keys are read from
    those rows).
    ``counts`` says which way it went (``cut_recopied_groups``). The run is locked FOR UPDATE: no
    report lands between the reading of the changed groups and their copy. The row answered
    carries the whole key list (``cut_staging_keys``) unless ``full_keys`` is False (a trainer
    that asked for the delta; a repeat carries it anyway)."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True)
        base = await _barrier_reads(conn, run_id, snapshot_id)
        snap = SnapshotRow(**{k: v for k, v in base.items() if k not in _BARRIER_READS})
        if snap.cut_at is not None and snap.outcome is None:
            return await get(conn, run_id, snapshot_id, columns=_COLS_WITH_KEYS)
        _require_awaiting_barrier(snap, snapshot_id, base["newest_step"])
        p = {"r": run_id, "s": snapshot_id}
        notice = _notice(run_id, snapshot_id)  # rides on the cut's update
        changed = await _groups_to_copy_again(conn, run_id, snapshot_id, base)
        if changed is not None:
            r = await _delta_cut(conn, p, notice, base, changed)
        else:
            r = await _whole_cut(conn, p, notice, base)
        row = _notified_row(r)
        if full_keys:
            row.cut_staging_keys = list((await conn.execute(text(f"SELECT {sk.KEYS} FROM snapshots WHERE run_id = :r AND snapshot_id = :s"), p)).scalar())
        return row


async def _barrier_reads(conn: AsyncConnection, run_id: str, snapshot_id: str) -> dict[str, Any]:
    """The row and all the barrier reads besides it, in one statement (after the run's lock: its
    xmin sees every report that committed before the cut). The groups recorded as changed are
    taken in the same statement (a barrier that does not go on rolls their deletion back; a
    repeat's is harmless: the cut is taken)."""
    return await _read_row(
        conn, run_id, snapshot_id,
        f"{_COLS_NONE}, cut_base_xid, {CURRENT_XMIN_SQL} AS cut_xmin, {SYSTEM_ID_SQL} AS cut_system_id, "
        "COALESCE(CAST(counts ->> 'cut_pre_cut_groups' AS bigint), 0) AS pre_cut_groups, "
        "CAST(counts ->> 'cut_pre_cut_siblings' AS bigint) AS pre_cut_siblings, "
        f"({_NEWEST_STEP_SQL}) AS newest_step, (SELECT COALESCE(array_agg(d.group_id), '{{}}') FROM d) AS recorded, "
        "CAST(counts ->> 'cut_pre_cut_keys' AS bigint) AS pre_cut_keys, (gym_manifest IS NOT NULL OR EXISTS (SELECT 1 FROM snapshot_gym_entries ge "
        "WHERE ge.run_id = :r AND ge.snapshot_id = :s AND ge.new_keys IS NULL)) AS unfound_keys",
        " FOR UPDATE OF snapshots",
        with_="WITH d AS (DELETE FROM snapshot_changed_groups WHERE run_id = :r RETURNING group_id) ",
    )


def _require_awaiting_barrier(snap: SnapshotRow, snapshot_id: str, newest: int | None) -> None:
    """Refuse a cut of a snapshot that is not waiting for the barrier (or is being aborted)."""
    if snap.outcome is not None or snap.phase != P.data_plane:
        raise SnapshotNotAwaiting(
            f"snapshot {snapshot_id!r} is in phase {snap.phase}" + (f" ({snap.outcome}: {snap.reason})" if snap.outcome else "") + "; not awaiting the barrier",
            phase=snap.phase, outcome=snap.outcome, reason=snap.reason,
        )
    if snap.abort_requested is not None:
        raise SnapshotNotAwaiting(f"snapshot {snapshot_id!r} is being aborted ({snap.abort_requested})", phase=snap.phase, reason=snap.abort_requested)
    if newest is not None and newest > snap.anchor_step and not snap.stop:
        # Train step wins: it was announced before this cut (not over a stopping snapshot:
        # the trainer is stopping). The announce itself asked the owner to abort.
        raise SnapshotNotAwaiting(f"train step {newest} committed after anchor {snap.anchor_step}; snapshot aborted", phase=snap.phase, reason="train_step_committed")


async def _groups_to_copy_again(conn: AsyncConnection, run_id: str, snapshot_id: str, base: dict[str, Any]) -> list[str] | None:
    """The groups written since the pre-cut, or None when the whole run is copied."""
    changed: list[str] | None = None
    recorded = list(base["recorded"])
    if base["cut_base_xid"] is not None and base["pre_cut_groups"] > 0 and base["pre_cut_siblings"] is not None:
        changed = recorded
        if len(changed) * _DELTA_MAX_SHARE > base["pre_cut_groups"]:
            changed = None  # deleting and re-copying most groups costs more than one whole copy
    if changed is not None and (changed or base["unfound_keys"]) and not await sk.key_rows_in(conn, run_id, snapshot_id, base["pre_cut_keys"]):
        # Their keys are counted against the pre-cut's key rows, which never came in.
        changed = None
    return changed


async def _delta_cut(conn: AsyncConnection, p: dict[str, Any], notice: dict[str, Any], base: dict[str, Any], changed: list[str]) -> Any:
    """The barrier after a pre-cut: the changed groups copied again, their keys counted in."""
    old_keys: list[str] = []
    new_keys: list[str] = []
    groups, siblings = base["pre_cut_groups"], base["pre_cut_siblings"]
    if changed:
        for keys, n in await conn.execute(
            text(
                "DELETE FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = :s AND group_id = ANY(CAST(:g AS text[])) "
                "RETURNING staging_keys, cardinality(siblings)"
            ),
            {**p, "g": changed},
        ):
            old_keys.extend(keys or ())
            groups, siblings = groups - 1, siblings - (n or 0)
        if len(changed) > _DELTA_HASH_FROM:
            await _cut_settings(conn)
        for keys, n in await conn.execute(text(_cut_insert(only_named_groups=True) + " RETURNING staging_keys, cardinality(siblings)"), {**p, "g": changed}):
            new_keys.extend(keys or ())
            groups, siblings = groups + 1, siblings + (n or 0)
    extra = {"cut_pre_cut_groups": base["pre_cut_groups"], "cut_recopied_groups": len(changed)}
    return (
        await conn.execute(
            text(_DELTA_CUT_SQL),
            {**p, **notice, "old": old_keys, "new": new_keys, "extra": _j(extra), "cx": base["cut_xmin"], "cs": base["cut_system_id"], "g": groups, "n": siblings},
        )
    ).one()


async def _whole_cut(conn: AsyncConnection, p: dict[str, Any], notice: dict[str, Any], base: dict[str, Any]) -> Any:
    """No pre-cut, or one that most groups changed since: copy everything. A pre-cut's key rows
    stay until the end: a whole-run cut's keys are read from its rows."""
    extra: dict[str, Any] = {}
    await delete_cut_rows(conn, p["r"], [p["s"]])
    if base["pre_cut_groups"]:
        extra = {"cut_pre_cut_groups": base["pre_cut_groups"]}
    await _cut_settings(conn)
    # No key rows: its keys are read from its cut rows (``staging_keys.KEYS``).
    await conn.execute(text(_cut_insert(only_named_groups=False)), p)
    return (await conn.execute(text(_FINISH_CUT_SQL), {**p, **notice, "extra": _j(extra), "cx": base["cut_xmin"], "cs": base["cut_system_id"]})).one()


async def cut_keys(engine: AsyncEngine, run_id: str, snapshot_id: str, *, pre_cut_keys: str | None = None) -> tuple[str, str]:
    """The keys the trainer may fetch ahead of the barrier, as a JSON array (text, sorted by code
    point): ``("pre_cut", keys)`` once a pre-cut was taken and until the barrier, ``("cut", keys)``
    after it, ``("none", "[]")`` before either. A trainer that holds the pre-cut's keys asks the
    barrier for its delta only. One statement, so the state and the keys are of the same moment;
    PostgreSQL writes the JSON, which spares this process parsing and encoding a few hundred
    thousand keys while Gym commits.

    ``pre_cut_keys``: the snapshot's pre-cut keys as :func:`pre_cut` answered them (its owner
    holds them, ``PreCut.keys_json``); answered in the pre-cut state instead of aggregating the
    cut rows' keys again (a snapshot takes one pre-cut, and nothing else writes its cut rows
    before the barrier). The trainer's fetch may still be running when Gym's commit ends, and
    the barrier waits for it."""
    async with engine.connect() as conn:
        st = (
            await conn.execute(
                text(
                    "SELECT x.cut, x.pre_cut, CASE WHEN x.cut THEN CAST(array_to_json(x.keys) AS text) WHEN x.pre_cut AND NOT :known THEN "
                    f"({sk.PRE_CUT_KEYS_JSON}) END AS keys FROM ("
                    "SELECT cut_at IS NOT NULL AS cut, counts ->> 'cut_pre_cut_keys' IS NOT NULL AND cut_base_xid IS NOT NULL AS pre_cut, "
                    f"{sk.KEYS} AS keys FROM snapshots WHERE run_id = :r AND snapshot_id = :s) x"
                ),
                {"r": run_id, "s": snapshot_id, "known": pre_cut_keys is not None},
            )
        ).first()
    if st is None:
        raise NotFound(f"snapshot {snapshot_id!r} not found in run {run_id!r}", code="snapshot_not_found")
    if st.cut:
        return "cut", st.keys or "[]"
    if not st.pre_cut:
        return "none", "[]"
    return "pre_cut", st.keys if pre_cut_keys is None else pre_cut_keys

_GROUP_COLS = ", ".join(SNAPSHOT_GROUP_COLUMNS)

def _sibling(row_attempts: str = "a") -> str:
    """One sibling of a cut row, from ``a`` (its attempt's columns) and ``row_attempts`` (the
    alias holding ``row_attempts_used``)."""
    return "CAST(ROW(" + ", ".join(f"{row_attempts if name == 'row_attempts_used' else 'a'}.{name}" for name, _ in SNAPSHOT_SIBLING_FIELDS) + ") AS snapshot_sibling)"

_LIVE = f"('{GroupStatus.generating}', '{GroupStatus.ready}')"

# The cut: one row per live group into ``snapshot_cut_groups``, its siblings (each with its
# current attempt) aggregated into one array, and the staging keys of its sealed and returned
# siblings into another (the barrier's answer is their union with the Gym manifest's keys).
# The siblings are aggregated per group before the group's own columns join them, so that the
# join and the aggregate carry one narrow row per sibling, not the group's columns with each.
# The inner join with the live groups keeps the aggregate to them: a run's finalized groups stay
# in the ledger as history.
def _cut_insert(*, only_named_groups: bool) -> str:
    named_g = " AND g.group_id = ANY(CAST(:g AS text[]))" if only_named_groups else ""
    named_a = " AND a.group_id = ANY(CAST(:g AS text[]))" if only_named_groups else ""
    return (
        f"INSERT INTO snapshot_cut_groups (run_id, snapshot_id, {_GROUP_COLS}, siblings, staging_keys) "
        f"SELECT g.run_id, :s, {', '.join('g.' + c for c in SNAPSHOT_GROUP_COLUMNS)}, COALESCE(x.siblings, '{{}}'), x.keys "
        f"FROM prompt_groups g LEFT JOIN (SELECT a.group_id, array_agg({_sibling('s')}) AS siblings, "
        f"ckptc_text_cat(a.staging_keys) FILTER (WHERE a.status IN ('{AttemptStatus.sealed}', '{AttemptStatus.returned}')) AS keys "
        "FROM attempts a JOIN siblings s ON s.run_id = a.run_id AND s.group_id = a.group_id AND s.generation_index = a.generation_index "
        f"JOIN prompt_groups lg ON lg.run_id = a.run_id AND lg.group_id = a.group_id AND lg.status IN {_LIVE} "
        f"WHERE a.run_id = :r AND a.is_current{named_a} GROUP BY a.group_id) x ON x.group_id = g.group_id "
        f"WHERE g.run_id = :r AND g.status IN {_LIVE}{named_g}"
    )

# Hash joins and a hash aggregate for a whole-run copy, with room for them (the aggregate holds the
# whole cut). With statistics the planner otherwise sorts every joined row by group id (a
# linguistic sort) for a merge join and a group aggregate, or plans a nested loop of one index
# probe per sibling; both were slower. Transaction-local
# settings as a select list, so that they ride on a statement the caller sends anyway.
_CUT_SETTINGS = "set_config('enable_nestloop', 'off', true), set_config('enable_sort', 'off', true), set_config('work_mem', '128MB', true)"

async def _cut_settings(conn: AsyncConnection) -> None:
    """The whole-run copy's plan settings (``_CUT_SETTINGS``) for the rest of the transaction."""
    await conn.execute(text(f"SELECT {_CUT_SETTINGS}"))

# Above this many groups to copy again at the barrier, the whole-run plan settings are used.
_DELTA_HASH_FROM = 2000

# When more than 1/this of the pre-cut's groups changed, the barrier copies the whole run instead.
_DELTA_MAX_SHARE = 3

# A recorded xmin (a pre-cut's base, a cut's ``cut_xmin``) is trusted while the xid counter moved
# less than this since (32-bit xids compare correctly within 2**31 of each other).
_DELTA_MAX_XIDS = 1_000_000_000

# The 64-bit xmin of the statement's snapshot: every transaction with an older xid had ended when
# the snapshot was taken. Rows compare with it through ``age(xmin) <= age(CAST(:x32 AS xid))``
# (a newer or equal xid has the smaller age), ``:x32`` being the value modulo 2**32 as text.
CURRENT_XMIN_SQL = "CAST(CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS bigint)"

# The 64-bit xid the next transaction gets (the snapshot's xmax), which ``xid_base_usable`` measures against.
NEXT_XID_SQL = "CAST(CAST(pg_snapshot_xmax(pg_current_snapshot()) AS text) AS bigint)"

# The cluster those xids count in (text: an unsigned 64-bit number).
SYSTEM_ID_SQL = "(SELECT CAST(system_identifier AS text) FROM pg_control_system())"

async def cut_xid_basis(conn: AsyncConnection) -> tuple[int, str]:
    """``(cut_xmin, cut_system_id)`` for a cut about to be copied in this transaction: read
    *before* the copy, so every transaction older than that xmin had committed when the copy's
    statements took their snapshots. ``take_cut`` reads it once it holds the run lock; writers of
    a cut by other means (benchmarks, tests) call this, then ``set_cut_xid_basis``. An imported
    cut has none: it did not come from this ledger."""
    r = (await conn.execute(text(f"SELECT {CURRENT_XMIN_SQL}, {SYSTEM_ID_SQL}"))).one()
    return int(r[0]), str(r[1])

async def set_cut_xid_basis(conn: AsyncConnection, run_id: str, snapshot_id: str, basis: tuple[int, str]) -> None:
    await conn.execute(
        text("UPDATE snapshots SET cut_xmin = :x, cut_system_id = :c WHERE run_id = :r AND snapshot_id = :s"),
        {"r": run_id, "s": snapshot_id, "x": basis[0], "c": basis[1]},
    )

def xid_base_usable(base_xid: int | None, next_xid: int) -> bool:
    """Whether rows can still be compared with ``base_xid`` by ``age()``: recorded, a normal xid
    (not 0-2), and less than ``_DELTA_MAX_XIDS`` behind ``next_xid`` (the current snapshot's xmax)."""
    return base_xid is not None and base_xid % 2**32 >= 3 and 0 <= next_xid - base_xid < _DELTA_MAX_XIDS

# The barrier after a pre-cut, one statement: the keys of the groups copied again (``:new``)
# counted in, those of their pre-cut copies (``:old``) counted out (a key whose count reaches
# zero goes); what that and the Gym manifest's keys added to and removed from the pre-cut's keys,
# sorted by code point, is recorded with the cut. Only the changed keys are touched and the
# manifest's looked up (index lookups), never the whole cut. New key rows are plain inserts, not
# an upsert: the run's lock, and the wait for the pre-cut's own writer of them
# (``staging_keys.key_rows_in``), keep every other writer out.
_DELTA_CUT_SQL = (
    "WITH chg AS (SELECT x.k, sum(x.n) AS n FROM ("
    " SELECT k, 1 AS n FROM unnest(CAST(:new AS text[])) AS k"
    " UNION ALL SELECT k, -1 FROM unnest(CAST(:old AS text[])) AS k) x GROUP BY x.k HAVING sum(x.n) <> 0), "
    # Each changed key is probed in the key index (a scalar subquery, and ``= ANY`` of the keys
    # to update or delete): the pre-cut inserted the key rows moments ago and their statistics do
    # not show them, so a join let the planner walk every key row of the cut, once per part.
    "prev AS (SELECT chg.k COLLATE \"C\" AS k, chg.n, COALESCE((SELECT ck.refs FROM snapshot_cut_keys ck "
    " WHERE ck.run_id = :r AND ck.snapshot_id = :s AND ck.key = chg.k COLLATE \"C\"), 0) AS before FROM chg), "
    "up AS (INSERT INTO snapshot_cut_keys (run_id, snapshot_id, key, refs) SELECT :r, :s, k, n FROM prev WHERE before = 0 AND n > 0 ORDER BY k), "
    "upd AS (UPDATE snapshot_cut_keys ck SET refs = p.before + p.n FROM prev p WHERE ck.run_id = :r AND ck.snapshot_id = :s "
    " AND ck.key = ANY(ARRAY(SELECT k FROM prev WHERE before > 0 AND before + n > 0)) AND ck.key = p.k), "
    "gone AS (DELETE FROM snapshot_cut_keys ck WHERE ck.run_id = :r AND ck.snapshot_id = :s "
    " AND ck.key = ANY(ARRAY(SELECT k FROM prev WHERE before > 0 AND before + n <= 0))), "
    # Every statement part reads the key rows as they were before it: the pre-cut's.
    "added AS (SELECT COALESCE(array_agg(a.k ORDER BY a.k), '{}') AS ks FROM (SELECT k FROM prev WHERE before <= 0 AND before + n > 0 "
    f" UNION SELECT k FROM ({sk.MANIFEST_NEW_KEYS}) mn) a), "
    "removed AS (SELECT COALESCE(array_agg(d.k ORDER BY d.k), '{}') AS ks FROM prev d "
    f" WHERE d.before > 0 AND d.before + d.n <= 0 AND NOT EXISTS (SELECT 1 FROM ({sk.MANIFEST_KEYS}) man WHERE man.k COLLATE \"C\" = d.k)), "
    "tot AS (SELECT CAST(:g AS bigint) AS g, CAST(:n AS bigint) AS n), "
    "done AS (UPDATE snapshots SET cut_at = now(), cut_xmin = :cx, cut_system_id = :cs, "
    " cut_keys_added = (SELECT ks FROM added), cut_keys_removed = (SELECT ks FROM removed), "
    " counts = COALESCE(counts, '{}'::jsonb) || jsonb_build_object('cut_groups', (SELECT g FROM tot), "
    " 'cut_siblings', (SELECT n FROM tot)) || CAST(:extra AS jsonb) "
    f"WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS_NONE}, cut_keys_added, cut_keys_removed) "
    "SELECT done.*, pg_notify(:ch, :np) AS notified FROM done"
)

_TOT_COUNTED = (
    "(SELECT count(*) AS g, COALESCE(sum(cardinality(siblings)), 0) AS n FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = :s)"
)

# The snapshot row at a whole-run barrier: cut, and its counts.
_FINISH_CUT_SQL = (
    f"WITH tot AS {_TOT_COUNTED}, "
    "done AS (UPDATE snapshots SET cut_at = now(), cut_xmin = :cx, cut_system_id = :cs, cut_keys_added = NULL, cut_keys_removed = NULL, "
    " counts = COALESCE(counts, '{}'::jsonb) || jsonb_build_object('cut_groups', (SELECT g FROM tot), "
    " 'cut_siblings', (SELECT n FROM tot)) || CAST(:extra AS jsonb) "
    f"WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS_NONE}, cut_keys_added, cut_keys_removed) "
    "SELECT done.*, pg_notify(:ch, :np) AS notified FROM done"
)

async def insert_cut_rows(conn: AsyncConnection, run_id: str, snapshot_id: str, groups_sql: str, attempts_sql: str, params: dict[str, Any]) -> int:
    """Write a cut from two row sources, in the caller's transaction: ``groups_sql`` yields the
    columns of the ``snapshot_groups`` view after run_id and snapshot_id (``group_id``,
    ``prompt_ref``, ...), ``attempts_sql`` those of ``snapshot_attempts`` (``attempt_id``,
    ``group_id``, ``generation_index``, ...; any extra columns are ignored). Both are SQL with
    ``:name`` parameters from ``params``; ``:r`` and ``:s`` are the run and the snapshot. The
    cut tables are views: this is the way to write one outside the cut itself (the import
    writer, benchmarks, tests). Returns the number of groups written."""
    return (
        await conn.execute(
            text(
                f"INSERT INTO snapshot_cut_groups (run_id, snapshot_id, {_GROUP_COLS}, siblings) "
                f"SELECT :r, :s, {', '.join('g.' + c for c in SNAPSHOT_GROUP_COLUMNS)}, COALESCE(x.siblings, '{{}}') "
                f"FROM ({groups_sql}) AS g LEFT JOIN (SELECT a.group_id, array_agg({_sibling()}) AS siblings FROM ({attempts_sql}) AS a "
                "GROUP BY a.group_id) AS x ON x.group_id = g.group_id"
            ),
            {**params, "r": run_id, "s": snapshot_id},
        )
    ).rowcount

async def delete_cut_rows(conn: AsyncConnection, run_id: str, snapshot_ids: list[str]) -> None:
    """Delete the cut of these snapshots, in the caller's transaction (the one deleting the rows).
    Their key rows go at the snapshot's end (:func:`end`, for the whole run)."""
    if snapshot_ids:
        await conn.execute(text("DELETE FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = ANY(:ids)"), {"r": run_id, "ids": snapshot_ids})
