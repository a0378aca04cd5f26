"""The save choreography of recovery-ledger.md section 5, driving the ledger and the Gym client.

gate -> deliver queued retires -> prepare -> (leases renewed) -> commit -> drain -> data-plane
barrier and ledger cut -> capture -> resume and reopen the gate -> publish -> retention.

Each phase is written to the snapshot row before its side effects. Resume (the abort) and the
gate reopen happen before publish. The trainer's handshakes reach the runner through the
database (any replica may take them); the runner polls its own snapshot row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.snapshot_state import reason_for_gym_failure
from ..gym.errors import GymControlError
from ..gym.models import Episode
from ..gym.save import GymSave, GymSaveAborted
from ..gym_runtime import GymClients, load_topology
from ..ledger import snapshots as repo
from ..ledger.db import classify_database_error
from ..ledger.runs import get_run
from ..observability import metrics
from ..outbox.worker import OutboxDeliverer

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.05
# While the database is away, a write that must happen (the snapshot's end, the writes after its
# cut) is tried again this often, so the snapshot ends within a moment of the database's return.
DB_RETRY_S = 0.25


def _database_away(error: BaseException) -> str | None:
    verdict = classify_database_error(error)
    return verdict[1] if verdict is not None and verdict[0] == "unavailable" else None


async def _until_database_answers(write: Callable[[], Awaitable[T]], what: str) -> T:
    """Run ``write`` until the database takes it; any other failure is raised at once."""
    warned = False
    while True:
        try:
            return await write()
        except Exception as e:
            why = _database_away(e)
            if why is None:
                raise
            if not warned:
                log.warning("%s: %s; trying again until the database answers", what, why)
                warned = True
            await asyncio.sleep(DB_RETRY_S)


async def _read_through_outage(read: Callable[[], Awaitable[T]]) -> T | None:
    """A poll that the database could not answer counts as "no news yet" (the phase's own
    deadline bounds the wait); any other failure is raised."""
    try:
        return await read()
    except Exception as e:
        if _database_away(e) is None:
            raise
        return None


class _Failed(Exception):
    def __init__(self, reason: str, detail: dict[str, Any]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass
class SnapshotJob:
    run_id: str
    snapshot_id: str
    task: asyncio.Task[None] | None = None
    save: GymSave | None = None
    pre_cut: asyncio.Task[None] | None = None
    candidates: asyncio.Task[dict[str, list[tuple[str, int]]]] | None = None
    abort_reason: str | None = None
    # The phase last written (or being written): where a database outage caught the snapshot.
    phase: str = "requested"
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def abort(self, reason: str) -> None:
        self.abort_reason = reason
        if self.save is not None:
            self.save.abort(reason)


class _PhaseRecordingClient:
    """Delegates to the Gym client, writing phase ``commit`` to the ledger before the commit fan-out."""

    def __init__(self, inner: Any, on_commit: Any) -> None:
        self._inner = inner
        self._on_commit = on_commit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def commit(self, *args: Any, **kwargs: Any) -> Any:
        await self._on_commit()
        return await self._inner.commit(*args, **kwargs)


class SnapshotRunner:
    def __init__(self, engine: AsyncEngine, gym: GymClients, outbox: OutboxDeliverer, owner: str) -> None:
        self.engine = engine
        self.gym = gym
        self.outbox = outbox
        self.owner = owner
        self.jobs: dict[tuple[str, str], SnapshotJob] = {}

    def start(self, run_id: str, snapshot_id: str) -> SnapshotJob:
        key = (run_id, snapshot_id)
        job = self.jobs.get(key)
        if job is None:
            job = SnapshotJob(run_id, snapshot_id)
            self.jobs[key] = job
            job.task = asyncio.create_task(self._run(job), name=f"snapshot-{run_id}-{snapshot_id}")
            job.task.add_done_callback(_log_crash)
        return job

    def abort_local(self, run_id: str, snapshot_ids: list[str], reason: str) -> None:
        for sid in snapshot_ids:
            job = self.jobs.get((run_id, sid))
            if job is not None:
                job.abort(reason)

    async def shutdown(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None and not job.task.done():
                job.task.cancel()
        for job in list(self.jobs.values()):
            if job.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await job.task

    # ------------------------------------------------------------------------------------------

    async def _run(self, job: SnapshotJob) -> None:
        metrics.SNAPSHOTS_IN_PROGRESS.inc()
        started = time.monotonic()
        try:
            await self._choreography(job, started)
        except asyncio.CancelledError:
            # Shutdown: Gym was resumed by GymSave's own cancellation path; end the record so the
            # gate does not stay closed until the next start.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._end(job, "aborted", "cancelled", {"why": "coordinator shutting down"}, {}, started))
            raise
        except _Failed as e:
            await self._end(job, "failed", e.reason, e.detail, {}, started)
        except Exception as e:  # neither a database outage nor a bug may leave the gate closed
            why = _database_away(e)
            if why is not None:
                # Gym was resumed by GymSave's failure path; end the record once the database is back.
                log.warning("snapshot %s of run %s: a phase write failed in phase %s (%s); it ends when the database answers",
                            job.snapshot_id, job.run_id, job.phase, why)
                detail = {"phase": job.phase, "why": why}
                await self._end(job, "failed", "database_unavailable", detail, self._timings(job.save, {}), started, job.save)
            else:
                log.exception("snapshot %s of run %s crashed", job.snapshot_id, job.run_id)
                await self._end(job, "failed", "gym_invariant", {"error": type(e).__name__, "message": str(e)[:2000]}, {}, started)
        finally:
            metrics.SNAPSHOTS_IN_PROGRESS.dec()
            self.jobs.pop((job.run_id, job.snapshot_id), None)
            job.done.set()

    async def _choreography(self, job: SnapshotJob, started: float) -> None:
        run_id, sid = job.run_id, job.snapshot_id
        async with self.engine.connect() as conn:
            run = await get_run(conn, run_id)
            snap = await repo.get(conn, run_id, sid)
            topology = await load_topology(conn, run_id)
        cfg = run.config
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        job.phase = "gate"
        await repo.close_gate(self.engine, run_id, sid)
        if not topology:
            raise _NoGym()
        await self._phase(job, "retire")
        client = self.gym.for_run(run_id, cfg)
        # The candidates (the gate is closed: no dispatch adds to them) are first needed for the
        # commit scopes: their query runs beside the retire delivery and the prepare calls.
        job.candidates = asyncio.create_task(repo.candidates(self.engine, run_id), name=f"candidates-{run_id}-{sid}")
        unknown: list[str] = []
        counts: dict[str, Any] = {}
        timings["gate"] = time.monotonic() - t0
        checkpoint_id = client.new_checkpoint_id(sid)
        snapshot_dir = snap.snapshot_dir or str(Path(run.checkpoint_root) / "snapshots" / sid)
        drain_info: dict[str, Any] = {}

        async def before_prepare() -> None:
            # Gym refuses retire and forget once a checkpoint is open: deliver what is owed first.
            await self.outbox.deliver_run(run_id, ignore_schedule=True)
            await self._phase(job, "prepare", gym_checkpoint_id=checkpoint_id, snapshot_dir=snapshot_dir)
            # The gate is closed: copy the ledger now, beside Gym's prepare and commit, so that the
            # barrier (while Gym and the trainer wait) copies only the groups written since.
            job.pre_cut = asyncio.create_task(self._pre_cut(job, timings), name=f"pre-cut-{run_id}-{sid}")

        async def gym_candidates() -> dict[str, list[Episode]]:
            assert job.candidates is not None
            cands = await job.candidates
            unknown.extend(sorted(set(cands) - set(topology)))
            candidates = {iid: [Episode(r, a) for r, a in cands.get(iid, [])] for iid in topology}
            counts.update(candidates=sum(len(v) for v in candidates.values()), unknown_instances=unknown)
            return candidates

        async def on_commit() -> None:
            await self._phase(job, "commit", counts=counts)

        async def drain(pending: dict[str, set[Episode]]) -> None:
            await self._phase(job, "drain")
            drain_info["pending"] = sum(len(v) for v in pending.values())
            while any(pending.values()):
                keys = [(e.rollout_id, e.attempt) for eps in pending.values() for e in eps]
                still = await _read_through_outage(lambda: repo.still_pending(self.engine, run_id, keys))
                if still is None:
                    await asyncio.sleep(POLL_S)
                    continue
                for iid, eps in pending.items():
                    for e in list(eps):
                        if (e.rollout_id, e.attempt) not in still:
                            eps.discard(e)
                if any(pending.values()):
                    await asyncio.sleep(POLL_S)

        async def capture(manifest: dict[str, Any]) -> None:
            await self._await_pre_cut(job)  # the barrier must find it done (or never started)
            await self._phase(job, "data_plane", gym_manifest=manifest)
            deadline = time.monotonic() + float(cfg.get("data_plane_timeout_s", 600))
            while True:
                s = await _read_through_outage(lambda: repo.poll(self.engine, run_id, sid))
                if s is None:
                    if time.monotonic() > deadline:
                        raise _Failed("data_plane_timeout", {"awaiting": "capture", "timeout_s": cfg.get("data_plane_timeout_s")})
                    await asyncio.sleep(POLL_S)
                    continue
                if s.abort_requested:
                    raise _Aborted(s.abort_requested)
                if s.captured:
                    # The cut is taken; GymSave resumes Gym as soon as this hook returns.
                    await self._phase(job, "resume")
                    return
                if time.monotonic() > deadline:
                    raise _Failed("data_plane_timeout", {"awaiting": s.awaiting, "timeout_s": cfg.get("data_plane_timeout_s")})
                await asyncio.sleep(POLL_S)

        save = GymSave(
            _PhaseRecordingClient(client, on_commit),  # type: ignore[arg-type]
            topology,
            snapshot_dir=snapshot_dir,
            candidates={},
            candidates_hook=gym_candidates,
            drain_hook=drain,
            capture_hook=capture,
            drain_timeout_s=float(cfg.get("drain_timeout_s", 120)),
            checkpoint_id=checkpoint_id,
            before_prepare_hook=before_prepare,
            write_manifest_file=True,
        )
        job.save = save
        if job.abort_reason:
            save.abort(job.abort_reason)
        watcher = asyncio.create_task(self._watch_abort(job))
        try:
            result = await save.run()
        except GymSaveAborted as e:
            await self._end(job, _outcome_of(e.reason), e.reason, {"resume_failure": e.resume_failure.to_dict() if e.resume_failure else None}, self._timings(save, timings), started, save)
            return
        except _Aborted as e:
            await self._end(job, _outcome_of(e.reason), e.reason, {}, self._timings(save, timings), started, save)
            return
        except GymControlError as e:
            reason = reason_for_gym_failure(str(e.failure_class)).value
            await self._end(job, "failed", reason, _gym_detail(e), self._timings(save, timings), started, save)
            return
        except _Failed as e:
            await self._end(job, "failed", e.reason, e.detail, self._timings(save, timings), started, save)
            return
        finally:
            watcher.cancel()
        # Resume was answered inside save.run(); reopen the gate before publishing. The cut is
        # taken: a database outage from here on delays the publish, it does not lose the snapshot.
        await _until_database_answers(lambda: repo.open_gate(self.engine, run_id, sid), f"snapshot {sid}: reopening the gate")
        resume_failure = None
        if result.resume is not None and result.resume.failure is not None:
            resume_failure = result.resume.failure.to_dict()
            metrics.record_snapshot_resume_failure()
            log.warning("snapshot %s: Gym resume failed after the cut; leases will reopen Gym: %s", sid, result.resume.failure)
        await _until_database_answers(lambda: self._phase(job, "publish"), f"snapshot {sid}: publishing")
        detail = {
            "warnings": list(result.warnings),
            "drained": drain_info.get("pending", 0),
            "gym": {iid: ic.figures() for iid, ic in sorted(result.commit.instances.items())},
        }
        for ic in result.commit.instances.values():
            for kind, count in ic.outside_scope.items():
                metrics.record_exported_outside_scope(kind, count)
        if unknown:
            detail["unregistered_instances"] = unknown
        await self._end(job, "published", "ok", detail, self._timings(save, timings), started, save,
                        restarted=result.gym_restarted_episodes, resume_failure=resume_failure, keep=int(cfg.get("keep_latest_k", 2)))

    async def _phase(self, job: SnapshotJob, phase: str, **fields: Any) -> None:
        job.phase = phase
        await repo.set_phase(self.engine, job.run_id, job.snapshot_id, phase, **fields)

    async def _pre_cut(self, job: SnapshotJob, timings: dict[str, float]) -> None:
        t = time.monotonic()
        try:
            groups = await repo.pre_cut(self.engine, job.run_id, job.snapshot_id)
        except Exception as e:  # the barrier then copies the whole run: slower, not wrong
            log.warning("snapshot %s of run %s: pre-cut failed (%s: %s); the barrier will copy the whole ledger",
                        job.snapshot_id, job.run_id, type(e).__name__, str(e)[:500])
            return
        if groups is not None:
            timings["pre_cut"] = time.monotonic() - t

    @staticmethod
    async def _await_pre_cut(job: SnapshotJob) -> None:
        if job.pre_cut is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(job.pre_cut)

    async def _watch_abort(self, job: SnapshotJob) -> None:
        """Train step wins even when announced on another replica: poll the row for the request."""
        while True:
            await asyncio.sleep(POLL_S)
            with contextlib.suppress(Exception):
                s = await repo.poll(self.engine, job.run_id, job.snapshot_id)
                if s.abort_requested and job.save is not None and not job.save.cut_done:
                    job.abort(s.abort_requested)
                    return

    @staticmethod
    def _timings(save: GymSave | None, before: dict[str, float]) -> dict[str, float]:
        t = dict(before)
        if save is not None:
            st = save.timings
            t["gate"] = t.get("gate", 0.0) + st.get("gate", 0.0)
            for k_out, k_in in (("prepare", "prepare"), ("commit", "commit"), ("drain", "drain"), ("data_plane", "capture"), ("resume", "resume")):
                if k_in in st:
                    t[k_out] = st[k_in]
            if "renew" in st:
                t["prepare"] = t.get("prepare", 0.0) + st["renew"]
            if "manifest" in st:
                t["drain"] = t.get("drain", 0.0) + st["manifest"]
            if save.gym_parked_seconds is not None:
                t["gym_parked"] = save.gym_parked_seconds
        return t

    async def _end(
        self,
        job: SnapshotJob,
        outcome: str,
        reason: str,
        detail: dict[str, Any],
        timings: dict[str, float],
        started: float,
        save: GymSave | None = None,
        *,
        restarted: int | None = None,
        resume_failure: dict[str, Any] | None = None,
        keep: int = 2,
    ) -> None:
        # An unfinished pre-cut would otherwise write its copy after end() deleted the cut rows
        # (it checks the snapshot again before committing; waiting keeps the log and timings clean).
        await self._await_pre_cut(job)
        if job.candidates is not None:
            job.candidates.cancel()  # no-op once it has its answer
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await job.candidates
        timings["total"] = time.monotonic() - started
        row, losses = await _until_database_answers(
            lambda: repo.end(
                self.engine, job.run_id, job.snapshot_id, outcome, reason, detail=detail, timings=timings,
                gym_parked_seconds=save.gym_parked_seconds if save else None, gym_restarted_episodes=restarted,
                resume_failure=resume_failure, keep_latest_k=keep,
            ),
            f"snapshot {job.snapshot_id} of run {job.run_id}: ending it {outcome}/{reason}",
        )
        metrics.record_snapshot_outcome(outcome, reason)
        for phase, secs in timings.items():
            if phase in ("gate", "prepare", "commit", "drain", "data_plane", "resume", "total", "gym_parked"):
                metrics.observe_snapshot_phase(phase, max(0.0, secs))
        if restarted is not None:
            metrics.observe_gym_restarted_episodes(restarted)
        async def config() -> dict[str, Any]:
            async with self.engine.connect() as conn:
                return (await get_run(conn, job.run_id)).config

        warn_after = int((await _until_database_answers(config, f"snapshot {job.snapshot_id}: reading the run")).get("snapshot_loss_warn_after", 3))
        metrics.set_snapshot_losses(job.run_id, losses, warn_after)
        if reason == "train_step_committed" and losses >= warn_after:
            log.warning("run %s: %d consecutive snapshots lost to train steps; snapshot more often or earlier in the step", job.run_id, losses)
        log.info("snapshot %s of run %s ended %s/%s", job.snapshot_id, job.run_id, outcome, reason)


async def recover_unfinished(runner: SnapshotRunner, lease_ttl_s: float) -> list[str]:
    """On start (and periodically): keep the leases of runs with a snapshot running here; start
    requested snapshots this coordinator owns; every other non-terminal snapshot it owns, or whose
    owner lost the run's lease, is resumed on Gym and ended ``aborted/coordinator_restart``."""
    from ..ledger import leases

    engine, gym, owner = runner.engine, runner.gym, runner.owner
    running = set(runner.jobs)
    for run_id in sorted({r for r, _ in running}):
        await leases.acquire(engine, run_id, owner, lease_ttl_s)
    ended = []
    for run_id, sid, snap_owner, cid, phase, abort_requested in await repo.unfinished(engine):
        if (run_id, sid) in running:
            continue
        if snap_owner != owner and await leases.acquire(engine, run_id, owner, lease_ttl_s) is None:
            continue  # its owner is alive and will finish it
        if phase == "requested" and await leases.acquire(engine, run_id, owner, lease_ttl_s) is not None:
            await repo.set_owner(engine, run_id, sid, owner)
            runner.start(run_id, sid)  # nothing happened yet: run it rather than abort it
            continue
        detail: dict[str, Any] = {"phase_at_restart": phase, "previous_owner": snap_owner}
        if cid:
            async with engine.connect() as conn:
                run = await get_run(conn, run_id)
                topology = await load_topology(conn, run_id)
            report = await gym.for_run(run_id, run.config).resume(cid, topology, raise_on_failure=False)
            if report.failure is not None:
                detail["resume_failure"] = report.failure.to_dict()
                log.warning("resume of %s after restart failed; Gym leases will reopen it: %s", cid, report.failure)
        # An abort asked for before its owner died says why it ended (a restore, the trainer);
        # otherwise the owner's death is the reason.
        reason = abort_requested or "coordinator_restart"
        outcome = _outcome_of(reason)
        await repo.end(engine, run_id, sid, outcome, reason, detail=detail)
        metrics.record_snapshot_outcome(outcome, reason)
        log.warning("snapshot %s of run %s was unfinished at %s; Gym resumed, ended %s/%s", sid, run_id, phase, outcome, reason)
        ended.append(sid)
    return ended


def _log_crash(task: asyncio.Task[None]) -> None:
    """Retrieve a snapshot task's exception, so none goes unobserved (``_run`` ends every
    snapshot itself; reaching this means even that failed)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("snapshot task %s ended with an error", task.get_name(), exc_info=task.exception())


def _outcome_of(reason: str) -> str:
    """A caller's abort ends the snapshot under its reason's outcome (data_plane_failed: failed)."""
    from ..domain.snapshot_state import REASON_OUTCOME, SnapshotReason

    return REASON_OUTCOME[SnapshotReason(reason)].value


class _Aborted(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _NoGym(_Failed):
    def __init__(self) -> None:
        super().__init__("gym_unavailable", {"why": "no Gym instance is registered for this run"})


def _gym_detail(e: GymControlError) -> dict[str, Any]:
    d = e.to_dict()
    d["message"] = str(e)[:4000]
    return d
