"""Both client flavours against a live coordinator (real app, real Postgres, loopback HTTP)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckpt_client import (
    AsyncCoordinatorClient,
    BatchRefused,
    Conflict,
    FailedRow,
    Forbidden,
    GateClosed,
    InvalidRequest,
    NotFound,
    RunClosed,
    SealedRow,
    TooLarge,
)
from tests.conftest import ADMIN_TOKEN

from .conftest import LiveServer, MakeClient, group, open_run, sealed, set_gate

INSTANCE = "math/replica-0"


async def test_run_lifecycle_and_tokens(coordinator: LiveServer, make_client: MakeClient) -> None:
    run = await open_run(coordinator, make_client)
    got = await run.get_run()
    assert got.run_id == "run-1" and got.state == "open" and got.run_token is None
    assert got.recovery["target_level"] == "sibling"

    admin = make_client(coordinator.url, ADMIN_TOKEN)
    with pytest.raises(Conflict) as exists:
        await admin.create_run("run-1", "/tmp/elsewhere")
    assert exists.value.code == "run_exists" and exists.value.status == 409

    stranger = make_client(coordinator.url, "ckptc_run_not-the-token", run_id="run-1")
    with pytest.raises(Forbidden):
        await stranger.counts()
    with pytest.raises(ValueError, match="run_id"):
        await make_client(coordinator.url, ADMIN_TOKEN).counts()

    closed = await run.close_run()
    assert closed.state == "closed"
    with pytest.raises(RunClosed) as refused:
        await run.admit_groups([group("g1")])
    assert isinstance(refused.value, Conflict) and refused.value.code == "run_closed"
    assert (await run.counts()).groups == {}  # reads still answer on a closed run


async def test_sibling_flow_admit_dispatch_seal_finalize(coordinator: LiveServer, make_client: MakeClient) -> None:
    run = await open_run(coordinator, make_client)
    specs = [group(f"g{i}", 2) for i in range(5)]
    gids = [s.group_id for s in specs]

    admitted = await run.admit_groups(specs, batch_size=2)  # three requests, one merged answer
    assert [g.group_id for g in admitted.groups] == gids and all(g.admitted for g in admitted.groups)
    rows = admitted.rows
    ids = [r.rollout_id for r in rows]
    assert len(set(ids)) == 10 and all(r.capture_key == r.rollout_id and r.status == "reserved" for r in rows)
    assert all(g.granularity == "sibling" and g.group_attempt == 0 for g in admitted.groups)

    again = await run.admit_groups(specs)  # a retried admit answers the same identities
    assert not any(g.admitted for g in again.groups) and [r.rollout_id for r in again.rows] == ids

    sent = await run.dispatch(ids, dispatch_id="d-1", instance_id=INSTANCE, batch_size=4)
    assert sent.dispatch_id == "d-1" and [r.rollout_id for r in sent.rows] == ids
    assert all(r.status == "dispatched" and r.instance_id == INSTANCE for r in sent.rows)
    await run.dispatch(ids[:1], dispatch_id="d-1", instance_id=INSTANCE)  # identical repeat accepted
    assert (await run.admit_groups(specs)).rows == []  # nothing left to send
    assert await run.pending(ids, batch_size=3) == sorted(ids)

    seal = await run.report_sealed([sealed(r) for r in rows], batch_size=3)
    assert [r.rollout_id for r in seal.rows] == ids and {r.result for r in seal.rows} == {"sealed"}
    assert sorted(seal.ready_groups) == gids and seal.cohorts_sealed == []
    assert (await run.report_sealed([sealed(rows[0])])).rows[0].result == "unchanged"
    assert await run.pending(ids) == []

    fin = await run.finalize_groups(gids, batch_size=2)
    assert [(g.group_id, g.result) for g in fin.groups] == [(g, "finalized") for g in gids]
    counts = await run.counts()
    assert counts.groups == {"finalized": 5} and counts.live_attempts == {} and counts.outbox_pending == {}
    detail = await run.group("g0")
    assert detail.status == "finalized" and [s.current.status for s in detail.siblings if s.current] == ["sealed", "sealed"]
    assert detail.siblings[0].current is not None and detail.siblings[0].current.staging_keys == [f"tq/{rows[0].capture_key}/0"]


async def test_prompt_group_cohort_seals_at_once(coordinator: LiveServer, make_client: MakeClient) -> None:
    run = await open_run(coordinator, make_client, target_level="prompt_group")
    rows = (await run.admit_groups([group("c", 3)])).rows
    await run.dispatch([r.rollout_id for r in rows], instance_id=INSTANCE)
    first = await run.report_sealed([sealed(r) for r in rows[:2]])
    assert {r.result for r in first.rows} == {"returned"} and first.ready_groups == []
    last = await run.report_sealed([sealed(rows[2])])
    assert last.cohorts_sealed == ["c"] and last.ready_groups == ["c"] and last.rows[0].status == "sealed"


async def test_failures_answer_what_to_send_next(coordinator: LiveServer, make_client: MakeClient) -> None:
    run = await open_run(coordinator, make_client)
    admitted = await run.admit_groups([group("t", 3), group("d", 2)])
    t_rows, d_rows = admitted.groups[0].rows, admitted.groups[1].rows
    await run.dispatch([r.rollout_id for r in t_rows + d_rows], dispatch_id="d-1", instance_id=INSTANCE)

    # Transport failure under sibling recovery: only that sibling gets a fresh attempt.
    tf = await run.report_failed([FailedRow(t_rows[0].rollout_id, "transport", "stream reset")])
    assert [(r.rollout_id, r.result) for r in tf.rows] == [(t_rows[0].rollout_id, "abandoned")]
    [fresh] = tf.rows_to_send
    assert fresh.generation_index == 0 and fresh.rollout_id != t_rows[0].rollout_id and fresh.group_attempt == 0
    assert fresh.rollout_id.startswith("t_g0_a")

    # Data failure: the prompt fails as a whole; a new cohort under group_attempt 1.
    df = await run.report_failed([FailedRow(d_rows[1].rollout_id, "data")])
    [dg] = df.groups
    assert dg.group_id == "d" and dg.group_attempt == 1 and dg.status == "generating"
    assert {r.generation_index for r in dg.rows_to_send} == {0, 1}
    assert not {r.rollout_id for r in dg.rows_to_send} & {r.rollout_id for r in d_rows}

    # Gym refused the fresh row at admission: same identity back to reserved, nothing spent.
    await run.dispatch([fresh.rollout_id], dispatch_id="d-2", instance_id=INSTANCE)
    back = await run.report_refused([fresh.rollout_id])
    assert [(r.rollout_id, r.status) for r in back.rows] == [(fresh.rollout_id, "reserved")]

    # Stream d-1 ended with only t_g1 back: t_g2 is lost and replaced.
    ended = await run.report_stream_ended("d-1", [t_rows[1].rollout_id])
    assert ended.missing == [t_rows[2].rollout_id]
    t_next = next(g for g in ended.groups if g.group_id == "t")
    assert sorted(r.generation_index for r in t_next.rows_to_send) == [0, 2]
    assert next(r for r in t_next.rows_to_send if r.generation_index == 0).rollout_id == fresh.rollout_id
    repeat = await run.report_stream_ended("d-1", [t_rows[1].rollout_id])  # a retried report
    assert repeat.missing == [] and {r.rollout_id for r in repeat.rows_to_send} >= {r.rollout_id for r in t_next.rows_to_send}

    detail = await run.group("t")
    s0 = detail.siblings[0]
    assert [a.status for a in s0.attempts] == ["abandoned", "reserved"] and s0.attempts[0].failure_class == "transport"
    assert s0.current is not None and s0.current.refusals == 1 and s0.row_attempts_used == 1

    owed = {i["rollout_id"] for i in (await run.outbox()).items}
    assert owed == {t_rows[0].rollout_id, t_rows[2].rollout_id, d_rows[0].rollout_id}  # d_g1 replied: no retire
    gone = await run.abandon_groups(["t"])
    assert gone.groups[0].result == "abandoned"
    assert t_rows[1].rollout_id in {i["rollout_id"] for i in (await run.outbox(limit=1000)).items}
    assert (await run.counts()).groups == {"generating": 1, "abandoned": 1}


async def test_batch_refusal_is_typed_and_atomic(coordinator: LiveServer, make_client: MakeClient) -> None:
    run = await open_run(coordinator, make_client)
    rows = (await run.admit_groups([group("g1", 2)])).rows
    await run.dispatch([r.rollout_id for r in rows], instance_id=INSTANCE)
    ghost = "g1_g9_a" + "0" * 32
    with pytest.raises(BatchRefused) as refused:
        await run.report_sealed([sealed(rows[0]), SealedRow(rows[1].rollout_id, {"rollout_id": "someone-else"}), SealedRow(ghost, {"rollout_id": ghost})])
    err = refused.value
    assert err.status == 409 and err.code == "batch_refused" and err.batch_index == 0 and err.refused_count == 2
    assert err.codes() == {rows[1].rollout_id: "receipt_mismatch", ghost: "unknown_rollout"}
    # Atomic: the good row of the refused batch was not written either.
    assert [s.current.status for s in (await run.group("g1")).siblings if s.current] == ["dispatched", "dispatched"]

    await run.report_sealed([sealed(rows[0])])
    with pytest.raises(BatchRefused) as conflict:
        await run.report_sealed([sealed(rows[0], reward=0.5)])
    assert conflict.value.code == "seal_conflict" and conflict.value.rows[0].rollout_id == rows[0].rollout_id

    await run.report_sealed([sealed(rows[1])])
    with pytest.raises(BatchRefused) as late:
        await run.finalize_groups(["g1", "nope"], batch_size=1)
    # Batches before the refused one were written; the error says which batch failed.
    assert late.value.batch_index == 1 and late.value.rows[0].group_id == "nope" and late.value.code == "unknown_group"
    assert (await run.group("g1")).status == "finalized"


async def test_invalid_requests_and_unknown_things(coordinator: LiveServer, make_client: MakeClient) -> None:
    run = await open_run(coordinator, make_client)
    with pytest.raises(InvalidRequest) as bad_id:
        await run.admit_groups([group("bad-a3")])
    assert bad_id.value.status == 422 and [e["field"] for e in bad_id.value.errors] == ["groups.0.group_id"]
    with pytest.raises(InvalidRequest) as bad_class:
        await run.report_failed([{"rollout_id": "x", "failure_class": "cosmic"}])
    assert any(e["field"].startswith("rows.0.failure_class") for e in bad_class.value.errors)
    with pytest.raises(NotFound) as no_group:
        await run.group("nope")
    assert no_group.value.code == "group_not_found"
    with pytest.raises(NotFound) as no_dispatch:
        await run.report_stream_ended("never-sent", [])
    assert no_dispatch.value.code == "unknown_dispatch"
    # Empty reports cost no request and answer empty results.
    assert (await run.report_sealed([])).rows == [] and (await run.dispatch([], dispatch_id="d-0")).rows == []


async def test_gate_closed_is_typed_and_dispatch_when_open_waits(coordinator: LiveServer, make_client: MakeClient, database_url: str) -> None:
    run = await open_run(coordinator, make_client)
    ids = [r.rollout_id for r in (await run.admit_groups([group("g1", 3)])).rows]
    await asyncio.to_thread(set_gate, database_url, "run-1", "snap-7")

    with pytest.raises(GateClosed) as closed:
        await run.dispatch(ids, dispatch_id="d-1", instance_id=INSTANCE)
    assert closed.value.snapshot_id == "snap-7" and closed.value.retry_after_s == pytest.approx(0.2)
    assert closed.value.status == 409 and isinstance(closed.value, Conflict)
    assert await run.pending(ids) == []  # nothing dispatched

    started = time.monotonic()
    with pytest.raises(GateClosed) as still:
        await run.dispatch_when_open(ids, dispatch_id="d-1", instance_id=INSTANCE, timeout=0.8, max_wait=0.3)
    waited = time.monotonic() - started
    assert 0.8 <= waited < 5 and still.value.snapshot_id == "snap-7"

    async def reopen_soon() -> None:
        await asyncio.sleep(0.6)
        await asyncio.to_thread(set_gate, database_url, "run-1", None)

    reopening = asyncio.create_task(reopen_soon())
    started = time.monotonic()
    sent = await run.dispatch_when_open(ids, dispatch_id="d-1", instance_id=INSTANCE, timeout=30, max_wait=0.3)
    await reopening
    assert time.monotonic() - started >= 0.6
    assert [r.rollout_id for r in sent.rows] == ids and {r.status for r in sent.rows} == {"dispatched"}
    assert await run.pending(ids) == sorted(ids)


async def test_too_large_body_and_batching_avoids_it(settings: Any, database_url: str, make_client: MakeClient, tmp_path: Path) -> None:
    from checkpoint_coordinator.app import create_app

    small = settings.model_copy(update={"max_body_bytes": 2048})
    server = LiveServer(lambda: create_app(small, database_url=database_url), tmp_path / "checkpoints", database_url=database_url)
    await asyncio.to_thread(server.start)
    try:
        run = await open_run(server, make_client)
        specs = [group(f"group-{i:03d}", 2) for i in range(60)]
        with pytest.raises(TooLarge) as big:
            await run.admit_groups(specs)
        assert big.value.status == 413
        assert len((await run.admit_groups(specs, batch_size=5)).groups) == 60
    finally:
        await asyncio.to_thread(server.stop)


async def test_async_client_over_an_in_process_asgi_transport(app: Any, tmp_path: Path) -> None:
    transport = httpx.ASGITransport(app=app)
    async with AsyncCoordinatorClient("http://coordinator", ADMIN_TOKEN, transport=transport) as admin:
        made = await admin.create_run("run-asgi", str(tmp_path), {"target_level": "sibling"})
    assert made.run_token
    async with AsyncCoordinatorClient("http://coordinator", made.run_token, run_id="run-asgi", transport=transport) as run:
        rows = (await run.admit_groups([group("g1", 2)])).rows
        assert len(rows) == 2 and (await run.counts()).live_attempts == {"reserved": 2}
