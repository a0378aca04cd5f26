"""The lock order of transactions that lock both a run's row and its lease row: the run first.

A snapshot request locks the run row FOR UPDATE and then upserts the run's lease. A transaction
that held the lease (a fenced write's ``fence_sql`` takes it FOR SHARE) and then wanted the run
row (a foreign key to ``runs`` takes it FOR KEY SHARE, the gate's reopen updates it) deadlocked
with it: seen as a snapshot request answered 503 (SQLSTATE 40P01) while the outbox acknowledged a
retire and queued its forget. Each test holds one side mid-transaction and checks that the other
waits for the run row before it takes the lease, and that both then go through.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from checkpoint_coordinator.domain.snapshot_state import SnapshotPhase
from checkpoint_coordinator.ledger import leases
from checkpoint_coordinator.ledger.db import make_async_engine
from checkpoint_coordinator.ledger.runs import lock_run
from checkpoint_coordinator.outbox import store as outbox
from checkpoint_coordinator.snapshots import service as snapshot_service
from checkpoint_coordinator.snapshots import store as repo
from checkpoint_coordinator.snapshots.pending import MonotonicClock
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from ..gym_placeholders import register_placeholders

RUN = "run-locks"
OWNER = "test"


@pytest.fixture
async def engine(database_url: str) -> Any:
    eng = make_async_engine(database_url, pool_size=4)
    async with eng.begin() as conn:
        await conn.execute(text("INSERT INTO runs (run_id, config, checkpoint_root, token_hash) VALUES (:r, '{}', '/tmp/ckptc-locks', 'x')"), {"r": RUN})
    await register_placeholders(eng, RUN, "i/0")  # a snapshot is refused to a run without Gym
    try:
        yield eng
    finally:
        await eng.dispose()


async def _fence(engine: Any) -> leases.Fence:
    epoch = await leases.acquire(engine, RUN, OWNER, 600)
    assert epoch is not None
    return leases.Fence(OWNER, epoch)


async def _row_waited_for(engine: Any, timeout: float = 10) -> str:
    """The table of the row another backend of this database waits to lock (the waiter holds
    that row's tuple lock while it waits for the transaction that has the row)."""
    async with asyncio.timeout(timeout):
        while True:
            async with engine.connect() as conn:
                table = (
                    await conn.execute(
                        text(
                            "SELECT l.relation::regclass::text FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                            "WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() AND a.wait_event_type = 'Lock' "
                            "AND l.locktype = 'tuple'"
                        )
                    )
                ).scalar()
            if table is not None:
                return str(table)
            await asyncio.sleep(0.01)


async def _claimed_retire(engine: Any, fence: leases.Fence) -> list[outbox.DueOutboxItem]:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO outbox_items (run_id, instance_id, op, rollout_id, gym_attempt, checkpoint_id) "
                "VALUES (:r, 'i/0', 'retire', 'r0', 0, 'retire')"
            ),
            {"r": RUN},
        )
    items = await outbox.claim(engine, RUN, "i/0", "retire", fence, 60)
    assert len(items) == 1
    return items


async def _acknowledge_retire(conn: Any, items: list[outbox.DueOutboxItem], fence: leases.Fence) -> None:
    """What the outbox worker writes once a retire was acknowledged: delivered, and its forget queued."""
    await outbox.mark_delivered(conn, RUN, items, fence)
    await outbox.enqueue_forgets(conn, RUN, "i/0", [(it.rollout_id, it.gym_attempt, it.attempt_id) for it in items])


async def test_a_snapshot_request_waits_for_an_outbox_acknowledgement_before_the_lease(engine: Any) -> None:
    """The interleaving of the failure: the acknowledgement holds its locks (the run row's, then
    the lease's FOR SHARE through the fence) when the request starts; the request waits for the
    run row, holding nothing, and the forget's foreign key finds the run row already locked."""
    fence = await _fence(engine)
    items = await _claimed_retire(engine, fence)
    runner = SimpleNamespace(owner=OWNER, start=lambda *args, **kwargs: None, ctx=SimpleNamespace(clock=MonotonicClock()))
    async with outbox.acknowledging(engine, RUN) as ack:
        await outbox.mark_delivered(ack, RUN, items, fence)
        request = asyncio.ensure_future(snapshot_service.request_snapshot(engine, runner, RUN, "s1", 0, lease_ttl_s=600))
        assert await _row_waited_for(engine) == "runs"
        await outbox.enqueue_forgets(ack, RUN, "i/0", [(it.rollout_id, it.gym_attempt, it.attempt_id) for it in items])
    row, created = await asyncio.wait_for(request, 10)
    # Created by its owner's replica: the request closed the gate too; the queued forget is owed to Gym.
    assert created and row.phase == SnapshotPhase.gate
    async with engine.connect() as conn:
        states = dict((await conn.execute(text("SELECT op, state FROM outbox_items WHERE run_id = :r"), {"r": RUN})).all())
    assert states == {"retire": "delivered", "forget": "pending"}


