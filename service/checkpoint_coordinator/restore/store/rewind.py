"""The rewind of the live ledger to a snapshot's cut with a restore plan applied
(docs/ledger.md#rewind, docs/ledger.md#the-outbox), in one transaction that locks the run
(fencing).

Set-based: ``INSERT ... SELECT`` / ``UPDATE ... FROM`` over the snapshot tables joined with
``unnest``-ed plan arrays. It rewrites only the rows whose live state differs from their target,
so its cost follows the number of siblings and what changed since the cut. The steps are those
of ``rewind_diff`` (0-5: the cut against the live ledger) and ``rewind_write`` (6-11: the cut
written back); what they share is ``rewind_state``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...errors import Conflict
from ...ledger.runs import RunRow, lock_run
from .records import AnswerRows, mark_applied, store_answer_rows
from .rewind_diff import (
    after_cut_rows,
    check_cut,
    diff_with_cut,
    end_unknown_attempts,
    remove_later_groups,
    supersede_continued,
    unknown_attempts,
)
from .rewind_state import AfterCut, Minter, Rewind, Rewinding, RewindReport
from .rewind_effects import orphan_effects
from .rewind_work import count_reinstated, record_work
from .rewind_write import (
    attempts_as_in_cut,
    bump_epoch,
    focus_rows,
    groups_as_in_cut,
    insert_new_attempts,
    siblings_as_in_cut,
)

__all__ = ["AfterCut", "Minter", "Rewind", "RewindReport", "apply_restore"]


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
    if record is not None:
        rw.restore_id = record[0]
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


async def _rewind(conn: AsyncConnection, run: RunRow, rw: Rewind, minter: Minter, compare_every_row: bool = False) -> RewindReport:
    """The steps of :func:`apply_restore`.

    Rewriting every attempt of a million-sibling cut would cost a million row versions, so the
    rewind writes only what can differ from the cut: the rows the plan changes (continued,
    replaced), the rows of groups the live ledger changed after the cut, and what the cut does
    not know. A cut group is *touched* when, after the cut, its group row changed, it got an
    attempt the cut does not know, or one of its never-sent rows reached Gym. That is exhaustive
    because every live change (docs/ledger.md#live-rollouts) does one of these: admit and
    transport or data failures mint attempts, dispatch moves a reserved row out of ``reserved``,
    seal/return/refuse only act on rows the cut knows as dispatched (which the plan always
    continues or replaces), finalize and abandon change the group. A restore applied after the cut breaks that
    reasoning, so then every cut group counts as touched.
    """
    c = Rewinding(
        conn, run.run_id, rw.snapshot_id, rw, RewindReport(epoch=run.epoch + 1), minter, compare_every_row,
        bumped=set(rw.bumped_groups), retire=list(rw.retire),
    )
    c.p = {"r": c.r, "s": c.s}
    for step in _STEPS:
        await step(c)
    return c.report


_STEPS = (
    check_cut,
    diff_with_cut,
    after_cut_rows,
    unknown_attempts,
    record_work,
    orphan_effects,
    supersede_continued,
    remove_later_groups,
    end_unknown_attempts,
    groups_as_in_cut,
    count_reinstated,
    focus_rows,
    siblings_as_in_cut,
    attempts_as_in_cut,
    insert_new_attempts,
    bump_epoch,
)
