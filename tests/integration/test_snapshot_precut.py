"""The pre-cut (``ledger.snapshots.pre_cut``) and the barrier's delta copy, on a real PostgreSQL.

The runner copies the whole ledger while Gym prepares and commits; at the barrier ``take_cut``
copies again only the groups with a row written since the pre-cut's base (or gone since). The
promise checked here: whatever happened in between, the cut a barrier takes after a pre-cut is
row for row the cut a whole-run copy takes at the same moment, with the same staging keys and
counts; and a pre-cut of a snapshot that does not publish leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from checkpoint_coordinator.domain.snapshot_state import SnapshotPhase
from checkpoint_coordinator.ledger.db import JsonText
from checkpoint_coordinator.ledger.leases import Fenced
from checkpoint_coordinator.ledger.notify import _notice
from checkpoint_coordinator.snapshots import store as repo
from checkpoint_coordinator.snapshots.store.cut import _DELTA_CUT_SQL
from sqlalchemy import text

from . import test_snapshot_cut as cut_tests
from .test_snapshot_cut import (
    _ATTEMPT_VIEW_COLS,
    _GROUP_VIEW_COLS,
    MANIFEST,
    RUN,
    _data_plane,
    _rows,
    owner_fence,
)

engine = cut_tests.engine  # the same small ledger: g1 generating, g2 ready, g3 finalized


async def _cut_keys(engine: Any) -> tuple[str, list[str]]:
    as_of, keys = await repo.cut_keys(engine, RUN, "p")
    return as_of, json.loads(keys)


async def _committing(engine: Any, sid: str) -> None:
    """A snapshot in phase commit: the pre-cut's moment (the barrier is not open yet)."""
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner, gym_manifest, counts) "
                 "VALUES (:r, :s, 0, 'commit', 'test', CAST(:m AS jsonb), '{\"candidates\": 3}')"),
            {"r": RUN, "s": sid, "m": json.dumps(MANIFEST)},
        )


async def _to_data_plane(engine: Any, sid: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE snapshots SET phase = 'data_plane' WHERE run_id = :r AND snapshot_id = :s"), {"r": RUN, "s": sid})


async def _cut_of(engine: Any, sid: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    groups = await _rows(engine, f"SELECT {_GROUP_VIEW_COLS} FROM snapshot_groups WHERE run_id = :r AND snapshot_id = :s ORDER BY group_id", s=sid)
    atts = await _rows(engine, f"SELECT {_ATTEMPT_VIEW_COLS} FROM snapshot_attempts WHERE run_id = :r AND snapshot_id = :s ORDER BY attempt_id", s=sid)
    return [tuple(g) for g in groups], [tuple(a) for a in atts]


async def _stored(engine: Any, sid: str) -> int:
    return (await _rows(engine, "SELECT count(*) FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = :s", s=sid))[0][0]


async def _add_group(conn: Any, gid: str, status: str = "generating", keys: list[str] | None = None) -> None:
    await conn.execute(
        text("INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, restore_level, expected_generations, status) "
             "VALUES (:r, :g, '{}', 'sha256:' || :g, 'sibling', 1, :st)"),
        {"r": RUN, "g": gid, "st": status},
    )
    await conn.execute(text("INSERT INTO siblings (run_id, group_id, generation_index) VALUES (:r, :g, 0)"), {"r": RUN, "g": gid})
    await conn.execute(
        text("INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, status, staging_keys) VALUES (:r, :g, 0, :ro, :st, :k)"),
        {"r": RUN, "g": gid, "ro": f"{gid}-0", "st": "sealed" if keys else "reserved", "k": keys},
    )


async def _quiet_groups(engine: Any, n: int = 10) -> None:
    """Groups nothing touches after the pre-cut: the barrier re-copies only when at most a third
    of the pre-cut's groups changed (past that, one whole copy is cheaper)."""
    async with engine.begin() as conn:
        for k in range(n):
            await _add_group(conn, f"q{k:02d}", keys=[f"tq/q{k:02d}"])


async def _same_as_a_whole_run_cut(engine: Any, sid: str, row: Any) -> None:
    """Take a whole-run cut now (another snapshot, no pre-cut) and compare everything."""
    ref_sid = sid + "-whole"
    async with engine.begin() as conn:  # one open snapshot per run: this one is done
        await conn.execute(text("UPDATE snapshots SET outcome = 'published' WHERE run_id = :r AND snapshot_id = :s"), {"r": RUN, "s": sid})
    await _data_plane(engine, ref_sid)
    ref = await repo.take_cut(engine, RUN, ref_sid)
    assert "cut_recopied_groups" not in ref.counts
    assert await _cut_of(engine, sid) == await _cut_of(engine, ref_sid)
    assert row.cut_staging_keys == ref.cut_staging_keys
    assert (row.counts["cut_groups"], row.counts["cut_siblings"]) == (ref.counts["cut_groups"], ref.counts["cut_siblings"])


async def test_barrier_after_a_pre_cut_copies_only_what_changed_and_equals_a_whole_run_cut(engine: Any) -> None:
    await _quiet_groups(engine)
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 12  # g1, g2, q00-q09 (g3 is finalized)
    assert await _stored(engine, "p") == 12
    # Between the pre-cut and the barrier: a seal (attempt and sibling rows), a deleted group
    # (its children go through the trigger), a new group.
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE attempts SET status = 'sealed', staging_keys = '{tq/new}' WHERE run_id = :r AND rollout_id = 'g1-2-dispatched'"), {"r": RUN}
        )
        await conn.execute(text("UPDATE siblings SET row_attempts_used = 9 WHERE run_id = :r AND group_id = 'g1' AND generation_index = 2"), {"r": RUN})
        await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = :r AND group_id = 'g2'"), {"r": RUN})
        await _add_group(conn, "g5", keys=["tq/g5"])
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    assert row.counts["cut_pre_cut_groups"] == 12
    assert row.counts["cut_recopied_groups"] == 3  # g1, g2 (gone), g5; none of the quiet ones
    assert [g[0] for g in (await _cut_of(engine, "p"))[0]] == ["g1", "g5"] + [f"q{k:02d}" for k in range(10)]
    assert "tq/new" in row.cut_staging_keys and "tq/g5" in row.cut_staging_keys and "tq/\u00e9" not in row.cut_staging_keys
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_a_barrier_too_early_keeps_the_recorded_groups_and_the_cut_notifies_once(engine: Any) -> None:
    await _quiet_groups(engine)
    await _committing(engine, "p")
    await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))
    async with engine.begin() as conn:
        await _add_group(conn, "g5", keys=["tq/g5"])
    recorded = "SELECT group_id FROM snapshot_changed_groups WHERE run_id = :r"
    assert await _rows(engine, recorded) == [("g5",)]
    with pytest.raises(repo.SnapshotNotAwaiting):  # still committing: its deletion of them rolls back
        await repo.take_cut(engine, RUN, "p", full_keys=False)
    assert await _rows(engine, recorded) == [("g5",)]
    await _to_data_plane(engine, "p")
    async with engine.connect() as listener:
        raw = listener.sync_connection.connection.driver_connection  # type: ignore[union-attr]
        await listener.execute(text(f"LISTEN {repo.NOTIFY_CHANNEL}"))
        await listener.commit()
        row = await repo.take_cut(engine, RUN, "p", full_keys=False)
        heard = [n.payload async for n in raw.notifies(timeout=1)]
    assert heard == [f"{RUN}/p"]  # trainers waiting on the snapshot read it again
    assert row.counts["cut_recopied_groups"] == 1 and "tq/g5" in row.cut_keys_added
    assert await _rows(engine, recorded) == []


