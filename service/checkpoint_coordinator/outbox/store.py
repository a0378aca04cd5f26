"""Durable retire/forget queue (docs/ledger.md#the-outbox).

Items are claimed (``FOR UPDATE SKIP LOCKED`` picks them, an owner and expiry keep them), so two
coordinator replicas never deliver the same item at once; every claim and acknowledgement also
carries the run's lease (``fence_sql``), so a replica that lost it stops at its next write. Progress is recorded per participant
stage, so a coordinator that dies mid-delivery resumes with the stages still owed instead of
sending the whole batch again; its claims expire, or are released when it restarts.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain.vocabulary import (
    FORGET_CHECKPOINT_ID,
    RETIRE_CHECKPOINT_ID,
    OutboxOp,
    OutboxState,
)
from ..ledger.db import execute
from ..ledger.leases import Fence, Fenced, fence_sql

MAX_BATCH = 1024


@dataclass(frozen=True)
class DueOutboxItem:
    item_id: int
    instance_id: str
    op: str
    rollout_id: str
    gym_attempt: int | None
    attempt_id: int | None
    checkpoint_id: str
    tries: int
    servers_done: list[str]


async def due_work(engine: AsyncEngine, run_ids: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(run_id, instance_id) pairs with pending, unclaimed, due items whose run has no open checkpoint."""
    where = "AND o.run_id = ANY(:runs)" if run_ids is not None else ""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT DISTINCT o.run_id, o.instance_id FROM outbox_items o JOIN runs r ON r.run_id = o.run_id "
                    f"WHERE o.state = '{OutboxState.pending}' AND o.next_attempt_at <= now() AND r.gate_snapshot_id IS NULL "
                    "AND (o.claimed_until IS NULL OR o.claimed_until < now()) "
                    f"{where} ORDER BY 1, 2"
                ),
                {"runs": list(run_ids or [])},
            )
        ).all()
    return [(r.run_id, r.instance_id) for r in rows]


async def owed(engine: AsyncEngine, run_id: str, *, ignore_schedule: bool = False) -> set[tuple[str, str]]:
    """(instance_id, op) pairs of the run with pending, unclaimed items (due ones only unless
    ``ignore_schedule``): one index scan, so that a delivery with nothing owed costs one query."""
    due = "" if ignore_schedule else "AND next_attempt_at <= now()"
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    f"SELECT DISTINCT instance_id, op FROM outbox_items WHERE run_id = :r AND state = '{OutboxState.pending}' "
                    f"{due} AND (claimed_until IS NULL OR claimed_until < now())"
                ),
                {"r": run_id},
            )
        ).all()
    return {(r.instance_id, r.op) for r in rows}


async def pending_of_run(conn: AsyncConnection, run_id: str) -> set[tuple[str, str]]:
    """(instance_id, op) pairs of the run with any pending item, in backoff or claimed included:
    with none, a snapshot has no retire phase. With some, it delivers them before its prepare,
    after any delivery of this replica under way (a claim of another replica is not waited for)."""
    rows = (await conn.execute(text(f"SELECT DISTINCT instance_id, op FROM outbox_items WHERE run_id = :r AND state = '{OutboxState.pending}'"), {"r": run_id})).all()
    return {(r.instance_id, r.op) for r in rows}


async def claim(
    engine: AsyncEngine, run_id: str, instance_id: str, op: str, fence: Fence, claim_s: float, *, ignore_schedule: bool = False, limit: int = MAX_BATCH
) -> list[DueOutboxItem]:
    """Claim up to ``limit`` pending items for delivery by ``owner``; committed at once.

    ``FOR UPDATE SKIP LOCKED`` lets replicas claim side by side without waiting on each other;
    the claim itself (owner, expiry) keeps them apart for the whole delivery, and a claim whose
    owner died expires. Raises :class:`Fenced` when ``fence`` no longer holds the run's lease.
    """
    due = "" if ignore_schedule else "AND next_attempt_at <= now()"
    async with engine.begin() as conn:
        if not (await conn.execute(text(f"SELECT {fence_sql()}"), {"r": run_id, **fence.params()})).scalar():
            raise Fenced(run_id, f"claiming {op} items", fence)
        rows = (
            await conn.execute(
                text(
                    "UPDATE outbox_items SET claimed_by = :fence_owner, claimed_until = now() + make_interval(secs => :ttl) "
                    f"WHERE {fence_sql()} AND item_id IN (SELECT item_id FROM outbox_items "
                    f"  WHERE run_id = :r AND instance_id = :i AND op = :op AND state = '{OutboxState.pending}' {due} "
                    "  AND (claimed_until IS NULL OR claimed_until < now()) "
                    "  ORDER BY item_id LIMIT :lim FOR UPDATE SKIP LOCKED) "
                    "RETURNING item_id, instance_id, op, rollout_id, gym_attempt, attempt_id, checkpoint_id, tries, servers_done"
                ),
                {"r": run_id, "i": instance_id, "op": op, "lim": limit, "ttl": claim_s, **fence.params()},
            )
        ).all()
    return sorted((DueOutboxItem(**dict(r._mapping)) for r in rows), key=lambda x: x.item_id)


