"""The ledger cut (``ledger.snapshots.take_cut``) and its retention, on a real PostgreSQL.

The cut is one statement (the copy, staging keys, snapshot row) writing one row per group into
``snapshot_cut_groups``, read through the views ``snapshot_groups`` and ``snapshot_attempts``; the
cut storage has no foreign key to ``snapshots``, so retention deletes its rows itself. Status reads leave out the Gym manifest
and answer the staging keys only while the snapshot awaits its capture.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import text

from checkpoint_coordinator.api.schemas import SnapshotOut
from checkpoint_coordinator.domain.snapshot_state import SnapshotPhase
from checkpoint_coordinator.ledger import leases
from checkpoint_coordinator.snapshots import store as repo
from checkpoint_coordinator.ledger.db import make_async_engine

RUN = "run-cut"


def api_record(row: repo.SnapshotRow, *, with_manifest: bool = False) -> dict[str, Any]:
    """The snapshot record the API answers for ``row``."""
    return SnapshotOut.of(row, with_manifest=with_manifest).model_dump(mode="json", exclude_unset=True)


@pytest.fixture
async def engine(database_url: str) -> Any:
    eng = make_async_engine(database_url, pool_size=2)
    async with eng.begin() as conn:
        await conn.execute(text("INSERT INTO runs (run_id, config, checkpoint_root, token_hash) VALUES (:r, '{}', '/tmp', 'x')"), {"r": RUN})
        # g1 generating (4 siblings: sealed, returned, dispatched, reserved + a replaced attempt),
        # g2 ready, g3 finalized (not live: not in the cut).
        for gid, status in (("g1", "generating"), ("g2", "ready"), ("g3", "finalized")):
            await conn.execute(
                text(
                    "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, restore_level, expected_generations, status) "
                    "VALUES (:r, :g, CAST(:p AS jsonb), 'sha256:' || :g, 'turn', 4, :st)"
                ),
                {"r": RUN, "g": gid, "p": json.dumps({"sample_id": gid}), "st": status},
            )
            await conn.execute(
                text("INSERT INTO siblings (run_id, group_id, generation_index, row_attempts_used) SELECT :r, :g, i, i FROM generate_series(0, 3) i"),
                {"r": RUN, "g": gid},
            )
        rows = [
            ("g1", 0, "sealed", ["tq/b", "tq/a"], True),
            ("g1", 1, "returned", ["tq/a", "tq/c"], True),
            ("g1", 2, "dispatched", None, True),
            ("g1", 3, "reserved", None, True),
            ("g1", 3, "failed", ["tq/old"], False),  # replaced attempt: not current, not cut
            ("g2", 0, "sealed", ["tq/\u00e9"], True),
            ("g2", 1, "sealed", ["tq/Z"], True),
            ("g2", 2, "sealed", None, True),
            ("g2", 3, "sealed", None, True),
            ("g3", 0, "sealed", ["tq/gone"], True),
        ]
        for gid, i, st, keys, current in rows:
            await conn.execute(
                text(
                    "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, status, is_current, staging_keys, receipt) "
                    "VALUES (:r, :g, :i, :ro, :st, :cur, :k, CAST(:rc AS jsonb))"
                ),
                {"r": RUN, "g": gid, "i": i, "ro": f"{gid}-{i}-{st}", "st": st, "cur": current, "k": keys,
                 "rc": json.dumps({"rollout_id": f"{gid}-{i}"}) if keys else None},
            )
    try:
        yield eng
    finally:
        await eng.dispose()


MANIFEST = {"instances": {"math/replica-0": {"staging_keys": ["model/x", "tq/a"], "episodes": []}, "math/replica-1": {"episodes": []}}}


async def _data_plane(engine: Any, sid: str, manifest: dict[str, Any] | None = MANIFEST) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner, gym_manifest, counts) "
                 "VALUES (:r, :s, 0, 'data_plane', 'test', CAST(:m AS jsonb), '{\"candidates\": 3}')"),
            {"r": RUN, "s": sid, "m": json.dumps(manifest) if manifest is not None else None},
        )


async def _rows(engine: Any, sql: str, **p: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(sql), {"r": RUN, **p})).all())


async def test_cut_copies_live_rows_and_answers_sorted_distinct_keys(engine: Any) -> None:
    await _data_plane(engine, "s1")
    row = await repo.take_cut(engine, RUN, "s1")
    expected = sorted({"tq/b", "tq/a", "tq/c", "tq/\u00e9", "tq/Z", "model/x"})
    assert row.cut_staging_keys == expected
    assert row.cut_at is not None and row.awaiting == "capture"
    assert row.counts == {"candidates": 3, "cut_groups": 2, "cut_siblings": 8}
    assert row.gym_manifest is None  # not re-read to answer the barrier
    groups = await _rows(engine, "SELECT group_id, status FROM snapshot_groups WHERE run_id = :r AND snapshot_id = 's1' ORDER BY 1")
    assert [tuple(g) for g in groups] == [("g1", "generating"), ("g2", "ready")]
    atts = await _rows(
        engine,
        "SELECT sa.group_id, sa.generation_index, sa.status, sa.row_attempts_used, sa.staging_keys, sa.receipt FROM snapshot_attempts sa "
        "WHERE run_id = :r AND snapshot_id = 's1' ORDER BY 1, 2",
    )
    assert [(a.group_id, a.generation_index, a.status, a.row_attempts_used) for a in atts] == [
        ("g1", 0, "sealed", 0), ("g1", 1, "returned", 1), ("g1", 2, "dispatched", 2), ("g1", 3, "reserved", 3),
        ("g2", 0, "sealed", 0), ("g2", 1, "sealed", 1), ("g2", 2, "sealed", 2), ("g2", 3, "sealed", 3),
    ]
    assert atts[0].staging_keys == ["tq/b", "tq/a"] and atts[0].receipt == {"rollout_id": "g1-0"}

    # Idempotent: the same keys, no second copy.
    again = await repo.take_cut(engine, RUN, "s1")
    assert again.cut_staging_keys == expected and again.cut_at == row.cut_at
    n = await _rows(engine, "SELECT count(*) FROM snapshot_attempts WHERE run_id = :r AND snapshot_id = 's1'")
    assert n[0][0] == 8

    # Status reads: keys while awaiting the capture, the manifest only on request.
    async with engine.connect() as conn:
        got = await repo.get(conn, RUN, "s1")
        full = await repo.get(conn, RUN, "s1", with_manifest=True)
    assert api_record(got)["staging_keys"] == expected and "gym_manifest" not in api_record(got)
    assert api_record(full, with_manifest=True)["gym_manifest"] == MANIFEST
    done = await repo.captured(engine, RUN, "s1", {"path": "/d", "digest": "sha256:0"})
    assert done.awaiting is None and "staging_keys" not in api_record(done)
    async with engine.connect() as conn:
        after = await repo.get(conn, RUN, "s1")
        full = await repo.get(conn, RUN, "s1", with_manifest=True)
    assert after.cut_staging_keys is None and "staging_keys" not in api_record(after)
    assert api_record(full, with_manifest=True)["staging_keys"] == expected


_GROUP_VIEW_COLS = (
    "group_id, prompt_ref, task_digest, task_source, agent_name, restore_level, expected_generations, target_step, "
    "weight_version, group_attempt, data_attempts_used, status"
)
_ATTEMPT_VIEW_COLS = (
    "attempt_id, group_id, generation_index, row_attempts_used, rollout_id, gym_instance_id, gym_attempt, group_attempt, "
    "status, refusals, receipt, reward, mask_sample, staging_keys, gym_owned"
)


async def test_the_views_read_back_exactly_what_the_cut_copied(engine: Any) -> None:
    # Every column of a sibling in every shape it takes: NULL and empty key arrays, rewards,
    # masks, Gym fields, refusals; and a live group without a current attempt.
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE attempts SET gym_instance_id = 'math/replica-1', gym_attempt = 2, group_attempt = 1, refusals = 3, "
                "reward = 0.25, mask_sample = true, gym_owned = true, staging_keys = '{}' WHERE run_id = :r AND rollout_id = 'g1-2-dispatched'"
            ),
            {"r": RUN},
        )
        await conn.execute(
            text("UPDATE attempts SET reward = -1.5, mask_sample = false WHERE run_id = :r AND rollout_id = 'g2-0-sealed'"), {"r": RUN}
        )
        await conn.execute(
            text(
                "UPDATE prompt_groups SET task_source = 'src', agent_name = 'agent', target_step = 7, weight_version = 'w3', "
                "group_attempt = 2, data_attempts_used = 1 WHERE run_id = :r AND group_id = 'g2'"
            ),
            {"r": RUN},
        )
        await conn.execute(
            text(
                "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, restore_level, expected_generations) "
                "VALUES (:r, 'g4', '{}', 'sha256:g4', 'sibling', 1)"
            ),
            {"r": RUN},
        )
    live_groups = await _rows(
        engine, f"SELECT {_GROUP_VIEW_COLS} FROM prompt_groups WHERE run_id = :r AND status IN ('generating', 'ready') ORDER BY group_id"
    )
    live_attempts = await _rows(
        engine,
        f"SELECT {', '.join('a.' + c if c != 'row_attempts_used' else 's.row_attempts_used' for c in _ATTEMPT_VIEW_COLS.split(', '))} "
        "FROM attempts a JOIN siblings s USING (run_id, group_id, generation_index) JOIN prompt_groups g USING (run_id, group_id) "
        "WHERE a.run_id = :r AND a.is_current AND g.status IN ('generating', 'ready') ORDER BY a.attempt_id",
    )
    await _data_plane(engine, "s1")
    row = await repo.take_cut(engine, RUN, "s1")
    assert row.counts["cut_groups"] == 3 and row.counts["cut_siblings"] == 8
    cut_groups = await _rows(engine, f"SELECT {_GROUP_VIEW_COLS} FROM snapshot_groups WHERE run_id = :r AND snapshot_id = 's1' ORDER BY group_id")
    cut_attempts = await _rows(
        engine, f"SELECT {_ATTEMPT_VIEW_COLS} FROM snapshot_attempts WHERE run_id = :r AND snapshot_id = 's1' ORDER BY attempt_id"
    )
    assert [tuple(r) for r in cut_groups] == [tuple(r) for r in live_groups]
    assert [tuple(r) for r in cut_attempts] == [tuple(r) for r in live_attempts]
    by_rollout = {r.rollout_id: r for r in cut_attempts}
    assert by_rollout["g1-2-dispatched"].staging_keys == [] and by_rollout["g1-3-reserved"].staging_keys is None
    # One stored row per group, the group without attempts with an empty sibling array.
    stored = await _rows(
        engine, "SELECT group_id, cardinality(siblings) FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = 's1' ORDER BY 1"
    )
    assert [tuple(r) for r in stored] == [("g1", 4), ("g2", 4), ("g4", 0)]


async def test_cut_without_manifest_and_without_keys(engine: Any) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE attempts SET staging_keys = NULL WHERE run_id = :r"), {"r": RUN})
    await _data_plane(engine, "s1", manifest=None)
    row = await repo.take_cut(engine, RUN, "s1")
    assert row.cut_staging_keys == []
    assert row.counts["cut_siblings"] == 8


async def test_retention_deletes_the_cut_rows_of_removed_snapshots(engine: Any) -> None:
    for sid in ("s1", "s2", "s3"):
        await _data_plane(engine, sid)
        await repo.take_cut(engine, RUN, sid)
        await repo.captured(engine, RUN, sid, {"path": f"/d/{sid}", "digest": "sha256:0"})
        await repo.end(engine, RUN, sid, "published", "ok", keep_latest_k=2, fence=await owner_fence(engine), expected=SnapshotPhase.data_plane)
    left = await _rows(engine, "SELECT snapshot_id FROM snapshots WHERE run_id = :r ORDER BY 1")
    assert [r[0] for r in left] == ["s2", "s3"]
    for table in ("snapshot_cut_groups", "snapshot_groups", "snapshot_attempts"):
        per = await _rows(engine, f"SELECT snapshot_id, count(*) FROM {table} WHERE run_id = :r GROUP BY 1 ORDER BY 1")
        assert [r[0] for r in per] == ["s2", "s3"], table


async def test_a_snapshot_lost_after_its_cut_leaves_no_cut_rows(engine: Any) -> None:
    # s1 published (its cut is what a restore reads), s2 cut and then lost (the trainer's data
    # plane failed): only s1's copy stays; s2's row stays as history with its reason.
    await _data_plane(engine, "s1")
    await repo.take_cut(engine, RUN, "s1")
    await repo.captured(engine, RUN, "s1", {"path": "/d/s1", "digest": "sha256:0"})
    await repo.end(engine, RUN, "s1", "published", "ok", fence=await owner_fence(engine), expected=SnapshotPhase.data_plane)
    await _data_plane(engine, "s2")
    await repo.take_cut(engine, RUN, "s2")
    row, _ = await repo.end(engine, RUN, "s2", "failed", "data_plane_failed", fence=await owner_fence(engine), expected=SnapshotPhase.data_plane)
    assert row.outcome == "failed" and row.cut_at is not None
    for table in ("snapshot_cut_groups", "snapshot_groups", "snapshot_attempts"):
        per = await _rows(engine, f"SELECT snapshot_id, count(*) FROM {table} WHERE run_id = :r GROUP BY 1 ORDER BY 1")
        assert [r[0] for r in per] == ["s1"], table
    left = await _rows(engine, "SELECT snapshot_id, outcome, reason FROM snapshots WHERE run_id = :r ORDER BY 1")
    assert [tuple(r) for r in left] == [("s1", "published", "ok"), ("s2", "failed", "data_plane_failed")]


async def test_cut_refused_after_newer_train_step(engine: Any) -> None:
    await _data_plane(engine, "s1")
    await repo.announce_train_step(engine, RUN, 5, None)
    with pytest.raises(repo.SnapshotNotAwaiting):
        await repo.take_cut(engine, RUN, "s1")
    n = await _rows(engine, "SELECT count(*) FROM snapshot_attempts WHERE run_id = :r")
    assert n[0][0] == 0
    n = await _rows(engine, "SELECT count(*) FROM snapshot_cut_groups WHERE run_id = :r")
    assert n[0][0] == 0


async def owner_fence(engine: Any) -> leases.Fence:
    """The lease of the snapshots' owner (``test``), as its fenced writes need it."""
    epoch = await leases.acquire(engine, RUN, "test", 600)
    assert epoch is not None
    return leases.Fence("test", epoch)


