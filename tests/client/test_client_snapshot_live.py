"""The snapshot and restore helpers against the live coordinator and a real gymsim instance."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_client import AsyncCoordinatorClient, Conflict, CoordinatorClient, DataPlaneRef, GymInstance, NotFound, SnapshotFailed, TrainStep
from tests.conftest import ADMIN_TOKEN

from .conftest import Facade, LiveServer, MakeClient, group, open_run, sealed

pytestmark = pytest.mark.timeout(120)

INSTANCE = "math/replica-0"


class Recorder:
    """Stands in for the trainer's data plane: a barrier it can hold and a capture that saves
    the staging keys to a file, recording the order of what happened."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.events: list[str] = []
        self.held = False
        self.captured_keys: list[str] | None = None

    def barrier_sync(self) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            self.events.append("barrier:enter")
            self.held = True
            try:
                yield
            finally:
                self.held = False
                self.events.append("barrier:exit")

        return hold()

    def barrier_async(self) -> contextlib.AbstractAsyncContextManager[None]:
        @contextlib.asynccontextmanager
        async def hold() -> AsyncIterator[None]:
            self.events.append("barrier:enter")
            self.held = True
            try:
                yield
            finally:
                self.held = False
                self.events.append("barrier:exit")

        return hold()

    def capture(self, staging_keys: list[str]) -> dict[str, str]:
        assert self.held, "capture must run while the trainer's barrier is held"
        self.events.append("capture")
        self.captured_keys = list(staging_keys)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "data_plane.json"
        payload = json.dumps(sorted(staging_keys)).encode()
        path.write_bytes(payload)
        return {"path": str(path), "digest": "sha256:" + hashlib.sha256(payload).hexdigest()}

    def barrier_for(self, run: Facade) -> Any:
        return self.barrier_async if run.is_async else self.barrier_sync


async def _registered_run(coordinator: LiveServer, make_client: MakeClient, gym: Any, **recovery: Any) -> Facade:
    run = await open_run(coordinator, make_client, **recovery)
    reg = await run.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
    [inst] = reg.instances
    assert inst["instance_id"] == INSTANCE and inst["participants"]
    assert "tok-gym" not in json.dumps(reg.raw)  # control tokens never come back
    return run


async def test_snapshot_publishes_and_restore_reruns_what_was_in_flight(
    coordinator: LiveServer, make_client: MakeClient, gym: Any, tmp_path: Path
) -> None:
    run = await _registered_run(coordinator, make_client, gym)
    admitted = await run.admit_groups([group("g0"), group("g1"), group("g2")])
    by_group = {g.group_id: g.rows for g in admitted.groups}
    await run.dispatch([r.rollout_id for r in admitted.rows], dispatch_id="d-1", instance_id=INSTANCE)
    done = by_group["g0"] + by_group["g1"][:1]
    await run.report_sealed([sealed(r) for r in done])

    rec = Recorder(tmp_path / "s1")
    snap = await run.snapshot(0, rec.capture, snapshot_id="s1", barrier=rec.barrier_for(run), poll_interval=0.05, timeout=60)
    assert snap.snapshot_id == "s1" and snap.published and (snap.outcome, snap.reason) == ("published", "ok")
    assert snap.cause is None and snap.retryable is None
    # This Gym keeps Gym's default lease grace of 600 s against a control_timeout_s of 60: said, typed.
    assert [w for w in snap.warnings if "lease grace" in w and "above 4x" in w], snap.warnings
    assert rec.events == ["barrier:enter", "capture", "barrier:exit"]
    # The coordinator asked for exactly the staging keys of the rows sealed at the cut.
    assert sorted(rec.captured_keys or []) == sorted(f"tq/{r.capture_key}/0" for r in done)
    assert snap.data_plane_ref == DataPlaneRef(str(tmp_path / "s1" / "data_plane.json"), snap.data_plane_ref.digest if snap.data_plane_ref else "")
    assert snap.counts.get("cut_siblings") == 6 and "total" in snap.phase_timings
    assert [s.snapshot_id for s in await run.list_snapshots()] == ["s1"]
    # A repeated request of the same id answers the same snapshot (the helper can be re-run).
    assert (await run.request_snapshot(0, snapshot_id="s1")).outcome == "published"

    step = await run.announce_train_step(1, "ckpt/step-1")
    assert isinstance(step, TrainStep) and step.step == 1 and step.created is True and step.aborted_snapshots == []
    again = await run.announce_train_step(1, "ckpt/step-1")
    assert again.created is False

    # The trainer crashed and came back at step 1; Gym kept running (not fresh).
    plan = await run.restore_plan(step=1, with_gym_state=False)
    assert plan.snapshot_id == "s1" and plan.anchor_step == 0 and plan.data_plane_ref == snap.data_plane_ref
    assert plan.counts["reused"] == 3 and plan.counts["rerun"] == 3
    assert sorted((r.group_id, r.generation_index) for r in plan.rows_to_send) == [("g1", 1), ("g2", 0), ("g2", 1)]
    full = await run.restore_plan(snapshot_id="s1", with_gym_state=False, include_reused=True)
    reused = [r for r in full.rows if r.disposition == "reused"]
    assert len(reused) == 3 and all(r.staging_keys for r in reused)

    restored = await run.restore("r-1", step=1, with_gym_state=False, timeout=60)
    assert restored.restore_id == "r-1" and restored.snapshot_id == "s1" and restored.state == "applied"
    assert {(r.group_id, r.generation_index) for r in restored.rows_to_send} == {("g1", 1), ("g2", 0), ("g2", 1)}
    old_ids = {r.rollout_id for r in admitted.rows}
    assert not {r.rollout_id for r in restored.rows_to_send} & old_ids  # reruns get fresh ids
    # Restore is idempotent per id: the same call answers the same rows.
    replay = await run.restore("r-1", step=1, with_gym_state=False, timeout=60)
    assert [r.rollout_id for r in replay.rows] == [r.rollout_id for r in restored.rows]
    assert (await run.get_run()).restored_from_rollout_snapshot == "s1"

    # The restored rows are ordinary reserved attempts: the trainer sends them and goes on.
    sent = await run.dispatch([r.rollout_id for r in restored.rows_to_send if r.rollout_id], instance_id=INSTANCE)
    assert len(sent.rows) == 3