async def record_progress(engine: AsyncEngine, run_id: str, items: Sequence[DueOutboxItem], servers: Sequence[str], fence: Fence) -> None:
    """These participants acknowledged these items: durable before the next stage is sent."""
    if not items or not servers:
        return
    async with engine.begin() as conn:
        n = (
            await conn.execute(
                text(
                    "UPDATE outbox_items SET servers_done = ARRAY(SELECT DISTINCT x FROM unnest(servers_done || CAST(:s AS text[])) AS x ORDER BY x) "
                    f"WHERE item_id = ANY(:ids) AND claimed_by = :fence_owner AND {fence_sql()}"
                ),
                {"r": run_id, "ids": [i.item_id for i in items], "s": list(servers), **fence.params()},
            )
        ).rowcount
        _acknowledged(run_id, n, items, "recording delivery progress", fence)


async def release_claims(engine: AsyncEngine, owner: str) -> int:
    """On start: claims this coordinator held before it died are free again (nothing of ours is in flight)."""
    async with engine.begin() as conn:
        return (
            await conn.execute(text(f"UPDATE outbox_items SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = :o AND state = '{OutboxState.pending}'"), {"o": owner})
        ).rowcount


@contextlib.asynccontextmanager
async def acknowledging(engine: AsyncEngine, run_id: str) -> AsyncIterator[AsyncConnection]:
    """The transaction of a delivery's acknowledgements (:func:`mark_delivered`,
    :func:`mark_failed`, :func:`enqueue_forgets`), the run row locked first (FOR KEY SHARE).

    Whatever locks both the run row and the run's lease takes the run row first: a snapshot
    request locks it FOR UPDATE, then upserts the lease. The acknowledgements take the lease
    FOR SHARE (``fence_sql``), and a queued forget's foreign key then takes the run row FOR KEY
    SHARE: lease before run, and a request in between deadlocked with them (it was answered
    503, SQLSTATE 40P01). FOR KEY SHARE is the lock the foreign key takes anyway, now taken
    before the lease: against a holder of the run row FOR UPDATE the acknowledgement waits
    holding nothing."""
    async with engine.begin() as conn:
        await conn.execute(text("SELECT 1 FROM runs WHERE run_id = :r FOR KEY SHARE"), {"r": run_id})
        yield conn


def _acknowledged(run_id: str, n: int, items: Sequence[DueOutboxItem], what: str, fence: Fence) -> None:
    """Every item is still claimed by ``fence``'s owner under its lease, or the write is refused
    (the caller's transaction rolls back with it)."""
    if n != len(items):
        raise Fenced(run_id, what, fence)


async def mark_delivered(conn: AsyncConnection, run_id: str, items: Sequence[DueOutboxItem], fence: Fence) -> None:
    if not items:
        return
    n = (
        await conn.execute(
            text(
                f"UPDATE outbox_items SET state = '{OutboxState.delivered}', delivered_at = now(), tries = tries + 1, last_error = NULL, "
                f"claimed_by = NULL, claimed_until = NULL WHERE item_id = ANY(:ids) AND claimed_by = :fence_owner AND {fence_sql()}"
            ),
            {"r": run_id, "ids": [i.item_id for i in items], **fence.params()},
        )
    ).rowcount
    _acknowledged(run_id, n, items, "acknowledging delivered items", fence)


