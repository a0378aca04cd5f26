"""Steps 0 to 5 of a rewind (:func:`rewind.apply_restore`): check that the cut is still there,
compare the live ledger with it (only the rows written since the cut when ``cut_xmin`` allows),
retire what may still run in Gym, and take out what came after the cut. Set-based, as the
rest of the rewind."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ...domain.levels import RestoreLevel
from ...domain.restore_plan import RetireItem
from ...domain.vocabulary import (
    RETIRE_CHECKPOINT_ID,
    OutboxOp,
    RestoreRecordState,
)
from ...domain.vocabulary import AttemptStatus as A
from ...domain.vocabulary import GroupStatus as G
from ...domain.vocabulary import RetirementState as R
from ...domain.vocabulary import WorkReason
from ...errors import Conflict
from ...ledger.db import execute as execute_binary
from ...ledger.db import fetch
from ...outbox import store as outbox
from ...snapshots.store import NEXT_XID_SQL, SYSTEM_ID_SQL, xid_base_usable
from .rewind_state import AfterCut, Rewinding, SinceCut

# The time of the snapshot's cut (parameters ``:r`` and ``:s``; ``CUT_TIME_BINARY``: the same
# for statements sent through the driver, ``%(r)s`` and ``%(s)s``).
CUT_TIME = "(SELECT COALESCE(cut_at, published_at, created_at) FROM snapshots WHERE run_id = :r AND snapshot_id = :s)"
CUT_TIME_BINARY = CUT_TIME.replace(":r", "%(r)s").replace(":s", "%(s)s")

# A live group absent from the cut because it had ended before the cut (the cut holds live
# groups only): kept as history. Any other group absent from the cut was admitted after it.
_ENDED_BY_CUT_TIME = (
    f"g.status IN ('{G.finalized}', '{G.abandoned}') AND g.ended_at IS NOT NULL AND g.ended_at <= {CUT_TIME}"
)
_ENDED_BEFORE_CUT = (
    f"{_ENDED_BY_CUT_TIME} AND NOT EXISTS (SELECT 1 FROM snapshot_groups sg "
    "WHERE sg.run_id = :r AND sg.snapshot_id = :s AND sg.group_id = g.group_id)"
)

#: The live groups admitted after the cut: the rewind removes them (step 4), and its accounting
#: (``rewind_work``) and a plan preview list them first (parameters ``:r`` and ``:s``).
LATER_GROUPS_SQL = (
    "SELECT g.group_id FROM prompt_groups g WHERE g.run_id = :r AND NOT EXISTS (SELECT 1 FROM snapshot_groups sg "
    f"WHERE sg.run_id = :r AND sg.snapshot_id = :s AND sg.group_id = g.group_id) AND NOT ({_ENDED_BEFORE_CUT})"
)

_DIFF_COLS = "a.attempt_id, a.group_id, a.generation_index, a.rollout_id, a.gym_attempt, a.gym_instance_id, a.status, a.gym_owned, a.retirement"


def _restore_diff_sql(live: str, cut_groups: str = "") -> str:
    """``restore_diff``: the live attempts ``a`` read from ``live`` (a run's attempts, or those
    _restore_diff_since_cut kept) joined with their cut rows ``c`` by attempt id (``cut_groups``:
    an extra filter naming the cut groups to read). An attempt is kept when the cut does not know
    it and it may be current or still run in Gym, or when the cut knew it as never sent and it
    left ``reserved`` since."""
    return (
        f"CREATE TEMP TABLE restore_diff ON COMMIT DROP AS SELECT {_DIFF_COLS}, c.attempt_id IS NOT NULL AS known, "
        f"c.group_attempt AS cut_group_attempt FROM {live} LEFT JOIN (SELECT attempt_id, group_attempt, "
        f"status = '{A.reserved}' AND gym_attempt = 0 AS unsent FROM snapshot_attempts "
        f"WHERE run_id = %(r)s AND snapshot_id = %(s)s{cut_groups}) c ON c.attempt_id = a.attempt_id "
        f"WHERE CASE WHEN c.attempt_id IS NULL THEN a.is_current OR a.status IN ('{A.reserved}', '{A.dispatched}', '{A.returned}') "
        f"ELSE c.unsent AND a.status <> '{A.reserved}' END"
    )


async def _restore_diff_since_cut(conn: AsyncConnection, run_id: str, snapshot_id: str, cut_xmin: int) -> SinceCut:
    """``restore_diff`` without comparing a million unchanged rows with the cut.

    A row version whose xmin is older than the cut's ``cut_xmin`` was committed before the
    barrier read anything (``cut_xmin`` is taken before its first copy; any transaction still
    running then, or started later, has a newer xid), and nothing wrote the row since: the
    barrier's copy saw this version, and a group it took from the pre-cut had no row newer than
    the pre-cut's base (``_CHANGED_GROUPS_SQL``), so the cut holds it as it is. So such a row is
    known to the cut exactly when it is current and its group is in the cut, and then it cannot
    have left ``reserved`` since. Of the old rows only those the cut does not know are kept: not
    current but in flight, or current in a live group the cut lacks (one that had ended before
    the cut is history, which step 2 drops anyway, so the few others are listed first and no row
    is probed against every group id of the cut). Rows written at or after ``cut_xmin`` (after
    the cut, or by a transaction still running when the barrier locked the run, which errs on
    the safe side) are compared with the cut rows of their groups, read by the cut's primary
    key. The result equals the full comparison (``tests/integration/test_restore_rewind.py``)."""
    p = {"r": run_id, "s": snapshot_id, "cx": str(cut_xmin % 2**32)}
    # One hash join of the run's groups with the cut's keys (as aggregate filters, NOT EXISTS
    # subqueries would run once per group): _ENDED_BEFORE_CUT for a group the cut lacks.
    absent, recent_groups = (
        await conn.execute(
            text(
                f"SELECT COALESCE(array_agg(g.group_id) FILTER (WHERE cg.group_id IS NULL AND NOT ({_ENDED_BY_CUT_TIME})), '{{}}'), "
                "COALESCE(array_agg(g.group_id) FILTER (WHERE age(g.xmin) <= age(CAST(:cx AS xid))), '{}') "
                "FROM prompt_groups g LEFT JOIN snapshot_cut_groups cg ON cg.run_id = :r AND cg.snapshot_id = :s "
                "AND cg.group_id = g.group_id WHERE g.run_id = :r"
            ),
            p,
        )
    ).one()
    await execute_binary(
        conn,
        "CREATE TEMP TABLE restore_since_cut ON COMMIT DROP AS SELECT "
        f"{_DIFF_COLS}, a.is_current, age(a.xmin) <= age(CAST(%(cx)s AS xid)) AS recent FROM attempts a "
        "WHERE a.run_id = %(r)s AND (age(a.xmin) <= age(CAST(%(cx)s AS xid)) "
        f"OR NOT a.is_current AND a.status IN ('{A.reserved}', '{A.dispatched}', '{A.returned}') "
        "OR a.is_current AND a.group_id = ANY(%(absent)s::text[]))",
        {**p, "absent": absent},
    )
    groups = (await conn.execute(text("SELECT array_agg(DISTINCT group_id) FROM restore_since_cut WHERE recent"))).scalar() or []
    # The cut rows of the recent rows' groups only (the view's group filter is the cut's primary
    # key). An old row kept above is never among them: the cut holds current attempts, and an old
    # row is either not current or of a group the cut lacks.
    await execute_binary(
        conn,
        _restore_diff_sql("restore_since_cut a", " AND group_id = ANY(%(g)s::text[])"),
        {"r": run_id, "s": snapshot_id, "g": groups},
    )
    return SinceCut(absent=list(absent), recent_groups=list(recent_groups))



async def check_cut(c: Rewinding) -> None:
    """0. The cut is still there (and stays), and whether every row must be compared."""
    # A snapshot's tables are often only moments old when a restore reads them, before any
    # ANALYZE: the planner then takes a million-row join for a one-row one and picks a nested
    # loop, quadratic. Every join here is a bulk join, for which hash and merge joins (linear)
    # are right whatever the estimates say; give them room to stay in memory.
    await c.conn.execute(text("SET LOCAL enable_nestloop = off"))
    await c.conn.execute(text("SET LOCAL work_mem = '128MB'"))
    # The cut must still be there (retention may delete old snapshots) and stay for the whole
    # transaction: rewinding to a vanished cut would empty the ledger.
    c.still = (
        await c.conn.execute(
            text(
                "SELECT outcome, cut_xmin, cut_system_id = "
                f"{SYSTEM_ID_SQL} AS same_cluster, {NEXT_XID_SQL} AS next_xid "
                "FROM snapshots WHERE run_id = :r AND snapshot_id = :s FOR SHARE"
            ),
            c.p,
        )
    ).first()
    if c.still is None or c.still.outcome != "published":
        raise Conflict(
            f"snapshot {c.s!r} is no longer a published snapshot of run {c.r!r} (removed by retention?); restore another one",
            code="snapshot_gone",
            snapshot_id=c.s,
        )
    c.everything = c.compare_every_row or bool(
        (
            await c.conn.execute(
                text(
                    f"SELECT EXISTS (SELECT 1 FROM restores x, snapshots sn WHERE x.run_id = :r AND x.state = '{RestoreRecordState.applied}' "
                    "AND sn.run_id = :r AND sn.snapshot_id = :s AND x.ended_at >= COALESCE(sn.cut_at, sn.published_at, sn.created_at))"
                ),
                c.p,
            )
        ).scalar()
    )


async def diff_with_cut(c: Rewinding) -> None:
    # 1-2. One pass over the run's attempts against the cut (a hash join on attempt ids; an
    #      attempt's group, sibling and rollout id never change, so the live row stands for the
    #      cut's): never-sent cut rows that reached Gym after the cut (``known``), and live
    #      attempts the cut does not know (admitted or replaced after it).
    c.since = None
    if not c.compare_every_row and c.still.same_cluster and xid_base_usable(c.still.cut_xmin, c.still.next_xid):
        c.report.diff_by_xmin = True
        c.since = await _restore_diff_since_cut(c.conn, c.r, c.s, c.still.cut_xmin)
    else:
        await execute_binary(c.conn, _restore_diff_sql("(SELECT * FROM attempts WHERE run_id = %(r)s) a"), c.p)


async def after_cut_rows(c: Rewinding) -> None:
    # 1. Rows sent under their old identity whose attempt reached Gym after the cut.
    rows = (
        await c.conn.execute(
            text(
                "SELECT d.attempt_id, d.group_id, d.generation_index, d.rollout_id, d.cut_group_attempt AS group_attempt, "
                "g.restore_level, d.status AS live_status, d.gym_instance_id AS live_instance, d.gym_attempt AS live_gym_attempt, "
                "d.retirement FROM restore_diff d JOIN snapshot_groups g ON g.run_id = :r AND g.snapshot_id = :s "
                f"AND g.group_id = d.group_id WHERE d.known AND g.status IN ('{G.generating}', '{G.ready}') AND NOT (d.group_id = ANY(:bumped)) "
                "ORDER BY d.attempt_id"
            ),
            {**c.p, "bumped": sorted(c.bumped)},
        )
    ).all()
    cohort_groups: set[str] = set()
    c.touched = set()
    for x in rows:
        c.touched.add(x.group_id)
        if x.live_status == "dispatched" and x.retirement == "none":
            c.retire.append(RetireItem(x.live_instance, x.rollout_id, x.live_gym_attempt, x.attempt_id))
        if x.restore_level == RestoreLevel.prompt_group:
            cohort_groups.add(x.group_id)
            continue
        new = c.minter(x.group_id, x.generation_index)
        disp = "restarted" if x.restore_level == RestoreLevel.turn else "rerun"
        c.rw.add_new(x.attempt_id, x.group_id, x.generation_index, new, x.group_attempt, disp)
        c.report.after_cut.append(AfterCut(x.attempt_id, x.group_id, x.generation_index, disp, new, x.rollout_id, x.group_attempt))
    if cohort_groups:
        # Part of a never-sent cohort went out after the cut: the whole cohort reruns at
        # group_attempt + 1, so a cohort verifier never mixes it with what Gym saw.
        members = (
            await c.conn.execute(
                text(
                    "SELECT attempt_id, group_id, generation_index, rollout_id, group_attempt FROM snapshot_attempts "
                    "WHERE run_id = :r AND snapshot_id = :s AND group_id = ANY(:g) ORDER BY group_id, generation_index"
                ),
                {**c.p, "g": sorted(cohort_groups)},
            )
        ).all()
        for x in members:
            new = c.minter(x.group_id, x.generation_index)
            c.rw.add_new(x.attempt_id, x.group_id, x.generation_index, new, x.group_attempt + 1, "rerun")
            c.report.after_cut.append(AfterCut(x.attempt_id, x.group_id, x.generation_index, "rerun", new, x.rollout_id, x.group_attempt + 1))
        c.bumped |= cohort_groups
        c.report.bumped_after_cut = sorted(cohort_groups)


async def unknown_attempts(c: Rewinding) -> None:
    # 2. Live attempts the cut does not know (admitted or replaced after it), except the
    #    history of groups that had ended before the cut (see step 4).
    await c.conn.execute(
        text(
            "CREATE TEMP TABLE restore_unknown ON COMMIT DROP AS SELECT attempt_id, group_id, rollout_id, gym_attempt, "
            "gym_instance_id, status, gym_owned, retirement FROM restore_diff WHERE NOT known"
        )
    )
    await c.conn.execute(
        text(f"DELETE FROM restore_unknown u USING prompt_groups g WHERE g.run_id = :r AND g.group_id = u.group_id AND {_ENDED_BEFORE_CUT}"),
        c.p,
    )
    await c.conn.execute(text("ANALYZE restore_unknown"))
    c.touched.update((await c.conn.execute(text("SELECT DISTINCT group_id FROM restore_unknown"))).scalars())
    # ... any of them that may still run in Gym is retired first (and the plan's retires).
    c.report.retires_queued = await _queue_retires(c.conn, c.r, c.retire, registered_only=c.rw.into_other_topology)


async def supersede_continued(c: Rewinding) -> None:
    # 3. Continued rollouts keep their id: an old retire (or the forget that follows it) queued
    #    for them must not reach Gym after the restore installed their continuation.
    c.report.outbox_superseded = await outbox.supersede_pending(c.conn, c.r, c.rw.continued_rollouts)


async def remove_later_groups(c: Rewinding) -> None:
    # 4. Groups the cut does not know leave the ledger (siblings and attempts cascade): they were
    #    admitted after it, and ``rewind_work`` listed and recorded them (``c.removed``). Groups
    #    that had ended (finalized, abandoned) before the cut are not in it either; they stay, as
    #    history.
    c.report.groups_removed = await execute_binary(
        c.conn, "DELETE FROM prompt_groups WHERE run_id = %(r)s AND group_id = ANY(%(g)s::text[])", {"r": c.r, "g": c.removed}
    ) if c.removed else 0


async def end_unknown_attempts(c: Rewinding) -> None:
    # 5. The unknown attempts of the remaining groups end (kept as history, no longer current).
    c.report.attempts_ended = (
        await c.conn.execute(
            text(
                "UPDATE attempts a SET is_current = false, "
                f"status = CASE WHEN a.status IN ('{A.reserved}', '{A.dispatched}', '{A.returned}') THEN '{A.abandoned}' ELSE a.status END, "
                # Their work is redone because of the restore (docs/accounting.md#rollout-seconds),
                # unless it had been thrown away already.
                f"end_reason = CASE WHEN a.status IN ('{A.reserved}', '{A.dispatched}', '{A.returned}', '{A.sealed}') "
                f"THEN '{WorkReason.retired_by_restore}' ELSE a.end_reason END, "
                "ended_at = COALESCE(a.ended_at, now()) FROM restore_unknown u WHERE a.attempt_id = u.attempt_id"
            ),
        )
    ).rowcount


async def _queue_retires(conn: AsyncConnection, run_id: str, extra: Sequence[RetireItem], *, registered_only: bool = False) -> int:
    """Retire items for the unknown live attempts that may still run in Gym (``restore_unknown``)
    and for ``extra``; an attempt that ran on no known instance is retired on every instance. A
    retire already queued for the same rollout (at this attempt or later) is not queued again.
    Only attempts that stay in the ledger (the unknown ones) record ``retire_pending``; the
    others are the cut's, which the rewind deletes (replaced) or resets."""
    # Through the driver with binary arrays: ``extra`` is every row the cut knows as running when
    # Gym keeps running (a large share of the cut), which as text parameters psycopg escapes
    # element by element in Python.
    # Into another topology (an instance map) the saved instances are gone: a retire for one that
    # is no longer registered would wait for it forever.
    only = " WHERE instance_id IN (SELECT instance_id FROM gym_instances WHERE run_id = %(r)s)" if registered_only else ""
    ins = outbox.insert_items_sql(
        f"SELECT %(r)s, instance_id, '{OutboxOp.retire}', rollout_id, gym_attempt, attempt_id, '{RETIRE_CHECKPOINT_ID}' FROM items" + only, skip_if_pending=True
    )
    ((queued,),) = await fetch(
        conn,
        (
            "WITH items AS ("
            "SELECT u.attempt_id, u.rollout_id, u.gym_attempt, COALESCE(u.gym_instance_id, gi.instance_id) AS instance_id "
            "FROM restore_unknown u LEFT JOIN gym_instances gi ON u.gym_instance_id IS NULL AND gi.run_id = %(r)s "
            f"WHERE u.retirement = '{R.none}' AND (u.status = '{A.dispatched}' OR (u.status = '{A.reserved}' AND u.gym_owned AND u.gym_instance_id IS NOT NULL)) "
            "UNION ALL "
            "SELECT x.aid, x.ro, x.ga, COALESCE(x.inst, gi.instance_id) FROM unnest(%(aid)s::bigint[], %(ro)s::text[], "
            "%(ga)s::int[], %(inst)s::text[]) AS x(aid, ro, ga, inst) "
            "LEFT JOIN gym_instances gi ON x.inst IS NULL AND gi.run_id = %(r)s"
            f"), ins AS ({ins}"
            "), upd AS ("
            f"UPDATE attempts a SET retirement = '{R.retire_pending}' FROM (SELECT DISTINCT i.attempt_id FROM ins i "
            "JOIN restore_unknown u ON u.attempt_id = i.attempt_id) i "
            f"WHERE a.attempt_id = i.attempt_id AND a.run_id = %(r)s AND a.retirement = '{R.none}' RETURNING 1"
            ") SELECT count(*) FROM ins"
        ),
        {
            "r": run_id,
            "aid": [int(x.attempt_id) for x in extra],
            "ro": [x.rollout_id for x in extra],
            "ga": [x.gym_attempt for x in extra],
            "inst": [x.instance_id for x in extra],
        },
    )
    return int(queued or 0)