async def test_a_write_open_during_the_pre_cut_and_committed_after_it_is_in_the_cut(engine: Any) -> None:
    await _quiet_groups(engine)
    await _committing(engine, "p")
    tracked_from = await repo.tracking_horizon(engine)  # what the runner reads as it starts the pre-cut
    # A seal's transaction is open (its write invisible) while the pre-cut copies; it commits after.
    async with engine.begin() as writer:  # commits when the block ends
        await writer.execute(
            text("UPDATE attempts SET status = 'sealed', staging_keys = '{tq/late}' WHERE run_id = :r AND rollout_id = 'g1-3-reserved'"), {"r": RUN}
        )
        assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine), tracked_from=tracked_from)).groups == 12
    stale = await _rows(engine, "SELECT status FROM snapshot_attempts WHERE run_id = :r AND snapshot_id = 'p' AND rollout_id = 'g1-3-reserved'")
    assert stale[0][0] == "reserved"  # the pre-cut did not see it
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    assert row.counts["cut_recopied_groups"] == 1
    got = await _rows(engine, "SELECT status, staging_keys FROM snapshot_attempts WHERE run_id = :r AND snapshot_id = 'p' AND rollout_id = 'g1-3-reserved'")
    assert tuple(got[0]) == ("sealed", ["tq/late"])
    assert "tq/late" in row.cut_staging_keys
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_a_write_to_a_group_recorded_before_and_open_during_the_pre_cut_is_in_the_cut(engine: Any) -> None:
    # g1 is recorded as changed (a committed write) before a second writer touches it again and
    # stays open while the pre-cut runs. That writer's record must hold the pre-cut's emptying of
    # the record back until it commits; else the copy misses its write and nothing records it.
    await _quiet_groups(engine)
    await _committing(engine, "p")
    tracked_from = await repo.tracking_horizon(engine)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE attempts SET refusals = refusals + 1 WHERE run_id = :r AND rollout_id = 'g1-2-dispatched'"), {"r": RUN})
    fence = await owner_fence(engine)
    async with engine.begin() as writer:  # commits when the block ends
        await writer.execute(
            text("UPDATE attempts SET status = 'sealed', staging_keys = '{tq/held}' WHERE run_id = :r AND rollout_id = 'g1-3-reserved'"), {"r": RUN}
        )
        pre = asyncio.create_task(repo.pre_cut(engine, RUN, "p", fence, tracked_from=tracked_from))
        await asyncio.sleep(0.5)
        assert not pre.done()  # waiting for this writer's record
    assert (await pre).groups == 12
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    got = await _rows(engine, "SELECT status, staging_keys FROM snapshot_attempts WHERE run_id = :r AND snapshot_id = 'p' AND rollout_id = 'g1-3-reserved'")
    assert tuple(got[0]) == ("sealed", ["tq/held"])
    assert "tq/held" in row.cut_staging_keys
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_nothing_changed_since_the_pre_cut_copies_nothing(engine: Any) -> None:
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 2
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    assert row.counts["cut_recopied_groups"] == 0
    # Idempotent: a second barrier answers the same and copies nothing more.
    again = await repo.take_cut(engine, RUN, "p")
    assert again.cut_at == row.cut_at and again.cut_staging_keys == row.cut_staging_keys
    assert await _stored(engine, "p") == 2
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_an_untrusted_base_makes_the_barrier_copy_the_whole_run(engine: Any) -> None:
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 2
    async with engine.begin() as conn:
        # As if two billion transactions had run since: 32-bit xids no longer compare.
        await conn.execute(text("UPDATE snapshots SET cut_base_xid = cut_base_xid - 2000000000 WHERE run_id = :r AND snapshot_id = 'p'"), {"r": RUN})
        await conn.execute(text("UPDATE prompt_groups SET status = 'finalized' WHERE run_id = :r AND group_id = 'g2'"), {"r": RUN})
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    assert "cut_recopied_groups" not in row.counts and row.counts["cut_groups"] == 1
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_when_most_groups_changed_the_barrier_copies_the_whole_run(engine: Any) -> None:
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 2
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE attempts SET refusals = refusals + 1 WHERE run_id = :r AND generation_index = 0"), {"r": RUN})
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    assert row.counts["cut_pre_cut_groups"] == 2 and "cut_recopied_groups" not in row.counts
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_a_write_open_when_tracking_began_holds_the_pre_cut_back(engine: Any) -> None:
    # This writer may have written before it could see the tracking phase (so recorded nothing):
    # the pre-cut waits for it, and gives up (the barrier copies the whole run) while it stays open.
    await _quiet_groups(engine)
    async with engine.begin() as writer:
        await writer.execute(text("UPDATE attempts SET status = 'sealed', staging_keys = '{tq/early}' WHERE run_id = :r AND rollout_id = 'g1-3-reserved'"), {"r": RUN})
        await _committing(engine, "p")
        tracked_from = await repo.tracking_horizon(engine)
        assert await repo.pre_cut(engine, RUN, "p", await owner_fence(engine), tracked_from=tracked_from) is None
    assert await _stored(engine, "p") == 0
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine), tracked_from=tracked_from)).groups == 12