async def test_an_end_by_a_replica_that_lost_the_lease_is_refused(engine: Any) -> None:
    await _data_plane(engine, "s1")
    stale = await owner_fence(engine)
    async with engine.begin() as conn:  # another replica took the run over
        await conn.execute(text("UPDATE ownership_leases SET owner = 'other', epoch = epoch + 1 WHERE run_id = :r"), {"r": RUN})
    with pytest.raises(leases.Fenced):
        await repo.end(engine, RUN, "s1", "failed", "data_plane_failed", fence=stale, expected=SnapshotPhase.data_plane)
    with pytest.raises(leases.Fenced):
        await repo.move(engine, RUN, "s1", stale, SnapshotPhase.data_plane, SnapshotPhase.resume)
    async with engine.connect() as conn:
        row = await repo.get(conn, RUN, "s1")
    assert (row.phase, row.outcome) == ("data_plane", None)


async def test_the_gate_closes_with_the_move_to_gate_or_not_at_all(engine: Any) -> None:
    """The gate's close and the move to ``gate`` are one statement: a move refused (the lease
    moved on) leaves the gate open, a closed run is refused as closed; the close answers the
    run's pending outbox items, claimed or in backoff too, and only after it closed."""
    from checkpoint_coordinator.errors import RunClosed

    async def state(sid: str) -> tuple[str | None, str]:
        async with engine.connect() as conn:
            gate = (await conn.execute(text("SELECT gate_snapshot_id FROM runs WHERE run_id = :r"), {"r": RUN})).scalar()
            return gate, (await repo.get(conn, RUN, sid)).phase

    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) VALUES (:r, 's1', 0, 'requested', 'test')"), {"r": RUN})
    stale = await owner_fence(engine)
    async with engine.begin() as conn:  # another replica took the run over
        await conn.execute(text("UPDATE ownership_leases SET epoch = epoch + 1 WHERE run_id = :r"), {"r": RUN})
    with pytest.raises(leases.Fenced):
        await repo.close_gate(engine, RUN, "s1", stale)
    assert await state("s1") == (None, "requested")

    fence = leases.Fence("test", stale.lease_epoch + 1)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO outbox_items (run_id, instance_id, op, rollout_id, checkpoint_id, state, next_attempt_at, claimed_until) VALUES "
                "(:r, 'i/0', 'retire', 'r0', 'retire', 'pending', now() + interval '1 hour', NULL), "
                "(:r, 'i/1', 'forget', 'r1', 'forget', 'pending', now(), now() + interval '1 hour'), "
                "(:r, 'i/2', 'retire', 'r2', 'retire', 'delivered', now(), NULL)"
            ),
            {"r": RUN},
        )
    assert await repo.close_gate(engine, RUN, "s1", fence, prepare_as="snap-s1-0000") == repo.GateClosure({("i/0", "retire"), ("i/1", "forget")}, False)
    assert await state("s1") == ("s1", "gate")  # owed items first: no move to prepare with the close

    async with engine.begin() as conn:  # a run closed under a new snapshot
        await conn.execute(text("UPDATE runs SET state = 'closed', gate_snapshot_id = NULL WHERE run_id = :r"), {"r": RUN})
        await conn.execute(text("UPDATE snapshots SET phase = 'aborted', outcome = 'aborted', reason = 'cancelled' WHERE run_id = :r"), {"r": RUN})
        await conn.execute(text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) VALUES (:r, 's2', 0, 'requested', 'test')"), {"r": RUN})
    with pytest.raises(RunClosed):
        await repo.close_gate(engine, RUN, "s2", fence)
    assert await state("s2") == (None, "requested")


