"""The coordinator dies in the middle of a batched report and comes back on the same port.

The worst case is staged on purpose: the coordinator commits one batch, then the connection
drops before the answer leaves (the caller cannot know the batch was written), and the process
stops. The client retries through connection refusals until a fresh coordinator serves the same
database, re-sends the unanswered batch, and goes on with the rest. Afterwards the ledger must
hold every row exactly once: nothing lost, nothing doubled (no second replacement attempt for a
failure reported twice, no second retire in the outbox).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from ckpt_client import FailedRow

from .conftest import LiveServer, MakeClient, group, open_run, sealed

INSTANCE = "math/replica-0"
GROUPS, SIBLINGS, BATCH = 6, 4, 4  # one group per batch, six batches


class DropAnswerOnce:
    """ASGI wrapper: lets the ``nth`` POST to ``path_suffix`` run to completion (committed),
    then signals, waits until the server is stopping, and drops the connection without the
    answer (the response starts but never completes, so the server closes the socket)."""

    def __init__(self, app: Any, path_suffix: str, nth: int, stopping: threading.Event, hit: threading.Event) -> None:
        self.app = app
        self.path_suffix = path_suffix
        self.nth = nth
        self.seen = 0
        self.stopping = stopping
        self.hit = hit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(self.path_suffix):
            await self.app(scope, receive, send)
            return
        self.seen += 1
        if self.seen != self.nth:
            await self.app(scope, receive, send)
            return
        held: list[Any] = []

        async def hold(message: Any) -> None:
            held.append(message)

        await self.app(scope, receive, hold)  # the batch is now durable in Postgres
        self.hit.set()
        while not self.stopping.is_set():
            await asyncio.sleep(0.01)
        # By now the listener is closed: the client's retries meet refused connections.
        await asyncio.sleep(0.3)
        start = next(m for m in held if m["type"] == "http.response.start")
        await send(start)


def _restart_on_hit(server: LiveServer, hit: threading.Event, stopping: threading.Event) -> threading.Thread:
    def run() -> None:
        assert hit.wait(60), "the dropped batch never arrived"
        stopping.set()
        server.restart(down_for=1.0)

    t = threading.Thread(target=run, name="restarter", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("report", ["sealed", "failed"])
async def test_restart_mid_batch_nothing_lost_nothing_doubled(
    coordinator: LiveServer, make_client: MakeClient, report: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = await open_run(coordinator, make_client)
    # Enough retries to outlast the outage (about 1.5 s down) with the backoff capped at 0.4 s.
    reporter = make_client(coordinator.url, run.token, run_id="run-1", retries=30, backoff=0.05, max_backoff=0.4)
    specs = [group(f"g{i}", SIBLINGS) for i in range(GROUPS)]
    rows = (await run.admit_groups(specs)).rows
    ids = [r.rollout_id for r in rows]
    await run.dispatch(ids, dispatch_id="d-1", instance_id=INSTANCE)

    stopping, hit = threading.Event(), threading.Event()
    # Bring the coordinator back with the wrapper that drops the 3rd report's answer.
    await asyncio.to_thread(coordinator.restart, lambda app: DropAnswerOnce(app, f"/attempts/{report}", 3, stopping, hit))
    restarter = _restart_on_hit(coordinator, hit, stopping)

    caplog.set_level(logging.WARNING, logger="ckpt_client")
    if report == "sealed":
        result = await reporter.report_sealed([sealed(r) for r in rows], batch_size=BATCH)
    else:
        result = await reporter.report_failed([FailedRow(i, "transport") for i in ids], batch_size=BATCH)
    await asyncio.to_thread(restarter.join, 60)
    assert not restarter.is_alive()

    # The outage really happened under the client: a dropped answer, then refused connections.
    reasons = " ".join(r.getMessage() for r in caplog.records)
    assert "RemoteProtocolError" in reasons and "ConnectError" in reasons

    # One answer per row; the re-sent batch (third group) answers "unchanged".
    assert [r.rollout_id for r in result.rows] == ids
    dropped = set(ids[2 * SIBLINGS : 3 * SIBLINGS])
    assert {r.rollout_id for r in result.rows if r.result == "unchanged"} == dropped

    counts = await run.counts()
    if report == "sealed":
        assert counts.groups == {"ready": GROUPS} and counts.live_attempts == {"sealed": GROUPS * SIBLINGS}
        assert counts.outbox_pending == {}
        for spec in specs:
            detail = await run.group(spec.group_id)
            assert detail.status == "ready"
            assert [[a.status for a in s.attempts] for s in detail.siblings] == [["sealed"]] * SIBLINGS
    else:
        # Every failed row replaced exactly once, retired exactly once.
        assert counts.groups == {"generating": GROUPS} and counts.live_attempts == {"reserved": GROUPS * SIBLINGS}
        assert counts.outbox_pending == {"retire": GROUPS * SIBLINGS}
        owed = [i["rollout_id"] for i in (await run.outbox(limit=1000)).items]
        assert sorted(owed) == sorted(ids)
        fresh = [r.rollout_id for r in result.rows_to_send]
        assert len(fresh) == len(set(fresh)) == GROUPS * SIBLINGS and not set(fresh) & set(ids)
        for spec in specs:
            detail = await run.group(spec.group_id)
            for s in detail.siblings:
                assert [a.status for a in s.attempts] == ["abandoned", "reserved"]
                assert s.current is not None and s.current.rollout_id in fresh and s.row_attempts_used == 1
