"""Durable retire/forget queue (recovery-ledger.md section 7).

Items are claimed with ``FOR UPDATE SKIP LOCKED`` inside a transaction that stays open while the
batch is delivered, so two coordinator replicas never deliver the same item at once, and a
coordinator that dies mid-delivery leaves the items pending (its transaction rolls back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

MAX_BATCH = 1024


@dataclass(frozen=True)
class OutboxItem:
    item_id: int
    instance_id: str
    op: str
    rollout_id: str
    gym_attempt: int | None
    attempt_id: int | None
    checkpoint_id: str
    tries: int


async def due_work(engine: AsyncEngine, run_ids: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(run_id, instance_id) pairs with pending items that are due and whose run has no open checkpoint."""
    where = "AND o.run_id = ANY(:runs)" if run_ids is not None else ""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT DISTINCT o.run_id, o.instance_id FROM outbox_items o JOIN runs r ON r.run_id = o.run_id "
                    "WHERE o.state = 'pending' AND o.next_attempt_at <= now() AND r.gate_snapshot_id IS NULL "
                    f"{where} ORDER BY 1, 2"
                ),
                {"runs": list(run_ids or [])},
            )
        ).all()
    return [(r.run_id, r.instance_id) for r in rows]


async def claim(conn: AsyncConnection, run_id: str, instance_id: str, op: str, *, ignore_schedule: bool = False, limit: int = MAX_BATCH) -> list[OutboxItem]:
    due = "" if ignore_schedule else "AND next_attempt_at <= now()"
    rows = (
        await conn.execute(
            text(
                "SELECT item_id, instance_id, op, rollout_id, gym_attempt, attempt_id, checkpoint_id, tries FROM outbox_items "
                f"WHERE run_id = :r AND instance_id = :i AND op = :op AND state = 'pending' {due} "
                "ORDER BY item_id LIMIT :lim FOR UPDATE SKIP LOCKED"
            ),
            {"r": run_id, "i": instance_id, "op": op, "lim": limit},
        )
    ).all()
    return [OutboxItem(**dict(r._mapping)) for r in rows]


async def mark_delivered(conn: AsyncConnection, items: Sequence[OutboxItem]) -> None:
    if not items:
        return
    await conn.execute(
        text("UPDATE outbox_items SET state = 'delivered', delivered_at = now(), tries = tries + 1, last_error = NULL WHERE item_id = ANY(:ids)"),
        {"ids": [i.item_id for i in items]},
    )


async def mark_failed(conn: AsyncConnection, items: Sequence[OutboxItem], error: str, *, base_backoff_s: float, max_backoff_s: float) -> None:
    if not items:
        return
    await conn.execute(
        text(
            "UPDATE outbox_items SET tries = tries + 1, last_error = :err, "
            "next_attempt_at = now() + make_interval(secs => LEAST(:cap, :base * power(2, LEAST(tries, 16)))) "
            "WHERE item_id = ANY(:ids)"
        ),
        {"ids": [i.item_id for i in items], "err": error[:4096], "base": base_backoff_s, "cap": max_backoff_s},
    )


async def set_retirement(conn: AsyncConnection, attempt_ids: Sequence[int], state: str) -> None:
    ids = [a for a in attempt_ids if a is not None]
    if ids:
        await conn.execute(text("UPDATE attempts SET retirement = :s WHERE attempt_id = ANY(:ids)"), {"s": state, "ids": ids})


async def enqueue_forgets(conn: AsyncConnection, run_id: str, instance_id: str, items: Sequence[tuple[str, int | None, int | None]]) -> None:
    """Queue forgets of (rollout_id, last retired gym_attempt, attempt_id) on one instance."""
    if not items:
        return
    await conn.execute(
        text(
            "INSERT INTO outbox_items (run_id, instance_id, op, rollout_id, gym_attempt, attempt_id, checkpoint_id) "
            "SELECT :r, :i, 'forget', ro, ga, aid, 'forget' FROM unnest(CAST(:ro AS text[]), CAST(:ga AS int[]), CAST(:aid AS bigint[])) AS t(ro, ga, aid)"
        ),
        {"r": run_id, "i": instance_id, "ro": [x[0] for x in items], "ga": [x[1] for x in items], "aid": [x[2] for x in items]},
    )


async def backlog(engine: AsyncEngine) -> dict[str, tuple[int, float]]:
    """Pending count and oldest age in seconds, per op, across all runs (for the gauges)."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT op, count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0) FROM outbox_items "
                    "WHERE state = 'pending' GROUP BY op"
                )
            )
        ).all()
    out = {"retire": (0, 0.0), "forget": (0, 0.0)}
    for op, n, age in rows:
        out[op] = (int(n), float(age))
    return out


def describe(items: Sequence[OutboxItem]) -> dict[str, Any]:
    return {"count": len(items), "sample": [i.rollout_id for i in items[:10]]}
