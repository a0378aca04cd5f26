"""A simulated RL trainer built on the thin client (``ckpt_client``) and gymsim's agents.

It does what a NeMo RL trainer does with the coordinator, at toy scale:

* a deterministic data loader hands out prompt groups per train step (a mix of turn, sibling and
  prompt_group restore levels, chosen by the run's level overrides);
* rows are admitted, dispatched in batches to a Gym instance with a bounded number of rollouts in
  flight per instance, run through the agent's ``/run``, and reported sealed, refused or failed;
* when every group of a step is ready it trains: consumes the groups, writes a trainer
  checkpoint that lists everything consumed so far, finalizes the groups and announces the step;
* mid-step it takes snapshots through the client's helper, with a data-plane capture (its rollout
  buffer, written to a file, sha256) taken under a barrier shared with training;
* after a crash, a fresh trainer that knows only the run, its token and its last checkpoint step
  asks for the restore plan, loads the snapshot's anchor checkpoint and data-plane capture,
  restores, and sends what the coordinator says (continuations to their own instance).

The trainer keeps nothing outside its checkpoint and capture files that a restart could need;
the :class:`Journal` it writes to belongs to whoever runs it and outlives a crash, so a demo or a
test can check afterwards that nothing was lost or consumed twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ckpt_client import (
    AsyncCoordinatorClient,
    BatchRefused,
    Conflict,
    DataPlaneRef,
    CoordinatorError,
    FailedRow,
    GroupSpec,
    RunStopped,
    SealedRow,
    SendRow,
    SnapshotFailed,
    SnapshotTimeout,
)

__all__ = [
    "KINDS",
    "recovery_config",
    "PromptGroup",
    "DataLoader",
    "Journal",
    "SnapshotRecord",
    "RestoreReport",
    "Trainer",
    "TrainerError",
    "sealed_fraction",
]

# The group mix of every step, in order. Each kind reaches its restore level through the run's
# override maps (docs/ledger.md#recovery-configuration): turn is the run's target level, sibling comes from the task
# source, prompt_group from the agent name.
KINDS = ("turn", "sibling", "turn", "prompt_group")
_TASK_SOURCE = {"turn": "calendar", "sibling": "retrieval", "prompt_group": "calendar"}
_AGENT = {"turn": "workplace_agent", "sibling": "workplace_agent", "prompt_group": "cohort_judge_agent"}
_SHORT = {"turn": "turn", "sibling": "sib", "prompt_group": "pg"}
_KIND_OF_SHORT = {v: k for k, v in _SHORT.items()}

# The agent server every row runs on, whatever its level: gymsim's multi-turn agent.
AGENT_SERVER = "workplace_agent"
_REFUSAL_CODES = frozenset({"admission_closed", "checkpoint_parked"})


def recovery_config(**extra: Any) -> dict[str, Any]:
    """The run's recovery config: turn level, with overrides that make the sibling and
    prompt_group groups coarser, and restart-only Gym servers allowed (one instance has one)."""
    return {
        "target_level": "turn",
        "task_source_target_level_overrides": {_TASK_SOURCE["sibling"]: "sibling"},
        "agent_target_level_overrides": {_AGENT["prompt_group"]: "prompt_group"},
        "allow_restart_only_gym_servers": True,
        **extra,
    }


class TrainerError(RuntimeError):
    """Something the trainer cannot go on from (a refusal it does not expect, a bad capture...)."""


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class PromptGroup:
    """One prompt group of the data loader: N siblings of the same task."""

    group_id: str
    step: int
    kind: str
    sample_id: int
    generations: int
    turns: tuple[int, ...]  # per sibling

    @property
    def level(self) -> str:
        return self.kind

    def task(self, index: int) -> dict[str, Any]:
        # The same task on every attempt of a sibling: a continuation with another task is
        # refused by Gym (task_mismatch), and a rerun must redo the same prompt.
        return {"sample_id": self.sample_id, "group": self.group_id, "generation": index}

    def digest(self) -> str:
        raw = json.dumps({"sample_id": self.sample_id, "kind": self.kind}, sort_keys=True).encode()
        return "sha256:" + hashlib.sha256(raw).hexdigest()

    def spec(self) -> GroupSpec:
        return GroupSpec(
            group_id=self.group_id,
            sample_id=self.sample_id,
            task_name="calendar_planning",
            task_digest=self.digest(),
            expected_generations=self.generations,
            task_source=_TASK_SOURCE[self.kind],
            agent_name=_AGENT[self.kind],
            target_step=self.step,
        )


class DataLoader:
    """Deterministic per (seed, step): a restarted trainer sees the very same groups again."""

    def __init__(self, seed: int, groups_per_step: int, *, generations: int = 4, min_turns: int = 3, max_turns: int = 9) -> None:
        if groups_per_step < 1 or generations < 1 or not 1 <= min_turns <= max_turns:
            raise ValueError("groups_per_step, generations >= 1 and 1 <= min_turns <= max_turns")
        self.seed = seed
        self.groups_per_step = groups_per_step
        self.generations = generations
        self.min_turns = min_turns
        self.max_turns = max_turns
        self._cache: dict[int, list[PromptGroup]] = {}

    def step(self, step: int) -> list[PromptGroup]:
        if step not in self._cache:
            rng = random.Random(f"{self.seed}:{step}")
            out = []
            for i in range(self.groups_per_step):
                kind = KINDS[i % len(KINDS)]
                turns = tuple(rng.randint(self.min_turns, self.max_turns) for _ in range(self.generations))
                sample = rng.randrange(1_000_000)
                out.append(PromptGroup(f"s{step:02d}-{_SHORT[kind]}-{i:02d}", step, kind, sample, self.generations, turns))
            self._cache[step] = out
        return self._cache[step]

    def group(self, group_id: str) -> PromptGroup:
        try:
            step = int(group_id.split("-", 1)[0][1:])
        except ValueError:
            raise KeyError(group_id) from None
        for g in self.step(step):
            if g.group_id == group_id:
                return g
        raise KeyError(group_id)

    @staticmethod
    def kind_of(group_id: str) -> str:
        parts = group_id.split("-")
        return _KIND_OF_SHORT.get(parts[1], "?") if len(parts) > 2 else "?"


# ---------------------------------------------------------------------------------------------
# What a run of the trainer leaves behind for checks and progress


@dataclass
class SnapshotRecord:
    snapshot_id: str
    anchor_step: int
    taken_in_step: int
    label: str
    incarnation: int
    outcome: str | None = None
    reason: str | None = None
    gym_parked_seconds: float | None = None
    detail: Any = None
    stop_honoured: bool | None = None
    gym: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-instance Gym figures

    @property
    def published(self) -> bool:
        return self.outcome == "published"

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "anchor_step": self.anchor_step,
            "taken_in_step": self.taken_in_step,
            "label": self.label,
            "incarnation": self.incarnation,
            "outcome": self.outcome,
            "reason": self.reason,
            "gym_parked_seconds": self.gym_parked_seconds,
        }


@dataclass
class Journal:
    """Everything the trainers did, kept by their owner across a crash (never read by a trainer)."""

    admitted: dict[str, int] = field(default_factory=dict)  # group id -> admissions that created it
    consumed: list[tuple[int, int, str]] = field(default_factory=list)  # (incarnation, step, group id)
    finalize_results: list[tuple[str, str]] = field(default_factory=list)
    abandoned: set[str] = field(default_factory=set)
    snapshots: list[SnapshotRecord] = field(default_factory=list)
    dispatched: set[str] = field(default_factory=set)
    sealed_rows: int = 0
    refusals: int = 0
    failures: list[str] = field(default_factory=list)
    # capture key -> Gym's final row, for every row that came back sealed
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    # listeners: progress views
    on_event: Callable[[str, str], None] | None = None
    on_change: Callable[[], None] | None = None

    def event(self, phase: str, text: str) -> None:
        if self.on_event is not None:
            self.on_event(phase, text)

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


@dataclass
class RestoreReport:
    snapshot_id: str
    anchor_step: int
    restore_id: str
    counts: dict[str, int]
    plan_counts: dict[str, int]
    gym: dict[str, Any]
    data_plane_ref: DataPlaneRef | None
    continued: list[dict[str, Any]]  # {rollout_id, capture_key, instance_id, group_id, generation_index}
    refused_not_fresh: list[list[str]]  # instance lists named by each gym_not_fresh refusal
    reused_missing_from_capture: list[str]
    # rows per disposition and reason (docs/ledger.md#row-reasons); empty from a coordinator without them
    plan_reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


# ---------------------------------------------------------------------------------------------
# The data-plane barrier


class DataPlaneLock:
    """Seals take it shared (buffer update + seal report happen together); the snapshot barrier
    and training take it exclusive, so a ledger cut never falls between a row entering the
    buffer and its seal reaching the coordinator, nor between finalizing consumed groups and
    announcing the checkpoint that consumed them. Exclusive waiters go first."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and self._waiting == 0)
            self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()