async def test_a_pre_cut_is_refused_once_the_snapshot_moved_on(engine: Any) -> None:
    await _committing(engine, "p")
    await repo.end(engine, RUN, "p", "aborted", "train_step_committed", fence=await owner_fence(engine), expected=SnapshotPhase.commit)
    assert await repo.pre_cut(engine, RUN, "p", await owner_fence(engine)) is None
    assert await _stored(engine, "p") == 0
    async with engine.connect() as conn:
        assert (await repo.get(conn, RUN, "p")).counts == {"candidates": 3}
    # At the barrier (the runner never pre-cuts then) and twice: refused, nothing written.
    await _data_plane(engine, "b")
    assert await repo.pre_cut(engine, RUN, "b", await owner_fence(engine)) is None
    assert await _stored(engine, "b") == 0


async def test_a_refused_second_pre_cut_keeps_the_groups_recorded_since_the_first(engine: Any) -> None:
    await _quiet_groups(engine)
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 12
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE attempts SET status = 'sealed', staging_keys = '{tq/after}' WHERE run_id = :r AND rollout_id = 'g1-3-reserved'"), {"r": RUN})
    recorded = "SELECT group_id FROM snapshot_changed_groups WHERE run_id = :r"
    assert await _rows(engine, recorded) == [("g1",)]
    assert await repo.pre_cut(engine, RUN, "p", await owner_fence(engine)) is None  # once per snapshot
    assert await _rows(engine, recorded) == [("g1",)]  # its emptying of the record rolled back
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    assert row.counts["cut_recopied_groups"] == 1 and "tq/after" in row.cut_staging_keys


async def test_a_snapshot_that_does_not_publish_takes_its_pre_cut_with_it(engine: Any) -> None:
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 2
    assert await repo.pre_cut(engine, RUN, "p", await owner_fence(engine)) is None  # once per snapshot
    assert await _stored(engine, "p") == 2
    await repo.end(engine, RUN, "p", "aborted", "train_step_committed", fence=await owner_fence(engine), expected=SnapshotPhase.commit)
    assert await _stored(engine, "p") == 0


async def test_the_barrier_records_the_xid_basis_a_restore_compares_rows_with(engine: Any) -> None:
    """``cut_xmin`` splits the ledger as ``ledger.restore`` needs: rows the cut holds as they are
    count as older, a row written after the barrier counts as newer; ``cut_system_id`` names this
    cluster."""
    await _quiet_groups(engine)
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 12
    await _to_data_plane(engine, "p")
    await repo.take_cut(engine, RUN, "p")
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE attempts SET status = 'sealed' WHERE run_id = :r AND rollout_id = 'g1-2-dispatched'"), {"r": RUN})
    (cx, same_cluster), = await _rows(
        engine, "SELECT cut_xmin, cut_system_id = (SELECT CAST(system_identifier AS text) FROM pg_control_system()) "
        "FROM snapshots WHERE run_id = :r AND snapshot_id = 'p'"
    )
    assert cx is not None and same_cluster
    newer = await _rows(
        engine, f"SELECT rollout_id FROM attempts WHERE run_id = :r AND age(xmin) <= age(CAST('{cx % 2**32}' AS xid)) ORDER BY rollout_id"
    )
    assert [r[0] for r in newer] == ["g1-2-dispatched"]