async def test_the_snapshot_helper_waits_on_the_coordinator_not_on_its_poll_interval(
    coordinator: LiveServer, make_client: MakeClient, gym: Any, tmp_path: Path
) -> None:
    """The coordinator offers a long poll (``watch_token``): the helper hears of each step as
    it is written. Polling every 120 s, it could not finish within its 60 s timeout."""
    run = await _registered_run(coordinator, make_client, gym)
    admitted = await run.admit_groups([group("g0")])
    await run.dispatch([r.rollout_id for r in admitted.rows], dispatch_id="d-1", instance_id=INSTANCE)
    rec = Recorder(tmp_path / "s-wait")
    snap = await run.snapshot(0, rec.capture, snapshot_id="s-wait", barrier=rec.barrier_for(run), poll_interval=120, timeout=60)
    assert snap.published and snap.watch_token is not None
    assert rec.events == ["barrier:enter", "capture", "barrier:exit"]


async def test_snapshot_without_gym_is_refused_saying_to_register_it(coordinator: LiveServer, make_client: MakeClient, tmp_path: Path) -> None:
    run = await open_run(coordinator, make_client, placeholders=())
    rows = (await run.admit_groups([group("g0")])).rows
    rec = Recorder(tmp_path)
    with pytest.raises(Conflict) as refused:
        await run.snapshot(0, rec.capture, snapshot_id="s-nogym", barrier=rec.barrier_for(run), poll_interval=0.05, timeout=30)
    err = refused.value
    assert err.status == 409 and err.code == "gym_not_registered"
    assert "register its Gym instances first" in str(err) and "register_gym_instances" in str(err)
    assert rec.events == [] and await run.list_snapshots() == []  # nothing was started
    # Nor is a dispatch to an instance the run never registered.
    with pytest.raises(NotFound) as unknown:
        await run.dispatch([r.rollout_id for r in rows], instance_id=INSTANCE)
    assert unknown.value.code == "unknown_instance" and INSTANCE in str(unknown.value) and "register it first" in str(unknown.value)
    assert (await run.counts()).live_attempts == {"reserved": len(rows)}