async def mark_failed(
    conn: AsyncConnection, run_id: str, items: Sequence[DueOutboxItem], fence: Fence, error: str, *, base_backoff_s: float, max_backoff_s: float
) -> None:
    if not items:
        return
    n = (
        await conn.execute(
            text(
                "UPDATE outbox_items SET tries = tries + 1, last_error = :err, claimed_by = NULL, claimed_until = NULL, "
                "next_attempt_at = now() + make_interval(secs => LEAST(:cap, :base * power(2, LEAST(tries, 16)))) "
                f"WHERE item_id = ANY(:ids) AND claimed_by = :fence_owner AND {fence_sql()}"
            ),
            {"r": run_id, "ids": [i.item_id for i in items], "err": error[:4096], "base": base_backoff_s, "cap": max_backoff_s, **fence.params()},
        )
    ).rowcount
    _acknowledged(run_id, n, items, "recording failed deliveries", fence)


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
            f"SELECT :r, :i, '{OutboxOp.forget}', ro, ga, aid, '{FORGET_CHECKPOINT_ID}' FROM unnest(CAST(:ro AS text[]), CAST(:ga AS int[]), CAST(:aid AS bigint[])) AS t(ro, ga, aid)"
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
                    f"WHERE state = '{OutboxState.pending}' GROUP BY op"
                )
            )
        ).all()
    out = {"retire": (0, 0.0), "forget": (0, 0.0)}
    for op, n, age in rows:
        out[op] = (int(n), float(age))
    return out




_ITEM_COLUMNS = "(run_id, instance_id, op, rollout_id, gym_attempt, attempt_id, checkpoint_id)"


def insert_items_sql(source: str, *, skip_if_pending: bool = False) -> str:
    """``INSERT INTO outbox_items`` of the rows ``source`` selects, in the column order
    ``run_id, instance_id, op, rollout_id, gym_attempt, attempt_id, checkpoint_id``, returning
    ``attempt_id``: for callers that queue items in the same statement as their ledger change.
    ``skip_if_pending``: ``source`` is an alias ``i`` of such rows, and a row whose retire is
    already pending for the same rollout at that Gym attempt or later is left out."""
    if not skip_if_pending:
        return f"INSERT INTO outbox_items {_ITEM_COLUMNS} {source} RETURNING attempt_id"
    return (
        f"INSERT INTO outbox_items {_ITEM_COLUMNS} SELECT DISTINCT i.* FROM ({source}) AS i(run_id, instance_id, op, rollout_id, "
        "gym_attempt, attempt_id, checkpoint_id) WHERE i.instance_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM outbox_items o "
        f"WHERE o.run_id = i.run_id AND o.state = '{OutboxState.pending}' AND o.op = i.op AND o.instance_id = i.instance_id "
        "AND o.rollout_id = i.rollout_id AND o.gym_attempt >= i.gym_attempt) RETURNING attempt_id"
    )


async def enqueue_retires(
    conn: AsyncConnection, run_id: str, items: Sequence[tuple[str, str, int, int]], checkpoint_id: str = RETIRE_CHECKPOINT_ID
) -> None:
    """Queue a retire of each ``(instance_id, rollout_id, gym_attempt, attempt_id)`` in the
    caller's transaction (docs/ledger.md#the-outbox)."""
    if not items:
        return
    await execute(
        conn,
        insert_items_sql(
            f"SELECT %(r)s, inst, '{OutboxOp.retire}', ro, ga, aid, %(cp)s FROM unnest(%(inst)s::text[], %(ro)s::text[], %(ga)s::int[], "
            "%(aid)s::bigint[]) AS t(inst, ro, ga, aid)"
        ),
        {
            "r": run_id,
            "cp": checkpoint_id,
            "inst": [x[0] for x in items],
            "ro": [x[1] for x in items],
            "ga": [x[2] for x in items],
            "aid": [x[3] for x in items],
        },
        prepare=False,
    )


async def supersede_pending(conn: AsyncConnection, run_id: str, rollout_ids: Sequence[str]) -> int:
    """Pending items of these rollouts will not be delivered (a restore installed them again)."""
    if not rollout_ids:
        return 0
    return await execute(
        conn,
        f"UPDATE outbox_items o SET state = '{OutboxState.superseded}' FROM unnest(%(ro)s::text[]) AS c(ro) "
        f"WHERE o.run_id = %(r)s AND o.state = '{OutboxState.pending}' AND o.rollout_id = c.ro",
        {"r": run_id, "ro": list(rollout_ids)},
    )