def _merged(base: list[str], added: list[str], removed: list[str]) -> list[str]:
    """What a trainer holding the pre-cut's keys makes of the barrier's delta."""
    return sorted((set(base) - set(removed)) | set(added))


async def test_the_barrier_after_a_pre_cut_answers_its_keys_as_a_delta_that_rebuilds_the_whole_list(engine: Any) -> None:
    await _quiet_groups(engine)
    async with engine.begin() as conn:
        # Two groups name the same key: it stays while one of them does.
        await _add_group(conn, "h1", keys=["tq/shared"])
        await _add_group(conn, "h2", keys=["tq/shared"])
    await _committing(engine, "p")
    assert await repo.cut_keys(engine, RUN, "p") == ("none", "[]")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 14
    as_of, base = await _cut_keys(engine)
    assert as_of == "pre_cut" and base == sorted(base) and {"tq/shared", "tq/\u00e9", "tq/q00"} <= set(base)
    assert "model/x" not in base  # the manifest's keys come in at the barrier
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE attempts SET status = 'sealed', staging_keys = '{tq/new}' WHERE run_id = :r AND rollout_id = 'g1-2-dispatched'"), {"r": RUN}
        )
        await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = :r AND group_id IN ('g2', 'h1')"), {"r": RUN})
        await _add_group(conn, "g5", keys=["tq/g5"])
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p", full_keys=False)
    assert row.counts["cut_recopied_groups"] == 4 and row.cut_staging_keys is None
    assert row.cut_keys_added == ["model/x", "tq/g5", "tq/new"]
    assert row.cut_keys_removed == ["tq/Z", "tq/\u00e9"]  # g2's; tq/shared is still h2's, tq/a g1's and the manifest's
    as_of, full = await _cut_keys(engine)
    assert as_of == "cut" and full == _merged(base, row.cut_keys_added, row.cut_keys_removed)
    # A repeated barrier answers the same delta (and the whole list).
    again = await repo.take_cut(engine, RUN, "p", full_keys=False)
    assert (again.cut_keys_added, again.cut_keys_removed, again.cut_staging_keys) == (row.cut_keys_added, row.cut_keys_removed, full)
    row.cut_staging_keys = full
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_the_keys_json_the_database_writes_reads_back_as_the_keys_in_code_point_order(engine: Any) -> None:
    awkward = ['tq/"quoted"', "tq/back\\slash", "tq/tab\there", "tq/new\nline", "tq/\u00e9t\u00e9", "tq/\U0001f600", "tq/\u007f"]
    async with engine.begin() as conn:
        await _add_group(conn, "h9", keys=awkward)
    await _committing(engine, "p")
    taken = await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))
    as_of, raw = await repo.cut_keys(engine, RUN, "p")
    keys = json.loads(raw)
    assert as_of == "pre_cut" and set(awkward) <= set(keys)
    assert keys == sorted(keys)  # Python compares str by code point, as the C collation orders UTF-8
    assert taken.keys_json == raw  # what the owner hands a trainer's fetch is the database's answer, byte for byte
    await _to_data_plane(engine, "p")
    await repo.take_cut(engine, RUN, "p")
    as_of, raw = await repo.cut_keys(engine, RUN, "p")
    full = json.loads(raw)
    assert as_of == "cut" and full == sorted(full) and set(keys) <= set(full)


async def test_a_published_snapshot_keeps_its_keys_in_its_row_and_its_key_rows_go(engine: Any) -> None:
    await _committing(engine, "p")
    fence = await owner_fence(engine)
    assert (await repo.pre_cut(engine, RUN, "p", fence)).groups == 2
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    await repo.captured(engine, RUN, "p", {"path": "/d", "digest": "sha256:0"})
    await repo.end(engine, RUN, "p", "published", "ok", fence=fence, expected=SnapshotPhase.data_plane)
    assert await _rows(engine, "SELECT count(*) FROM snapshot_cut_keys WHERE run_id = :r AND snapshot_id = 'p'") == [(0,)]
    stored = await _rows(engine, "SELECT cut_staging_keys FROM snapshots WHERE run_id = :r AND snapshot_id = 'p'")
    assert stored[0][0] == row.cut_staging_keys and "model/x" in row.cut_staging_keys
    async with engine.connect() as conn:
        assert cut_tests.api_record(await repo.get(conn, RUN, "p", with_manifest=True), with_manifest=True)["staging_keys"] == row.cut_staging_keys


async def test_a_snapshot_that_does_not_publish_leaves_no_key_rows(engine: Any) -> None:
    await _committing(engine, "p")
    fence = await owner_fence(engine)
    assert (await repo.pre_cut(engine, RUN, "p", fence)).groups == 2
    assert (await _rows(engine, "SELECT count(*) FROM snapshot_cut_keys WHERE run_id = :r AND snapshot_id = 'p'"))[0][0] > 0
    await repo.end(engine, RUN, "p", "aborted", "train_step_committed", fence=fence, expected=SnapshotPhase.commit)
    assert await _rows(engine, "SELECT count(*) FROM snapshot_cut_keys WHERE run_id = :r AND snapshot_id = 'p'") == [(0,)]