async def test_with_nothing_owed_the_close_moves_on_to_prepare_in_its_transaction(engine: Any) -> None:
    fence = await owner_fence(engine)

    async def requested(sid: str, snapshot_dir: str | None) -> None:
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE runs SET gate_snapshot_id = NULL WHERE run_id = :r"), {"r": RUN})
            await conn.execute(text("UPDATE snapshots SET phase = 'aborted', outcome = 'aborted', reason = 'cancelled' WHERE run_id = :r AND outcome IS NULL"),
                               {"r": RUN})
            await conn.execute(
                text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner, snapshot_dir) VALUES (:r, :s, 0, 'requested', 'test', :d)"),
                {"r": RUN, "s": sid, "d": snapshot_dir},
            )

    # No instance registered: the snapshot cannot reach Gym, the close stops at gate.
    await requested("s0", "/ck/s0")
    assert await repo.close_gate(engine, RUN, "s0", fence, prepare_as="snap-s0-0001") == repo.GateClosure(set(), False)
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO gym_instances (run_id, instance_id, servers, control_token) VALUES (:r, 'i/0', '{}', 'tok')"), {"r": RUN})
    await requested("s1", "/ck/s1")
    closed = await repo.close_gate(engine, RUN, "s1", fence, prepare_as="snap-s1-0001")
    assert closed == repo.GateClosure(set(), True)
    async with engine.connect() as conn:
        row = await repo.get(conn, RUN, "s1")
        gate = (await conn.execute(text("SELECT gate_snapshot_id FROM runs WHERE run_id = :r"), {"r": RUN})).scalar()
    assert (row.phase, row.gym_checkpoint_id, row.snapshot_dir, gate) == ("prepare", "snap-s1-0001", "/ck/s1", "s1")
    # A row without a snapshot_dir stays in gate: its owner writes the directory with the move.
    await requested("s2", None)
    assert await repo.close_gate(engine, RUN, "s2", fence, prepare_as="snap-s2-0001") == repo.GateClosure(set(), False)
    async with engine.connect() as conn:
        row = await repo.get(conn, RUN, "s2")
    assert (row.phase, row.gym_checkpoint_id) == ("gate", None)


