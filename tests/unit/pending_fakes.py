"""Fakes for the pending snapshot's unit suite: a virtual clock, the ledger in memory, and a Gym
save whose every step can be made to fail or hang.

The clock moves only when every task is waiting: ``drive`` yields to the loop until nothing is
ready, then jumps to the next sleeper's deadline. No test waits for real time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from checkpoint_coordinator.domain.snapshot_state import SnapshotPhase
from checkpoint_coordinator.gym.errors import FailureClass, GymControlError
from checkpoint_coordinator.gym.models import Episode
from checkpoint_coordinator.gym.results import CommitResult, InstanceCommit, ResumeReport
from checkpoint_coordinator.ledger.leases import Fence, Fenced
from checkpoint_coordinator.snapshots import store as repo
from checkpoint_coordinator.snapshots.pending import PendingSnapshot, SnapshotContext

P = SnapshotPhase
RUN, SNAP = "run-1", "snap-1"
TOPOLOGY = {"math": object(), "code": object()}


class VirtualClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self.now + max(0.0, seconds), next(self._seq), fut))
        await fut

    def advance(self) -> bool:
        """Jump to the next live sleeper's deadline and wake every sleeper due; False: none."""
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)
        if not self._heap:
            return False
        self.now = max(self.now, self._heap[0][0])
        while self._heap and self._heap[0][0] <= self.now:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
        return True


async def drive(clock: VirtualClock, aw: Awaitable[Any], *, max_jumps: int = 20_000) -> Any:
    """Run ``aw`` to its end on the virtual clock."""
    task = asyncio.ensure_future(aw)
    for _ in range(max_jumps):
        for _ in range(50):
            if task.done():
                return task.result()
            await asyncio.sleep(0)
        if task.done():
            return task.result()
        if not clock.advance():
            stacks = "\n".join(f"{t.get_name()}: {t.get_stack(limit=3)}" for t in asyncio.all_tasks() if not t.done())
            task.cancel()
            raise AssertionError(f"stuck: every task waits and no timer is set\n{stacks}")
    task.cancel()
    raise AssertionError("no end after many timer jumps")


def database_away() -> ConnectionError:
    return ConnectionError("the database is unreachable")