async def _holding_key_row(engine: Any, key: str) -> Any:
    """A transaction holding an uncommitted key row of snapshot p: the writer of the pre-cut's key
    rows, inserting the same key, waits for it to end (and keeps its lock meanwhile). Opened after
    the snapshot's tracking began (``tracked_from``), so that the pre-cut does not wait for it."""
    conn = await engine.connect().start()
    await conn.execution_options(isolation_level="READ COMMITTED")
    await conn.begin()
    await conn.execute(text("INSERT INTO snapshot_cut_keys (run_id, snapshot_id, key, refs) VALUES (:r, 'p', :k, 1)"), {"r": RUN, "k": key})
    return conn


async def _key_row_count(engine: Any) -> int:
    return int((await _rows(engine, "SELECT count(*) FROM snapshot_cut_keys WHERE run_id = :r AND snapshot_id = 'p'"))[0][0])


async def _seal_g1(engine: Any) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE attempts SET status = 'sealed', staging_keys = '{tq/new}' WHERE run_id = :r AND rollout_id = 'g1-2-dispatched'"), {"r": RUN}
        )


@contextlib.asynccontextmanager
async def _key_rows_held(engine: Any, key: str, *, quiet: bool = True, entries: bool = False) -> AsyncIterator[tuple[Any, Any]]:
    """A pre-cut of snapshot p (in phase commit; its Gym manifest as entries with ``entries``)
    taken while a transaction holds an uncommitted key row ``key``: the pre-cut returns with its
    key rows' writer waiting for that transaction, which rolls back when the block ends.
    Yields (the pre-cut, the owner's fence)."""
    if quiet:
        await _quiet_groups(engine)
    await (_committing_with_entries if entries else _committing)(engine, "p")
    fence = await owner_fence(engine)
    tracked_from = await repo.tracking_horizon(engine)
    blocker = await _holding_key_row(engine, key)
    try:
        taken = await repo.pre_cut(engine, RUN, "p", fence, tracked_from=tracked_from, defer_key_rows=True)
        assert taken is not None and taken.key_rows is not None
        yield taken, fence
    finally:
        await blocker.rollback()
        await blocker.close()


async def test_a_barrier_that_copies_groups_again_waits_for_the_pre_cut_s_key_rows(engine: Any) -> None:
    async with _key_rows_held(engine, "tq/q00") as (taken, _):
        assert taken.groups == 12
        await asyncio.sleep(0.2)
        assert not taken.key_rows.done()  # returned with its key rows still being written
        await _seal_g1(engine)
        await _to_data_plane(engine, "p")
        barrier = asyncio.create_task(repo.take_cut(engine, RUN, "p"))
        await asyncio.sleep(0.3)
        assert not barrier.done()  # g1 changed: its keys are counted against the key rows, not in yet
    assert await taken.key_rows == len(taken.keys)
    row = await barrier
    assert row.counts["cut_recopied_groups"] == 1 and "tq/new" in row.cut_staging_keys
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_a_barrier_copies_the_whole_run_when_the_pre_cut_s_key_rows_never_came(engine: Any) -> None:
    async with _key_rows_held(engine, "tq/q00") as (taken, _):
        taken.key_rows.cancel()  # their writer is gone before it wrote them (its transaction rolls back)
        with pytest.raises(asyncio.CancelledError):
            await taken.key_rows
    assert await _key_row_count(engine) == 0
    await _seal_g1(engine)
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p")
    assert "cut_recopied_groups" not in row.counts and row.counts["cut_pre_cut_groups"] == 12
    assert await _key_row_count(engine) == 0  # a whole-run cut writes none: its keys are read from its rows
    assert "tq/new" in row.cut_staging_keys
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_a_barrier_that_copies_nothing_again_does_not_wait_for_the_key_rows(engine: Any) -> None:
    async with _key_rows_held(engine, "tq/q00", entries=True) as (taken, fence):
        # Gym's entry, its keys found against the pre-cut's (as the owner stores it).
        await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("i1", ["model/x", "tq/q01"], taken.keys))
        await _to_data_plane(engine, "p")
        row = await asyncio.wait_for(repo.take_cut(engine, RUN, "p"), 5)  # the rows are still held back
        assert row.counts["cut_recopied_groups"] == 0 and not taken.key_rows.done()
        keys = json.loads((await repo.cut_keys(engine, RUN, "p"))[1])  # read from the cut rows meanwhile
        assert keys == row.cut_staging_keys and set(taken.keys) <= set(keys)
    assert await taken.key_rows == len(taken.keys)
    assert json.loads((await repo.cut_keys(engine, RUN, "p"))[1]) == row.cut_staging_keys  # and from the key rows now
    await _same_as_a_whole_run_cut(engine, "p", row)


async def test_a_snapshot_ended_while_its_key_rows_are_written_leaves_none_behind(engine: Any) -> None:
    async with _key_rows_held(engine, "tq/a", quiet=False) as (taken, fence):
        ending = asyncio.create_task(repo.end(engine, RUN, "p", "aborted", "train_step_committed", fence=fence, expected=SnapshotPhase.commit))
        await asyncio.sleep(0.3)
        assert not ending.done()  # the end waits for their writer, which has begun writing them
    await ending
    assert await taken.key_rows > 0
    assert await _key_row_count(engine) == 0


