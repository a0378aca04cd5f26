"""Writing a decided report's change plan (``domain.change_plan.ChangePlan``) to the live ledger:
attempt and group updates grouped by the columns they touch, minted attempts, row budgets and
the retires it owes, each as one set-based statement (``unnest`` arrays or one JSON document),
never a statement per row. Kept apart from the report operations (``store``) that decide it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from pydantic_core import to_json
from sqlalchemy.ext.asyncio import AsyncConnection

from ..domain.change_plan import ChangePlan
from ..domain.vocabulary import ENDED_ATTEMPT_STATUSES, ENDED_GROUP_STATUSES, sql_list
from ..domain.vocabulary import AttemptStatus as A
from ..domain.vocabulary import GroupStatus as G
from ..domain.vocabulary import PromptBucket, WorkFate
from ..ledger.db import execute, fetch
from ..outbox import store as outbox

__all__ = ["POLICY_VERSION_AT_DISPATCH", "apply_plan", "count_transitions", "execute_batch", "fetch_batch"]

# Batch statements are planned for their own arguments, never run as prepared statements: a
# prepared statement's generic plan treats arrays of thousands of ids as if they held a handful.
fetch_batch = functools.partial(fetch, prepare=False)
execute_batch = functools.partial(execute, prepare=False)
_execute = execute_batch

_ENDED_ATTEMPTS = sql_list(ENDED_ATTEMPT_STATUSES)
_ENDED_GROUPS = sql_list(ENDED_GROUP_STATUSES)

# ``attempts.policy_version`` of an attempt ``a`` of run ``%(r)s`` dispatched now: the run's newest
# train step not retired by a restore, NULL before any (docs/ledger.md#stale-continuations). The
# subquery is uncorrelated, so it runs once per statement, not per row. A continuation (Gym
# attempt > 0) keeps the version of its first dispatch: its saved turns were sampled under it.
POLICY_VERSION_AT_DISPATCH = (
    "CASE WHEN a.gym_attempt > 0 THEN a.policy_version "
    "ELSE (SELECT max(step) FROM train_steps WHERE run_id = %(r)s AND retired_at IS NULL) END"
)


async def apply_plan(conn: AsyncConnection, run_id: str, plan: ChangePlan) -> None:
    """Write what ``plan`` names, set-based, and count its transitions."""
    await _apply_attempt_updates(conn, run_id, plan)
    if plan.new_attempts:
        new = plan.new_attempts.values()
        await _execute(
            conn,
            "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, group_attempt) "
            "SELECT %(r)s, g, i, ro, ga FROM unnest(%(g)s::text[], %(i)s::int[], %(ro)s::text[], %(ga)s::int[]) AS t(g, i, ro, ga)",
            {
                "r": run_id,
                "g": [x["group_id"] for x in new],
                "i": [x["generation_index"] for x in new],
                "ro": [x["rollout_id"] for x in new],
                "ga": [x["group_attempt"] for x in new],
            },
        )
    if plan.row_attempts:
        keys = list(plan.row_attempts)
        await _execute(
            conn,
            "UPDATE siblings s SET row_attempts_used = t.n FROM unnest(%(g)s::text[], %(i)s::int[], %(n)s::int[]) AS t(g, i, n) "
            "WHERE s.run_id = %(r)s AND s.group_id = t.g AND s.generation_index = t.i",
            {"r": run_id, "g": [k[0] for k in keys], "i": [k[1] for k in keys], "n": [plan.row_attempts[k] for k in keys]},
        )
    await _apply_group_updates(conn, run_id, plan)
    if plan.retires:
        await outbox.enqueue_retires(
            conn, run_id, [(a.gym_instance_id, a.rollout_id, a.gym_attempt, a.attempt_id) for a in plan.retires if a.gym_instance_id is not None]
        )
    count_transitions(plan.transitions)


async def _apply_group_updates(conn: AsyncConnection, run_id: str, plan: ChangePlan) -> None:
    by_shape: dict[tuple[str, ...], list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for gid, ch in plan.group_updates.items():
        by_shape[tuple(sorted(ch))].append((gid, ch))
    for cols, items in by_shape.items():
        params: dict[str, Any] = {"r": run_id, "gids": [gid for gid, _ in items]}
        for c in cols:
            params[c] = [ch[c] for _, ch in items]
        casts = ", ".join(f"%({c})s::{_GROUP_COL_TYPES[c]}[]" for c in cols)
        sets = ", ".join(f"{c} = t.{c}" for c in cols)
        if "status" in cols:
            sets += f", ended_at = CASE WHEN t.status IN ({_ENDED_GROUPS}) THEN now() ELSE g.ended_at END"
        await _execute(
            conn,
            f"UPDATE prompt_groups g SET {sets} FROM unnest(%(gids)s::text[], {casts}) AS t(gid, {', '.join(cols)}) "
            "WHERE g.run_id = %(r)s AND g.group_id = t.gid",
            params,
        )


async def _apply_attempt_updates(conn: AsyncConnection, run_id: str, plan: ChangePlan) -> None:
    if not plan.status_updates:
        return
    # Group updates by the set of columns they touch, one UPDATE per shape. The rows travel as
    # one JSON document (serialised in one native call) that PostgreSQL unpacks with
    # jsonb_to_recordset: no per-row JSON dump of receipts, no per-element array dumping.
    by_shape: dict[tuple[str, ...], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for aid, ch in plan.status_updates.items():
        by_shape[tuple(sorted(ch))].append((aid, ch))
    for cols, items in by_shape.items():
        doc = to_json([{"id": aid, **ch} for aid, ch in items]).decode()
        sets = [f"{c} = t.{c}" for c in cols]
        if "status" in cols:
            sets.append(f"ended_at = CASE WHEN t.status IN ({_ENDED_ATTEMPTS}) THEN now() ELSE a.ended_at END")
            sets.append(f"dispatched_at = CASE WHEN t.status = '{A.dispatched}' THEN now() ELSE a.dispatched_at END")
            sets.append(f"policy_version = CASE WHEN t.status = '{A.dispatched}' THEN {POLICY_VERSION_AT_DISPATCH} ELSE a.policy_version END")
        record = ", ".join(["id bigint", *(f"{c} {_COL_TYPES[c]}" for c in cols)])
        update = f"UPDATE attempts a SET {', '.join(sets)} FROM jsonb_to_recordset(%(doc)s::jsonb) AS t({record}) WHERE a.attempt_id = t.id"
        if "status" not in cols:
            await _execute(conn, update, {"doc": doc})
            continue
        # The work of the attempts this ends, by status, for ckptc_rollout_seconds_total.
        count_ended_work(await fetch_batch(conn, f"WITH u AS ({update} RETURNING {ENDED_WORK_RETURNING}) {ENDED_WORK_SUM}", {"doc": doc, "r": run_id}))


_GROUP_COL_TYPES = {"status": "text", "group_attempt": "int", "data_attempts_used": "int", "abandon_reason": "text"}

_COL_TYPES = {
    "status": "text",
    "is_current": "boolean",
    "failure_class": "text",
    "retirement": "text",
    "gym_instance_id": "text",
    "dispatch_id": "text",
    "refusals": "int",
    "receipt": "jsonb",
    "reward": "float8",
    "mask_sample": "boolean",
    "staging_keys": "text[]",
    "gym_owned": "boolean",
    "replaced_by_attempt_id": "bigint",
    "end_reason": "text",
}


# What an UPDATE that ends attempts returns, and how the statement sums it: the seconds from
# dispatch to end of each attempt it ended, by status (docs/accounting.md#where-it-shows).
ENDED_WORK_RETURNING = (
    "a.status AS st, CASE WHEN a.ended_at IS NOT NULL AND a.dispatched_at IS NOT NULL "
    "THEN EXTRACT(EPOCH FROM a.ended_at - a.dispatched_at)::float8 END AS w"
)
ENDED_WORK_SUM = "SELECT st, sum(w) FROM u WHERE w > 0 GROUP BY st"


def count_ended_work(rows: Sequence[tuple[Any, ...]]) -> None:
    """Count the rollout-seconds of attempts just ended: sealed ones trained, failed or abandoned
    ones redone."""
    from ..observability.metrics import record_rollout_seconds

    for status, seconds in rows:
        if status == A.sealed:
            record_rollout_seconds(WorkFate.trained, float(seconds or 0.0))
        elif status in (A.failed, A.abandoned):
            record_rollout_seconds(WorkFate.redone, float(seconds or 0.0))


def count_admitted(groups: int) -> None:
    """Groups admitted enter the ``live`` bucket (docs/accounting.md#prompt-conservation)."""
    from ..observability.metrics import record_prompts

    record_prompts(PromptBucket.live, groups)


def count_transitions(transitions: dict[str, int]) -> None:
    from ..observability.metrics import record_ledger_transition, record_prompts

    for to, n in transitions.items():
        if n:
            record_ledger_transition(to, n)
    # Groups entering a bucket (docs/accounting.md#prompt-conservation).
    record_prompts(PromptBucket.trained, transitions.get(G.finalized.value, 0))
    record_prompts(PromptBucket.abandoned, transitions.get("group_abandoned", 0))