class FakeLedger:
    """The snapshot's row and run in memory, fenced as the real store is."""

    def __init__(self, *, owed: bool = False, prepared: bool = True, stop: bool = False, deadline_s: float | None = None,
                 candidates: dict[str, list[tuple[str, int]]] | None = None) -> None:
        self.phase = P.requested
        self.outcome: str | None = None
        self.reason: str | None = None
        self.epoch = 1
        self.writes: list[tuple[Any, ...]] = []
        self.owed = owed
        self.prepared = prepared and not owed
        self.stop = stop
        self.deadline_s = deadline_s
        self.captured = False
        self.abort_requested: str | None = None
        self.pending: set[tuple[str, int]] = set()
        self.fail: dict[str, list[BaseException]] = {}  # method -> errors raised by its next calls
        self.entries: dict[str, Any] = {}
        self._candidates = candidates or {"math": [("r1", 1)], "code": [("r2", 1)]}
        self.config: dict[str, Any] = {"drain_timeout_s": 30, "data_plane_timeout_s": 60, "keep_latest_k": 2}

    def _maybe_fail(self, name: str) -> None:
        errors = self.fail.get(name)
        if errors:
            raise errors.pop(0)

    def _fenced(self, fence: Fence, expected: SnapshotPhase | None = None) -> None:
        if fence.lease_epoch != self.epoch or self.outcome is not None or (expected is not None and expected != self.phase):
            raise Fenced(RUN, "fake write", fence)

    async def run(self, run_id: str) -> Any:
        self._maybe_fail("run")
        return SimpleNamespace(run_id=run_id, config=dict(self.config), checkpoint_root="/tmp/fake-root")

    async def snapshot(self, run_id: str, snapshot_id: str) -> Any:
        return SimpleNamespace(stop=self.stop, snapshot_dir=f"/tmp/fake-root/snapshots/{snapshot_id}")

    async def topology(self, run_id: str) -> dict[str, Any]:
        return dict(TOPOLOGY)

    async def deadline_left_s(self, run_id: str, snapshot_id: str) -> float | None:
        return self.deadline_s

    async def poll(self, run_id: str, snapshot_id: str) -> repo.SnapshotProgress:
        self._maybe_fail("poll")
        return repo.SnapshotProgress(self.phase.value, self.outcome, self.abort_requested, False, self.captured)

    async def still_pending(self, run_id: str, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
        self._maybe_fail("still_pending")
        return {k for k in keys if k in self.pending}

    async def candidates(self, run_id: str) -> dict[str, list[tuple[str, int]]]:
        return self._candidates

    async def saved_episodes_ended(self, run_id: str, snapshot_id: str, saved: list[tuple[str, str, int]]) -> list[str]:
        return []

    async def close_gate(self, run_id: str, snapshot_id: str, fence: Fence, *, prepare_as: str) -> repo.GateClosure:
        self._maybe_fail("close_gate")
        self._fenced(fence, P.requested)
        self.phase = P.prepare if self.prepared else P.gate
        self.writes.append(("close_gate", self.phase))
        return repo.GateClosure({("math", "r0")} if self.owed else set(), self.prepared)

    async def move(self, run_id: str, snapshot_id: str, fence: Fence, expected: SnapshotPhase, to: SnapshotPhase, **fields: Any) -> None:
        await asyncio.sleep(0)
        self._maybe_fail(f"move:{to.value}")
        self._fenced(fence, expected)
        self.phase = to
        self.writes.append(("move", expected, to))
        if to is P.data_plane and fields.get("gym_entry") is not None:
            self.entries[fields["gym_entry"].instance_id] = fields["gym_entry"]

    async def publish(self, run_id: str, snapshot_id: str, fence: Fence, *, keep_gate: bool) -> None:
        self._maybe_fail("publish")
        self._fenced(fence, P.resume)
        self.phase = P.publish
        self.writes.append(("publish", keep_gate))

    async def take_over(self, run_id: str, snapshot_id: str, fence: Fence, expected: SnapshotPhase) -> None:
        self.writes.append(("take_over", expected))

    async def end(self, run_id: str, snapshot_id: str, outcome: Any, reason: Any, *, fence: Fence, expected: SnapshotPhase, **kw: Any) -> Any:
        self._maybe_fail("end")
        self._fenced(fence, expected)
        self.phase, self.outcome, self.reason = P(outcome.value), outcome.value, reason.value
        self.writes.append(("end", expected, outcome.value, reason.value))
        return None, repo.Streaks(0, 0)

    async def pre_cut(self, run_id: str, snapshot_id: str, fence: Fence) -> Any:
        return None

    async def store_gym_entry(self, run_id: str, snapshot_id: str, fence: Fence, entry: repo.GymEntry) -> None:
        self._maybe_fail("store_gym_entry")
        self._fenced(fence)
        self.entries[entry.instance_id] = entry


def _commit_of(checkpoint_id: str, pending: dict[str, list[Episode]]) -> CommitResult:
    instances = {
        iid: InstanceCommit(
            instance_id=iid, checkpoint_dir=f"/tmp/{iid}", scope=(), episodes=(), restarts=(), staging_keys=(f"k/{iid}",),
            participants=("agent",), pending=tuple(pending.get(iid, ())), manifest_entry='{"fake": true}',
        )
        for iid in TOPOLOGY
    }
    return CommitResult(checkpoint_id=checkpoint_id, instances=instances)


class FakeSave:
    """GymSave's steps as the machine calls them. ``fail``: step -> error; ``hang``: steps that
    never answer (until cancelled). ``calls`` records what Gym was asked."""

    def __init__(self, gym: FakeGym, topology: dict[str, Any], kwargs: dict[str, Any]) -> None:
        self.gym = gym
        self.topology = topology
        self.checkpoint_id = kwargs["checkpoint_id"]
        self.stop = kwargs.get("stop", False)
        self.drain_timeout_s = kwargs["drain_timeout_s"]
        self.timings: dict[str, float] = {}
        self.gym_parked_seconds: float | None = None
        self.parked = False
        self.cut_done = False
        self._commit: CommitResult | None = None

    async def _call(self, name: str) -> None:
        self.gym.calls.append(name)
        if name in self.gym.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(0)
        if name in self.gym.fail:
            raise self.gym.fail[name]

    async def prepare(self) -> None:
        self.parked = True
        try:
            await self._call("prepare")
        except GymControlError:
            self.parked = False  # prepare's own failure path resumes everyone
            raise

    def offer_candidates(self, candidates: dict[str, list[Episode]]) -> None:
        self.candidates = candidates

    def plan_commit(self) -> Any:
        return ({}, {})

    def plan_is_current(self) -> bool:
        return True

    async def commit(self, *, on_instance: Any = None) -> CommitResult:
        await self._call("commit")
        self._commit = _commit_of(self.checkpoint_id, self.gym.pending)
        for iid, ic in self._commit.instances.items():
            if on_instance is not None:
                on_instance(iid, ic)
        return self._commit

    def pending(self) -> dict[str, set[Episode]]:
        assert self._commit is not None
        return {iid: set(ic.pending) for iid, ic in self._commit.instances.items() if ic.pending}

    async def drain(self, resolved: Awaitable[None] | None, pending: dict[str, set[Episode]]) -> None:
        self.gym.calls.append("drain")
        if resolved is None:
            return
        if "drain" in self.gym.fail:
            if asyncio.iscoroutine(resolved):
                resolved.close()
            raise self.gym.fail["drain"]
        await resolved

    def build_manifest(self) -> None:
        self.gym.calls.append("manifest")

    async def write_manifest_file_now(self) -> None:
        await asyncio.sleep(0)

    async def within_lease(self, aw: Awaitable[Any]) -> Any:
        if "lease" in self.gym.fail:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise self.gym.fail["lease"]
        return await aw

    def cut(self) -> None:
        self.cut_done = True
        self.gym.calls.append("cut")

    async def finish(self) -> Any:
        await self._call("finish")
        self.parked = False
        assert self._commit is not None
        return SimpleNamespace(lapsed={}, warnings=(), resume=None, gym_restarted_episodes=0,
                               stop_honoured={iid: self.stop for iid in self.topology})

    async def resume_before_cut(self) -> ResumeReport | None:
        self.gym.calls.append("resume_before_cut")
        if not self.parked:
            return None
        self.parked = False
        return ResumeReport(self.checkpoint_id, None, 0.0)

    async def abandon(self) -> None:
        self.gym.calls.append("abandon")
        self.parked = False


@dataclass
class FakeGym:
    fail: dict[str, BaseException] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)
    pending: dict[str, list[Episode]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    saves: list[FakeSave] = field(default_factory=list)

    def new_save(self, run_id: str, config: Any, topology: dict[str, Any], kwargs: dict[str, Any]) -> FakeSave:
        save = FakeSave(self, topology, kwargs)
        self.saves.append(save)
        return save


class FakeOutbox:
    def __init__(self) -> None:
        self.delivered = 0

    async def deliver_run(self, run_id: str, epoch: int, *, ignore_schedule: bool = False) -> dict[str, int]:
        self.delivered += 1
        await asyncio.sleep(0)
        return {"delivered": 1}


def gym_failure(cls: FailureClass) -> GymControlError:
    return GymControlError(cls, f"fake {cls.value}")


def make(ledger: FakeLedger, gym: FakeGym, clock: VirtualClock, outbox: FakeOutbox | None = None) -> PendingSnapshot:
    ctx = SnapshotContext(ledger, None, outbox or FakeOutbox(), "replica-a", 1.0, clock=clock, new_save=gym.new_save)  # type: ignore[arg-type]
    return PendingSnapshot(ctx, RUN, SNAP, ledger.epoch)
