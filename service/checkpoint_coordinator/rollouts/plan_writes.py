"""Writing a decided report's change plan (``domain.change_plan.ChangePlan``) to the live ledger:
attempt and group updates grouped by the columns they touch, minted attempts, row budgets and
the retires it owes, each as one set-based statement (``unnest`` arrays or one JSON document),
never a statement per row. Kept apart from the report operations (``store``) that decide it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

from pydantic_core import to_json
from sqlalchemy.ext.asyncio import AsyncConnection

from ..domain.change_plan import ChangePlan
from ..domain.vocabulary import ENDED_ATTEMPT_STATUSES, ENDED_GROUP_STATUSES, sql_list
from ..domain.vocabulary import AttemptStatus as A
from ..ledger.db import execute, fetch
from ..outbox import store as outbox

__all__ = ["apply_plan", "count_transitions", "execute_batch", "fetch_batch"]

# Batch statements are planned for their own arguments, never run as prepared statements: a
# prepared statement's generic plan treats arrays of thousands of ids as if they held a handful.
fetch_batch = functools.partial(fetch, prepare=False)
execute_batch = functools.partial(execute, prepare=False)
_execute = execute_batch

_ENDED_ATTEMPTS = sql_list(ENDED_ATTEMPT_STATUSES)
_ENDED_GROUPS = sql_list(ENDED_GROUP_STATUSES)


async def apply_plan(conn: AsyncConnection, run_id: str, plan: ChangePlan) -> None:
    """Write what ``plan`` names, set-based, and count its transitions."""
    await _apply_attempt_updates(conn, plan)
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


async def _apply_attempt_updates(conn: AsyncConnection, plan: ChangePlan) -> None:
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
        record = ", ".join(["id bigint", *(f"{c} {_COL_TYPES[c]}" for c in cols)])
        await _execute(
            conn,
            f"UPDATE attempts a SET {', '.join(sets)} FROM jsonb_to_recordset(%(doc)s::jsonb) AS t({record}) WHERE a.attempt_id = t.id",
            {"doc": doc},
        )


_GROUP_COL_TYPES = {"status": "text", "group_attempt": "int", "data_attempts_used": "int"}

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
}


def count_transitions(transitions: dict[str, int]) -> None:
    from ..observability.metrics import record_ledger_transition

    for to, n in transitions.items():
        if n:
            record_ledger_transition(to, n)
