"""The rewind of the live ledger to a snapshot's cut with a restore plan applied
(recovery-ledger.md sections 6.4 and 7), in one transaction that locks the run (fencing).

Set-based: ``INSERT ... SELECT`` / ``UPDATE ... FROM`` over the snapshot tables joined with
``unnest``-ed plan arrays. It rewrites only the rows whose live state differs from their target,
so its cost follows the number of siblings and what changed since the cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.restore_plan import RetireItem
from ...domain.vocabulary import AttemptStatus as A
from ...domain.vocabulary import GroupStatus as G
from ...domain.vocabulary import RetirementState as R
from ...errors import Conflict
from ...ledger.db import dump_json, fetch
from ...ledger.db import execute as execute_binary
from ...ledger.runs import RunRow, lock_run
from ...outbox import store as outbox
from ...snapshots.store import NEXT_XID_SQL, SYSTEM_ID_SQL, xid_base_usable
from .records import AnswerRows, mark_applied, store_answer_rows

# -------------------------------------------------------------------------------------------
# The rewind


@dataclass
class Rewind:
    """What the plan asks of the live ledger, in columns (see :func:`apply_restore`)."""

    snapshot_id: str
    # continued rows: the cut attempt id and its rollout id
    continued_ids: list[int] = field(default_factory=list)
    continued_rollouts: list[str] = field(default_factory=list)
    # their groups (the cut is read by group key; empty: found by attempt id alone)
    continued_groups: list[str] = field(default_factory=list)
    # new attempts: the cut attempt they replace, sibling, new rollout id, group attempt
    new_old_ids: list[int] = field(default_factory=list)
    new_groups: list[str] = field(default_factory=list)
    new_indexes: list[int] = field(default_factory=list)
    new_rollouts: list[str] = field(default_factory=list)
    new_group_attempts: list[int] = field(default_factory=list)
    # prompt_group cohorts that rerun at group_attempt + 1
    bumped_groups: list[str] = field(default_factory=list)
    # retires owed on Gym (instance None: every registered instance)
    retire: list[RetireItem] = field(default_factory=list)
    # {saved instance: live instance}: continued rows move to the live instance (section 6.1)
    instance_map: dict[str, str] = field(default_factory=dict)
    # A restore with an instance map: retires go only to registered instances.
    into_other_topology: bool = False

    def add_new(self, old_id: int, group_id: str, index: int, rollout_id: str, group_attempt: int) -> None:
        self.new_old_ids.append(int(old_id))
        self.new_groups.append(group_id)
        self.new_indexes.append(index)
        self.new_rollouts.append(rollout_id)
        self.new_group_attempts.append(group_attempt)


@dataclass(frozen=True)
class AfterCut:
    """A row the plan would send under its old identity, though its attempt reached Gym after the
    cut: it is sent under a new rollout id instead (``disposition`` after the adjustment)."""

    attempt_id: int
    group_id: str
    generation_index: int
    disposition: str
    rollout_id: str
    replaces_rollout_id: str
    group_attempt: int


@dataclass
class RewindReport:
    epoch: int
    retires_queued: int = 0
    outbox_superseded: int = 0
    groups_removed: int = 0
    attempts_ended: int = 0
    attempts_rewritten: int = 0
    attempts_inserted: int = 0
    after_cut: list[AfterCut] = field(default_factory=list)
    bumped_after_cut: list[str] = field(default_factory=list)
    # Whether ``restore_diff`` compared only the rows written since the cut (``cut_xmin``).
    diff_by_xmin: bool = False
    # Train steps announced after the snapshot's anchor, retired with the lineage (section 6.7).
    train_steps_retired: list[int] = field(default_factory=list)


Minter = Callable[[str, int], str]


async def apply_restore(
    engine: AsyncEngine,
    run_id: str,
    rw: Rewind,
    *,
    after_cut_minter: Minter,
    record: tuple[str, Callable[[RewindReport], tuple[dict[str, Any], AnswerRows]]] | None = None,
    expect_epoch: int | None = None,
    compare_every_row: bool = False,
) -> RewindReport:
    """Make the run's live ledger the cut with the plan applied, in one transaction.

    ``record = (restore_id, result_of)``: ``result_of(report)`` gives the restore record's result
    and the rows it answers; both are stored in the same transaction (the rows as
    ``restore_row_chunks``), so the ledger change and the idempotent answer commit together.
    ``compare_every_row`` compares every cut row with the live ledger, as after a restore applied
    after the cut, and every live attempt with the cut whatever ``cut_xmin`` says (tests use it to
    check that looking only at what changed gives the same ledger).
    """
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id, for_update=True, expect_epoch=expect_epoch)
        try:
            report = await _rewind(conn, run, rw, after_cut_minter, compare_every_row)
        except (IntegrityError, psycopg.errors.IntegrityError) as e:
            # SQLAlchemy's wrapper, or the driver's own error for the statements sent through it.
            raise Conflict(
                f"the ledger cut of snapshot {rw.snapshot_id} collides with the live ledger: {getattr(e, 'orig', e)}",
                code="restore_ledger_conflict",
            ) from e
        if record is not None:
            restore_id, result_of = record
            report.train_steps_retired = await _retire_later_train_steps(conn, run_id, rw.snapshot_id, restore_id)
            result, rows = result_of(report)
            await store_answer_rows(conn, run_id, restore_id, rows)
            await mark_applied(conn, run_id, restore_id, result)
        return report


async def _retire_later_train_steps(conn: AsyncConnection, run_id: str, snapshot_id: str, restore_id: str) -> list[int]:
    """The steps announced after the restored anchor belong to a trainer lineage that no longer
    exists: retired here, in the restore's transaction, so the new lineage may announce them
    again (the announces stay as history, with the restore that retired them)."""
    rows = await conn.execute(
        text(
            "UPDATE train_steps t SET retired_at = now(), retired_by_restore = :i FROM snapshots s "
            "WHERE t.run_id = :r AND t.retired_at IS NULL AND s.run_id = :r AND s.snapshot_id = :s AND t.step > s.anchor_step "
            "RETURNING t.step"
        ),
        {"r": run_id, "s": snapshot_id, "i": restore_id},
    )
    return sorted(int(x) for x in rows.scalars().all())


# A live group absent from the cut because it had ended before the cut (the cut holds live
# groups only): kept as history. Any other group absent from the cut was admitted after it.
_ENDED_BY_CUT_TIME = (
    f"g.status IN ('{G.finalized}', '{G.abandoned}') AND g.ended_at IS NOT NULL AND g.ended_at <= "
    "(SELECT COALESCE(cut_at, published_at, created_at) FROM snapshots WHERE run_id = :r AND snapshot_id = :s)"
)
_ENDED_BEFORE_CUT = (
    f"{_ENDED_BY_CUT_TIME} AND NOT EXISTS (SELECT 1 FROM snapshot_groups sg "
    "WHERE sg.run_id = :r AND sg.snapshot_id = :s AND sg.group_id = g.group_id)"
)

# The target state of a cut attempt (``restore_focus``): as in the cut, or continued (``cont``:
# Gym attempt N+1, reserved, Gym-owned, no result yet).
_TARGET = (
    "SELECT f.attempt_id, f.group_id, f.generation_index, f.rollout_id, f.cont, "
    f"CASE WHEN f.cont THEN '{A.reserved}' ELSE f.status END AS status, true AS is_current, f.gym_instance_id, "
    "f.gym_attempt + CASE WHEN f.cont THEN 1 ELSE 0 END AS gym_attempt, f.group_attempt, f.refusals, "
    "CASE WHEN f.cont THEN NULL ELSE f.receipt END AS receipt, "
    "CASE WHEN f.cont THEN NULL ELSE f.reward END AS reward, "
    "CASE WHEN f.cont THEN NULL ELSE f.mask_sample END AS mask_sample, "
    "CASE WHEN f.cont THEN NULL ELSE f.staging_keys END AS staging_keys, "
    "f.gym_owned OR f.cont AS gym_owned FROM restore_focus f"
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


async def _restore_diff_since_cut(conn: AsyncConnection, run_id: str, snapshot_id: str, cut_xmin: int) -> "_SinceCut":
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
    return _SinceCut(absent=list(absent), recent_groups=list(recent_groups))


@dataclass(frozen=True)
class _SinceCut:
    """What :func:`_restore_diff_since_cut` learnt about the run's groups: the live groups the
    cut lacks that had not ended before it (step 4 deletes exactly these), and the groups whose
    row was written at or after ``cut_xmin`` (any other live group row is the cut's, so step 6
    compares only these and the rerunning cohorts)."""

    absent: list[str]
    recent_groups: list[str]


@dataclass
class _Rewinding:
    """What the steps of a rewind share: the transaction, the plan, and what earlier steps
    learnt (the groups touched since the cut, the cohorts that rerun, the retires owed)."""

    conn: AsyncConnection
    r: str
    s: str
    rw: Rewind
    report: RewindReport
    minter: Minter
    compare_every_row: bool
    bumped: set[str]
    retire: list[RetireItem]
    p: dict[str, Any] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)
    since: _SinceCut | None = None
    everything: bool = False
    still: Any = None
    new_groups: Sequence[str] = ()


async def _rewind(conn: AsyncConnection, run: RunRow, rw: Rewind, minter: Minter, compare_every_row: bool = False) -> RewindReport:
    """The steps of :func:`apply_restore`.

    Rewriting every attempt of a million-sibling cut would cost a million row versions, so the
    rewind writes only what can differ from the cut: the rows the plan changes (continued,
    replaced), the rows of groups the live ledger changed after the cut, and what the cut does
    not know. A cut group is *touched* when, after the cut, its group row changed, it got an
    attempt the cut does not know, or one of its never-sent rows reached Gym. That is exhaustive
    because every live change of section 4 does one of these: admit and transport or data
    failures mint attempts, dispatch moves a reserved row out of ``reserved``, seal/return/refuse
    only act on rows the cut knows as dispatched (which the plan always continues or replaces),
    finalize and abandon change the group. A restore applied after the cut breaks that
    reasoning, so then every cut group counts as touched.
    """
    c = _Rewinding(
        conn, run.run_id, rw.snapshot_id, rw, RewindReport(epoch=run.epoch + 1), minter, compare_every_row,
        bumped=set(rw.bumped_groups), retire=list(rw.retire),
    )
    c.p = {"r": c.r, "s": c.s}
    for step in _STEPS:
        await step(c)
    return c.report


async def _check_cut(c: _Rewinding) -> None:
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
                    "SELECT EXISTS (SELECT 1 FROM restores x, snapshots sn WHERE x.run_id = :r AND x.state = 'applied' "
                    "AND sn.run_id = :r AND sn.snapshot_id = :s AND x.ended_at >= COALESCE(sn.cut_at, sn.published_at, sn.created_at))"
                ),
                c.p,
            )
        ).scalar()
    )


async def _diff_with_cut(c: _Rewinding) -> None:
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


async def _after_cut_rows(c: _Rewinding) -> None:
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
        if x.restore_level == "prompt_group":
            cohort_groups.add(x.group_id)
            continue
        new = c.minter(x.group_id, x.generation_index)
        disp = "restarted" if x.restore_level == "turn" else "rerun"
        c.rw.add_new(x.attempt_id, x.group_id, x.generation_index, new, x.group_attempt)
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
            c.rw.add_new(x.attempt_id, x.group_id, x.generation_index, new, x.group_attempt + 1)
            c.report.after_cut.append(AfterCut(x.attempt_id, x.group_id, x.generation_index, "rerun", new, x.rollout_id, x.group_attempt + 1))
        c.bumped |= cohort_groups
        c.report.bumped_after_cut = sorted(cohort_groups)


async def _unknown_attempts(c: _Rewinding) -> None:
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


async def _supersede_continued(c: _Rewinding) -> None:
    # 3. Continued rollouts keep their id: an old retire (or the forget that follows it) queued
    #    for them must not reach Gym after the restore installed their continuation.
    c.report.outbox_superseded = await outbox.supersede_pending(c.conn, c.r, c.rw.continued_rollouts)


async def _remove_later_groups(c: _Rewinding) -> None:
    # 4. Groups the cut does not know leave the ledger (siblings and attempts cascade): they were
    #    admitted after it. Groups that had ended (finalized, abandoned) before the cut are not
    #    in it either; they stay, as history.
    if c.since is not None:
        # The same groups, listed by _restore_diff_since_cut in this transaction (nothing wrote
        # a group row since, and the run is locked).
        c.report.groups_removed = await execute_binary(
            c.conn, "DELETE FROM prompt_groups WHERE run_id = %(r)s AND group_id = ANY(%(g)s::text[])", {"r": c.r, "g": c.since.absent}
        ) if c.since.absent else 0
    else:
        c.report.groups_removed = (
            await c.conn.execute(
                text(
                    "DELETE FROM prompt_groups g WHERE g.run_id = :r AND NOT EXISTS (SELECT 1 FROM snapshot_groups sg "
                    f"WHERE sg.run_id = :r AND sg.snapshot_id = :s AND sg.group_id = g.group_id) AND NOT ({_ENDED_BEFORE_CUT})"
                ),
                c.p,
            )
        ).rowcount


async def _end_unknown_attempts(c: _Rewinding) -> None:
    # 5. The unknown attempts of the remaining groups end (kept as history, no longer current).
    c.report.attempts_ended = (
        await c.conn.execute(
            text(
                "UPDATE attempts a SET is_current = false, "
                f"status = CASE WHEN a.status IN ('{A.reserved}', '{A.dispatched}', '{A.returned}') THEN '{A.abandoned}' ELSE a.status END, "
                "ended_at = COALESCE(a.ended_at, now()) FROM restore_unknown u WHERE a.attempt_id = u.attempt_id"
            ),
        )
    ).rowcount


async def _groups_as_in_cut(c: _Rewinding) -> None:
    # 6. Groups as in the cut (cohorts that rerun at group_attempt + 1): changed ones rewritten,
    #    missing ones (removed by an earlier restore, or an imported cut) inserted.
    gparams: dict[str, Any] = {**c.p, "bumped": sorted(c.bumped)}
    gsrc = (
        "SELECT sg.*, sg.group_attempt + CASE WHEN b.g IS NULL THEN 0 ELSE 1 END AS target_attempt FROM snapshot_groups sg "
        "LEFT JOIN unnest(CAST(:bumped AS text[])) AS b(g) ON b.g = sg.group_id WHERE sg.run_id = :r AND sg.snapshot_id = :s"
    )
    # Only groups whose live row may differ from the cut's: with ``cut_xmin``, those written since
    # the cut and the rerunning cohorts (by the cut's primary key); otherwise every cut group.
    usrc = gsrc
    if c.since is not None:
        usrc += " AND sg.group_id = ANY(CAST(:cand AS text[]))"
        gparams["cand"] = sorted(set(c.since.recent_groups) | c.bumped)
    changed = (
        await c.conn.execute(
            text(
                "UPDATE prompt_groups g SET group_attempt = t.target_attempt, data_attempts_used = t.data_attempts_used, "
                f"status = t.status, ended_at = CASE WHEN t.status IN ('{G.finalized}', '{G.abandoned}') THEN COALESCE(g.ended_at, now()) END "
                f"FROM ({usrc}) t WHERE g.run_id = :r AND g.group_id = t.group_id AND "
                "(g.group_attempt, g.data_attempts_used, g.status) IS DISTINCT FROM (t.target_attempt, t.data_attempts_used, t.status) "
                "RETURNING g.group_id"
            ),
            gparams,
        )
    ).scalars().all()
    # Cut groups missing from the live ledger, found on the keys alone (both primary keys), then
    # inserted whole: usually none.
    missing = (
        await c.conn.execute(
            text(
                "SELECT COALESCE(array_agg(c.group_id), '{}') FROM snapshot_cut_groups c WHERE c.run_id = :r AND c.snapshot_id = :s "
                "AND NOT EXISTS (SELECT 1 FROM prompt_groups g WHERE g.run_id = :r AND g.group_id = c.group_id)"
            ),
            c.p,
        )
    ).scalar()
    c.new_groups = []
    if missing:
        c.new_groups = (
            await c.conn.execute(
                text(
                    "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, task_source, agent_name, restore_level, "
                    "expected_generations, target_step, weight_version, group_attempt, data_attempts_used, status, ended_at) "
                    "SELECT :r, t.group_id, t.prompt_ref, t.task_digest, t.task_source, t.agent_name, t.restore_level, "
                    "t.expected_generations, t.target_step, t.weight_version, t.target_attempt, t.data_attempts_used, t.status, "
                    f"CASE WHEN t.status IN ('{G.finalized}', '{G.abandoned}') THEN now() END FROM ({gsrc} AND sg.group_id = ANY(CAST(:missing AS text[]))) t "
                    "RETURNING group_id"
                ),
                {**gparams, "missing": list(missing)},
            )
        ).scalars().all()
    c.touched.update(changed)
    c.touched.update(c.new_groups)
    c.touched |= c.bumped


async def _focus_rows(c: _Rewinding) -> None:
    # 7. The cut rows the rest works on, in a small analyzed table so that the steps below look
    #    attempts and siblings up by key instead of scanning the run: continued rows and the
    #    rows of touched groups. A rerunning cohort (``bumped``) needs none of its rows there:
    #    each of them is replaced (deleted in step 9, its successor inserted in step 10) and its
    #    siblings restart their budgets by group (step 8). So when no other group changed after
    #    the cut, the table is filled by one filter of the cut on the continued ids. After a
    #    restore applied after the cut, every row is compared.
    focus_cols = (
        "sa.attempt_id, sa.group_id, sa.generation_index, sa.row_attempts_used, sa.rollout_id, sa.gym_instance_id, "
        "sa.gym_attempt, sa.group_attempt, sa.status, sa.refusals, sa.receipt, sa.reward, sa.mask_sample, sa.staging_keys, "
        "sa.gym_owned"
    )
    # The same columns read from the cut storage itself: the group id is the cut row's, the rest
    # the sibling's (``sa`` an element of ``c.siblings``).
    cut_focus_cols = focus_cols.replace("sa.group_id", "c.group_id")
    bumped_list = sorted(c.bumped)
    if c.everything:
        await c.conn.execute(
            text(
                f"CREATE TEMP TABLE restore_focus ON COMMIT DROP AS SELECT {focus_cols}, p.id IS NOT NULL AS cont, "
                "b.g IS NOT NULL AS bumped FROM snapshot_attempts sa "
                "LEFT JOIN unnest(CAST(:cid AS bigint[])) AS p(id) ON p.id = sa.attempt_id "
                "LEFT JOIN unnest(CAST(:bumped AS text[])) AS b(g) ON b.g = sa.group_id "
                "WHERE sa.run_id = :r AND sa.snapshot_id = :s"
            ),
            {**c.p, "cid": c.rw.continued_ids, "bumped": bumped_list},
        )
    elif c.rw.continued_groups or not c.rw.continued_ids:
        # The continued rows, read by group key: their groups' cut rows by the primary key of
        # the cut storage (``pk_snapshot_cut_groups``; an attempt's group never changes), then
        # their siblings filtered on the ids. Through the ``snapshot_attempts`` view the same
        # filter unnests the whole cut.
        await execute_binary(
            c.conn,
            f"CREATE TEMP TABLE restore_focus ON COMMIT DROP AS SELECT {cut_focus_cols}, true AS cont, "
            "c.group_id = ANY(%(bumped)s::text[]) AS bumped "
            "FROM snapshot_cut_groups c CROSS JOIN LATERAL unnest(c.siblings) AS sa "
            "WHERE c.run_id = %(r)s AND c.snapshot_id = %(s)s AND c.group_id = ANY(%(cg)s::text[]) "
            "AND sa.attempt_id = ANY(%(cid)s::bigint[])",
            {**c.p, "cid": c.rw.continued_ids, "cg": sorted(set(c.rw.continued_groups)), "bumped": bumped_list},
        )
    else:
        # Continued rows without their groups: by a filter on their ids over the whole cut.
        await c.conn.execute(
            text(
                f"CREATE TEMP TABLE restore_focus ON COMMIT DROP AS SELECT {focus_cols}, true AS cont, "
                "b.g IS NOT NULL AS bumped FROM snapshot_attempts sa "
                "LEFT JOIN unnest(CAST(:bumped AS text[])) AS b(g) ON b.g = sa.group_id "
                "WHERE sa.run_id = :r AND sa.snapshot_id = :s AND sa.attempt_id = ANY(CAST(:cid AS bigint[]))"
            ),
            {**c.p, "cid": c.rw.continued_ids, "bumped": bumped_list},
        )
    if not c.everything:
        scan_groups = sorted(c.touched - c.bumped)
        if scan_groups:
            # By group key, as above.
            await execute_binary(
                c.conn,
                f"INSERT INTO restore_focus SELECT {cut_focus_cols}, false, false "
                "FROM snapshot_cut_groups c CROSS JOIN LATERAL unnest(c.siblings) AS sa "
                "WHERE c.run_id = %(r)s AND c.snapshot_id = %(s)s AND c.group_id = ANY(%(g)s::text[]) "
                "AND NOT (sa.attempt_id = ANY(%(cid)s::bigint[]))",
                {**c.p, "cid": c.rw.continued_ids, "g": scan_groups},
            )
    if c.rw.instance_map:
        # A continuation lives on the live instance its saved instance maps to.
        await execute_binary(
            c.conn,
            "UPDATE restore_focus f SET gym_instance_id = m.live FROM unnest(%(saved)s::text[], %(live)s::text[]) AS m(saved, live) "
            "WHERE f.cont AND f.gym_instance_id = m.saved",
            {"saved": list(c.rw.instance_map), "live": list(c.rw.instance_map.values())},
        )
    await c.conn.execute(text("CREATE UNIQUE INDEX ON restore_focus (attempt_id)"))
    await c.conn.execute(text("ANALYZE restore_focus"))
    # From here every statement starts at restore_focus (whose size the planner now knows) or
    # at the plan's arrays, and looks attempts and siblings up by key.
    await c.conn.execute(text("SET LOCAL enable_nestloop = on"))


async def _siblings_as_in_cut(c: _Rewinding) -> None:
    bumped_list = sorted(c.bumped)
    # 8. Siblings as in the cut (a rerunning cohort starts its row budgets again).
    if c.new_groups:
        await c.conn.execute(
            text(
                "INSERT INTO siblings (run_id, group_id, generation_index, row_attempts_used) "
                "SELECT :r, sa.group_id, sa.generation_index, sa.row_attempts_used FROM snapshot_attempts sa "
                "WHERE sa.run_id = :r AND sa.snapshot_id = :s AND sa.group_id = ANY(:g) ON CONFLICT DO NOTHING"
            ),
            {**c.p, "g": sorted(c.new_groups)},
        )
    await c.conn.execute(
        text(
            "UPDATE siblings sb SET row_attempts_used = t.n FROM (SELECT f.group_id, f.generation_index, "
            "CASE WHEN f.bumped THEN 0 ELSE f.row_attempts_used END AS n FROM restore_focus f) t "
            "WHERE sb.run_id = :r AND sb.group_id = t.group_id AND sb.generation_index = t.generation_index "
            "AND sb.row_attempts_used <> t.n"
        ),
        c.p,
    )
    if bumped_list and not c.everything:
        await c.conn.execute(
            text(
                "UPDATE siblings sb SET row_attempts_used = 0 FROM unnest(CAST(:bumped AS text[])) AS b(g) "
                "WHERE sb.run_id = :r AND sb.group_id = b.g AND sb.row_attempts_used <> 0"
            ),
            {"r": c.r, "bumped": bumped_list},
        )


async def _attempts_as_in_cut(c: _Rewinding) -> None:
    # 9. The cut's attempts. Replaced ones are deleted: their replacement (step 10) is the
    #    sibling's attempt from now on, and a deleted row costs far less than a rewritten one
    #    (their rollout ids live on in the retires queued above and the restore's answer).
    #    Everything from here goes by primary key (a few percent of the run's rows, which a
    #    sequential scan of the whole run would cost more to find).
    for knob in ("enable_seqscan", "enable_hashjoin", "enable_mergejoin"):
        await c.conn.execute(text(f"SET LOCAL {knob} = off"))
    # The plan's arrays go as binary parameters: as text, psycopg escapes every element in
    # Python.
    new_old_ids = sorted(c.rw.new_old_ids)
    if new_old_ids:
        await execute_binary(
            c.conn, "DELETE FROM attempts a WHERE a.attempt_id = ANY(%(nid)s::bigint[]) AND a.run_id = %(r)s", {"r": c.r, "nid": new_old_ids}
        )
    # The focus rows back to their target state (only those that differ are written).
    c.report.attempts_rewritten = (
        await c.conn.execute(
            text(
                "UPDATE attempts a SET status = t.status, is_current = t.is_current, gym_instance_id = t.gym_instance_id, "
                "gym_attempt = t.gym_attempt, group_attempt = t.group_attempt, refusals = t.refusals, receipt = t.receipt, "
                "reward = t.reward, mask_sample = t.mask_sample, staging_keys = t.staging_keys, gym_owned = t.gym_owned, "
                f"retirement = CASE WHEN t.cont THEN '{R.none}' ELSE a.retirement END, "
                f"dispatch_id = CASE WHEN t.status = '{A.reserved}' THEN NULL ELSE a.dispatch_id END, "
                f"ended_at = CASE WHEN t.status IN ('{A.sealed}', '{A.failed}', '{A.abandoned}') THEN COALESCE(a.ended_at, now()) END "
                f"FROM ({_TARGET}) t WHERE a.attempt_id = t.attempt_id AND a.run_id = :r AND ("
                "(a.status, a.is_current, a.gym_instance_id, a.gym_attempt, a.group_attempt, a.refusals, a.receipt, a.reward, "
                "a.mask_sample, a.staging_keys, a.gym_owned) IS DISTINCT FROM (t.status, t.is_current, t.gym_instance_id, "
                "t.gym_attempt, t.group_attempt, t.refusals, t.receipt, t.reward, t.mask_sample, t.staging_keys, t.gym_owned) "
                f"OR (t.cont AND a.retirement <> '{R.none}') OR (t.status = '{A.reserved}' AND a.dispatch_id IS NOT NULL))"
            ),
            c.p,
        )
    ).rowcount
    # Cut attempts missing from the live ledger (their group was removed by an earlier restore,
    # or the cut was imported) come back as rows of their own, unless replaced. Only touched
    # groups can miss attempts.
    c.report.attempts_inserted = await execute_binary(
        c.conn,
        "INSERT INTO attempts (attempt_id, run_id, group_id, generation_index, rollout_id, gym_instance_id, gym_attempt, "
        "group_attempt, status, is_current, refusals, receipt, reward, mask_sample, staging_keys, gym_owned, ended_at) "
        "SELECT t.attempt_id, %(r)s, t.group_id, t.generation_index, t.rollout_id, t.gym_instance_id, t.gym_attempt, "
        "t.group_attempt, t.status, t.is_current, t.refusals, t.receipt, t.reward, t.mask_sample, t.staging_keys, "
        f"t.gym_owned, CASE WHEN t.status IN ('{A.sealed}', '{A.failed}', '{A.abandoned}') THEN now() END "
        f"FROM ({_TARGET}) t LEFT JOIN unnest(%(nid)s::bigint[]) AS n(id) ON n.id = t.attempt_id WHERE n.id IS NULL "
        "AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.attempt_id = t.attempt_id)",
        {"r": c.r, "nid": new_old_ids},
    )


async def _insert_new_attempts(c: _Rewinding) -> None:
    # 10. New attempts (restarted, gym_restarted, rerun) under their new rollout ids, in sibling
    #     order: each index then takes them in one sweep (its pages stay in memory) instead of
    #     one sweep per disposition.
    if c.rw.new_old_ids:
        await execute_binary(
            c.conn,
            "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, group_attempt) "
            "SELECT %(r)s, g, i, ro, ga FROM unnest(%(g)s::text[], %(i)s::int[], %(ro)s::text[], %(ga)s::int[]) "
            "AS t(g, i, ro, ga) ORDER BY g, i",
            {"r": c.r, "g": c.rw.new_groups, "i": c.rw.new_indexes, "ro": c.rw.new_rollouts, "ga": c.rw.new_group_attempts},
        )
        c.report.attempts_inserted += len(c.rw.new_old_ids)
    for knob in ("enable_seqscan", "enable_hashjoin", "enable_mergejoin"):
        await c.conn.execute(text(f"SET LOCAL {knob} = on"))


async def _bump_epoch(c: _Rewinding) -> None:
    # 11. Fencing: every writer of the old epoch is refused from now on; the gate reopens.
    await c.conn.execute(
        text(
            "UPDATE runs SET epoch = epoch + 1, restored_from_rollout_snapshot = :s, gate_snapshot_id = NULL WHERE run_id = :r"
        ),
        c.p,
    )


_STEPS = (
    _check_cut,
    _diff_with_cut,
    _after_cut_rows,
    _unknown_attempts,
    _supersede_continued,
    _remove_later_groups,
    _end_unknown_attempts,
    _groups_as_in_cut,
    _focus_rows,
    _siblings_as_in_cut,
    _attempts_as_in_cut,
    _insert_new_attempts,
    _bump_epoch,
)


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
        "SELECT %(r)s, instance_id, 'retire', rollout_id, gym_attempt, attempt_id, 'retire' FROM items" + only, skip_if_pending=True
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


def _json(v: Any) -> str:
    return dump_json(v, default=str)