async def test_train_step_wins_over_a_snapshot_at_the_barrier(
    coordinator: LiveServer, make_client: MakeClient, gym: Any, tmp_path: Path
) -> None:
    run = await _registered_run(coordinator, make_client, gym)
    await run.admit_groups([group("g0")])
    rec = Recorder(tmp_path)
    token = run.token

    # The trainer's checkpoint for step 1 commits right when the snapshot asks for the barrier.
    if run.is_async:

        @contextlib.asynccontextmanager
        async def barrier() -> AsyncIterator[None]:
            async with AsyncCoordinatorClient(coordinator.url, token, run_id="run-1") as other:
                await other.announce_train_step(1)
            async with rec.barrier_async():
                yield

    else:

        @contextlib.contextmanager  # type: ignore[no-redef]
        def barrier() -> Iterator[None]:
            with CoordinatorClient(coordinator.url, token, run_id="run-1") as other:
                other.announce_train_step(1)
            with rec.barrier_sync():
                yield

    with pytest.raises(SnapshotFailed) as lost:
        await run.snapshot(0, rec.capture, snapshot_id="s-lost", barrier=barrier, poll_interval=0.05, timeout=60)
    assert (lost.value.outcome, lost.value.reason) == ("aborted", "train_step_committed") and lost.value.retryable, (lost.value.snapshot.raw["detail"], lost.value.snapshot.raw["reason"])
    # Its message says why and what to do; the document carries the same.
    assert "a newer train step was announced before the cut" in str(lost.value) and "snapshot earlier in the step" in str(lost.value)
    assert lost.value.cause == lost.value.snapshot.cause and lost.value.snapshot.retryable is True
    # The barrier was taken once, refused, released; nothing was captured.
    assert rec.events == ["barrier:enter", "barrier:exit"]
    assert (await run.get_run()).raw["consecutive_snapshot_losses"] == 1
    # A snapshot anchored behind the newest train step is refused up front, typed.
    with pytest.raises(Conflict) as stale:
        await run.request_snapshot(0, snapshot_id="s-stale")
    assert stale.value.code == "snapshot_anchor_stale"
    admin = make_client(coordinator.url, ADMIN_TOKEN, run_id="run-1")
    assert (await admin.get_snapshot("s-lost")).reason == "train_step_committed"


def test_the_snapshot_helper_fetches_the_pre_cut_keys_during_commit_and_asks_the_barrier_for_the_delta(
    coordinator: LiveServer, gym: Any, tmp_path: Path
) -> None:
    import httpx

    class Seen(httpx.HTTPTransport):
        def __init__(self) -> None:
            super().__init__()
            self.requests: list[str] = []

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            self.requests.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")
            return super().handle_request(request)

    admin = CoordinatorClient(coordinator.url, ADMIN_TOKEN)
    token = admin.create_run("run-d", str(coordinator.checkpoint_root), {"target_level": "sibling"}).run_token
    seen = Seen()
    run = CoordinatorClient(coordinator.url, token, run_id="run-d", transport=seen)
    run.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
    admitted = run.admit_groups([group("g0"), group("g1"), group("g2")])
    run.dispatch([r.rollout_id for r in admitted.rows], dispatch_id="d-1", instance_id=INSTANCE)
    by_group = {g.group_id: g.rows for g in admitted.groups}
    run.report_sealed([sealed(r) for r in by_group["g0"]])
    # Gym's commit takes a second: the pre-cut is done before the barrier is awaited.
    gym.admin("POST", "/admin/faults", {"server_name": "policy_model", "op": "commit", "type": "delay", "seconds": 1.0})
    rec = Recorder(tmp_path / "s1")

    original = run._api.snapshot_barrier

    def barrier_after_a_late_seal(snapshot_id: str, delta: bool = False, **kwargs: Any) -> Any:
        # A row sealed after the pre-cut and before the barrier: its key comes in the delta.
        run.report_sealed([sealed(by_group["g1"][0])])
        return original(snapshot_id, delta, **kwargs)

    run._api.snapshot_barrier = barrier_after_a_late_seal  # type: ignore[method-assign]
    snap = run.snapshot(0, rec.capture, snapshot_id="s1", barrier=rec.barrier_sync, poll_interval=0.05, timeout=60)
    assert snap.published
    keys_calls = [r for r in seen.requests if r.startswith("GET /v1/runs/run-d/snapshots/s1/staging-keys")]
    barrier_calls = [r for r in seen.requests if "/barrier" in r]
    assert len(keys_calls) == 1 and barrier_calls == ["POST /v1/runs/run-d/snapshots/s1/barrier?staging_keys=delta"]
    expected = sorted(f"tq/{r.capture_key}/0" for r in [*by_group["g0"], by_group["g1"][0]])
    assert rec.captured_keys == expected
    # The published snapshot keeps the same list (its key rows moved into its record).
    stored = httpx.get(f"{coordinator.url}/v1/runs/run-d/snapshots/s1", params={"manifest": "true"}, headers={"Authorization": f"Bearer {token}"})
    assert stored.json()["staging_keys"] == expected