async def test_an_outbox_acknowledgement_waits_for_a_snapshot_request_before_the_lease(engine: Any) -> None:
    """The other interleaving: the request holds the run row FOR UPDATE; the acknowledgement waits
    for it before it takes the lease, so the request's lease upsert goes through at once."""
    fence = await _fence(engine)
    items = await _claimed_retire(engine, fence)

    async def acknowledge() -> None:
        async with outbox.acknowledging(engine, RUN) as ack:
            await _acknowledge_retire(ack, items, fence)

    async with engine.begin() as req:
        await lock_run(req, RUN, for_update=True)
        acked = asyncio.ensure_future(acknowledge())
        assert await _row_waited_for(engine) == "runs"
        assert await asyncio.wait_for(leases.acquire_in(req, RUN, OWNER, 600), 5) == fence.lease_epoch
        await repo.create_in(req, RUN, "s1", 0, OWNER, "/tmp/ckptc-locks/s1")
    await asyncio.wait_for(acked, 10)


async def test_the_publish_move_takes_the_run_row_before_the_lease(engine: Any) -> None:
    """The move to publish reopens the gate in its transaction: the run row is updated before
    the fenced move takes the lease, so a request (or a repeated barrier or capture) holding the
    run row is waited for, not deadlocked with."""
    fence = await _fence(engine)
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) VALUES (:r, 's1', 0, 'resume', :o)"), {"r": RUN, "o": OWNER}
        )
        await conn.execute(text("UPDATE runs SET gate_snapshot_id = 's1' WHERE run_id = :r"), {"r": RUN})
    async with engine.begin() as req:
        await lock_run(req, RUN, for_update=True)
        published = asyncio.ensure_future(repo.publish_phase(engine, RUN, "s1", fence))
        assert await _row_waited_for(engine) == "runs"
        assert await asyncio.wait_for(leases.acquire_in(req, RUN, OWNER, 600), 5) == fence.lease_epoch
    await asyncio.wait_for(published, 10)
    async with engine.connect() as conn:
        gate = (await conn.execute(text("SELECT gate_snapshot_id FROM runs WHERE run_id = :r"), {"r": RUN})).scalar()
        assert (gate, (await repo.get(conn, RUN, "s1")).phase) == (None, "publish")


async def test_the_gates_close_takes_the_run_row_before_the_lease(engine: Any) -> None:
    """The gate's close is one statement of CTEs (whose order PostgreSQL does not promise): held
    up at the lease, it already holds the run row, the order every other writer takes them in."""
    fence = await _fence(engine)
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) VALUES (:r, 's1', 0, 'requested', :o)"), {"r": RUN, "o": OWNER}
        )
    async with engine.begin() as holder:
        await holder.execute(text("SELECT 1 FROM ownership_leases WHERE run_id = :r FOR UPDATE"), {"r": RUN})
        closed = asyncio.ensure_future(repo.close_gate(engine, RUN, "s1", fence))
        assert await _row_waited_for(engine) == "ownership_leases"
        async with engine.connect() as probe:
            with pytest.raises(DBAPIError) as e:
                await probe.execute(text("SELECT 1 FROM runs WHERE run_id = :r FOR UPDATE NOWAIT"), {"r": RUN})
            assert getattr(e.value.orig, "sqlstate", None) == "55P03"  # lock_not_available: the close holds it
    assert await asyncio.wait_for(closed, 10) == repo.GateClosure(set(), False)


async def test_a_capture_in_one_statement_takes_the_run_row_before_the_snapshot_row(engine: Any) -> None:
    """The capture is one statement of CTEs: held up at the run row (a request holds it), it
    holds no lock on the snapshot row yet, the order the barrier and the end take them in."""
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner, cut_at) VALUES (:r, 's1', 0, 'data_plane', :o, now())"),
            {"r": RUN, "o": OWNER},
        )
    async with engine.begin() as req:
        await lock_run(req, RUN, for_update=True)
        captured = asyncio.ensure_future(repo.captured(engine, RUN, "s1", {"path": "/d", "digest": "sha256:0"}))
        assert await _row_waited_for(engine) == "runs"
        async with engine.connect() as probe:  # the snapshot row is free: the capture waits holding nothing
            await probe.execute(text("SELECT 1 FROM snapshots WHERE run_id = :r AND snapshot_id = 's1' FOR UPDATE NOWAIT"), {"r": RUN})
    row = await asyncio.wait_for(captured, 10)
    assert row.data_plane_ref == {"path": "/d", "digest": "sha256:0"}