async def test_moves_recovery_treats_alike_commit_without_a_flush_and_stay_fenced(engine: Any) -> None:
    """Moves into ``UNFLUSHED_MOVES`` commit asynchronously (the owner does not wait for the log
    flush), every other move flushes; both are visible at once and both are fenced."""
    from sqlalchemy import event

    from checkpoint_coordinator.domain.snapshot_state import UNFLUSHED_MOVES

    P = SnapshotPhase
    # Recovery resumes Gym and aborts alike from each of them; prepare carries the checkpoint id,
    # the trainer acts on data_plane.
    assert P.prepare not in UNFLUSHED_MOVES and P.resume not in UNFLUSHED_MOVES and P.data_plane not in UNFLUSHED_MOVES
    assert all(p.gym_touched for p in UNFLUSHED_MOVES)
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) VALUES (:r, 's1', 0, 'retire', 'test')"), {"r": RUN}
        )
    fence = await owner_fence(engine)
    sent: list[str] = []

    every: list[tuple[str, bool]] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        every.append((statement, conn.connection.driver_connection.autocommit))
        if "UPDATE snapshots SET phase" in statement:
            sent.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        for expected, to in ((P.retire, P.prepare), (P.prepare, P.commit), (P.commit, P.drain), (P.drain, P.data_plane), (P.data_plane, P.resume)):
            await repo.move(engine, RUN, "s1", fence, expected, to)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
    assert ["synchronous_commit" in s for s in sent] == [False, True, False, False, False]
    # Each move is its one statement, committing by itself (one round trip while Gym is parked);
    # the unflushed one's setting rides in it (an autocommit statement is its own transaction).
    assert [a for _, a in every] == [True] * 5 and [st for st, _ in every] == sent
    async with engine.begin() as conn:  # the setting is the transaction's only
        await repo.move_in(conn, RUN, "s1", fence, P.resume, P.publish, flush=False)
        assert (await conn.execute(text("SHOW synchronous_commit"))).scalar() == "off"
    async with engine.connect() as conn:
        assert (await conn.execute(text("SHOW synchronous_commit"))).scalar() == "on"
        assert (await repo.get(conn, RUN, "s1")).phase == "publish"
    async with engine.begin() as conn:  # another replica took the run over
        await conn.execute(text("UPDATE ownership_leases SET owner = 'other', epoch = epoch + 1 WHERE run_id = :r"), {"r": RUN})
        await conn.execute(text("UPDATE snapshots SET phase = 'commit' WHERE run_id = :r"), {"r": RUN})
    with pytest.raises(leases.Fenced):
        await repo.move(engine, RUN, "s1", fence, P.commit, P.drain)
    async with engine.connect() as conn:
        assert (await repo.get(conn, RUN, "s1")).phase == "commit"