async def test_key_rows_left_behind_by_a_writer_the_end_stopped_waiting_for_go_at_the_next_end(engine: Any) -> None:
    """A writer that stopped answering past the end's wait commits its rows after that end: the
    run's next snapshot's end deletes them (nothing reads the key rows of an ended snapshot)."""
    await _committing(engine, "old")
    fence = await owner_fence(engine)
    await repo.end(engine, RUN, "old", "aborted", "train_step_committed", fence=fence, expected=SnapshotPhase.commit)
    async with engine.begin() as conn:  # what such a writer commits late
        await conn.execute(text("INSERT INTO snapshot_cut_keys (run_id, snapshot_id, key, refs) VALUES (:r, 'old', 'tq/late', 1)"), {"r": RUN})
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", fence)).groups == 2
    await repo.end(engine, RUN, "p", "aborted", "train_step_committed", fence=fence, expected=SnapshotPhase.commit)
    assert await _rows(engine, "SELECT count(*) FROM snapshot_cut_keys WHERE run_id = :r") == [(0,)]


async def test_a_key_that_leaves_every_group_but_the_manifest_still_names_is_not_removed(engine: Any) -> None:
    await _quiet_groups(engine)
    async with engine.begin() as conn:
        await _add_group(conn, "h3", keys=["model/x", "tq/h3"])  # model/x is in the Gym manifest too
    await _committing(engine, "p")
    assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 13  # g1, g2, q00-q09, h3
    _, base = await _cut_keys(engine)
    assert {"model/x", "tq/a"} <= set(base)  # h3's and g1's, both in the manifest too
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = :r AND group_id = 'h3'"), {"r": RUN})
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p", full_keys=False)
    assert row.cut_keys_removed == ["tq/h3"]  # model/x left its group, the manifest keeps it
    assert row.cut_keys_added == []  # the manifest names nothing the pre-cut did not hold
    _, full = await _cut_keys(engine)
    assert full == _merged(base, row.cut_keys_added, row.cut_keys_removed) and "model/x" in full


async def test_a_snapshot_that_fails_after_its_cut_answers_no_keys(engine: Any) -> None:
    await _committing(engine, "p")
    fence = await owner_fence(engine)
    assert (await repo.pre_cut(engine, RUN, "p", fence)).groups == 2
    await _to_data_plane(engine, "p")
    assert (await repo.take_cut(engine, RUN, "p")).cut_staging_keys
    await repo.end(engine, RUN, "p", "failed", "data_plane_failed", fence=fence, expected=SnapshotPhase.data_plane)
    assert await repo.cut_keys(engine, RUN, "p") == ("cut", "[]")
    async with engine.connect() as conn:
        assert cut_tests.api_record(await repo.get(conn, RUN, "p", with_manifest=True), with_manifest=True)["staging_keys"] == []


async def test_the_pre_cut_commits_without_waiting_for_its_log_flush(engine: Any) -> None:
    """Its commit, and its key rows' (a transaction of their own), are asynchronous (the barrier's
    flushed commit comes later and flushes them); the setting stays inside the transactions."""
    from sqlalchemy import event

    await _quiet_groups(engine)
    await _committing(engine, "p")
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        assert (await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))).groups == 12
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
    lazy = [i for i, s in enumerate(sent) if "set_config('synchronous_commit', 'off', true)" in s]
    copy = [i for i, s in enumerate(sent) if "INSERT INTO snapshot_cut_groups" in s]
    key_rows = [i for i, s in enumerate(sent) if "INSERT INTO snapshot_cut_keys" in s]
    # Two transactions: the copy's, and that of its key rows, which come after it.
    assert len(lazy) == 2 and len(copy) == 1 and len(key_rows) == 1 and max(lazy) < copy[0] < key_rows[0]
    async with engine.connect() as conn:
        assert (await conn.execute(text("SHOW synchronous_commit"))).scalar() == "on"
    assert await _stored(engine, "p") == 12


async def _committing_with_entries(engine: Any, sid: str) -> None:
    """A snapshot in phase commit whose Gym manifest comes as per-instance entries, as the runner
    stores them while Gym commits (no manifest in its row)."""
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner, gym_checkpoint_id, counts) "
                 "VALUES (:r, :s, 0, 'commit', 'test', 'snap-p-0000', '{\"candidates\": 3}')"),
            {"r": RUN, "s": sid},
        )


def _entry(keys: list[str]) -> JsonText:
    return JsonText(json.dumps({"episodes": [], "participants": ["agent"], "restarts": [], "staging_keys": keys}, sort_keys=True))


def _gym_entry(instance_id: str, keys: list[str], pre_cut_keys: frozenset[str] | None) -> repo.GymEntry:
    return repo.GymEntry(instance_id, _entry(keys), repo.new_keys(keys, pre_cut_keys))


async def test_the_pre_cut_answers_the_keys_its_key_rows_hold(engine: Any) -> None:
    await _quiet_groups(engine)
    await _committing(engine, "p")
    taken = await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))
    as_of, rows = await _cut_keys(engine)
    assert as_of == "pre_cut" and taken.keys == frozenset(rows) and len(rows) == len(taken.keys) > 0


async def test_the_owner_s_pre_cut_keys_answer_the_fetch_only_between_the_pre_cut_and_the_barrier(engine: Any) -> None:
    held = '["held/by/the/owner"]'
    await _committing(engine, "p")
    assert await repo.cut_keys(engine, RUN, "p", pre_cut_keys=held) == ("none", "[]")  # no pre-cut in the row yet
    await repo.pre_cut(engine, RUN, "p", await owner_fence(engine))
    assert await repo.cut_keys(engine, RUN, "p", pre_cut_keys=held) == ("pre_cut", held)
    await _to_data_plane(engine, "p")
    await repo.take_cut(engine, RUN, "p")
    as_of, raw = await repo.cut_keys(engine, RUN, "p", pre_cut_keys=held)
    assert as_of == "cut" and raw != held and raw == (await repo.cut_keys(engine, RUN, "p"))[1]


