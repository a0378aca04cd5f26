"""Edge cases of the waiting helpers against a scripted contract server (fake_coordinator.py).

Time is virtual: the clients get an injected clock and a sleep that advances it, so deadlines
and Retry-After are checked exactly and no test sleeps. The sync flavour talks to the fake over
loopback HTTP; the async flavour through an in-process ASGI transport.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckpt_client import (
    AsyncCoordinatorClient,
    CoordinatorClient,
    GateClosed,
    SnapshotFailed,
    SnapshotNotAwaiting,
    SnapshotTimeout,
    Unavailable,
)

from .conftest import LiveServer
from .fake_coordinator import FakeCoordinator


class VirtualTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)
        await asyncio.sleep(0)


class Harness:
    """One fake coordinator and a client of the parametrised flavour, both ways awaitable."""

    def __init__(self, flavour: str, tmp_path: Path) -> None:
        self.fake = FakeCoordinator()
        self.time = VirtualTime()
        self.flavour = flavour
        self.server: LiveServer | None = None
        opts: dict[str, Any] = dict(run_id="run-1", retries=3, backoff=0.1, max_backoff=1.0, clock=self.time.clock)
        if flavour == "sync":
            self.server = LiveServer(lambda: self.fake.app, tmp_path)
            self.server.start()
            self.client: Any = CoordinatorClient(self.server.url, "tok", sleep=self.time.sleep, **opts)
        else:
            self.client = AsyncCoordinatorClient("http://fake", "tok", transport=httpx.ASGITransport(app=self.fake.app), sleep=self.time.asleep, **opts)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.client, name)
        if self.flavour == "sync":
            return await asyncio.to_thread(fn, *args, **kwargs)
        return await fn(*args, **kwargs)

    async def close(self) -> None:
        if self.flavour == "sync":
            self.client.close()
            assert self.server is not None
            await asyncio.to_thread(self.server.stop)
        else:
            await self.client.close()


@pytest.fixture(params=["sync", "async"])
async def h(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(request.param, tmp_path)
    try:
        yield harness
    finally:
        await harness.close()


class Trainer:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.fail_capture = False

    @contextlib.contextmanager
    def barrier(self) -> Iterator[None]:
        self.events.append("enter")
        try:
            yield
        except BaseException as e:
            self.events.append(f"exit-with:{type(e).__name__}")
            raise
        else:
            self.events.append("exit")

    def capture(self, keys: list[str]) -> tuple[str, str]:
        self.events.append(f"capture:{','.join(keys)}")
        if self.fail_capture:
            raise OSError("disk full")
        return ("/dp/snap", "sha256:abc")


async def test_snapshot_polls_through_phases_and_retries_an_early_barrier(h: Harness) -> None:
    h.fake.early_barrier_refusals = 2  # asked too early (no abort reason): keep polling, ask again
    t = Trainer()
    snap = await h.call("snapshot", 3, t.capture, snapshot_id="s1", barrier=t.barrier, poll_interval=0.5, timeout=60)
    assert snap.published and snap.anchor_step == 3 and snap.gym_parked_seconds == 0.5
    assert snap.raw["a_field_from_the_future"] == {"x": 1}  # unknown fields ignored, still reachable
    assert h.fake.count("barrier") == 3 and h.fake.count("captured") == 1
    # Each refused try released the barrier (seeing the refusal); the third one captured.
    refused = "exit-with:SnapshotNotAwaiting"
    assert t.events == ["enter", refused, "enter", refused, "enter", "capture:tq/a/0,tq/b/0", "exit"]
    captured = next(c for c in h.fake.calls if c[0] == "captured")
    assert captured[2]["reference"] == {"path": "/dp/snap", "digest": "sha256:abc"}
    assert all(s == 0.5 for s in h.time.sleeps)  # polled at the interval


async def test_a_resumed_helper_does_not_take_the_barrier_again(h: Harness) -> None:
    # A helper died after the cut: the snapshot awaits only the capture, with its staging keys.
    await h.call("request_snapshot", 3, snapshot_id="s1")
    snap = h.fake.snapshots["s1"]
    snap.before_barrier, snap.phase, snap.cut = [], "data_plane", True
    t = Trainer()
    done = await h.call("snapshot", 3, t.capture, snapshot_id="s1", barrier=t.barrier, poll_interval=0.5, timeout=60)
    assert done.published and h.fake.count("barrier") == 0
    assert t.events == ["enter", "capture:tq/a/0,tq/b/0", "exit"]


async def test_a_failing_capture_releases_the_barrier_and_propagates(h: Harness) -> None:
    t = Trainer()
    t.fail_capture = True
    with pytest.raises(OSError, match="disk full"):
        await h.call("snapshot", 3, t.capture, snapshot_id="s1", barrier=t.barrier, poll_interval=0.5, timeout=60)
    assert t.events == ["enter", "capture:tq/a/0,tq/b/0", "exit-with:OSError"]
    assert h.fake.count("captured") == 0


async def test_snapshot_times_out_on_the_clients_own_deadline(h: Harness) -> None:
    await h.call("request_snapshot", 3, snapshot_id="s1")
    h.fake.snapshots["s1"].stuck = True
    h.fake.snapshots["s1"].phase = "prepare"
    t = Trainer()
    with pytest.raises(SnapshotTimeout) as timed_out:
        await h.call("snapshot", 3, t.capture, snapshot_id="s1", barrier=t.barrier, poll_interval=2.0, timeout=9.0)
    assert timed_out.value.snapshot.phase == "prepare" and "prepare" in str(timed_out.value)
    assert sum(h.time.sleeps) == pytest.approx(9.0) and max(h.time.sleeps) <= 2.0  # never past the deadline
    assert t.events == []


async def test_snapshot_that_fails_after_capture_raises_typed(h: Harness) -> None:
    await h.call("request_snapshot", 3, snapshot_id="s1")
    h.fake.snapshots["s1"].end_as = ("failed", "data_plane_failed")
    t = Trainer()
    with pytest.raises(SnapshotFailed) as failed:
        await h.call("snapshot", 3, t.capture, snapshot_id="s1", barrier=t.barrier, poll_interval=0.5, timeout=60)
    assert (failed.value.outcome, failed.value.reason, failed.value.retryable) == ("failed", "data_plane_failed", False)
    assert failed.value.snapshot.snapshot_id == "s1"


async def test_barrier_refusal_is_typed(h: Harness) -> None:
    await h.call("request_snapshot", 3, snapshot_id="s1")
    with pytest.raises(SnapshotNotAwaiting) as early:
        await h.call("snapshot_barrier", "s1")
    assert early.value.phase == "requested" and early.value.status == 409 and early.value.reason is None


async def test_restore_plan_joins_pages_pinned_to_one_snapshot(h: Harness) -> None:
    h.fake.plan_rows = [
        {"group_id": f"g{i}", "generation_index": 0, "disposition": d, "rollout_id": f"g{i}_g0_a{i:032x}", "capture_key": f"g{i}_g0_a{i:032x}"}
        for i, d in enumerate(["rerun", "continued", "restarted", "dispatch", "rerun"])
    ]
    plan = await h.call("restore_plan", step=9)
    assert [r.group_id for r in plan.rows] == [f"g{i}" for i in range(5)] and plan.counts["rerun"] == 2
    assert plan.snapshot_id == "s-newest" and plan.anchor_step == 7
    pages = [c[2] for c in h.fake.calls if c[0] == "plan"]
    assert len(pages) == 3 and pages[0] == {"step": "9", "limit": "100000"}  # the largest page: each recomputes the plan
    # Later pages name the first page's snapshot instead of the step.
    assert all(p.get("snapshot_id") == "s-newest" and "step" not in p for p in pages[1:])


async def test_restore_waits_while_the_same_restore_is_still_running(h: Harness) -> None:
    h.fake.restore_busy = 2
    h.fake.plan_rows = [{"group_id": "g", "generation_index": 0, "disposition": "rerun", "rollout_id": "g_g0_a" + "1" * 32}]
    done = await h.call("restore", step=9, with_gym_state=False, poll_interval=3.0, timeout=60)
    ids = {c[2]["restore_id"] for c in h.fake.calls if c[0] == "restore"}
    assert len(ids) == 1 and done.restore_id in ids  # minted once, repeated as is
    assert done.state == "applied" and done.epoch == 2 and [r.group_id for r in done.rows_to_send] == ["g"]
    assert h.time.sleeps == [3.0, 3.0]


async def test_restore_joins_the_pages_of_a_large_answer(h: Harness) -> None:
    h.fake.plan_rows = [
        {"group_id": f"g{i}", "generation_index": 0, "disposition": "rerun", "rollout_id": f"g{i}_g0_a{i:032x}", "capture_key": f"g{i}_g0_a{i:032x}"}
        for i in range(5)
    ]
    done = await h.call("restore", "r-9", step=9, with_gym_state=False, timeout=60)
    assert [r.group_id for r in done.rows_to_send] == [f"g{i}" for i in range(5)]
    pages = [c for c in h.fake.calls if c[0] == "restore_rows"]
    assert [p[2] for p in pages] == [{"cursor": "2"}, {"cursor": "4"}]
    assert all(p[1].endswith("/restores/r-9/rows") for p in pages)


async def test_503_is_retried_then_surfaces_typed_when_it_persists(h: Harness) -> None:
    h.fake.unavailable = 2
    counts = await h.call("counts")
    assert counts.groups == {"generating": 1} and h.fake.count("counts") == 3
    h.fake.unavailable = 10
    with pytest.raises(Unavailable) as down:
        await h.call("counts")
    assert down.value.status == 503 and h.fake.count("counts") == 3 + 4  # retries=3
    assert all(0 < s <= 1.0 for s in h.time.sleeps)  # bounded by max_backoff


async def test_dispatch_when_open_honours_a_header_only_retry_after(h: Harness) -> None:
    h.fake.gate_closed = 3
    sent = await h.call("dispatch_when_open", ["r1", "r2"], dispatch_id="d-1", timeout=60, max_wait=8.0)
    assert [r.rollout_id for r in sent.rows] == ["r1", "r2"] and h.fake.count("dispatch") == 4
    # Retry-After: 2 (header only) is the floor; then doubling, capped at max_wait, +<=10% jitter.
    assert [lo <= s <= lo * 1.1 for s, lo in zip(h.time.sleeps, [2.0, 4.0, 8.0], strict=True)] == [True] * 3
    h.fake.gate_closed = 100
    with pytest.raises(GateClosed) as still:
        await h.call("dispatch_when_open", ["r1"], dispatch_id="d-2", timeout=20, max_wait=8.0)
    assert still.value.snapshot_id == "s-x" and still.value.retry_after_s == 2.0


async def test_cancelling_an_async_snapshot_releases_the_barrier(tmp_path: Path) -> None:
    h = Harness("async", tmp_path)
    t = Trainer()
    in_capture = asyncio.Event()

    async def slow_capture(keys: list[str]) -> tuple[str, str]:
        in_capture.set()
        await asyncio.Event().wait()  # a capture that never finishes
        return ("", "")

    @contextlib.asynccontextmanager
    async def barrier() -> AsyncIterator[None]:
        with t.barrier():
            yield

    try:
        task = asyncio.create_task(h.client.snapshot(3, slow_capture, snapshot_id="s1", barrier=barrier, poll_interval=0.5, timeout=60))
        await asyncio.wait_for(in_capture.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert t.events == ["enter", "exit-with:CancelledError"]
        assert h.fake.count("captured") == 0
    finally:
        await h.close()
