"""The pending snapshot's state machine alone: a fake Gym, the ledger in memory, a virtual clock.

Every path ends with the row ended as it should be, Gym left as it should be (resumed, or parked
after a stopping snapshot), and no task the snapshot started still running.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from checkpoint_coordinator.domain.snapshot_state import SnapshotPhase
from checkpoint_coordinator.gym.errors import FailureClass
from checkpoint_coordinator.gym.models import Episode
from checkpoint_coordinator.ledger.leases import Fence, Fenced
from checkpoint_coordinator.snapshots.pending import SnapshotContext, end_orphan
from checkpoint_coordinator.snapshots.pending.machine import PendingSnapshot

from tests.unit.pending_fakes import RUN, SNAP, FakeGym, FakeLedger, FakeOutbox, VirtualClock, database_away, drive, gym_failure, make

P = SnapshotPhase


def _moves(ledger: FakeLedger) -> list[Any]:
    return [w[2] if w[0] == "move" else w[0] for w in ledger.writes]


async def _run(snap: PendingSnapshot, clock: VirtualClock, *, auto_capture: bool = True, ledger: FakeLedger | None = None) -> None:
    """Drive the snapshot to its end; the trainer captures as soon as data_plane is written."""
    before = asyncio.all_tasks()
    if auto_capture and ledger is not None:
        original = ledger.move

        async def move(*a: Any, **kw: Any) -> None:
            await original(*a, **kw)
            if ledger.phase is P.data_plane:
                ledger.captured = True
                snap.wake()

        ledger.move = move  # type: ignore[method-assign]
    await drive(clock, snap.run())
    for _ in range(5):
        await asyncio.sleep(0)
    left = {t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()}
    assert not left, f"tasks outlived the snapshot: {left}"


async def test_a_snapshot_publishes_through_every_phase_in_order() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym()
    snap = make(ledger, gym, clock)
    await _run(snap, clock, ledger=ledger)
    assert _moves(ledger) == ["close_gate", P.commit, P.data_plane, P.resume, "publish", "end"]
    assert (ledger.outcome, ledger.reason) == ("published", "ok")
    assert gym.calls == ["prepare", "commit", "drain", "manifest", "cut", "finish"]
    assert set(ledger.entries) == {"math", "code"}
    assert snap.done.is_set() and snap.phase is P.published


async def test_owed_items_are_retired_and_pending_replies_drained_first() -> None:
    clock, ledger = VirtualClock(), FakeLedger(owed=True)
    gym = FakeGym(pending={"math": [Episode("r1", 1)]})
    ledger.pending = {("r1", 1)}
    outbox = FakeOutbox()
    snap = make(ledger, gym, clock, outbox)
    polls = []
    original = ledger.still_pending

    async def still_pending(run_id: str, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
        polls.append(ledger.phase)
        if len(polls) == 3:
            ledger.pending.clear()  # the trainer reported it, after two polls on the clock
        return await original(run_id, keys)

    ledger.still_pending = still_pending  # type: ignore[method-assign]
    await _run(snap, clock, ledger=ledger)
    assert polls == [P.drain] * 3
    assert _moves(ledger) == ["close_gate", P.retire, P.prepare, P.commit, P.drain, P.data_plane, P.resume, "publish", "end"]
    assert outbox.delivered == 1 and ledger.outcome == "published"


@pytest.mark.parametrize(("step", "reason"), [
    ("prepare", "gym_not_ready"), ("commit", "gym_unavailable"), ("drain", "drain_timeout"), ("lease", "lease_lost"),
])
async def test_a_gym_failure_in_each_phase_resumes_gym_and_fails(step: str, reason: str) -> None:
    cls = {"prepare": FailureClass.NOT_READY, "commit": FailureClass.UNAVAILABLE, "drain": FailureClass.DRAIN_TIMEOUT,
           "lease": FailureClass.LEASE_LOST}[step]
    clock, ledger = VirtualClock(), FakeLedger()
    gym = FakeGym(fail={step: gym_failure(cls)}, pending={"math": [Episode("r1", 1)]} if step == "drain" else {})
    ledger.pending = {("r1", 1)}
    snap = make(ledger, gym, clock)
    await _run(snap, clock, ledger=ledger)
    assert (ledger.outcome, ledger.reason) == ("failed", reason)
    assert not gym.saves[0].parked, "Gym left parked"
    if step != "prepare":  # prepare's own failure path resumed everyone; later ones go through resume
        assert _moves(ledger)[-2:] == [P.resume, "end"]


async def test_the_episodes_that_blocked_it_are_recorded_by_its_end_and_kept_out_of_its_detail() -> None:
    # docs/ledger.md#stragglers: every episode Gym named (capture keys, to rollout ids), not a
    # worker's name parsed into nothing; the detail keeps only the failure's own sample.
    from checkpoint_coordinator.gym.errors import BLOCKED_EPISODES, GymControlError

    error = GymControlError(FailureClass.NOT_READY, "not ready", extra={BLOCKED_EPISODES: {"math": ["r1-a2", "r3"], "code": ["r2"]}})
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym(fail={"prepare": error})
    ended: list[dict[str, Any]] = []
    original = ledger.end

    async def end(*a: Any, **kw: Any) -> Any:
        ended.append(kw)
        return await original(*a, **kw)

    ledger.end = end  # type: ignore[method-assign]
    await _run(make(ledger, gym, clock), clock, ledger=ledger)
    assert (ledger.outcome, ledger.reason) == ("failed", "gym_not_ready")
    assert ended[0]["blockers"] == [("code", "r2"), ("math", "r1"), ("math", "r3")]
    assert BLOCKED_EPISODES not in ended[0]["detail"]


async def test_no_capture_before_the_data_plane_timeout_fails_on_the_clock() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym()
    snap = make(ledger, gym, clock)
    start = clock.time()
    await _run(snap, clock, auto_capture=False, ledger=ledger)
    assert (ledger.outcome, ledger.reason) == ("failed", "data_plane_timeout")
    assert clock.time() - start >= 60  # the run's data_plane_timeout_s, on the virtual clock
    assert "cut" not in gym.calls and not gym.saves[0].parked


async def test_the_trainer_s_abort_in_data_plane_resumes_gym_and_aborts() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym()
    snap = make(ledger, gym, clock)
    original = ledger.move

    async def move(*a: Any, **kw: Any) -> None:
        await original(*a, **kw)
        if ledger.phase is P.data_plane:
            ledger.abort_requested = "cancelled"
            snap.wake()

    ledger.move = move  # type: ignore[method-assign]
    await _run(snap, clock, auto_capture=False)
    assert (ledger.outcome, ledger.reason) == ("aborted", "cancelled")
    assert "resume_before_cut" in gym.calls and not gym.saves[0].parked


async def _hung_in(step: str, ledger: FakeLedger) -> tuple[VirtualClock, FakeGym, PendingSnapshot, asyncio.Future[None]]:
    """A snapshot driven until Gym hangs in ``step``."""
    clock, gym = VirtualClock(), FakeGym(hang={step})
    snap = make(ledger, gym, clock)
    task = asyncio.ensure_future(_run(snap, clock, ledger=ledger))
    while step not in gym.calls:
        await asyncio.sleep(0)
    return clock, gym, snap, task


async def test_a_train_step_abort_while_gym_commits_stops_the_commit() -> None:
    ledger = FakeLedger()
    _, gym, snap, task = await _hung_in("commit", ledger)
    snap.abort("train_step_committed")
    await task
    assert (ledger.outcome, ledger.reason) == ("aborted", "train_step_committed")
    assert _moves(ledger)[-2:] == [P.resume, "end"]


async def test_the_deadline_aborts_a_snapshot_stuck_in_prepare() -> None:
    clock, ledger = VirtualClock(), FakeLedger(deadline_s=5.0)
    gym = FakeGym(hang={"prepare"})
    snap = make(ledger, gym, clock)
    start = clock.time()
    await _run(snap, clock, ledger=ledger)
    assert (ledger.outcome, ledger.reason) == ("aborted", "deadline_exceeded")
    assert 5.0 <= clock.time() - start < 6.0
    assert not gym.saves[0].parked


async def test_a_lost_lease_stops_at_once_without_writing_or_calling_gym() -> None:
    ledger = FakeLedger()
    _, gym, snap, task = await _hung_in("prepare", ledger)
    writes = list(ledger.writes)
    snap.lease_lost(Fenced(RUN, "test", snap.fence))
    await task
    assert ledger.writes == writes and ledger.outcome is None
    assert gym.calls[-1] == "abandon"


async def test_a_fenced_phase_write_stops_the_snapshot() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym()
    ledger.fail["move:commit"] = [Fenced(RUN, "taken over", Fence("replica-b", 2))]
    snap = make(ledger, gym, clock)
    await _run(snap, clock, ledger=ledger)
    assert ledger.outcome is None and "commit" not in gym.calls
    assert gym.calls[-1] == "abandon"


async def test_the_database_away_ends_the_snapshot_once_it_answers() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym()
    ledger.fail["move:commit"] = [database_away()]
    ledger.fail["end"] = [database_away(), database_away()]
    snap = make(ledger, gym, clock)
    await _run(snap, clock, ledger=ledger)
    assert (ledger.outcome, ledger.reason) == ("failed", "database_unavailable")
    assert not gym.saves[0].parked  # resumed without waiting for the database


async def test_a_database_outage_after_the_cut_only_delays_the_publication() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym()
    ledger.fail["publish"] = [database_away(), database_away(), database_away()]
    snap = make(ledger, gym, clock)
    await _run(snap, clock, ledger=ledger)
    assert (ledger.outcome, ledger.reason) == ("published", "ok")


async def test_a_stopping_snapshot_publishes_with_the_gate_kept_closed() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(stop=True), FakeGym()
    snap = make(ledger, gym, clock)
    await _run(snap, clock, ledger=ledger)
    assert ("publish", True) in ledger.writes and ledger.outcome == "published"


async def test_a_shutdown_before_the_cut_resumes_gym_and_ends_cancelled() -> None:
    clock, ledger = VirtualClock(), FakeLedger()
    gym = FakeGym(hang={"commit"})
    snap = make(ledger, gym, clock)
    before = asyncio.all_tasks()
    task = asyncio.ensure_future(snap.run())
    while "commit" not in gym.calls:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drive(clock, task)
    assert (ledger.outcome, ledger.reason) == ("aborted", "cancelled")
    assert not gym.saves[0].parked
    assert not {t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()}


async def test_a_bug_in_a_step_ends_the_snapshot_rather_than_leave_the_gate_closed() -> None:
    clock, ledger, gym = VirtualClock(), FakeLedger(), FakeGym(fail={"commit": RuntimeError("a bug")})
    snap = make(ledger, gym, clock)
    await _run(snap, clock, ledger=ledger)
    assert (ledger.outcome, ledger.reason) == ("failed", "gym_invariant")
    assert not gym.saves[0].parked


async def test_an_orphan_is_resumed_and_ended_by_the_replica_that_took_its_run() -> None:
    clock, ledger = VirtualClock(), FakeLedger()
    ledger.phase = P.commit
    resumed: list[str] = []

    class Client:
        async def resume(self, cid: str, topology: Any, *, raise_on_failure: bool) -> Any:
            resumed.append(cid)
            return type("R", (), {"failure": None})()

    gym = type("G", (), {"for_run": lambda self, run_id, cfg: Client()})()
    ctx = SnapshotContext(ledger, gym, FakeOutbox(), "replica-b", 1.0, clock=clock)  # type: ignore[arg-type]
    await end_orphan(ctx, RUN, SNAP, Fence("replica-b", 1), P.commit, previous_owner="replica-a",
                     gym_checkpoint_id="ckpt-1", abort_requested=None)
    assert resumed == ["ckpt-1"]
    assert (ledger.outcome, ledger.reason) == ("aborted", "coordinator_restart")


async def test_a_wait_within_the_gym_lease_takes_its_inner_wait_with_it() -> None:
    """Cancelled (an abort, a shutdown), the lease race cancels what it waited on: a capture wait
    left behind used to fail, unretrieved, long after its snapshot ended."""
    from types import SimpleNamespace

    from checkpoint_coordinator.gym.save import _race  # noqa: PLC0415

    renewer = SimpleNamespace(lost=asyncio.Event(), check=lambda: None)
    inner_cancelled = asyncio.Event()

    async def inner() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            inner_cancelled.set()
            raise

    before = asyncio.all_tasks()
    race = asyncio.ensure_future(_race(inner(), renewer))  # type: ignore[arg-type]
    for _ in range(3):
        await asyncio.sleep(0)
    race.cancel()
    with pytest.raises(asyncio.CancelledError):
        await race
    assert inner_cancelled.is_set()
    assert not {t for t in asyncio.all_tasks() - before if not t.done()}


async def test_a_stalled_manifest_file_does_not_hold_the_snapshot_s_end() -> None:
    """The Gym manifest file is written in a thread beside the trainer's handshakes; a shared
    filesystem that stalls must not hold an aborted snapshot's end for long (it is logged)."""
    clock, ledger = VirtualClock(), FakeLedger()
    gym = FakeGym()
    snap = make(ledger, gym, clock)
    stalled = asyncio.Event()

    async def write_manifest_file_now() -> None:
        await stalled.wait()

    original = gym.new_save

    def new_save(*a: Any) -> Any:
        save = original(*a)
        save.write_manifest_file_now = write_manifest_file_now  # type: ignore[method-assign]
        return save

    gym.new_save = new_save  # type: ignore[method-assign]
    original_move = ledger.move

    async def move(*a: Any, **kw: Any) -> None:
        await original_move(*a, **kw)
        if ledger.phase is P.data_plane:
            snap.abort("cancelled")

    ledger.move = move  # type: ignore[method-assign]
    start = clock.time()
    await drive(clock, snap.run())
    assert (ledger.outcome, ledger.reason) == ("aborted", "cancelled")
    assert clock.time() - start <= 6.0  # the manifest write's grace, not its stall
    stalled.set()
    await asyncio.sleep(0)