def test_an_entry_s_new_keys_are_its_distinct_keys_the_pre_cut_lacks_in_code_point_order() -> None:
    # Code point order is PostgreSQL's byte order of UTF-8 (COLLATE "C"): "Z" < "a" < "\u00e9" < "\U0001f600".
    keys = ["model/\U0001f600", "model/a", "model/\u00e9", "model/Z", "model/a", "tq/held"]
    assert repo.new_keys(keys, frozenset({"tq/held"})) == ["model/Z", "model/a", "model/\u00e9", "model/\U0001f600"]
    assert repo.new_keys(keys, None) is None  # no pre-cut's keys at hand: the barrier looks them up
    assert repo.new_keys([], frozenset()) == []


async def test_gym_entries_stored_after_the_pre_cut_carry_their_new_keys_to_the_barrier(engine: Any) -> None:
    await _quiet_groups(engine)
    async with engine.begin() as conn:
        await _add_group(conn, "h3", keys=["model/held", "tq/h3"])  # a key the Gym manifest names too
    await _committing_with_entries(engine, "p")
    fence = await owner_fence(engine)
    taken = await repo.pre_cut(engine, RUN, "p", fence)
    assert taken.groups == 13
    _, base = await _cut_keys(engine)
    await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-0", ["model/x", "model/held"], taken.keys))
    # Stored without the pre-cut's keys at hand: its keys are looked up at the barrier instead.
    await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-1", ["model/y", "model/\u00e9"], None))
    stored = dict(await _rows(engine, "SELECT instance_id, new_keys FROM snapshot_gym_entries WHERE run_id = :r AND snapshot_id = 'p'"))
    assert stored == {"math/replica-0": ["model/x"], "math/replica-1": None}
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = :r AND group_id = 'h3'"), {"r": RUN})
    await _to_data_plane(engine, "p")
    row = await repo.take_cut(engine, RUN, "p", full_keys=False)
    assert row.cut_keys_added == ["model/x", "model/y", "model/\u00e9"]
    assert row.cut_keys_removed == ["tq/h3"]  # model/held left its group, the manifest keeps it
    as_of, full = await _cut_keys(engine)
    assert as_of == "cut" and full == _merged(base, row.cut_keys_added, row.cut_keys_removed)
    assert {"model/held", "model/x", "model/y"} <= set(full)
    # While pending, a reader asking for the manifest gets the entries joined; at the end they
    # move into the row and go.
    async with engine.connect() as conn:
        pending = (await repo.get(conn, RUN, "p", with_manifest=True)).gym_manifest
    assert pending["checkpoint_id"] == "snap-p-0000" and pending["schema_version"] == 2
    assert sorted(pending["instances"]) == ["math/replica-0", "math/replica-1"]
    await repo.captured(engine, RUN, "p", {"path": "/d", "digest": "sha256:0"})
    await repo.end(engine, RUN, "p", "published", "ok", fence=fence, expected=SnapshotPhase.data_plane)
    assert await _rows(engine, "SELECT count(*) FROM snapshot_gym_entries WHERE run_id = :r AND snapshot_id = 'p'") == [(0,)]
    (manifest, keys), = await _rows(engine, "SELECT gym_manifest, cut_staging_keys FROM snapshots WHERE run_id = :r AND snapshot_id = 'p'")
    assert manifest == pending and keys == full


async def test_the_last_entry_is_stored_by_the_move_to_data_plane_and_not_by_a_refused_one(engine: Any) -> None:
    await _quiet_groups(engine)
    await _committing_with_entries(engine, "p")
    fence = await owner_fence(engine)
    taken = await repo.pre_cut(engine, RUN, "p", fence)
    await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-0", ["model/x", "tq/q01"], taken.keys))
    last = _gym_entry("math/replica-1", ["tq/q02", "model/\u00e9", "model/y"], taken.keys)
    stored = "SELECT instance_id, new_keys FROM snapshot_gym_entries WHERE run_id = :r AND snapshot_id = 'p' ORDER BY 1"
    with pytest.raises(Fenced):  # a refused move stores nothing
        await repo.move(engine, RUN, "p", fence, SnapshotPhase.drain, SnapshotPhase.data_plane, gym_entry=last)
    assert await _rows(engine, stored) == [("math/replica-0", ["model/x"])]
    await repo.move(engine, RUN, "p", fence, SnapshotPhase.commit, SnapshotPhase.data_plane, gym_entry=last)
    assert await _rows(engine, stored) == [("math/replica-0", ["model/x"]), ("math/replica-1", ["model/y", "model/\u00e9"])]
    row = await repo.take_cut(engine, RUN, "p", full_keys=False)
    assert row.cut_keys_added == ["model/x", "model/y", "model/\u00e9"]
    async with engine.connect() as conn:
        shown = (await repo.get(conn, RUN, "p", with_manifest=True)).gym_manifest
    assert sorted(shown["instances"]) == ["math/replica-0", "math/replica-1"]


