"""What a planned restore asks of the ledger (the rewind, in columns) and the answer built from
the plan and what the rewind did: kept apart from the execution (``service``), which only runs
them in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..accounting.summary import restore_summary
from ..domain.restore_plan import Disposition, RestorePlan, RetireItem
from ..domain.vocabulary import RestoreRecordState, RowReason, WorkReason
from .plan_loading import Planned, snapshot_fields
from .planning import NEW_ATTEMPT_DISPOSITIONS, counts_json
from .request import RestoreRequest
from .store import records, rewind


def rewind_of(p: Planned, plan: RestorePlan, retire: Sequence[RetireItem], *, installed: bool) -> rewind.Rewind:
    # Columns straight from the plan's columns: a large plan has many such rows,
    # and building a PlanRow for each only to take it apart again is slow.
    rw = rewind.Rewind(snapshot_id=p.snap.snapshot_id, retire=list(retire), bumped_groups=list(plan.cohort_reruns))
    rw.into_other_topology = p.instance_map is not None
    if installed:
        rw.instance_map = dict(p.instance_map or {})
        c = plan.rows.columns(Disposition.continued)
        rw.continued_ids = list(map(int, c.attempt_id))
        rw.continued_rollouts = list(c.rollout_id)
        rw.continued_groups = list(c.group_id)
    stale = _too_stale_ids(plan)
    for d in NEW_ATTEMPT_DISPOSITIONS:
        c = plan.rows.columns(d)
        # Why the replaced attempt's work is redone (docs/accounting.md#rollout-seconds).
        why = WorkReason.rerun.value if d is Disposition.rerun else WorkReason.restarted.value
        rw.new_reasons.extend(WorkReason.too_stale.value if int(a) in stale else why for a in c.attempt_id)
        rw.new_old_ids.extend(map(int, c.attempt_id))
        rw.new_groups.extend(c.group_id)
        rw.new_indexes.extend(c.generation_index)
        rw.new_rollouts.extend(c.rollout_id)
        rw.new_group_attempts.extend(c.group_attempt)
    return rw


def _too_stale_ids(plan: RestorePlan) -> set[int]:
    """The cut attempts the plan restarts because their policy was too old to continue
    (docs/ledger.md#stale-continuations); the rows are only looked at when there are any."""
    if not any(RowReason.too_stale.value in by for by in plan.reasons().values()):
        return set()
    return {int(r.attempt_id) for d in NEW_ATTEMPT_DISPOSITIONS for r in plan.rows.with_disposition(d) if r.reason is RowReason.too_stale}


def build_answer(
    run_id: str, req: RestoreRequest, p: Planned, plan: RestorePlan, report: rewind.RewindReport, gym: dict[str, Any]
) -> tuple[dict[str, Any], records.AnswerRows]:
    """The answer without its rows (``rows_total`` of them), and the rows, in plan order."""
    counts = counts_json(plan)
    reasons = plan.reasons()
    c = plan.rows.sent_columns()
    rows = records.AnswerRows(
        c.group_id, c.generation_index, c.disposition, c.rollout_id, c.gym_attempt, c.group_attempt, c.instance_id,
        c.replaces_rollout_id, c.reason,
    )
    if report.after_cut:
        # Rows sent under their old identity whose attempt reached Gym after the cut: new ids.
        adjusted = {int(a.attempt_id): a for a in report.after_cut}
        for k, aid in enumerate(c.attempt_id):
            adj = adjusted.get(int(aid))
            if adj is None:
                continue
            counts["dispatch"] -= 1
            counts[adj.disposition] += 1
            _move_reason(reasons, (Disposition.dispatch.value, rows.reasons[k]), (adj.disposition, RowReason.sent_after_cut.value))
            rows.reasons[k] = RowReason.sent_after_cut.value
            rows.dispositions[k] = adj.disposition
            rows.rollout_ids[k] = adj.rollout_id
            rows.gym_attempts[k] = 0
            rows.group_attempts[k] = adj.group_attempt
            if p.instance_map is None:
                rows.instance_ids[k] = None
            rows.replaces_rollout_ids[k] = adj.replaces_rollout_id
    summary = {
        "restore_id": req.restore_id,
        "run_id": run_id,
        **snapshot_fields(p),
        "state": RestoreRecordState.applied,
        "with_gym_state": req.with_gym_state,
        "epoch": report.epoch,
        "gym": gym,
        "total": plan.total,
        "counts": counts,
        "reasons": reasons,
        "instance_map": p.instance_map,
        "cohort_reruns": sorted(set(plan.cohort_reruns) | set(report.bumped_after_cut)),
        "dispatched_after_cut": len(report.after_cut),
        "retires_queued": report.retires_queued,
        "groups_removed": report.groups_removed,
        "train_steps_retired": report.train_steps_retired,
        "aborted_snapshots": [p.aborted_snapshot] if p.aborted_snapshot else [],
        "accounting": restore_summary(report.work, report.groups_rewound),
        "effects": {"orphaned": dict(sorted(report.effects_orphaned.items())), "pending": report.effects_pending},
        "rows_total": len(rows),
    }
    return summary, rows


def _move_reason(reasons: dict[str, dict[str, int]], old: tuple[str, str], new: tuple[str, str]) -> None:
    """One row of the summary's reasons moves from (disposition, reason) ``old`` to ``new``."""
    d, why = old
    left = reasons.get(d, {}).get(why, 0) - 1
    if left > 0:
        reasons[d][why] = left
    else:
        reasons.get(d, {}).pop(why, None)
        if d in reasons and not reasons[d]:
            del reasons[d]
    d, why = new
    reasons.setdefault(d, {})[why] = reasons.get(d, {}).get(why, 0) + 1