async def test_a_capture_is_one_autocommit_statement_and_every_other_case_is_answered_as_before(engine: Any) -> None:
    from sqlalchemy import event

    from checkpoint_coordinator.errors import Conflict, RunClosed

    await _data_plane(engine, "s1")
    with pytest.raises(repo.SnapshotNotAwaiting):  # before the barrier: nothing written
        await repo.captured(engine, RUN, "s1", {"path": "/d", "digest": "sha256:0"})
    await repo.take_cut(engine, RUN, "s1")
    every: list[tuple[str, bool]] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        every.append((statement, conn.connection.driver_connection.autocommit))

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        async with engine.connect() as listener:
            raw = listener.sync_connection.connection.driver_connection  # type: ignore[union-attr]
            await listener.execute(text(f"LISTEN {repo.NOTIFY_CHANNEL}"))
            await listener.commit()
            done = await repo.captured(engine, RUN, "s1", {"path": "/d", "digest": "sha256:0"})
            heard = [n.payload async for n in raw.notifies(timeout=2, stop_after=1)]
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
    mine = [(st, a) for st, a in every if "data_plane_ref" in st]
    assert len(mine) == 1 and mine[0][1] is True  # one round trip while Gym is parked
    assert heard == [f"{RUN}/s1"]  # the owner hears of it (a handshake, not a move of its own)
    assert done.data_plane_ref == {"path": "/d", "digest": "sha256:0"} and done.awaiting is None and "staging_keys" not in api_record(done)
    # A repeat is answered as stored; another reference is a conflict.
    again = await repo.captured(engine, RUN, "s1", {"path": "/d", "digest": "sha256:0"})
    assert again.data_plane_ref == done.data_plane_ref
    with pytest.raises(Conflict):
        await repo.captured(engine, RUN, "s1", {"path": "/other", "digest": "sha256:1"})
    # A closed run takes no capture, and nothing is written.
    await repo.end(engine, RUN, "s1", "published", "ok", fence=await owner_fence(engine), expected=SnapshotPhase.data_plane)
    await _data_plane(engine, "s2")
    await repo.take_cut(engine, RUN, "s2")
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE runs SET state = 'closed' WHERE run_id = :r"), {"r": RUN})
    with pytest.raises(RunClosed):
        await repo.captured(engine, RUN, "s2", {"path": "/d2", "digest": "sha256:2"})
    assert await _rows(engine, "SELECT data_plane_ref FROM snapshots WHERE run_id = :r AND snapshot_id = 's2'") == [(None,)]