async def test_an_entry_s_keys_not_found_before_the_barrier_are_looked_up_by_it(engine: Any) -> None:
    await _quiet_groups(engine)
    await _committing_with_entries(engine, "p")
    fence = await owner_fence(engine)
    await repo.pre_cut(engine, RUN, "p", fence)
    await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-0", ["model/y", "tq/q02"], None))
    await repo.move(engine, RUN, "p", fence, SnapshotPhase.commit, SnapshotPhase.data_plane)
    row = await repo.take_cut(engine, RUN, "p", full_keys=False)
    assert row.cut_keys_added == ["model/y"]


async def test_a_gym_entry_is_refused_once_the_snapshot_left_commit_or_its_owner_lost_the_lease(engine: Any) -> None:
    await _committing_with_entries(engine, "p")
    fence = await owner_fence(engine)
    await _to_data_plane(engine, "p")
    with pytest.raises(Fenced):  # phase data_plane
        await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-0", ["model/x"], None))
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE snapshots SET phase = 'commit' WHERE run_id = :r AND snapshot_id = 'p'"), {"r": RUN})
        await conn.execute(text("UPDATE ownership_leases SET epoch = epoch + 1 WHERE run_id = :r"), {"r": RUN})  # taken over
    with pytest.raises(Fenced):  # a lost lease
        await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-0", ["model/x"], None))
    assert await _rows(engine, "SELECT count(*) FROM snapshot_gym_entries WHERE run_id = :r") == [(0,)]


async def test_a_snapshot_ended_while_gym_commits_keeps_no_partial_manifest_and_drops_its_entries(engine: Any) -> None:
    await _committing_with_entries(engine, "p")
    fence = await owner_fence(engine)
    await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-0", ["model/x"], None))
    async with engine.connect() as conn:  # one instance of several is in: no manifest is shown yet
        assert (await repo.get(conn, RUN, "p", with_manifest=True)).gym_manifest is None
    await repo.end(engine, RUN, "p", "aborted", "train_step_committed", fence=fence, expected=SnapshotPhase.commit)
    assert await _rows(engine, "SELECT count(*) FROM snapshot_gym_entries WHERE run_id = :r") == [(0,)]
    assert await _rows(engine, "SELECT gym_manifest FROM snapshots WHERE run_id = :r AND snapshot_id = 'p'") == [(None,)]
    assert await repo.cut_keys(engine, RUN, "p") == ("none", "[]")


async def test_a_snapshot_that_fails_after_its_data_plane_move_keeps_its_gym_manifest(engine: Any) -> None:
    await _committing_with_entries(engine, "p")
    fence = await owner_fence(engine)
    await repo.store_gym_entry(engine, RUN, "p", fence, _gym_entry("math/replica-0", ["model/x"], None))
    await _to_data_plane(engine, "p")
    await repo.end(engine, RUN, "p", "failed", "data_plane_timeout", fence=fence, expected=SnapshotPhase.data_plane, keep_gym_manifest=True)
    assert await _rows(engine, "SELECT count(*) FROM snapshot_gym_entries WHERE run_id = :r") == [(0,)]
    (manifest,), = await _rows(engine, "SELECT gym_manifest FROM snapshots WHERE run_id = :r AND snapshot_id = 'p'")
    assert manifest["instances"]["math/replica-0"]["staging_keys"] == ["model/x"]


def _key_rows_read(plan: dict[str, Any]) -> int:
    """Rows the plan's nodes on ``snapshot_cut_keys`` produced, over all their loops."""
    n = plan.get("Actual Rows", 0) * plan.get("Actual Loops", 1) if plan.get("Relation Name") == "snapshot_cut_keys" else 0
    return int(n) + sum(_key_rows_read(p) for p in plan.get("Plans", ()))


@pytest.mark.parametrize("changed", [False, True])
async def test_the_barrier_s_key_statement_reads_only_the_changed_key_rows_of_a_fresh_pre_cut(engine: Any, changed: bool) -> None:
    # The pre-cut's key rows were inserted moments before the barrier: no statistics show them.
    # A plan that joined them walked every key row (twice) even when no key changed.
    await _committing(engine, "p")
    await _to_data_plane(engine, "p")
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO snapshot_cut_keys (run_id, snapshot_id, key, refs) "
                                "SELECT :r, 'p', 'tq/k' || lpad(g::text, 6, '0'), 1 FROM generate_series(1, 20000) g"), {"r": RUN})
    old = [f"tq/k{g:06d}" for g in range(1, 21)] if changed else []
    new = ([f"tq/k{g:06d}" for g in range(11, 21)] + ["tq/fresh"]) if changed else []
    params = {"r": RUN, "s": "p", "old": old, "new": new, "extra": "{}", "cx": 1, "cs": "x", "g": 1, "n": 1, **_notice(RUN, "p")}
    async with engine.begin() as conn:
        (plan,), = (await conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + _DELTA_CUT_SQL), params)).one()
        row = (await conn.execute(text("SELECT cut_keys_added, cut_keys_removed FROM snapshots WHERE run_id = :r AND snapshot_id = 'p'"), {"r": RUN})).one()
    assert _key_rows_read(plan["Plan"]) <= 2 * len(set(old) | set(new))
    # The manifest's keys (model/x, tq/a) are added either way; with the changes, tq/k1..10 lose
    # their only group and go, tq/fresh comes, tq/k11..20 stay as they were.
    assert row.cut_keys_added == (["model/x", "tq/a", "tq/fresh"] if changed else ["model/x", "tq/a"])
    assert row.cut_keys_removed == ([f"tq/k{g:06d}" for g in range(1, 11)] if changed else [])
