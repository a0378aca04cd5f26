"""What a rewind throws away and what it keeps, recorded in its transaction before it changes
anything (docs/accounting.md#what-a-restore-kept): the groups it rewinds (admitted after the cut)
and the rollout-seconds of every attempt it continues, replaces or ends, by instance, level, fate
and reason. Set-based, as the rest of the rewind: one pass over the attempts the plan names and
those the cut does not know."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ...accounting.sql import LIVE_FATE, LIVE_REASON, WORK_SECONDS
from ...domain.vocabulary import AttemptStatus as A
from ...domain.vocabulary import GroupStatus as G
from ...domain.vocabulary import WorkFate, WorkReason
from ...ledger.db import execute as execute_binary
from ...ledger.db import fetch
from ...accounting.summary import WorkItem
from .rewind_diff import CUT_TIME_BINARY, LATER_GROUPS_SQL
from .rewind_state import Rewind, Rewinding

# Per source row: (fate, reason, seconds) of the work it had when the restore came. A continued
# episode keeps its work up to the cut (carried) and does the rest again (after_cut).
_SPLIT = (
    "CROSS JOIN LATERAL (VALUES "
    f"('{WorkFate.carried}', NULL::text, s.before_cut, s.kind = 'continued'), "
    f"('{WorkFate.redone}', CASE WHEN s.kind = 'continued' THEN '{WorkReason.after_cut}' ELSE s.why END, "
    "CASE WHEN s.kind = 'continued' THEN s.work - s.before_cut ELSE s.work END, true)"
    ") AS v(fate, reason, seconds, applies)"
)


async def later_groups(conn: AsyncConnection, run_id: str, snapshot_id: str) -> list[str]:
    """The live groups of the run that the cut lacks and that had not ended before it."""
    return list((await conn.execute(text(LATER_GROUPS_SQL), {"r": run_id, "s": snapshot_id})).scalars())


async def rewound_groups(c: Rewinding) -> None:
    """The live groups the cut lacks that had not ended before it: admitted after the cut, the
    rewind removes them (step 4) and the trainer's data loader owes them again."""
    c.removed = list(c.since.absent) if c.since is not None else await later_groups(c.conn, c.r, c.s)


# The run's attempts, for the rewound groups' attempts when no ``restore_since_cut`` lists them.
ALL_ATTEMPTS = "(SELECT attempt_id, group_id FROM attempts WHERE run_id = %(r)s)"


def removed_source(c: Rewinding) -> str:
    """Where the rewound groups' attempts are read: ``restore_since_cut`` holds them all (they
    were written after the cut), else the run's attempts."""
    return "restore_since_cut" if c.since is not None else ALL_ATTEMPTS


def source_params(run_id: str, snapshot_id: str, rw: Rewind, removed: list[str], *, continued: bool = True) -> dict[str, Any]:
    """The parameters of :func:`sources_sql` (``continued`` false: the continued rows left out)."""
    return {
        "r": run_id, "s": snapshot_id, "cid": [int(x) for x in rw.continued_ids] if continued else [],
        "nid": [int(x) for x in rw.new_old_ids], "nwhy": list(rw.new_reasons), "rm": removed,
    }


def sources_sql(removed_src: str, with_unknown: bool) -> str:
    """The attempts the rewind acts on, each with its kind and the reason its work is redone:
    continued and replaced (the plan's arrays), the attempts of the rewound groups
    (``removed_src``) and, in a rewind, those the cut does not know (``restore_unknown``)."""
    unknown = (
        f"UNION ALL SELECT u.attempt_id, 'unknown', '{WorkReason.retired_by_restore}' FROM restore_unknown u "
        "LEFT JOIN unnest(%(rm)s::text[]) AS rm(g) ON rm.g = u.group_id WHERE rm.g IS NULL "
    ) if with_unknown else ""
    return (
        "SELECT id, 'continued' AS kind, NULL::text AS why FROM unnest(%(cid)s::bigint[]) AS id "
        "UNION ALL SELECT t.id, 'replaced', t.why FROM unnest(%(nid)s::bigint[], %(nwhy)s::text[]) AS t(id, why) "
        f"{unknown}UNION ALL SELECT x.attempt_id, 'removed', '{WorkReason.retired_by_restore}' FROM {removed_src} x "
        "JOIN unnest(%(rm)s::text[]) AS rm(g) ON rm.g = x.group_id"
    )


