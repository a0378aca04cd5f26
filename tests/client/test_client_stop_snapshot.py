"""Stopping snapshots (docs/ledger.md#stopping-snapshots) through the real client, against the live
coordinator and gymsim over HTTP: the snapshot publishes and leaves Gym parked, dispatch is refused
``run_stopped`` until a restore or a reopen, a deadline too short aborts it cleanly, and a Gym that
refuses ``stop`` (published profile) still gets a published snapshot that says so."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckpt_client import AsyncCoordinatorClient, CoordinatorClient, GymInstance, RunStopped, SnapshotFailed

from .conftest import Facade, LiveServer, MakeClient, group, open_run, sealed
from .test_client_snapshot_live import Recorder

pytestmark = pytest.mark.timeout(120)

INSTANCE = "math/replica-0"


def _gym(profile: str, **overrides: Any) -> Any:
    from gymsim.testing import GymsimInstance, default_instance_config

    return GymsimInstance.start(default_instance_config(INSTANCE, token="tok-gym", turn_seconds=0.05, gym_profile=profile, **overrides))


@pytest.fixture
def strict_gym() -> Iterator[Any]:
    g = _gym("strict")
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture
def published_gym() -> Iterator[Any]:
    g = _gym("published")
    try:
        yield g
    finally:
        g.stop()


def _participants(gym: Any) -> dict[str, Any]:
    return {name: s for name, s in gym.state()["servers"].items() if s.get("participant")}


async def _run_with_rows(coordinator: LiveServer, make_client: MakeClient, gym: Any) -> tuple[Facade, list[Any]]:
    run = await open_run(coordinator, make_client)
    await run.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
    admitted = await run.admit_groups([group("g0"), group("g1")])
    rows = list(admitted.rows)
    await run.dispatch([r.rollout_id for r in rows[:2]], dispatch_id="d-1", instance_id=INSTANCE)
    await run.report_sealed([sealed(r) for r in rows[:2]])
    return run, rows[2:]


async def test_a_stopping_snapshot_publishes_leaves_gym_parked_and_stops_dispatch_until_reopen(
    coordinator: LiveServer, make_client: MakeClient, strict_gym: Any, tmp_path: Path
) -> None:
    run, unsent = await _run_with_rows(coordinator, make_client, strict_gym)
    rec = Recorder(tmp_path / "stop")
    snap = await run.stop_snapshot(0, rec.capture, deadline_s=60, snapshot_id="s-stop", barrier=rec.barrier_for(run), poll_interval=0.05)
    assert (snap.outcome, snap.reason) == ("published", "ok")
    assert snap.raw["stop"] is True and snap.raw["deadline_at"]
    assert snap.raw["detail"]["stop_honoured"] == {INSTANCE: True}
    # No resume after the cut: every participant still holds the checkpoint, admission closed.
    for name, s in _participants(strict_gym).items():
        assert (s["phase"], s["admission_open"], s["resume_count"], s["stop_count"]) == ("committed", False, 0, 1), name
    assert (await run.get_run()).raw["dispatch_gate"] == {"open": False, "snapshot_id": "s-stop"}
    with pytest.raises(RunStopped) as stopped:
        await run.dispatch([r.rollout_id for r in unsent], instance_id=INSTANCE)
    assert stopped.value.code == "run_stopped" and stopped.value.snapshot_id == "s-stop" and stopped.value.status == 409
    # Another snapshot would reopen the gate at its end: refused the same way while stopped.
    with pytest.raises(RunStopped):
        await run.request_snapshot(0, snapshot_id="s-after")

    reopened = await run.reopen()
    assert reopened.raw["dispatch_gate"]["open"] is True
    assert (await run.reopen()).raw["dispatch_gate"]["open"] is True  # idempotent
    for name, s in _participants(strict_gym).items():
        assert (s["phase"], s["admission_open"]) == ("idle", True), name  # the reopen resumed Gym
    sent = await run.dispatch([r.rollout_id for r in unsent], instance_id=INSTANCE)
    assert len(sent.rows) == len(unsent)


async def test_a_restore_lifts_the_stop(coordinator: LiveServer, make_client: MakeClient, strict_gym: Any, tmp_path: Path) -> None:
    run, unsent = await _run_with_rows(coordinator, make_client, strict_gym)
    rec = Recorder(tmp_path / "stop")
    await run.stop_snapshot(0, rec.capture, deadline_s=60, snapshot_id="s-stop", barrier=rec.barrier_for(run), poll_interval=0.05)
    with pytest.raises(RunStopped):
        await run.dispatch([r.rollout_id for r in unsent], instance_id=INSTANCE)
    restored = await run.restore("r-1", snapshot_id="s-stop", with_gym_state=False, timeout=60)
    assert restored.snapshot_id == "s-stop" and restored.state == "applied"
    assert (await run.get_run()).raw["dispatch_gate"]["open"] is True
    to_send = [r.rollout_id for r in restored.rows_to_send if r.rollout_id]
    assert to_send and len((await run.dispatch(to_send, instance_id=INSTANCE)).rows) == len(to_send)


async def test_a_train_step_during_a_stopping_snapshot_does_not_abort_it(
    coordinator: LiveServer, make_client: MakeClient, strict_gym: Any, tmp_path: Path
) -> None:
    run, _ = await _run_with_rows(coordinator, make_client, strict_gym)
    rec = Recorder(tmp_path / "stop")
    token = run.token

    # The trainer's step-1 checkpoint commits while it takes its barrier for the stop.
    if run.is_async:

        @contextlib.asynccontextmanager
        async def barrier() -> AsyncIterator[None]:
            async with AsyncCoordinatorClient(coordinator.url, token, run_id="run-1") as other:
                assert (await other.announce_train_step(1)).aborted_snapshots == []
            async with rec.barrier_async():
                yield

    else:

        @contextlib.contextmanager  # type: ignore[no-redef]
        def barrier() -> Iterator[None]:
            with CoordinatorClient(coordinator.url, token, run_id="run-1") as other:
                assert other.announce_train_step(1).aborted_snapshots == []
            with rec.barrier_sync():
                yield

    snap = await run.stop_snapshot(0, rec.capture, deadline_s=60, snapshot_id="s-stop", barrier=barrier, poll_interval=0.05)
    assert (snap.outcome, snap.reason) == ("published", "ok")
    assert rec.events == ["barrier:enter", "capture", "barrier:exit"]


async def test_a_deadline_too_short_aborts_cleanly_and_the_previous_snapshot_stays_authoritative(
    coordinator: LiveServer, make_client: MakeClient, strict_gym: Any, tmp_path: Path
) -> None:
    run, unsent = await _run_with_rows(coordinator, make_client, strict_gym)
    rec = Recorder(tmp_path / "s0")
    s0 = await run.snapshot(0, rec.capture, snapshot_id="s0", barrier=rec.barrier_for(run), poll_interval=0.05, timeout=60)
    assert s0.published
    # The agent's prepare takes 3 s: a 1 s deadline cannot be made.
    strict_gym.admin("POST", "/admin/faults", {"server_name": "workplace_agent", "op": "prepare", "type": "delay", "seconds": 3, "times": 1})
    rec2 = Recorder(tmp_path / "stop")
    with pytest.raises(SnapshotFailed) as failed:
        await run.stop_snapshot(0, rec2.capture, deadline_s=1.0, snapshot_id="s-stop", barrier=rec2.barrier_for(run), poll_interval=0.05)
    err = failed.value
    assert (err.outcome, err.reason) == ("aborted", "deadline_exceeded") and err.retryable
    assert rec2.events == []  # the barrier was never asked for
    # Cleanly: Gym resumed, the gate open, the previous published snapshot authoritative.
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(100):
            if all(s["phase"] == "idle" and s["admission_open"] for s in _participants(strict_gym).values()):
                break
            await http.get(coordinator.url + "/healthz")
    assert all(s["phase"] == "idle" and s["admission_open"] for s in _participants(strict_gym).values())
    assert (await run.get_run()).raw["dispatch_gate"]["open"] is True
    plan = await run.restore_plan(step=0, with_gym_state=False)
    assert plan.snapshot_id == "s0"
    assert len((await run.dispatch([r.rollout_id for r in unsent], instance_id=INSTANCE)).rows) == len(unsent)


async def test_a_gym_that_refuses_stop_still_gets_a_published_snapshot_that_says_so(
    coordinator: LiveServer, make_client: MakeClient, published_gym: Any, tmp_path: Path
) -> None:
    run, unsent = await _run_with_rows(coordinator, make_client, published_gym)
    rec = Recorder(tmp_path / "stop")
    snap = await run.stop_snapshot(0, rec.capture, deadline_s=60, snapshot_id="s-stop", barrier=rec.barrier_for(run), poll_interval=0.05)
    assert (snap.outcome, snap.reason) == ("published", "ok")
    assert snap.raw["detail"]["stop_honoured"] == {INSTANCE: False}
    assert any("stop not honoured" in w for w in snap.raw["detail"]["warnings"])
    # The instance that refused `stop` was resumed as usual; the run is stopped all the same.
    for name, s in _participants(published_gym).items():
        assert (s["phase"], s["admission_open"], s["stop_count"]) == ("idle", True, 0), name
    with pytest.raises(RunStopped):
        await run.dispatch([r.rollout_id for r in unsent], instance_id=INSTANCE)


@pytest.mark.parametrize(
    "body",
    [
        {"snapshot_id": "s", "anchor_step": 0, "deadline_s": 10},  # a deadline without stop
        {"snapshot_id": "s", "anchor_step": 0, "stop": True, "deadline_s": 0},
        {"snapshot_id": "s", "anchor_step": 0, "stop": True, "deadline_s": -1},
        {"snapshot_id": "s", "anchor_step": 0, "stop": True, "deadline_s": 3601},
        {"snapshot_id": "s", "anchor_step": 0, "stop": "yes"},
    ],
)
async def test_bad_stop_requests_are_refused_422_and_write_nothing(coordinator: LiveServer, make_client: MakeClient, body: dict[str, Any]) -> None:
    run = await open_run(coordinator, make_client)
    async with httpx.AsyncClient(base_url=coordinator.url, timeout=10) as http:
        r = await http.post("/v1/runs/run-1/snapshots", json=body, headers={"Authorization": f"Bearer {run.token}"})
        assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), r.text
    assert await run.list_snapshots() == []
