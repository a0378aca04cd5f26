"""Stragglers in the live ledger (docs/ledger.md#stragglers): giving them up and replacing them,
in the transaction of the snapshot gate that found them, and telling the trainer afterwards.

``retire_stragglers`` locks the stragglers' groups (group-id order, as every report does), lets
``domain.stragglers`` decide and applies the plan set-based (``plan_writes``): the attempts
ended, their retires queued in the outbox, the replacements minted. The reads below name the
replacement of a row a trainer asks about after the fact.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain.identity import mint_rollout_id
from ..domain.rollout_rules import Budgets, Decision, send_row
from ..domain.stragglers import STRAGGLER, decide_stragglers
from ..domain.vocabulary import AttemptStatus as A
from ..domain.vocabulary import GroupStatus as G
from .locks import current_attempts, load_states
from .plan_writes import apply_plan, fetch_batch

__all__ = ["name_refused_replacements", "replacements_of", "retire_stragglers", "stragglers_among"]


async def retire_stragglers(conn: AsyncConnection, run_id: str, config: Mapping[str, Any], blocked_on: Mapping[str, str | None]) -> list[str]:
    """Give up on and replace the current, dispatched attempts of ``blocked_on`` (rollout id ->
    the instance that reported it), in the caller's transaction, which holds the run row. Returns
    the rollout ids given up (an attempt that ended meanwhile is left alone)."""
    if not blocked_on:
        return []
    gids = [r[0] for r in await fetch_batch(
        conn, "SELECT DISTINCT group_id FROM attempts WHERE run_id = %(r)s AND rollout_id = ANY(%(ids)s)", {"r": run_id, "ids": list(blocked_on)}
    )]
    states = await load_states(conn, run_id, gids)
    d = decide_stragglers(states, blocked_on, Budgets.of(config), _mint)
    await apply_plan(conn, run_id, d.plan)
    return list(d.extra)


def _mint(group_id: str, generation_index: int) -> str:
    """A fresh rollout id (docs/ledger.md#identifiers), as every replacement gets one."""
    return mint_rollout_id(group_id, generation_index, secrets.token_hex)


# The sibling's current attempt of each named attempt that is no longer current.
_REPLACED_SQL = (
    "SELECT o.rollout_id, c.rollout_id FROM attempts o JOIN attempts c ON c.run_id = o.run_id AND c.group_id = o.group_id "
    "AND c.generation_index = o.generation_index AND c.is_current "
    "WHERE o.run_id = %(r)s AND o.rollout_id = ANY(%(ids)s) AND NOT o.is_current"
)


async def replacements_of(conn: AsyncConnection, run_id: str, rollout_ids: Sequence[str]) -> dict[str, str]:
    """rollout id -> the rollout id of its sibling's current attempt, for the named attempts
    that were replaced (one index lookup each)."""
    if not rollout_ids:
        return {}
    return {r[0]: r[1] for r in await fetch_batch(conn, _REPLACED_SQL, {"r": run_id, "ids": list(rollout_ids)})}


async def name_refused_replacements(conn: AsyncConnection, run_id: str, d: Decision) -> Decision:
    """``d`` with ``replaced_by`` on each of its rows refused because the attempt was replaced
    (a late seal of a straggler, for one): the row the trainer sends instead."""
    replaced = [r["rollout_id"] for r in d.refused if r["code"] in _REPLACED_CODES]
    if replaced:
        found = await replacements_of(conn, run_id, replaced)
        for r in d.refused:
            if r["rollout_id"] in found and r["code"] in _REPLACED_CODES:
                r["replaced_by"] = found[r["rollout_id"]]
    return d


_REPLACED_CODES = frozenset({"attempt_replaced", "retired_straggler"})


async def stragglers_among(engine: AsyncEngine, run_id: str, rollout_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The named attempts the coordinator gave up as stragglers, each with its group as a
    failure report answers it (status, group attempt, rows to send): the pending read's news
    for a trainer whose row was retired under it."""
    if not rollout_ids:
        return []
    async with engine.connect() as conn:
        rows = await fetch_batch(
            conn,
            "SELECT a.rollout_id, a.group_id, g.status, g.group_attempt, g.restore_level FROM attempts a "
            "JOIN prompt_groups g ON g.run_id = a.run_id AND g.group_id = a.group_id "
            "WHERE a.run_id = %(r)s AND a.rollout_id = ANY(%(ids)s) AND a.end_reason = %(why)s ORDER BY a.rollout_id",
            {"r": run_id, "ids": list(rollout_ids), "why": STRAGGLER},
        )
        if not rows:
            return []
        current = await current_attempts(conn, run_id, sorted({r[1] for r in rows}))
    out = []
    for rollout_id, gid, status, group_attempt, level in rows:
        send = [send_row(a, level) for a in current.get(gid, []) if a.status == A.reserved] if status == G.generating else []
        out.append({"rollout_id": rollout_id, "group": {"group_id": gid, "status": status, "group_attempt": group_attempt, "rows_to_send": send}})
    return out