def work_sql(removed_src: str, *, with_unknown: bool) -> str:
    """One statement: the work of the attempts a rewind acts on (parameters ``r``, ``s``,
    ``cid``, ``nid``, ``nwhy``, ``rm``), summed by (instance, level, fate, reason, found, kept).

    Found work (in flight or sealed when the restore came) is split by what the restore does
    with it; work thrown away before (a failed or abandoned attempt, an abandoned group) keeps
    its reason, not found, for the rows whose attempt the rewind deletes or resets."""
    # ``before_cut``: the part of ``work`` up to the cut (never more than the work itself). The
    # group's level and status are joined once, here, for both uses below.
    src = (
        "SELECT w.*, CASE WHEN w.work = 0 THEN 0::float8 ELSE "
        f"GREATEST(0, LEAST(w.work, EXTRACT(EPOCH FROM {CUT_TIME_BINARY} - w.dispatched_at)::float8)) END AS before_cut "
        "FROM (SELECT a.attempt_id, a.gym_instance_id, a.status, a.dispatched_at, x.kind, x.why, g.restore_level, "
        f"g.status = '{G.abandoned}' AS group_abandoned, {WORK_SECONDS} AS work, "
        f"COALESCE({LIVE_FATE}, '') = '{WorkFate.redone}' AS thrown, {LIVE_REASON} AS live_why "
        # Each attempt by its primary key (a tenth of the run at most), not by hashing the run.
        f"FROM ({sources_sql(removed_src, with_unknown)}) x CROSS JOIN LATERAL (SELECT * FROM attempts a "
        "WHERE a.attempt_id = x.id AND a.run_id = %(r)s) a JOIN prompt_groups g ON g.run_id = %(r)s AND g.group_id = a.group_id) w"
    )
    found = (
        "SELECT s.gym_instance_id AS inst, s.restore_level AS lv, v.fate, v.reason, true AS found, s.kind = 'unknown' AS kept, "
        f"v.seconds FROM src s {_SPLIT} "
        f"WHERE v.applies AND (s.work > 0 OR s.status <> '{A.reserved}') "
        "AND (s.kind = 'continued' OR NOT (s.thrown OR s.group_abandoned))"
    )
    thrown = (
        f"SELECT s.gym_instance_id, s.restore_level, '{WorkFate.redone}', COALESCE(s.live_why, '{WorkReason.abandoned}'), false, false, "
        "s.work FROM src s "
        "WHERE s.kind IN ('replaced', 'removed') AND (s.thrown OR s.group_abandoned) AND s.work > 0"
    )
    return (
        f"WITH src AS MATERIALIZED ({src}) SELECT inst, lv, fate, reason, found, kept, count(*), COALESCE(sum(seconds), 0) "
        f"FROM ({found} UNION ALL {thrown}) w GROUP BY 1, 2, 3, 4, 5, 6 ORDER BY 1 NULLS FIRST, 2, 3, 4, 5, 6"
    )


def work_items(rows: list[tuple]) -> list[WorkItem]:  # type: ignore[type-arg]
    return [WorkItem(i, lv, f, why, bool(fd), bool(kp), int(n), float(sec)) for i, lv, f, why, fd, kp, n, sec in rows]


async def record_work(c: Rewinding) -> None:
    """The work of every attempt the rewind continues, replaces, removes with its group, or ends
    (``restore_work``), and the rewound groups (``restore_rewound_groups``), when the rewind
    belongs to a restore record. The rows that stay in the ledger (``kept``) are read there by
    the run's totals."""
    await rewound_groups(c)
    c.report.groups_rewound = len(c.removed)
    rows = await fetch(c.conn, work_sql(removed_source(c), with_unknown=True), source_params(c.r, c.s, c.rw, c.removed))
    c.report.work = work_items(rows)
    if c.rw.restore_id is not None:
        await _store(c)


async def _store(c: Rewinding) -> None:
    rid = c.rw.restore_id
    if c.report.work:
        w = c.report.work
        await execute_binary(
            c.conn,
            "INSERT INTO restore_work (run_id, restore_id, item, instance_id, restore_level, fate, reason, found, kept, attempts, seconds) "
            "SELECT %(r)s, %(i)s, o - 1, inst, lv, f, why, fd, kp, n, sec FROM unnest(%(inst)s::text[], %(lv)s::text[], %(f)s::text[], "
            "%(why)s::text[], %(fd)s::boolean[], %(kp)s::boolean[], %(n)s::bigint[], %(sec)s::float8[]) WITH ORDINALITY "
            "AS t(inst, lv, f, why, fd, kp, n, sec, o)",
            {
                "r": c.r, "i": rid, "inst": [x.instance_id for x in w], "lv": [x.restore_level for x in w], "f": [x.fate for x in w],
                "why": [x.reason for x in w], "fd": [x.found for x in w], "kp": [x.kept for x in w], "n": [x.attempts for x in w],
                "sec": [x.seconds for x in w],
            },
        )
    if c.removed:
        await execute_binary(
            c.conn,
            "INSERT INTO restore_rewound_groups (run_id, restore_id, group_id, admitted_at) SELECT %(r)s, %(i)s, g.group_id, g.created_at "
            "FROM prompt_groups g JOIN unnest(%(rm)s::text[]) AS rm(gid) ON rm.gid = g.group_id WHERE g.run_id = %(r)s",
            {"r": c.r, "i": rid, "rm": c.removed},
        )


async def count_reinstated(c: Rewinding) -> None:
    """Cut groups the rewind put back into the ledger (an earlier restore had rewound them, or the
    cut was imported) are admitted again: one admission row (docs/accounting.md#prompt-conservation)."""
    if c.new_groups and c.rw.restore_id is not None:
        await c.conn.execute(
            text("INSERT INTO group_admissions (run_id, groups, restore_id) VALUES (:r, :n, :i)"),
            {"r": c.r, "n": len(c.new_groups), "i": c.rw.restore_id},
        )