# ---------------------------------------------------------------------------------------------
# The trainer


@dataclass
class _Ticket:
    """A row to send: its identity, and the instance it goes to."""

    group_id: str
    index: int
    rollout_id: str
    capture_key: str
    gym_attempt: int
    instance_id: str


@dataclass
class _Result:
    group_id: str
    index: int
    rollout_id: str
    capture_key: str
    reward: float
    staging_keys: list[str]
    turns_completed: int
    resumed_from_turn: int | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Trainer:
    """One incarnation of the simulated trainer (see the module docstring).

    ``gym_agents`` maps instance id to its agent's base URL; the caller may update it (a Gym
    instance restarted on a new port) before rows are sent there.
    """

    def __init__(
        self,
        client: AsyncCoordinatorClient,
        gym_agents: dict[str, str],
        loader: DataLoader,
        workdir: Path,
        journal: Journal,
        *,
        incarnation: int = 1,
        slots_per_instance: int = 4,
        snapshot_when: Callable[[Trainer], bool] | None = None,
        late_snapshot_steps: Iterable[int] = (),
        hold_before_training: int | None = None,
        train_seconds: float = 0.15,
        snapshot_timeout: float = 120.0,
        gym_timeout: float = 120.0,
    ) -> None:
        self.client = client
        self.gym_agents = gym_agents
        self.instances = sorted(gym_agents)
        self.loader = loader
        self.workdir = workdir
        self.journal = journal
        self.incarnation = incarnation
        self.slots = max(1, slots_per_instance)
        # When a mid-step snapshot is due; checked whenever the trainer's state changes.
        self.snapshot_when: Callable[[Trainer], bool] = snapshot_when or sealed_fraction(0.35)
        self.late_snapshot_steps = frozenset(late_snapshot_steps)
        self.hold_before_training = hold_before_training
        self.train_seconds = train_seconds
        self.snapshot_timeout = snapshot_timeout
        (workdir / "trainer").mkdir(parents=True, exist_ok=True)
        (workdir / "dataplane").mkdir(parents=True, exist_ok=True)
        self._http = httpx.AsyncClient(timeout=gym_timeout, trust_env=False, limits=httpx.Limits(max_connections=256))

        self.step = 0
        self.last_announced = 0
        self.groups: dict[str, PromptGroup] = {}
        self.ready: set[str] = set()
        self.abandoned: set[str] = set()
        self.consumed: list[dict[str, Any]] = []  # what the trainer checkpoint holds
        self.buffer: dict[tuple[str, int], _Result] = {}  # the rollout buffer (data plane)
        self._queues: dict[str, list[_Ticket]] = {i: [] for i in self.instances}
        self._running: dict[str, tuple[_Ticket, float]] = {}  # rollout id -> (row, sent at)
        self._inflight: dict[str, int] = dict.fromkeys(self.instances, 0)
        self._changed = asyncio.Condition()
        self._dp = DataPlaneLock()
        self._tg: asyncio.TaskGroup | None = None
        self._snapshot_seq = 0
        self._extra_snapshot = asyncio.Event()
        self.at_hold = asyncio.Event()  # set when the trainer waits before training the held step
        # Set when the allocation ends (a stopping snapshot was asked for): from then on the
        # trainer only winds down, and what the coordinator refuses it is no longer its concern.
        self.stopping = False
        self.stopped = asyncio.Event()  # set once the coordinator refused dispatch with run_stopped
        self._closed = False

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()
        await self.client.close()

    # ------------------------------------------------------------------ progress views

    def step_progress(self) -> dict[str, int]:
        groups = [g for g in self.groups.values() if g.step == self.step]
        return {
            "groups": len(groups),
            "rows": sum(g.generations for g in groups),
            "sealed": sum(1 for g in groups for i in range(g.generations) if (g.group_id, i) in self.buffer),
            "ready": sum(1 for g in groups if g.group_id in self.ready or g.group_id in self.abandoned),
            "in_flight": sum(self._inflight.values()),
            "queued": sum(len(q) for q in self._queues.values()),
        }

    def queued_rows(self) -> list[tuple[str, int, str]]:
        """(group id, generation index, instance id) of every row waiting to be dispatched."""
        return [(t.group_id, t.index, t.instance_id) for q in self._queues.values() for t in q]

    def running_rows(self) -> list[tuple[str, int, str, float, int]]:
        """(group id, generation index, instance id, seconds since sent, turns) of rows in Gym."""
        now = asyncio.get_running_loop().time()
        return [(t.group_id, t.index, t.instance_id, now - sent, self.groups[t.group_id].turns[t.index]) for t, sent in self._running.values()]

    def request_snapshot(self) -> None:
        """Ask for one more mid-step snapshot (anchored on the last announced step)."""
        self._extra_snapshot.set()

    # ------------------------------------------------------------------ state changes

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        self.journal.changed()

    async def _wait_for(self, predicate: Callable[[], bool], *, poll: float | None = None) -> None:
        """Until ``predicate()`` holds; checked on every state change, and every ``poll``
        seconds as well for predicates that depend on time."""
        async with self._changed:
            while not predicate():
                if poll is None:
                    await self._changed.wait()
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll):
                        await self._changed.wait()

    def _instance_for(self, group_id: str, index: int) -> str:
        # Siblings alternate between instances, so every group has rows on each of them.
        suffix = group_id.rsplit("-", 1)[-1]
        base = int(suffix) if suffix.isdigit() else 0
        return self.instances[(base + index) % len(self.instances)]

    def _enqueue(self, row: SendRow | Any) -> None:
        """Queue a row from an answer (admit, failure, restore) for its instance: a continuation
        goes back to the instance holding its Gym state, anything else where it fits."""
        continued = row.instance_id is not None and getattr(row, "disposition", None) == "continued"
        # The coordinator may also spread other rows over the instances (a restore into another
        # topology does); it knows the whole plan, so its choice wins when it names one we have.
        chosen = row.instance_id if row.instance_id in self._queues else None
        iid = row.instance_id if continued else chosen or self._instance_for(row.group_id, row.generation_index)
        if iid not in self._queues:
            raise TrainerError(f"row {row.rollout_id} must go to Gym instance {iid!r}, which this trainer does not know")
        self._queues[iid].append(_Ticket(row.group_id, row.generation_index, row.rollout_id, row.capture_key or row.rollout_id, row.gym_attempt, iid))

    # ------------------------------------------------------------------ the loop

    async def run(self, first_step: int, last_step: int) -> None:
        """Train steps ``first_step..last_step``. Cancelling this is the trainer's crash."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            dispatchers = [tg.create_task(self._dispatcher(iid), name=f"dispatch {iid}") for iid in self.instances]
            for step in range(first_step, last_step + 1):
                await self._train_step(step)
            for d in dispatchers:
                d.cancel()

    async def _train_step(self, step: int) -> None:
        self.step = step
        groups = self.loader.step(step)
        # Groups the coordinator already holds (restored from a snapshot) are not admitted again.
        new = [g for g in groups if g.group_id not in self.groups]
        for g in groups:
            self.groups.setdefault(g.group_id, g)
        if new:
            answer = await self.client.admit_groups([g.spec() for g in new])
            order = {g.group_id: k for k, g in enumerate(new)}
            rows = []
            for ag in answer.groups:
                if ag.admitted:
                    self.journal.admitted[ag.group_id] = self.journal.admitted.get(ag.group_id, 0) + 1
                rows.extend(r for r in ag.rows if r.status in (None, "reserved"))
            # Sibling i of every group before sibling i+1 of any: what is in flight (and what
            # waits) at any moment is a mix of every restore level, as in a real rollout batch.
            for row in sorted(rows, key=lambda r: (r.generation_index, order.get(r.group_id, 0))):
                self._enqueue(row)
        await self._notify()
        self.journal.event("train", f"step {step}: {len(groups)} groups ({len(new)} admitted now), {sum(g.generations for g in groups)} siblings")

        assert self._tg is not None
        snapshots = self._tg.create_task(self._snapshots_during(step), name=f"snapshots step {step}")
        step_ids = [g.group_id for g in groups]
        await self._wait_for(lambda: all(gid in self.ready or gid in self.abandoned for gid in step_ids))
        await snapshots
        if self.hold_before_training == step:
            # The caller crashes the trainer here (cancels it); it never trains this step.
            self.at_hold.set()
            await asyncio.Event().wait()
        late: asyncio.Task[None] | None = None
        async with self._dp.exclusive():
            if step in self.late_snapshot_steps:
                late = await self._start_late_snapshot(step)
            await self._train(step, step_ids)
        if late is not None:
            await late

    async def _snapshots_during(self, step: int) -> None:
        """One snapshot once it is due (by default: part of the step's rows sealed, so others
        are in flight in Gym), and one more whenever asked and due again, until the step's
        groups are all ready."""

        def done() -> bool:
            return all(g.group_id in self.ready or g.group_id in self.abandoned for g in self.groups.values() if g.step == step)

        def due() -> bool:
            return done() or self.snapshot_when(self)

        await self._wait_for(due, poll=0.05)
        if done():
            return
        self._extra_snapshot.clear()
        await self._snapshot(step, self.last_announced, "mid")
        while True:
            waiter = asyncio.ensure_future(self._extra_snapshot.wait())
            finished = asyncio.ensure_future(self._wait_for(done))
            try:
                await asyncio.wait({waiter, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                finished.cancel()
            if done():
                return
            self._extra_snapshot.clear()
            await self._wait_for(due, poll=0.05)
            if done():
                return
            await self._snapshot(step, self.last_announced, "extra")

    def _new_snapshot_record(self, step: int, anchor: int, label: str) -> SnapshotRecord:
        self._snapshot_seq += 1
        sid = f"snap-i{self.incarnation}-s{step:02d}-{label}-{self._snapshot_seq}"
        rec = SnapshotRecord(sid, anchor, step, label, self.incarnation)
        self.journal.snapshots.append(rec)
        return rec

    async def _snapshot(self, step: int, anchor: int, label: str, rec: SnapshotRecord | None = None) -> None:
        rec = rec or self._new_snapshot_record(step, anchor, label)
        self.journal.changed()

        try:
            snap = await self.client.snapshot(
                anchor,
                capture=lambda keys: self._capture(rec, keys),
                snapshot_id=rec.snapshot_id,
                # The data-plane barrier: no seal half-done and no training while cut and
                # capture happen, so the capture holds exactly what the ledger cut has sealed.
                barrier=self._dp.exclusive,
                poll_interval=0.05,
                timeout=self.snapshot_timeout,
            )
            rec.outcome, rec.reason, rec.gym_parked_seconds = snap.outcome or "published", snap.reason, snap.gym_parked_seconds
        except SnapshotFailed as e:
            rec.outcome, rec.reason = e.outcome, e.reason
            rec.gym_parked_seconds = getattr(e.snapshot, "gym_parked_seconds", None)
            rec.detail = getattr(e.snapshot, "raw", {}).get("detail")
        except SnapshotTimeout as e:
            rec.outcome, rec.reason = "timeout", str(e)
        parked = f", Gym parked {rec.gym_parked_seconds:.2f}s" if rec.gym_parked_seconds is not None else ""
        why = f" ({rec.reason})" if rec.reason and not rec.published else ""
        self.journal.event("snapshot", f"{rec.snapshot_id} anchored on step {anchor}: {rec.outcome}{why}{parked}")
        self.journal.changed()

    async def stop_snapshot(self, deadline_s: float) -> SnapshotRecord:
        """What the trainer's SIGUSR1 handler does when the allocation ends: a stopping snapshot
        anchored on the newest announced step, with the same barrier and capture as any other,
        within ``deadline_s``. Gym stays parked and dispatch stays refused afterwards; the caller
        ends the process. Returns the record (its outcome says whether it made it)."""
        self.stopping = True
        rec = self._new_snapshot_record(self.step, self.last_announced, "stop")
        self.journal.changed()
        try:
            snap = await self.client.stop_snapshot(
                rec.anchor_step,
                capture=lambda keys: self._capture(rec, keys),
                snapshot_id=rec.snapshot_id,
                barrier=self._dp.exclusive,
                deadline_s=deadline_s,
                poll_interval=0.05,
            )
            rec.outcome, rec.reason, rec.gym_parked_seconds = snap.outcome or "published", snap.reason, snap.gym_parked_seconds
            rec.stop_honoured, rec.gym, rec.detail = snap.stop_honoured, snap.gym_figures, snap.raw.get("detail")
        except SnapshotFailed as e:
            rec.outcome, rec.reason = e.outcome, e.reason
            rec.detail = getattr(e.snapshot, "raw", {}).get("detail")
        except SnapshotTimeout as e:
            rec.outcome, rec.reason = "timeout", str(e)
        why = f" ({rec.reason})" if rec.reason and not rec.published else ""
        honoured = {True: "honoured", False: "not honoured (Gym refused it; committed without)", None: "not reported"}[rec.stop_honoured]
        self.journal.event("stop", f"{rec.snapshot_id} anchored on step {rec.anchor_step}: {rec.outcome}{why}; stop {honoured}")
        self.journal.changed()
        return rec

    async def _start_late_snapshot(self, step: int) -> asyncio.Task[None]:
        """A snapshot requested while this step is being trained: its barrier waits for the
        optimizer, so the train step commits first and the snapshot is aborted
        (docs/ledger.md#outcomes-and-reasons)."""
        rec = self._new_snapshot_record(step, self.last_announced, "late")
        # Requested here, before the announcement, so the coordinator sees it as a live snapshot
        # that loses to the train step (the helper's own request repeats the same id).
        await self.client.request_snapshot(rec.anchor_step, snapshot_id=rec.snapshot_id)
        assert self._tg is not None
        return self._tg.create_task(self._snapshot(step, rec.anchor_step, "late", rec), name=f"late snapshot {step}")

    async def _capture(self, rec: SnapshotRecord, staging_keys: list[str]) -> dict[str, str]:
        """Save the data plane (the rollout buffer of live groups) and return {path, digest}."""
        consumed = {c["group_id"] for c in self.consumed}
        rows = [r.to_json() for (gid, _), r in sorted(self.buffer.items()) if gid not in consumed]
        doc = {"snapshot_id": rec.snapshot_id, "anchor_step": rec.anchor_step, "required_staging_keys": sorted(staging_keys), "rows": rows}
        path = self.workdir / "dataplane" / f"{rec.snapshot_id}.json"
        data = json.dumps(doc, sort_keys=True).encode()
        _write_atomically(path, data)
        return {"path": str(path), "digest": "sha256:" + hashlib.sha256(data).hexdigest()}

    async def _train(self, step: int, group_ids: list[str]) -> None:
        """Consume the step's ready groups, checkpoint, finalize, announce; under the barrier."""
        batch = []
        for gid in group_ids:
            if gid in self.abandoned:
                continue
            g = self.groups[gid]
            rows = [self.buffer.get((gid, i)) for i in range(g.generations)]
            missing = [i for i, r in enumerate(rows) if r is None]
            if missing:
                raise TrainerError(f"group {gid} is ready but the rollout buffer lacks siblings {missing}")
            batch.append({"group_id": gid, "step": step, "rollouts": [r.rollout_id for r in rows if r], "rewards": [r.reward for r in rows if r]})
        await asyncio.sleep(self.train_seconds)  # the optimizer step
        self.consumed.extend(batch)
        ckpt = self.workdir / "trainer" / f"step-{step:04d}.json"
        _write_atomically(ckpt, json.dumps({"step": step, "seed": self.loader.seed, "consumed": self.consumed}, indent=1).encode())
        if batch:
            answer = await self.client.finalize_groups([b["group_id"] for b in batch])
            for o in answer.groups:
                self.journal.finalize_results.append((o.group_id, o.result))
        for b in batch:
            self.journal.consumed.append((self.incarnation, step, b["group_id"]))
            for i in range(len(b["rollouts"])):
                self.buffer.pop((b["group_id"], i), None)
        ts = await self.client.announce_train_step(step, checkpoint_ref=str(ckpt))
        self.last_announced = step
        lost = f"; snapshot(s) {', '.join(ts.aborted_snapshots)} lost to it" if ts.aborted_snapshots else ""
        self.journal.event("train", f"step {step}: trained on {len(batch)} groups, checkpoint {ckpt.name} announced{lost}")
        await self._notify()

    # ------------------------------------------------------------------ rows

    async def _dispatcher(self, iid: str) -> None:
        assert self._tg is not None
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: bool(self._queues[iid]) and self._inflight[iid] < self.slots)
                n = self.slots - self._inflight[iid]
                batch, self._queues[iid][:n] = self._queues[iid][:n], []
                self._inflight[iid] += len(batch)
            try:
                answer = await self.client.dispatch_when_open([t.rollout_id for t in batch], instance_id=iid, timeout=600.0, max_wait=0.5)
            except RunStopped:
                # A stopping snapshot ended dispatch for this allocation: the rows stay queued
                # (the ledger holds them as reserved) and this dispatcher is done.
                self._queues[iid][:0] = batch
                self._inflight[iid] -= len(batch)
                self.stopped.set()
                await self._notify()
                await asyncio.Event().wait()
            sent = {r.rollout_id: r for r in answer.rows}
            for t in batch:
                r = sent.get(t.rollout_id)
                if r is not None:
                    t.capture_key, t.gym_attempt = r.capture_key, r.gym_attempt
                self.journal.dispatched.add(t.rollout_id)
                self._tg.create_task(self._row(t), name=f"row {t.rollout_id}")
            self.journal.changed()

    async def _row(self, t: _Ticket) -> None:
        self._running[t.rollout_id] = (t, asyncio.get_running_loop().time())
        try:
            await self._run_row(t)
        except CoordinatorError as e:
            if not self.stopping:
                raise
            # After the stop the coordinator refuses re-sends (run_stopped): the stopping
            # snapshot's cut already decides what the next allocation does with this row.
            self.journal.failures.append(f"{t.rollout_id}: after the stop: {e.code}")
        finally:
            self._running.pop(t.rollout_id, None)
            self._inflight[t.instance_id] -= 1
            await self._notify()

    async def _run_row(self, t: _Ticket) -> None:
        g = self.groups[t.group_id]
        body = {"_ng_rollout_id": t.rollout_id, "_ng_attempt_index": t.gym_attempt, "task": g.task(t.index), "turns": g.turns[t.index]}
        url = self.gym_agents[t.instance_id].rstrip("/") + "/run"
        try:
            resp = await self._http.post(url, json=body)
        except httpx.TransportError as e:
            await self._failed(t, f"{t.instance_id}: {type(e).__name__}")
            return
        if resp.status_code == 200:
            await self._sealed(t, resp.json())
            return
        code = _gym_code(resp)
        if resp.status_code == 409 and code in _REFUSAL_CODES:
            # Gym closed admission for a checkpoint after the row was dispatched: same identity,
            # sent again once the coordinator's gate reopens.
            self.journal.refusals += 1
            answer = await self.client.report_refused([t.rollout_id])
            for row in answer.rows:
                if row.rollout_id == t.rollout_id:
                    t.capture_key, t.gym_attempt = row.capture_key, row.gym_attempt
            self._queues[t.instance_id].insert(0, t)
            return
        await self._failed(t, f"{t.instance_id}: HTTP {resp.status_code} {code or resp.text[:120]}")

    async def _sealed(self, t: _Ticket, reply: dict[str, Any]) -> None:
        result = _Result(
            t.group_id,
            t.index,
            t.rollout_id,
            str(reply.get("capture_key", t.capture_key)),
            float(reply.get("reward", 0.0)),
            list(reply.get("staging_keys", [])),
            int(reply.get("turns_completed", 0)),
            reply.get("resumed_from_turn"),
        )
        row = SealedRow.from_gym_reply(t, reply)  # the receipt names the attempt that was sent
        async with self._dp.shared():
            self.buffer[(t.group_id, t.index)] = result
            try:
                answer = await self.client.report_sealed([row])
            except BatchRefused as e:
                # The attempt was replaced meanwhile (its cohort was retried): its result is void.
                self.buffer.pop((t.group_id, t.index), None)
                self.journal.failures.append(f"{t.rollout_id}: seal refused ({e.code})")
                return
        self.journal.sealed_rows += 1
        self.journal.replies[result.capture_key] = dict(reply, instance_id=t.instance_id, group_id=t.group_id, generation_index=t.index)
        bad = [r for r in answer.rows if r.result not in ("sealed", "returned", "unchanged")]
        if bad:
            raise TrainerError(f"seal of {t.rollout_id} answered {bad[0].result!r}")
        self.ready.update(answer.ready_groups)

    async def _failed(self, t: _Ticket, detail: str) -> None:
        self.journal.failures.append(f"{t.rollout_id}: {detail}")
        answer = await self.client.report_failed([FailedRow(t.rollout_id, "transport", detail[:4000])])
        for row in answer.rows_to_send:
            self._enqueue(row)
        for gid in answer.abandoned_groups:
            self.abandoned.add(gid)
            self.journal.abandoned.add(gid)
            self.journal.event("train", f"group {gid} abandoned by the coordinator (retry budget spent)")

    # ------------------------------------------------------------------ restore after a crash

    async def restore(
        self,
        last_checkpoint_step: int,
        on_not_fresh: Callable[[list[str]], Awaitable[None]],
        *,
        max_refusals: int = 2,
        instance_map: Mapping[str, str] | None = None,
    ) -> RestoreReport:
        """Restore the run from the newest snapshot compatible with the trainer's last
        checkpoint. Loads the snapshot's anchor checkpoint and data-plane capture, applies the
        restore (``on_not_fresh(instances)`` is awaited when the coordinator refuses because
        Gym instances served work; it must restart them), then queues what must be sent.
        Returns the report; call :meth:`run` from ``anchor_step + 1`` next. ``instance_map``
        ``{saved instance: live instance}`` restores into a Gym deployment of another shape."""
        plan = await self.client.restore_plan(step=last_checkpoint_step, include_reused=True, instance_map=instance_map)
        anchor = plan.anchor_step if plan.anchor_step is not None else int(plan.raw.get("anchor_step", 0))
        self.journal.event(
            "restore",
            f"plan: snapshot {plan.snapshot_id} anchored on step {anchor} "
            f"(load trainer checkpoint {anchor}): " + _counts_text(plan.counts),
        )
        self.consumed = self._load_checkpoint(anchor)
        capture = self._load_capture(plan.data_plane_ref)
        refused: list[list[str]] = []
        while True:
            try:
                res = await self.client.restore(
                    snapshot_id=plan.snapshot_id, step=last_checkpoint_step, with_gym_state=True, instance_map=instance_map
                )
                break
            except Conflict as e:
                if e.code != "gym_not_fresh" or len(refused) >= max_refusals:
                    raise
                names = [str(x) for x in e.problem.get("instances") or []]
                refused.append(names)
                self.journal.event("restore", f"refused ({e.code}): {e.detail}")
                await on_not_fresh(names)

        self.step = anchor + 1
        self.last_announced = anchor
        by_rollout = {r["rollout_id"]: r for r in capture.get("rows", [])}
        missing: list[str] = []
        rows_by_group: dict[str, list[Any]] = {}
        for r in plan.rows:
            self.groups.setdefault(r.group_id, self.loader.group(r.group_id))
            rows_by_group.setdefault(r.group_id, []).append(r)
            if r.disposition != "reused":
                continue
            saved = by_rollout.get(r.rollout_id or "")
            if saved is None:
                missing.append(r.rollout_id or f"{r.group_id}_g{r.generation_index}")
                continue
            self.buffer[(r.group_id, r.generation_index)] = _Result(**{k: saved[k] for k in _Result.__dataclass_fields__})
        continued = []
        for r in res.rows_to_send:
            self.groups.setdefault(r.group_id, self.loader.group(r.group_id))
            self._enqueue(r)
            if r.disposition == "continued":
                continued.append(
                    {"rollout_id": r.rollout_id, "capture_key": r.capture_key, "instance_id": r.instance_id, "group_id": r.group_id, "generation_index": r.generation_index}
                )
        # Groups whose every sibling was sealed at the cut are ready again, with nothing to send.
        for gid, rows in rows_by_group.items():
            if all(r.disposition == "reused" for r in rows):
                detail = await self.client.group(gid)
                if detail.status != "ready":
                    raise TrainerError(f"group {gid}: every sibling reused but the coordinator says it is {detail.status!r}")
                self.ready.add(gid)
        await self._notify()
        report = RestoreReport(
            snapshot_id=plan.snapshot_id,
            anchor_step=anchor,
            restore_id=res.restore_id,
            counts=dict(res.counts),
            plan_counts=dict(plan.counts),
            plan_reasons=plan.reasons,
            gym=dict(res.raw.get("gym") or {}),
            data_plane_ref=plan.data_plane_ref,
            continued=continued,
            refused_not_fresh=refused,
            reused_missing_from_capture=missing,
            raw=dict(res.raw),
        )
        self.journal.event("restore", f"applied {res.restore_id} (epoch {res.epoch}): " + _counts_text(res.counts))
        return report

    def _load_checkpoint(self, step: int) -> list[dict[str, Any]]:
        if step == 0:
            return []  # step 0 is the initial policy: nothing consumed yet
        path = self.workdir / "trainer" / f"step-{step:04d}.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TrainerError(f"trainer checkpoint of step {step} unreadable at {path}: {e}") from e
        if doc.get("step") != step:
            raise TrainerError(f"{path} holds step {doc.get('step')}, not {step}")
        return list(doc.get("consumed", []))

    @staticmethod
    def _load_capture(ref: DataPlaneRef | None) -> dict[str, Any]:
        if ref is None:
            raise TrainerError("the restore plan names no data-plane capture")
        try:
            data = Path(ref.path).read_bytes()
        except OSError as e:
            raise TrainerError(f"data-plane capture {ref.path} unreadable: {e}") from e
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest != ref.digest:
            raise TrainerError(f"data-plane capture {ref.path} has digest {digest}, the snapshot recorded {ref.digest}")
        doc = json.loads(data)
        if not isinstance(doc, Mapping):
            raise TrainerError(f"data-plane capture {ref.path} is not a JSON object")
        return dict(doc)


def sealed_fraction(fraction: float) -> Callable[[Trainer], bool]:
    """A snapshot is due once this fraction of the current step's siblings is sealed."""

    def due(t: Trainer) -> bool:
        p = t.step_progress()
        return p["sealed"] >= fraction * max(1, p["rows"])

    return due


def _counts_text(counts: Mapping[str, int]) -> str:
    order = ("reused", "continued", "restarted", "gym_restarted", "rerun", "dispatch")
    return ", ".join(f"{k} {counts.get(k, 0)}" for k in order)


def _gym_code(resp: httpx.Response) -> str | None:
    try:
        code = resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(code)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

