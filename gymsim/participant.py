"""The per-participant phase machine (docs/gym-protocol.md#participant-phases), shared by every kind.

Kind-specific behaviour (what blocks readiness, what is in flight, what an export holds, how a
record is installed, how work is stopped) lives in the subclasses in `kinds.py`. Sections under
`self.lock` never await, so every transition is atomic on the event loop; waiting (for readiness,
an export, an install, stopping work) always happens outside the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from . import storage
from .config import PUBLISHED_PROFILES, ServerConfig
from .wire import (
    BODY_MODELS,
    MAX_BLOCKERS,
    RESUMED_MEMORY,
    CommitBody,
    CommitBodyWithoutStop,
    ForgetBody,
    PrepareBody,
    ProtocolError,
    RestoreBody,
    RetireBody,
    capture_key,
)

if TYPE_CHECKING:
    from .instance import Instance

log = logging.getLogger("gymsim")

Pair = tuple[str, int]
Predicate = Callable[[], bool]


def behaviour_mode(reported: str | None) -> str:
    """How a participant behaves: an older Gym without `mode`, the alias and unknown strings all export."""
    if reported in ("stateless", "restart_only"):
        return reported
    return "exported"


def sorted_pairs(pairs) -> list[Pair]:
    return sorted(pairs, key=lambda p: (p[0], p[1]))


class DropConnection(Exception):
    """The process this request reached was killed: the client sees the connection drop."""


@dataclass
class Stored:
    args: Any
    reply: dict[str, Any]


@dataclass
class ExportJob:
    """Export state of one checkpoint: one capture, shared by every commit of that checkpoint."""

    checkpoint_id: str
    capture: asyncio.Task
    writes: dict[Any, asyncio.Task] = field(default_factory=dict)


@dataclass
class InstallJob:
    key: Any
    task: asyncio.Task
    waiters: int = 0


class Participant:
    # What published Gym does differently per kind (rules P1 to P8 of
    # docs/gym-protocol.md#what-differs-rule-by-rule; README "gym_profile"); consulted only when
    # `self.published`.
    PUBLISHED_REPORTS_MODE = True  # model and agent status carry no `mode` (P3)
    PUBLISHED_EXPORTS_LIVE_OUTSIDE_SCOPE = False  # agent and resources export every live session (P2)
    PUBLISHED_RESTART_ONLY_STAYS_OPEN = False  # restart_only agent and resources never close admission

    def __init__(self, instance: "Instance", config: ServerConfig) -> None:
        self.instance = instance
        self.config = config
        self.server_name = config.server_name
        self.kind: str = config.kind or ""
        self.name = config.name
        self.reported_mode = self.configured_mode(config.mode)
        self.mode = behaviour_mode(self.reported_mode)
        self.clock = instance.clock
        self.notifier = instance.notifier
        self.lock = asyncio.Lock()
        # Published Gym serialises its control calls on one lock that a commit holds until its
        # export is written (README, "published"): a renew or resume sent meanwhile waits for it.
        self.commit_serial = asyncio.Lock()

        self.phase = "idle"
        self.active_id: str | None = None
        self.resumed: deque[str] = deque(maxlen=RESUMED_MEMORY)
        self.stored: dict[tuple[str, str], Stored] = {}
        self.lease_expires_at: float | None = None
        self.marks: dict[str, int] = {}
        self.restarts_fixed: list[str] | None = None
        self.unclaimed: dict[Pair, dict[str, Any]] = {}
        self.export_job: ExportJob | None = None
        self.install_job: InstallJob | None = None
        self.served = False
        self.killed = False
        self.tasks: set[asyncio.Task] = set()

        self.counters: dict[str, int] = {
            name: 0
            for name in (
                "prepare_calls",
                "prepare_count",
                "renew_count",
                "commit_calls",
                "commit_count",
                "export_count",
                "write_count",
                "restore_calls",
                "restore_count",
                "install_count",
                "resume_count",
                "stop_count",
                "retire_count",
                "forget_count",
                "lease_expired",
            )
        }
        self.retire_calls: list[list[str]] = []
        self.forget_calls: list[list[str]] = []

    # ------------------------------------------------------------------ helpers

    @property
    def knobs(self) -> ServerConfig:
        return self.config

    # The one place that decides which profile this participant follows; every difference between
    # the profiles branches on `self.published`.
    @property
    def profile(self) -> str:
        return self.instance.config.profile_of(self.server_name)

    @property
    def published(self) -> bool:
        return self.profile in PUBLISHED_PROFILES

    @property
    def spelling(self) -> str:
        return self.instance.config.spelling_for(self.server_name)

    def configured_mode(self, configured: str | None) -> str | None:
        """The mode this participant reports (None: none); resources override the published default."""
        return configured

    @property
    def accepts_stop(self) -> bool:
        if self.knobs.accepts_stop is not None:
            return self.knobs.accepts_stop
        return not self.published

    def body_model(self, op: str) -> type:
        """The request model of a control op; a commit without `stop` for Gym that predates it (P4)."""
        if op == "commit" and not self.accepts_stop:
            return CommitBodyWithoutStop
        return BODY_MODELS[op]

    @property
    def stays_open(self) -> bool:
        """Published restart_only agents and resources never close admission: they capture nothing."""
        return self.published and self.mode == "restart_only" and self.PUBLISHED_RESTART_ONLY_STAYS_OPEN

    def unexpected(self, error: BaseException, what: str) -> BaseException:
        """A failure that is no protocol refusal: strict wraps it in the 500 `checkpoint_error`
        envelope; published Gym lets it escape to the framework's plain 500."""
        if isinstance(error, ProtocolError) or self.published:
            return error
        return ProtocolError("checkpoint_error", f"{what} failed: {error!r}", status=500)

    def broken(self, behaviour: str) -> bool:
        return behaviour in self.instance.config.broken

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)

        def _done(t: asyncio.Task) -> None:
            self.tasks.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved here: a handler that gave up on it must not leave a warning
            self.notifier.notify()

        task.add_done_callback(_done)
        return task

    def shutdown(self) -> None:
        """Drop everything, as a killed process would: waiting requests lose their connections."""
        self.killed = True
        for task in list(self.tasks):
            task.cancel()
        self.notifier.notify()

    def ensure_alive(self) -> None:
        if self.killed:
            raise DropConnection()

    @property
    def installing(self) -> bool:
        job = self.install_job
        return job is not None and (not job.task.done() or job.waiters > 0)

    @property
    def admission_open(self) -> bool:
        return self.stays_open or (self.phase == "idle" and not self.installing)

    def _extend_lease(self, deadline_ts: float) -> None:
        candidate = deadline_ts + self.instance.config.lease_grace_seconds
        if self.lease_expires_at is None or candidate > self.lease_expires_at:
            self.lease_expires_at = candidate

    def check_lease(self) -> None:
        """Expire the lease if it is due: the participant resumes itself
        (docs/gym-protocol.md#leases-and-renewals)."""
        if self.phase == "idle" or self.lease_expires_at is None or self.broken("lease_never_expires"):
            return
        if self.clock.now() >= self.lease_expires_at:
            expired = self.active_id
            self.counters["lease_expired"] += 1
            log.warning(
                "gymsim %s/%s: lease of checkpoint %s expired in phase %s; reopening admission",
                self.instance.config.instance_id,
                self.server_name,
                expired,
                self.phase,
            )
            self._end_checkpoint()

    def _end_checkpoint(self) -> None:
        """Resume and lease expiry: stop the writer, reopen, remember the id
        (docs/gym-protocol.md#participant-phases, docs/gym-protocol.md#resume)."""
        job = self.export_job
        if job is not None:
            job.capture.cancel()
            for task in job.writes.values():
                task.cancel()
        self.export_job = None
        if self.active_id is not None:
            self.resumed.append(self.active_id)
        self.active_id = None
        self.stored.clear()
        self.phase = "idle"
        self.lease_expires_at = None
        self.restarts_fixed = None
        self.notifier.notify()

    def _precheck(self, checkpoint_id: str, op: str, args: Any) -> dict[str, Any] | None:
        """The first three checks of docs/gym-protocol.md#participant-phases; returns a stored reply
        to replay, or None to go on."""
        if checkpoint_id in self.resumed:
            raise ProtocolError("stale_checkpoint", f"checkpoint {checkpoint_id} was already resumed or its lease expired")
        if self.active_id is not None and self.active_id != checkpoint_id:
            raise ProtocolError("checkpoint_conflict", f"checkpoint {self.active_id} is active, not {checkpoint_id}")
        entry = self.stored.get((checkpoint_id, op))
        if entry is None:
            return None
        if entry.args == args or (op == "commit" and self.broken("replay_different_scope")):
            return entry.reply
        raise ProtocolError("checkpoint_conflict", f"{op} of {checkpoint_id} was already done with other arguments")

    def _invalid_phase(self, op: str) -> ProtocolError:
        return ProtocolError("invalid_phase", f"{op} is not allowed in phase {self.phase}")

    # ------------------------------------------------------------------ readiness

    def report(self) -> dict[str, Any]:
        tokens = self.worker_blockers()
        if self.published:
            # Published Gym puts the worker tokens first and does not sort them in with the rest.
            blockers = tokens + sorted(set(self.blockers()) - set(tokens))
        else:
            blockers = sorted(set(self.blockers()) | set(tokens))
        return {
            "ready": not blockers,
            "blockers": blockers[:MAX_BLOCKERS],
            "blocker_count": len(blockers),
            "counts": self.counts(),
            "restarts": self.restarts(),
        }

    def restarts(self) -> list[str]:
        """Strict: fixed while a checkpoint is open. Published: worked out again on every call."""
        if self.restarts_fixed is not None:
            return list(self.restarts_fixed)
        return self.current_restarts()

    @property
    def worker_label(self) -> str:
        return self.kind

    def worker_blockers(self) -> list[str]:
        out = []
        if self.knobs.workers > 1 or self.knobs.unreported_workers or self.knobs.worker_lost:
            if self.knobs.unreported_workers:
                out.append(f"{self.worker_label}-workers-unreported:{self.knobs.unreported_workers}")
            if self.knobs.worker_lost:
                out.append(f"{self.worker_label}-worker-lost")
        return out

    def current_restarts(self) -> list[str]:
        """Restarts are what a restart_only participant cannot capture: everything it holds live."""
        if self.mode != "restart_only":
            return []
        return sorted(set(self.live_keys()))

    def is_fresh(self) -> bool:
        return not (
            self.knobs.non_fresh
            or self.knobs.worker_lost
            or self.unclaimed
            or self.has_live_state()
        )

    # ------------------------------------------------------------------ kind hooks (overridden)

    def blockers(self) -> list[str]:
        return []

    def counts(self) -> dict[str, int]:
        return {"unclaimed": len(self.unclaimed)}

    def live_keys(self) -> list[str]:
        return [capture_key(*p) for p in self.unclaimed]

    def has_live_state(self) -> bool:
        return False

    def capture_state(self) -> dict[Pair, dict[str, Any]]:
        """Full exportable state, taken once per checkpoint; the scope is applied when writing."""
        return {pair: dict(state) for pair, state in self.unclaimed.items()}

    def commit_extras(self, exported: dict[Pair, dict[str, Any]]) -> dict[str, Any]:
        return {}

    def validate_record(self, record: dict[str, Any]) -> None:
        """Raise ValueError if a record in scope cannot be installed."""

    def install_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return dict(state)

    def claim(self, pair: Pair) -> dict[str, Any] | None:
        return self.unclaimed.pop(pair, None)

    def stop_work(self, pairs: list[Pair]) -> Predicate:
        """Begin stopping live work of attempts <= N; returns "everything has stopped"."""
        return lambda: True

    def free_state(self, pairs: list[Pair]) -> None:
        for rollout_id, attempt in pairs:
            for pair in [p for p in self.unclaimed if p[0] == rollout_id and p[1] <= attempt]:
                del self.unclaimed[pair]

    def tracked_attempts(self, rollout_id: str) -> list[int]:
        """Attempts of a rollout with live work still tracked (forget refuses while one is retired)."""
        return []

    def on_forget(self, rollout_id: str) -> None:
        pass

    def status_extras(self) -> dict[str, Any]:
        return {}

    def admin_extras(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ data plane

    def admit(self, rollout_id: str, attempt: int) -> None:
        """Admission of new data-plane work: marks first, then the checkpoint gate
        (docs/gym-protocol.md#marks-retire-and-forget, docs/gym-protocol.md#data-plane-refusals)."""
        self.check_lease()
        if self.is_marked(rollout_id, attempt):
            raise ProtocolError(
                "stale_attempt",
                f"attempt {attempt} of {rollout_id} was retired (mark {self.marks[rollout_id]})",
            )
        self.check_binding(rollout_id, attempt)
        if not self.admission_open:
            raise ProtocolError("admission_closed", f"{self.server_name} is parked for a checkpoint; retry after resume")

    def check_binding(self, rollout_id: str, attempt: int) -> None:
        """Kinds that bind sessions by rollout id (the published agent) refuse other attempts here."""

    def is_marked(self, rollout_id: str, attempt: int) -> bool:
        if self.broken("ignore_stale_attempt"):
            return False  # the deliberately broken data plane: marks are kept but never enforced
        return attempt <= self.marks.get(rollout_id, -1)

    # ------------------------------------------------------------------ control operations

    def status(self) -> dict[str, Any]:
        self.check_lease()
        body: dict[str, Any] = {
            "kind": self.kind,
            "instance": self.name,
            "phase": self.phase,
            "checkpoint_id": self.active_id,
            "lease_expires_at": self.lease_expires_at,
            "retired_rollouts": len(self.marks),
            "report": self.report(),
        }
        if self.reported_mode is not None and (self.PUBLISHED_REPORTS_MODE or not self.published):
            body["mode"] = self.reported_mode
        unclaimed_name = "restored_pending" if self.spelling == "legacy" else "unclaimed"
        body[unclaimed_name] = sorted(capture_key(*p) for p in self.unclaimed)
        if self.knobs.workers > 1:
            body["expected_workers"] = self.knobs.workers
            body["workers"] = self.knobs.workers - self.knobs.unreported_workers - (1 if self.knobs.worker_lost else 0)
        if not self.published:  # published Gym counts expiries as a metric only
            body["lease_expired"] = self.counters["lease_expired"]
        body.update(self.status_extras())
        return body

    async def prepare(self, body: PrepareBody) -> dict[str, Any]:
        cid = body.checkpoint_id
        async with self.lock:
            self.check_lease()
            self.counters["prepare_calls"] += 1
            replay = self._precheck(cid, "prepare", None)
            if replay is not None:
                self._extend_lease(body.deadline_ts)
                return replay
            if self.phase == "idle":
                self.active_id = cid
                self.phase = "preparing"
                self._extend_lease(body.deadline_ts)
                # Strict: restarts are decided now, while the checkpoint opens, and stay fixed for it.
                # Published Gym works them out again on every report (they can change meanwhile).
                self.restarts_fixed = None if self.published else self.current_restarts()
                self.counters["prepare_count"] += 1
                self.notifier.notify()  # admission is now closed: parked work must notice
            elif self.phase == "preparing":
                self._extend_lease(body.deadline_ts)
            else:
                raise self._invalid_phase("prepare")
        return await self._await_ready(cid, body.deadline_ts)

    async def _await_ready(self, cid: str, deadline_ts: float) -> dict[str, Any]:
        while True:
            self.ensure_alive()
            self.check_lease()
            if self.active_id != cid:
                # A resume (or lease expiry) ended the checkpoint while this prepare waited.
                return {"phase": "idle", "report": self.report()}
            if self.phase != "preparing":
                stored = self.stored.get((cid, "prepare"))
                return stored.reply if stored else {"phase": self.phase, "report": self.report()}
            report = self.report()
            if report["ready"]:
                async with self.lock:
                    if self.active_id == cid and self.phase == "preparing":
                        report = self.report()
                        if report["ready"]:
                            self.phase = "prepared"
                            reply = {"phase": "prepared", "report": report}
                            self.stored[(cid, "prepare")] = Stored(None, reply)
                            self.notifier.notify()
                            return reply
                continue
            remaining = deadline_ts - self.clock.now()
            if remaining <= 0:
                # Not ready by the deadline: a 200 reply, and admission stays closed.
                return {"phase": "preparing", "report": report}
            await self.notifier.wait(min(remaining, self.clock.MAX_WAIT))

    async def renew(self, body: PrepareBody) -> dict[str, Any]:
        async with self._behind_commit():
            return await self._renew(body)

    def _behind_commit(self) -> Any:
        """Published: wait for a commit under way to end; strict: no wait."""
        return self.commit_serial if self.published else contextlib.nullcontext()

    async def _renew(self, body: PrepareBody) -> dict[str, Any]:
        async with self.lock:
            self.check_lease()
            self._precheck(body.checkpoint_id, "renew", None)
            if self.phase == "idle":
                raise self._invalid_phase("renew")
            self._extend_lease(body.deadline_ts)
            self.counters["renew_count"] += 1
            return {"lease_expires_at": self.lease_expires_at}

    async def commit(self, body: CommitBody) -> dict[str, Any]:
        async with self._behind_commit():
            return await self._commit(body)

    async def _commit(self, body: CommitBody) -> dict[str, Any]:
        cid = body.checkpoint_id
        scope = None if body.episode_ids is None else frozenset(e.pair for e in body.episode_ids)
        args = (body.checkpoint_dir, scope, bool(getattr(body, "stop", None)))
        async with self.lock:
            self.check_lease()
            self.counters["commit_calls"] += 1
            replay = self._precheck(cid, "commit", args)
            if replay is not None:
                self._extend_lease(body.deadline_ts)
                return replay
            if self.phase != "prepared":
                raise self._invalid_phase("commit")
            if scope is None and self.kind == "model":
                raise ProtocolError("checkpoint_error", "a model commit must name its scope in episode_ids")
            if not self.report()["ready"]:
                raise ProtocolError("invalid_phase", "readiness regressed since prepare; resume and prepare again")
            if scope is not None and not self.broken("commit_names_restart"):
                named = sorted(set(self.restarts()) & {capture_key(*p) for p in scope})
                if named:
                    raise ProtocolError("restart_in_scope", f"the scope names reported restarts: {named[:10]}")
            job = self.export_job
            if job is not None and job.checkpoint_id == cid:
                for other, running in job.writes.items():
                    failed = running.done() and (running.cancelled() or running.exception() is not None)
                    if other != args and not failed:
                        raise ProtocolError("checkpoint_conflict", f"a commit of {cid} with other arguments is under way")
            directory = storage.participant_dir(storage.check_checkpoint_dir(body.checkpoint_dir), self.kind, self.name)
            storage.ensure_no_foreign_manifest(directory, cid)
            self._extend_lease(body.deadline_ts)
            task = self._write_task(cid, args)
        finished = await self.clock.wait_for(task.done, body.deadline_ts)
        self.ensure_alive()
        if not finished:
            raise ProtocolError("deadline_exceeded", "the export is still running; a repeated commit awaits it")
        async with self.lock:
            self.check_lease()
            replay = self._precheck(cid, "commit", args)
            if replay is not None:
                return replay
            if task.cancelled() or self.phase != "prepared":
                raise self._invalid_phase("commit")
            job = self.export_job
            error = task.exception()
            if error is not None:
                # A failed write is retried with the same captured records on the next commit.
                if job is not None:
                    job.writes.pop(args, None)
                raise self.unexpected(error, "export")
            reply = task.result()
            if scope is not None:
                # Restored state nobody claimed and the scope left out is deleted, without a mark.
                for pair in [p for p in self.unclaimed if p not in scope]:
                    del self.unclaimed[pair]
            self.phase = "committed"
            self.stored[(cid, "commit")] = Stored(args, reply)
            self.counters["commit_count"] += 1
            if args[2]:
                # A stopping controller: the exported state stays parked with the checkpoint
                # (admission closed) until a resume or the lease's expiry.
                self.counters["stop_count"] += 1
            self.notifier.notify()
            return reply

    def _write_task(self, cid: str, args: Any) -> asyncio.Task:
        job = self.export_job
        if job is None or job.checkpoint_id != cid:
            self.counters["export_count"] += 1
            job = self.export_job = ExportJob(cid, self.spawn(self._capture()))
        task = job.writes.get(args)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = job.writes[args] = self.spawn(self._write(job, *args))
        return task

    async def _capture(self) -> tuple[dict[Pair, dict[str, Any]], frozenset[Pair]]:
        if self.knobs.export_seconds:
            await self.clock.sleep(self.knobs.export_seconds)
        return self.capture_state(), frozenset(self.unclaimed)

    def exports(self, pair: Pair, scope, restored: frozenset[Pair]) -> bool:
        """Whether a captured episode is written: those of the scope; published agents and resources
        also write every other live one, only not restored state nobody claimed (P2)."""
        if scope is None or pair in scope:
            return True
        return self.published and self.PUBLISHED_EXPORTS_LIVE_OUTSIDE_SCOPE and pair not in restored

    async def _write(self, job: ExportJob, checkpoint_dir: str, scope, stop: bool) -> dict[str, Any]:
        captured, restored = await asyncio.shield(job.capture)
        if self.mode == "restart_only":
            exported: dict[Pair, dict[str, Any]] = {}
        else:
            exported = {p: s for p, s in captured.items() if self.exports(p, scope, restored)}
            if self.mode == "stateless":
                exported = {p: {} for p in exported}
        # The writer stops with the checkpoint: nothing is published after resume or expiry.
        if self.active_id != job.checkpoint_id or self.phase != "prepared":
            raise ProtocolError("stale_checkpoint", f"checkpoint {job.checkpoint_id} ended before its export was written")
        records = [
            {"episode_id": {"rollout_id": r, "attempt": a}, "kind": self.kind, "state": exported[(r, a)]}
            for r, a in sorted_pairs(exported)
        ]
        written = storage.write_participant_state(
            checkpoint_dir,
            kind=self.kind,
            name=self.name,
            checkpoint_id=job.checkpoint_id,
            records=records,
            extras={"mode": self.mode, "server_name": self.server_name},
        )
        self.counters["write_count"] += 1
        return {
            "phase": "committed",
            "manifest": written.manifest,
            "episode_ids": sorted(capture_key(*p) for p in exported),
            **self.commit_extras(exported),
        }

    async def resume(self, body: PrepareBody) -> dict[str, Any]:
        async with self._behind_commit():
            return await self._resume(body)

    async def _resume(self, body: PrepareBody) -> dict[str, Any]:
        cid = body.checkpoint_id
        async with self.lock:
            self.check_lease()
            if cid in self.resumed:
                return {"phase": "idle", "idempotent": True}
            if self.active_id == cid:
                self._end_checkpoint()
                self.counters["resume_count"] += 1
                return {"phase": "idle", "idempotent": False}
            if self.active_id is None:
                # Remembered so that a late prepare of an aborted checkpoint can never close admission.
                self.resumed.append(cid)
                return {"phase": "idle", "idempotent": True}
            raise ProtocolError("checkpoint_conflict", f"checkpoint {self.active_id} is active, not {cid}")

    async def restore(self, body: RestoreBody) -> dict[str, Any]:
        cid = body.checkpoint_id
        scope = frozenset(e.pair for e in body.episode_ids)
        args = (body.checkpoint_dir, scope)
        key = (cid, args)
        self.counters["restore_calls"] += 1
        while True:
            async with self.lock:
                self.check_lease()
                replay = self._precheck(cid, "restore", args)
                if replay is not None:
                    self._extend_lease(body.deadline_ts)
                    return replay
                if self.phase != "idle":
                    raise self._invalid_phase("restore")
                job = self.install_job
                earlier = job.task if job is not None and job.key != key and not job.task.done() else None
                if earlier is None:
                    if not self.published and not self.is_fresh():  # published: after the read
                        raise self._not_fresh()
                    reusable = (
                        job is not None
                        and job.key == key
                        and not (job.task.done() and (job.task.cancelled() or job.task.exception() is not None))
                    )
                    if not reusable:
                        self.counters["install_count"] += 1
                        job = self.install_job = InstallJob(key, self.spawn(self._read(body.checkpoint_dir, scope)))
                    job.waiters += 1  # admission stays closed while anyone installs
                    break
            # An earlier install that overran its deadline finishes before this one starts.
            finished = await self.clock.wait_for(earlier.done, body.deadline_ts)
            self.ensure_alive()
            if not finished:
                raise ProtocolError("deadline_exceeded", "an earlier install is still running")
        try:
            finished = await self.clock.wait_for(job.task.done, body.deadline_ts)
            self.ensure_alive()
            if not finished:
                raise ProtocolError("deadline_exceeded", "the install is still running; a repeated restore awaits it")
            async with self.lock:
                self.check_lease()
                replay = self._precheck(cid, "restore", args)
                if replay is not None:
                    return replay
                if self.phase != "idle":
                    raise self._invalid_phase("restore")
                if job.task.cancelled():
                    raise ProtocolError("checkpoint_error", "the install was cancelled", status=500)
                error = job.task.exception()
                if error is not None:
                    if self.install_job is job:
                        self.install_job = None
                    raise self.unexpected(error, "install")
                if self.published and not self.is_fresh():
                    # Published Gym's install checks freshness, after the directory was read and checked.
                    if self.install_job is job:
                        self.install_job = None
                    raise self._not_fresh()
                loaded: storage.Loaded = job.task.result()
                installed = self._install(loaded.records)
                if self.install_job is job:
                    self.install_job = None
                if not self.published:
                    # A straggler of the saved attempt N must now get stale_attempt. Published Gym
                    # raises no mark: its agent's restored binding refuses N instead (P5).
                    for rollout_id, attempt in scope:
                        self.marks[rollout_id] = max(self.marks.get(rollout_id, -1), attempt)
                self.phase = "restored"
                self.active_id = cid
                self._extend_lease(body.deadline_ts)
                reply = {
                    "phase": "restored",
                    "source_checkpoint_id": loaded.manifest["checkpoint_id"],
                    "restored": sorted(capture_key(*p) for p in installed),
                }
                self.stored[(cid, "restore")] = Stored(args, reply)
                self.counters["restore_count"] += 1
                return reply
        finally:
            job.waiters -= 1
            self.notifier.notify()

    def _not_fresh(self) -> ProtocolError:
        return ProtocolError("checkpoint_error", f"{self.server_name} is not fresh: it has served work")

    async def _read(self, checkpoint_dir: str, scope: frozenset) -> storage.Loaded:
        if self.knobs.install_seconds:
            await self.clock.sleep(self.knobs.install_seconds)
        return storage.read_participant_state(checkpoint_dir, kind=self.kind, name=self.name, scope=set(scope))

    def _install(self, records: list[dict[str, Any]]) -> list[Pair]:
        """Validate every record first, then install each as attempt N+1 (nothing half-installed)."""
        states: dict[Pair, dict[str, Any]] = {}
        for record in records:
            episode = record["episode_id"]
            try:
                self.validate_record(record)
            except (ValueError, KeyError, TypeError) as exc:
                raise ProtocolError("invalid_checkpoint_state", f"record of {episode} cannot be installed: {exc}") from exc
            pair = (episode["rollout_id"], episode["attempt"] + 1)
            if self.is_marked(*pair):
                continue  # N+1 was retired while this install ran (a restore cleanup): never revive it
            states[pair] = self.install_state(record["state"])
        self.unclaimed.update(states)
        return list(states)

    def _idle_or_restored(self, checkpoint_id: str, op: str) -> None:
        """Retire and forget: phase first, then the id (docs/gym-protocol.md#participant-phases)."""
        if self.phase in ("preparing", "prepared", "committed"):
            if not self.broken("retire_while_open"):
                raise ProtocolError("invalid_phase", f"{op} while checkpoint {self.active_id} is open: resume first")
        elif self.phase == "restored":
            if checkpoint_id != self.active_id:
                raise ProtocolError("checkpoint_conflict", f"restore {self.active_id} is active, not {checkpoint_id}")

    async def retire(self, body: RetireBody) -> dict[str, Any]:
        pairs = [e.pair for e in body.episode_ids]
        keys = [e.key for e in body.episode_ids]
        async with self.lock:
            self.check_lease()
            self._idle_or_restored(body.checkpoint_id, "retire")
            if self.phase == "restored":
                self._extend_lease(body.deadline_ts)
            self.counters["retire_count"] += 1
            self.retire_calls.append(keys)
            # Marks go up before anything is stopped, and never come down.
            for rollout_id, attempt in pairs:
                self.marks[rollout_id] = max(self.marks.get(rollout_id, -1), attempt)
            stopped = self.stop_work(pairs)
            self.notifier.notify()
        finished = await self.clock.wait_for(stopped, body.deadline_ts)
        self.ensure_alive()
        if not finished:
            raise ProtocolError("deadline_exceeded", "retired work is still stopping; retire again to finish")
        async with self.lock:
            self.free_state(pairs)
            self.notifier.notify()
        return {"retired": keys}

    async def forget(self, body: ForgetBody) -> dict[str, Any]:
        rollout_ids = sorted(set(body.rollout_ids))
        async with self.lock:
            self.check_lease()
            self._idle_or_restored(body.checkpoint_id, "forget")
            if self.phase == "restored":
                self._extend_lease(body.deadline_ts)
            busy = [r for r in rollout_ids if any(a <= self.marks.get(r, -1) for a in self.tracked_attempts(r))]
            if busy:
                raise ProtocolError("checkpoint_error", f"retired work is still tracked for {busy[:10]}; retire again first")
            for rollout_id in rollout_ids:
                self.marks.pop(rollout_id, None)
                self.on_forget(rollout_id)
            self.counters["forget_count"] += 1
            self.forget_calls.append(rollout_ids)
            return {"forgotten": rollout_ids}

    # ------------------------------------------------------------------ admin view

    def admin_state(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "participant_name": self.name,
            "gym_profile": self.profile,
            "mode": self.reported_mode,
            "behaviour_mode": self.mode,
            "phase": self.phase,
            "checkpoint_id": self.active_id,
            "lease_expires_at": self.lease_expires_at,
            "admission_open": self.admission_open,
            "fresh": self.is_fresh(),
            "marks": dict(sorted(self.marks.items())),
            "resumed": list(self.resumed),
            "unclaimed": sorted(capture_key(*p) for p in self.unclaimed),
            "report": self.report(),
            **self.counters,
            "retire_calls": [list(c) for c in self.retire_calls],
            "forget_calls": [list(c) for c in self.forget_calls],
            **self.admin_extras(),
        }

