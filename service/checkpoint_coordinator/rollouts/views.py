"""Read views of the live ledger for operators and the trainer's pending check (no writes)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.identity import capture_key
from ..domain.rollout_rules import granularity
from ..domain.vocabulary import LIVE_GROUP_STATUSES, AttemptStatus, OutboxState
from ..errors import NotFound
from ..ledger.db import read_rows
from ..ledger.models import Attempt, OutboxItem, PromptGroup, Sibling
from ..ledger.runs import lock_run

_G, _A, _S, _O = PromptGroup.__table__, Attempt.__table__, Sibling.__table__, OutboxItem.__table__


async def live_counts(engine: AsyncEngine, run_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        groups = dict((await conn.execute(select(_G.c.status, func.count()).where(_G.c.run_id == run_id).group_by(_G.c.status))).all())
        atts = dict(
            (
                await conn.execute(
                    select(_A.c.status, func.count())
                    .select_from(_A.join(_G, (_G.c.run_id == _A.c.run_id) & (_G.c.group_id == _A.c.group_id)))
                    .where(_A.c.run_id == run_id, _A.c.is_current, _G.c.status.in_([s.value for s in LIVE_GROUP_STATUSES]))
                    .group_by(_A.c.status)
                )
            ).all()
        )
        outbox = dict(
            (await conn.execute(select(_O.c.op, func.count()).where(_O.c.run_id == run_id, _O.c.state == OutboxState.pending).group_by(_O.c.op))).all()
        )
    return {"groups": groups, "live_attempts": atts, "outbox_pending": outbox}


_ATTEMPT_DETAIL = (
    "attempt_id", "generation_index", "rollout_id", "gym_instance_id", "gym_attempt", "group_attempt", "status", "is_current",
    "refusals", "reward", "mask_sample", "staging_keys", "failure_class", "retirement", "gym_owned", "dispatch_id", "policy_version",
    "created_at", "dispatched_at", "ended_at",
)


async def group_detail(engine: AsyncEngine, run_id: str, group_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        g = (await conn.execute(select(_G).where(_G.c.run_id == run_id, _G.c.group_id == group_id))).first()
        if g is None:
            raise NotFound(f"group {group_id!r} not found in run {run_id!r}", code="group_not_found")
        sibs = (
            await conn.execute(
                select(_S.c.generation_index, _S.c.row_attempts_used)
                .where(_S.c.run_id == run_id, _S.c.group_id == group_id)
                .order_by(_S.c.generation_index)
            )
        ).all()
        atts = (
            await conn.execute(
                select(*(_A.c[c] for c in _ATTEMPT_DETAIL))
                .where(_A.c.run_id == run_id, _A.c.group_id == group_id)
                .order_by(_A.c.generation_index, _A.c.attempt_id)
            )
        ).all()
    m = dict(g._mapping)
    by_sib: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for a in atts:
        d = dict(a._mapping)
        d["capture_key"] = capture_key(d["rollout_id"], d["gym_attempt"])
        for k in ("created_at", "dispatched_at", "ended_at"):
            d[k] = d[k].isoformat() if d[k] else None
        by_sib[d.pop("generation_index")].append(d)
    return {
        "group_id": m["group_id"],
        "status": m["status"],
        "restore_level": m["restore_level"],
        "granularity": granularity(m["restore_level"]),
        "expected_generations": m["expected_generations"],
        "group_attempt": m["group_attempt"],
        "data_attempts_used": m["data_attempts_used"],
        "prompt_ref": m["prompt_ref"],
        "task_digest": m["task_digest"],
        "task_source": m["task_source"],
        "agent_name": m["agent_name"],
        "target_step": m["target_step"],
        "weight_version": m["weight_version"],
        "siblings": [
            {"generation_index": s.generation_index, "row_attempts_used": s.row_attempts_used, "attempts": by_sib.get(s.generation_index, [])}
            for s in sibs
        ],
    }


_OUTBOX_DETAIL = ("item_id", "instance_id", "op", "rollout_id", "gym_attempt", "checkpoint_id", "tries", "last_error", "next_attempt_at", "created_at")


async def pending_outbox(engine: AsyncEngine, run_id: str, *, limit: int, after: int | None) -> dict[str, Any]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        pending = (_O.c.run_id == run_id) & (_O.c.state == OutboxState.pending)
        rows = (
            await conn.execute(
                select(*(_O.c[c] for c in _OUTBOX_DETAIL)).where(pending, _O.c.item_id > (after or 0)).order_by(_O.c.item_id).limit(limit)
            )
        ).all()
        oldest = (await conn.execute(select(func.min(_O.c.created_at)).where(pending))).scalar()
    items = []
    for r in rows:
        d = dict(r._mapping)
        d["next_attempt_at"] = d["next_attempt_at"].isoformat()
        d["created_at"] = d["created_at"].isoformat()
        items.append(d)
    return {"items": items, "oldest_created_at": oldest.isoformat() if oldest else None, "next_after": items[-1]["item_id"] if len(items) == limit else None}


async def pending_attempts(engine: AsyncEngine, run_id: str, rollout_ids: Sequence[str]) -> list[str]:
    """Which of these attempts are still pending (dispatched, current)? Index lookups only:
    the cost follows the number asked about, never the number of live rollouts."""
    rows = await read_rows(
        engine,
        "SELECT rollout_id FROM attempts WHERE run_id = %(r)s AND rollout_id = ANY(%(ids)s) AND is_current AND status = %(st)s",
        {"r": run_id, "ids": list(rollout_ids), "st": AttemptStatus.dispatched.value},
    )
    return sorted(r[0] for r in rows)
