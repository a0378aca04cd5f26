"""One pending snapshot as a state machine (recovery-ledger.md section 5), owned by one replica.

requested -> gate -> retire -> prepare -> commit -> drain -> data_plane -> resume -> publish
-> published (``retire`` and ``drain`` only when they have something to do); before the cut, a
failure or abort once Gym was prepared goes through resume (Gym's abort) to failed or aborted;
before Gym's prepare was sent it ends from the phase it reached.

The object owns its phases, its Gym calls (the steps of :class:`~..gym.save.GymSave`), its timers
and its abort. Every transition is one write, fenced by the phase it leaves and the owner's lease
epoch (``ledger.snapshots.move_in``); the gate's close is the one write that may take two
(``gate``, and ``prepare`` when nothing is owed to Gym), and on the owner's own replica the
request that creates the snapshot writes it (:class:`Opened`). A write that matches nothing
raises ``Fenced`` and the object stops at once, with no further Gym call: whoever holds the
run's lease now ends it.

Trainer handshakes (barrier, capture, abort, a train step announced) reach it as events: the
transaction that records one notifies, the replica's listener calls :meth:`wake`, and the object
reads its few progress columns. A timer reads them too, as the fallback for a lost notification.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.snapshot_state import (
    REASON_OUTCOME,
    UNFLUSHED_MOVES,
    SnapshotOutcome,
    SnapshotPhase,
    SnapshotReason,
    SnapshotTiming,
    check_snapshot_transition,
    reason_for_gym_failure,
)
from ..gym.context import checkpoint_id_for
from ..gym.errors import GymControlError
from ..gym.manifest import encode_instance_entry
from ..gym.models import Episode, Topology
from ..gym.results import CommitResult, InstanceCommit
from ..gym.save import GymSave
from ..gym.timings import SlowestCalls, recording
from ..gym_runtime import GymClients, load_topology
from . import store as repo
from ..ledger.db import JsonText, classify_database_error
from ..ledger.leases import Fence, Fenced
from ..restore.store.plan_sql import saved_episodes_ended
from ..ledger.runs import RunRow, get_run
from ..observability import metrics
from ..outbox.worker import OutboxDeliverer

log = logging.getLogger(__name__)
T = TypeVar("T")
P = SnapshotPhase

# The drain waits for trainer reports on the pending attempts themselves (not on this snapshot's
# row), a few index lookups per pass.
DRAIN_POLL_S = 0.05
# While the database is away, a write that must happen (the snapshot's end, the writes after its
# cut) is tried again this often, so the snapshot ends within a moment of the database's return.
DB_RETRY_S = 0.25


def database_away(error: BaseException) -> str | None:
    verdict = classify_database_error(error)
    return verdict[1] if verdict is not None and verdict[0] == "unavailable" else None


# How long a shutdown waits for a snapshot to end (or, after its cut, to publish).
SHUTDOWN_GRACE_S = 30.0


async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until ``event`` is set or ``timeout_s`` passed. ``asyncio.timeout``, not ``wait_for``: on
    Python 3.11 ``wait_for`` swallows a cancellation that arrives as the event is set, and a
    loop around it then never stops (a shutdown waited for it forever)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


async def until_database_answers(write: Callable[[], Awaitable[T]], what: str) -> T:
    """Run ``write`` until the database takes it; any other failure is raised at once."""
    warned = False
    while True:
        try:
            return await write()
        except Exception as e:
            why = database_away(e)
            if why is None:
                raise
            if not warned:
                log.warning("%s: %s; trying again until the database answers", what, why)
                warned = True
            await asyncio.sleep(DB_RETRY_S)


async def all_ended(*aws: Awaitable[Any]) -> list[Any]:
    """Their results, once every one of them has ended; the first failure (in argument order) is
    raised then, so that none is left running, or unretrieved, behind the error handling."""
    done = await asyncio.gather(*aws, return_exceptions=True)
    for d in done:
        if isinstance(d, BaseException):
            raise d
    return done


def outcome_of(reason: SnapshotReason | str) -> SnapshotOutcome:
    return REASON_OUTCOME[SnapshotReason(reason)]


class _Failed(Exception):
    def __init__(self, reason: SnapshotReason, detail: dict[str, Any]) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail


class _Aborted(Exception):
    def __init__(self, reason: SnapshotReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


@dataclass(frozen=True)
class SnapshotContext:
    """What every pending snapshot of a replica shares."""

    engine: AsyncEngine
    gym: GymClients
    outbox: OutboxDeliverer
    owner: str
    poll_s: float


@dataclass(frozen=True)
class Opened:
    """A snapshot whose creating request closed its gate (on its owner's replica): what that
    transaction wrote and read, from which the owner goes straight on to Gym's prepare.
    ``requested_at``: when the request began (the snapshot's time counts from there)."""

    run: RunRow
    row: repo.SnapshotRow
    topology: Topology
    deadline_left_s: float | None
    deadline_read_at: float  # when ``deadline_left_s`` was read (monotonic clock)
    gate: repo.GateClosed
    checkpoint_id: str
    requested_at: float


class PendingSnapshot:
    def __init__(self, ctx: SnapshotContext, run_id: str, snapshot_id: str, epoch: int, *, opened: Opened | None = None) -> None:
        self.ctx = ctx
        self._opened = opened
        self.engine = ctx.engine
        self.run_id = run_id
        self.snapshot_id = snapshot_id
        self.fence = Fence(ctx.owner, epoch)
        self.phase = P.requested
        self.cut_taken = False
        self.save: GymSave | None = None
        self.progress: repo.SnapshotProgress | None = None
        self.abort_reason: SnapshotReason | None = None
        self.fenced: Fenced | None = None
        self.timings: dict[str, float] = {}
        self.slowest = SlowestCalls()
        self._finishing: asyncio.Future[None] | None = None
        self.done = asyncio.Event()
        self._interrupt = asyncio.Event()
        self._wake = asyncio.Event()
        self._progressed = asyncio.Event()
        self._pre_cut: asyncio.Task[None] | None = None
        # The writing of the pre-cut's key rows, which goes on after the pre-cut (``repo.pre_cut``).
        self._key_rows: asyncio.Future[int] | None = None
        self._candidates: asyncio.Task[dict[str, Any]] | None = None
        # The pre-cut's keys, once it is in: each Gym entry's new keys are found against them;
        # as JSON, what a trainer's fetch of them is answered on this replica.
        self._pre_cut_keys: frozenset[str] | None = None
        self.pre_cut_keys_json: str | None = None
        # Each instance's Gym manifest entry, stored while the other instances still commit;
        # closed once the snapshot ends (an entry written after its end would be left behind).
        self._entries: dict[str, asyncio.Future[None]] = {}
        self._entries_closed = False
        # The last instance's entry, stored by the move to data_plane (one statement fewer
        # while Gym waits).
        self._last_entry: tuple[str, InstanceCommit] | None = None
        self._data_plane_reached = False
        # The phase before the last move, when that move was unflushed (its own is ``phase``).
        self._unflushed_from: SnapshotPhase | None = None
        self._started = opened.requested_at if opened is not None else time.monotonic()
        self._config: dict[str, Any] = {}
        self.stop = False
        self._deadline: float | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None

    # --- events from outside -------------------------------------------------------------------

    def wake(self) -> None:
        """A handshake for this snapshot was recorded (possibly on another replica)."""
        self._wake.set()

    def abort(self, reason: SnapshotReason | str) -> None:
        """Abort before the cut (train step, the trainer, a restore): Gym is resumed and the
        snapshot ends under the reason's outcome. Ignored once the cut is taken."""
        if self.cut_taken or self.abort_reason is not None:
            return
        self.abort_reason = SnapshotReason(reason)
        self._interrupt.set()

    def lease_lost(self, fenced: Fenced) -> None:
        """The run's lease is no longer this replica's: stop at once, no Gym call, no write."""
        if self.fenced is None:
            self.fenced = fenced
            self._interrupt.set()

    # --- the machine ---------------------------------------------------------------------------

    async def run(self) -> None:
        metrics.SNAPSHOTS_IN_PROGRESS.inc()
        watcher = asyncio.create_task(self._watch(), name=f"snapshot-watch-{self.run_id}-{self.snapshot_id}")
        try:
            with recording(self.slowest):
                await self._drive()
        except Fenced as e:
            await self._stop_fenced(e)
        except asyncio.CancelledError:
            # Shutdown. After the cut the snapshot is finished (the trainer has its capture; a
            # stopping snapshot must not resume Gym); before it Gym is resumed and the record
            # ended, so the gate does not stay closed until the next start. Both are bounded: with
            # the database away the row is left to the recovery of the next start.
            ending = self._finishing or asyncio.ensure_future(
                self._end_before_cut(SnapshotReason.cancelled, {"why": "coordinator shutting down"})
            )
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(SHUTDOWN_GRACE_S):
                    await asyncio.shield(ending)
            raise
        except _Aborted as e:
            await self._ending(self._end_before_cut(e.reason, {}))
        except _Failed as e:
            await self._ending(self._end_before_cut(e.reason, e.detail))
        except GymControlError as e:
            await self._ending(self._end_before_cut(reason_for_gym_failure(e.failure_class), _gym_detail(e)))
        except Exception as e:  # neither a database outage nor a bug may leave the gate closed
            why = database_away(e)
            if why is not None:
                log.warning("snapshot %s of run %s: a write failed in phase %s (%s); it ends when the database answers",
                            self.snapshot_id, self.run_id, self.phase, why)
                await self._ending(self._end_before_cut(SnapshotReason.database_unavailable, {"phase": self.phase.value, "why": why}, write_resume=False))
            else:
                log.exception("snapshot %s of run %s crashed", self.snapshot_id, self.run_id)
                await self._ending(self._end_before_cut(SnapshotReason.gym_invariant, {"error": type(e).__name__, "message": str(e)[:2000]}))
        finally:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            await self._drop_key_rows()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            metrics.SNAPSHOTS_IN_PROGRESS.dec()
            self.done.set()

    async def _ending(self, end: Awaitable[None]) -> None:
        try:
            await end
        except Fenced as e:
            await self._stop_fenced(e)

    async def _read(self, read: Callable[[Any], Awaitable[T]]) -> T:
        await asyncio.sleep(0)  # a write started beside it sends its statement first (``_drive``)
        async with self.engine.connect() as conn:
            return await read(conn)

    async def _drive(self) -> None:
        opened = self._opened
        if opened is not None:
            # Its request closed the gate and read all this in its transaction.
            checkpoint_id, gate, run, snap, topology, left = (
                opened.checkpoint_id, opened.gate, opened.run, opened.row, opened.topology, opened.deadline_left_s,
            )
            if left is not None:  # less what passed since it was read (the request's commit, this task's start)
                left -= time.monotonic() - opened.deadline_read_at
            self._opened = None
            self._entered(P.gate)
            if gate.prepared:
                self._entered(P.prepare)
        else:
            # The close and the reads side by side on their own connections: they are on the
            # snapshot's path to Gym's prepare. The gate's close needs none of the reads; every step
            # waits for the others to end, so that a failure of one leaves no write in flight behind
            # the error handling. The close, the longest, sends its statement first (``_write``
            # starts it in a task of its own, which each read, yielding once, lets run before it
            # takes its connection).
            # The Gym checkpoint id is drawn now: with nothing owed to Gym, the close's transaction
            # moves on to prepare with it (one flushed write, not two, before Gym is prepared).
            checkpoint_id = checkpoint_id_for(self.snapshot_id)
            gate, run, snap, topology, left = await all_ended(
                self._write(
                    P.gate,
                    lambda: repo.close_gate(self.engine, self.run_id, self.snapshot_id, self.fence, prepare_as=checkpoint_id),
                    reached=lambda closed: P.prepare if closed.prepared else P.gate,
                ),
                self._read(lambda c: get_run(c, self.run_id)),
                self._read(lambda c: repo.get(c, self.run_id, self.snapshot_id)),
                self._read(lambda c: load_topology(c, self.run_id)),
                self._read(lambda c: repo.deadline_left_s(c, self.run_id, self.snapshot_id)),
            )
        cfg = self._config = dict(run.config)
        self.stop = snap.stop
        if left is not None:
            # Past the deadline before the cut: abort cleanly (Gym resumed, gate reopened).
            self._deadline = time.monotonic() + left
            if left <= 0:
                self.abort(SnapshotReason.deadline_exceeded)
            else:
                self._deadline_timer = asyncio.get_running_loop().call_later(left, self.abort, SnapshotReason.deadline_exceeded)
        # An abort or a lost lease during the close: no Gym call follows, and the snapshot ends
        # from the phase the close reached.
        self._raise_interrupt()
        if not topology:  # refused at the request; only a registration removed meanwhile gets here
            raise _Failed(SnapshotReason.gym_invariant, {
                "why": "no Gym instance is registered for this run; register its Gym instances (client.register_gym_instances)",
                "retryable": False,
            })
        client = self.ctx.gym.for_run(self.run_id, cfg)
        snapshot_dir = snap.snapshot_dir or str(Path(run.checkpoint_root) / "snapshots" / self.snapshot_id)
        save = self.save = GymSave(
            client, topology, snapshot_dir=snapshot_dir, drain_timeout_s=self._clipped(float(cfg.get("drain_timeout_s", 120))),
            checkpoint_id=checkpoint_id, stop=self.stop, write_manifest_file=True,
        )
        # The gate is closed, no dispatch adds to the candidates: their query, and their sorting
        # into commit scopes, run beside the retire delivery and the prepare calls.
        self._candidates = asyncio.create_task(self._load_candidates(save, topology))
        if self.phase is P.gate:
            # Gym refuses retire and forget once a checkpoint is open: deliver what is owed first
            # (items of an unregistered instance wait for its registration, as in every delivery).
            if any(iid in topology for iid, _ in gate.owed):
                await self._move(P.retire)
                await self._step(self.ctx.outbox.deliver_run(self.run_id, self.fence.epoch, ignore_schedule=True))
            await self._move(P.prepare, gym_checkpoint_id=checkpoint_id, snapshot_dir=snapshot_dir)
        self.timings[SnapshotTiming.gate] = time.monotonic() - self._started
        # Copy the ledger now, beside Gym's prepare and commit, so that the barrier (while Gym and
        # the trainer wait) copies only the groups written since.
        self._pre_cut = asyncio.create_task(self._take_pre_cut())
        await self._step(save.prepare())
        counts = await self._step(self._candidates)
        if save.plan_is_current():  # computed while prepare was in flight (no restarts since)
            await self._move(P.commit, counts=counts)
        else:
            moved = asyncio.ensure_future(self._move(P.commit, counts=counts))
            try:
                # The scopes, computed in a thread while the move is on its way to the database
                # (in this thread the move would not leave before they were done).
                await asyncio.to_thread(save.plan_commit)
            finally:
                await moved  # no commit call before the phase is written
        commit = await self._step(save.commit(on_instance=self._store_entry_soon))
        unknown = counts["unknown_instances"]
        pending = save.pending()
        drained = sum(len(v) for v in pending.values())
        if pending:
            await self._move(P.drain)
        await self._step(save.drain(self._drained(pending) if pending else None, pending))
        save.build_manifest()
        # The manifest file is needed by the cut, not by the trainer's barrier: it is written
        # beside the phase write and the trainer's handshakes.
        manifest_file = asyncio.ensure_future(save.write_manifest_file_now())
        try:
            await self._settle_pre_cut()  # the barrier must find it done (or never started)
            await self._step(self._stored_entries(commit))
            last = self._last_entry
            await self._move(P.data_plane, gym_entry=self._gym_entry(*last) if last else None)
            self._data_plane_reached = True
            await self._step(save.within_lease(self._captured(self._clipped(float(cfg.get("data_plane_timeout_s", 600))))))
        except BaseException:
            manifest_file.add_done_callback(_retrieved)
            raise
        await self._step(manifest_file)
        save.cut()
        self.cut_taken = True
        self.pre_cut_keys_json = None  # the fetch answers the cut's keys from the database now
        # From here on nothing turns the snapshot into an abort: a shutdown waits for this task,
        # and a database outage delays its writes.
        self._finishing = asyncio.ensure_future(self._after_cut(save, commit, drained, unknown))
        await asyncio.shield(self._finishing)

    async def _after_cut(self, save: GymSave, commit: Any, drained: int, unknown: list[str]) -> None:
        # Gym is resumed beside the phase write, not after it: recovery resumes Gym from either
        # phase, and a resume of an ended checkpoint changes nothing in Gym (protocol section 4). A
        # refused write is raised once the resume is answered.
        _, result = await all_ended(
            until_database_answers(lambda: self._move(P.resume), f"snapshot {self.snapshot_id}: resume phase"), save.finish()
        )
        if result.lapsed:
            ended = await self._saved_episodes_ended(commit, result.lapsed)
            if ended:
                # Gym resumed on its own before the barrier, and saved episodes finished in the
                # ledger meanwhile: the cut and the Gym manifest disagree, and no restore could
                # continue them. The snapshot fails as a lost lease (try a new one).
                await self._end(SnapshotReason.lease_lost, {
                    "why": "Gym resumed on its own (its lease lapsed) and saved episodes ended before the ledger cut",
                    "lease_lapsed": {iid: list(servers) for iid, servers in result.lapsed.items()},
                    "ended_count": len(ended), "ended_samples": ended[:10], "warnings": list(result.warnings),
                })
                return
        # A stopping snapshot keeps the gate closed: the run is stopped until a restore or reopen.
        await until_database_answers(
            lambda: self._write(P.publish, lambda: repo.publish_phase(self.engine, self.run_id, self.snapshot_id, self.fence, keep_gate=self.stop)),
            f"snapshot {self.snapshot_id}: publishing",
        )
        resume_failure = None
        if result.resume is not None and result.resume.failure is not None:
            resume_failure = result.resume.failure.to_dict()
            metrics.record_snapshot_resume_failure()
            log.warning("snapshot %s: Gym resume failed after the cut; leases will reopen Gym: %s", self.snapshot_id, result.resume.failure)
        detail: dict[str, Any] = {
            "warnings": list(result.warnings),
            "drained": drained,
            "gym": {iid: {**ic.figures(), "slowest": self.slowest.of_instance(iid)} for iid, ic in sorted(commit.instances.items())},
        }
        for ic in commit.instances.values():
            for kind, n in ic.outside_scope.items():
                metrics.record_exported_outside_scope(kind, n, self.run_id)
        if unknown:
            detail["unregistered_instances"] = unknown
        if result.lapsed:
            # Gym resumed these participants on its own after their instance committed.
            detail["lease_lapsed"] = {iid: list(servers) for iid, servers in result.lapsed.items()}
        if self.stop:
            # Per instance: left parked (stop honoured), or resumed (a Gym that refused `stop`, or
            # whose lease lapsed).
            detail["stop_honoured"] = result.stop_honoured
        await self._end(SnapshotReason.ok, detail, restarted=result.gym_restarted_episodes, resume_failure=resume_failure)

    async def _saved_episodes_ended(self, commit: CommitResult, lapsed: Mapping[str, Any]) -> list[str]:
        """The saved episodes of the lapsed instances that the cut no longer has running in Gym."""
        saved = [(iid, ep.rollout_id, ep.attempt) for iid in lapsed for ep in commit.instances[iid].episodes]

        async def read() -> list[str]:
            async with self.engine.connect() as conn:
                return await saved_episodes_ended(conn, self.run_id, self.snapshot_id, saved)

        return await until_database_answers(read, f"snapshot {self.snapshot_id}: checking the lapsed instances' episodes")

    # --- transitions: one fenced write each ----------------------------------------------------

    async def _move(self, to: SnapshotPhase, **fields: Any) -> None:
        before = self.phase
        try:
            await self._write(to, lambda: repo.move(self.engine, self.run_id, self.snapshot_id, self.fence, self.phase, to, **fields))
        except Fenced as e:
            await self._fenced_write(e, resume=to is P.resume)
            await self._move(to, **fields)  # only the move to resume (an abort) goes on
            return
        self._unflushed_from = before if to in UNFLUSHED_MOVES else None

    async def _fenced_write(self, e: Fenced, *, resume: bool = False) -> None:
        """A fenced write was refused. When a database crash lost the last unflushed move, the
        row is where it was before it, still ours: not a lease lost to another owner. Then the
        move to resume (an abort, ``resume``) goes on from there (this returns) and any other
        write ends the snapshot, Gym resumed; otherwise ``e`` is raised."""
        lost = await self._lost_unflushed_move()
        if lost is None:
            raise e
        lost_to, self.phase = self.phase, lost
        self._unflushed_from = None
        if not resume:
            raise _Failed(
                SnapshotReason.database_unavailable, {"phase": lost.value, "why": f"the database lost the move to {lost_to} (restarted?)"}
            ) from None

    async def _lost_unflushed_move(self) -> SnapshotPhase | None:
        """The phase the row fell back to when the database lost this owner's last unflushed
        move (``UNFLUSHED_MOVES``); None for any other refusal."""
        if self._unflushed_from is None:
            return None
        try:
            progress = await repo.poll(self.engine, self.run_id, self.snapshot_id)
        except Exception:
            return None
        if progress.outcome is None and progress.phase == self._unflushed_from.value:
            return self._unflushed_from
        return None

    def _entered(self, to: SnapshotPhase) -> None:
        """A transition another transaction wrote for this owner (its creating request's)."""
        check_snapshot_transition(self.phase, to, cut_taken=self.cut_taken)
        self.phase = to

    async def _write(self, to: SnapshotPhase, write: Callable[[], Awaitable[T]], *, reached: Callable[[T], SnapshotPhase] | None = None) -> T:
        """Apply one transition; returns what the write answered. ``reached``: the phase the
        answer says the row went on to (a write that may take ``to`` and the next transition
        together). A cancellation (shutdown) waits for the write in flight, so that ``phase``
        always says what the row holds."""
        check_snapshot_transition(self.phase, to, cut_taken=self.cut_taken)

        def now_in(answer: T) -> SnapshotPhase:
            end = to if reached is None else reached(answer)
            if end is not to:
                check_snapshot_transition(to, end, cut_taken=self.cut_taken)
            return end

        task = asyncio.ensure_future(write())
        try:
            answer = await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await task
            if task.done() and not task.cancelled() and task.exception() is None:
                self.phase = now_in(task.result())
            raise
        self.phase = now_in(answer)
        return answer

    async def _end(
        self, reason: SnapshotReason, detail: dict[str, Any], *, restarted: int | None = None, resume_failure: dict[str, Any] | None = None
    ) -> None:
        outcome = outcome_of(reason)
        check_snapshot_transition(self.phase, P(outcome.value), cut_taken=self.cut_taken, reason=reason)
        await self._settle_pre_cut()
        await self._drop_entry_writes()
        if self._candidates is not None:
            self._candidates.cancel()  # a no-op once it has its answer
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._candidates
        timings = self._timings()
        save = self.save
        _, streaks = await until_database_answers(
            lambda: repo.end(
                self.engine, self.run_id, self.snapshot_id, outcome, reason, fence=self.fence, expected=self.phase,
                detail=detail, timings=timings, gym_parked_seconds=save.gym_parked_seconds if save else None,
                gym_restarted_episodes=restarted, resume_failure=resume_failure, keep_latest_k=int(self._config.get("keep_latest_k", 2)),
                keep_gate=self.stop, keep_gym_manifest=self._data_plane_reached,
            ),
            f"snapshot {self.snapshot_id} of run {self.run_id}: ending it {outcome}/{reason}",
        )
        self.phase = P(outcome.value)
        metrics.record_snapshot_outcome(outcome, reason, self.run_id)
        for name, secs in timings.items():
            if name in _TIMED:
                metrics.observe_snapshot_phase(name, max(0.0, secs), self.run_id)
        if restarted is not None:
            metrics.observe_gym_restarted_episodes(restarted, self.run_id)
        warn_after = int(self._config.get("snapshot_loss_warn_after", 3))
        losses = streaks.losses
        metrics.set_snapshot_losses(self.run_id, losses, warn_after)
        metrics.set_snapshot_failures(self.run_id, streaks.failures)
        if reason is SnapshotReason.train_step_committed and losses >= warn_after:
            log.warning("run %s: %d consecutive snapshots lost to train steps; snapshot more often or earlier in the step", self.run_id, losses)
        log.info("snapshot %s of run %s ended %s/%s", self.snapshot_id, self.run_id, outcome, reason)

    async def _end_before_cut(self, reason: SnapshotReason, detail: dict[str, Any], *, write_resume: bool = True) -> None:
        """Resume Gym (the abort) when it is parked, phase ``resume`` written first, then end.
        ``write_resume=False``: the database is away, Gym is resumed without waiting for it."""
        save = self.save
        if save is not None and save.parked:
            if write_resume and self.phase is not P.resume:
                await self._move(P.resume)
            report = await save.resume_before_cut()
            if report is not None and report.failure is not None:
                detail = {**detail, "resume_failure": report.failure.to_dict()}
        elif save is not None:
            await save.abandon()
        await self._end(reason, detail)

    async def _stop_fenced(self, e: Fenced) -> None:
        metrics.record_fenced_write(metrics.FencedWork.SNAPSHOT)
        log.warning("snapshot %s of run %s: fenced in phase %s (%s); this replica stops driving it", self.snapshot_id, self.run_id, self.phase, e)
        if self.save is not None:
            await self.save.abandon()
        if self._pre_cut is not None:
            self._pre_cut.cancel()
        self._close_entries()
        if self._candidates is not None:
            self._candidates.cancel()

    # --- waiting ------------------------------------------------------------------------------

    def _clipped(self, timeout_s: float) -> float:
        """A phase timeout, clipped to what is left of the deadline; past the clip the deadline's
        own abort (``deadline_exceeded``) comes first, so that is the reason given."""
        if self._deadline is None:
            return timeout_s
        left = self._deadline - time.monotonic()
        return timeout_s if timeout_s < left else max(0.0, left) + 1.0

    async def _step(self, aw: Awaitable[T]) -> T:
        """Await one step (a Gym call, a wait) unless an abort or a lost lease comes first; then
        cancel it and raise that. Writes are never raced: each is one transition (the close, two). A step
        asked for after the interrupt does not start."""
        try:
            self._raise_interrupt()
        except BaseException:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._interrupt.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._raise_interrupt()
        return task.result()

    def _raise_interrupt(self) -> None:
        if self.fenced is not None:
            raise self.fenced
        if self.abort_reason is not None and not self.cut_taken:
            raise _Aborted(self.abort_reason)

    async def _watch(self) -> None:
        """Read the progress columns on every event and every ``poll_s`` (the fallback)."""
        while True:
            await wait_event(self._wake, self.ctx.poll_s)
            self._wake.clear()
            try:
                progress = await repo.poll(self.engine, self.run_id, self.snapshot_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # no news yet; the phase's own deadline bounds the wait
                if database_away(e) is None:
                    log.warning("snapshot %s: reading its progress failed: %s", self.snapshot_id, e)
                continue
            self.progress = progress
            if progress.outcome is not None and self.phase.value != progress.outcome:
                # Ended by another replica (it took the run over): nothing here may touch it.
                self.lease_lost(Fenced(self.run_id, f"snapshot {self.snapshot_id}: ended elsewhere ({progress.outcome})", self.fence))
            if progress.abort_requested and not self.cut_taken:
                self.abort(progress.abort_requested)
            self._progressed.set()

    async def _captured(self, timeout_s: float) -> None:
        """Until the trainer reported its capture (after its barrier took the cut)."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()  # read once now: the barrier may have come before this phase was written
        while True:
            p = self.progress
            if p is not None and p.phase == P.data_plane:
                if p.captured:
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                awaiting = p.awaiting if p is not None and p.phase == P.data_plane else "barrier"
                raise _Failed(SnapshotReason.data_plane_timeout, {"awaiting": awaiting, "timeout_s": timeout_s})
            self._progressed.clear()
            await wait_event(self._progressed, left)

    async def _drained(self, pending: dict[str, set[Episode]]) -> None:
        """Until the trainer reported every pending attempt (discarding each one as it resolves)."""
        while any(pending.values()):
            keys = [(e.rollout_id, e.attempt) for eps in pending.values() for e in eps]
            try:
                still = await repo.still_pending(self.engine, self.run_id, keys)
            except Exception as e:
                if database_away(e) is None:
                    raise
                still = None
            if still is not None:
                for eps in pending.values():
                    for e in list(eps):
                        if (e.rollout_id, e.attempt) not in still:
                            eps.discard(e)
            if any(pending.values()):
                await asyncio.sleep(DRAIN_POLL_S)

    async def _load_candidates(self, save: GymSave, topology: Topology) -> dict[str, Any]:
        """The candidates, handed to ``save`` for its commit; returns their counts."""
        found = await repo.candidates(self.engine, self.run_id)
        save.offer_candidates({iid: [Episode(r, a) for r, a in found.get(iid, [])] for iid in topology})
        save.plan_commit()  # the scopes, while prepare is usually still in flight
        return {"candidates": sum(len(found.get(iid, ())) for iid in topology), "unknown_instances": sorted(set(found) - set(topology))}

    # --- the Gym manifest, stored per instance ----------------------------------------------------

    def _store_entry_soon(self, instance_id: str, ic: InstanceCommit) -> None:
        """An instance's commit validated while others may still commit: store its manifest
        entry now, beside their calls, rather than the whole manifest once Gym waits. The last
        instance's is kept for the move to ``data_plane``, which stores it."""
        if instance_id in self._entries or self._entries_closed or (self._last_entry and self._last_entry[0] == instance_id):
            return
        if self.save is not None and len(self._entries) + 1 >= len(self.save.topology):
            self._last_entry = (instance_id, ic)
        else:
            self._entries[instance_id] = asyncio.ensure_future(self._store_entry(instance_id, ic))

    async def _store_entry(self, instance_id: str, ic: InstanceCommit) -> None:
        await self._settle_pre_cut()  # its keys are what the entry's new keys are found against
        await repo.store_gym_entry(self.engine, self.run_id, self.snapshot_id, self.fence, self._gym_entry(instance_id, ic))

    def _gym_entry(self, instance_id: str, ic: InstanceCommit) -> repo.GymEntry:
        entry = JsonText(ic.manifest_entry or encode_instance_entry(ic))
        return repo.GymEntry(instance_id, entry, repo.new_keys(ic.staging_keys, self._pre_cut_keys))

    async def _stored_entries(self, commit: CommitResult) -> None:
        """Until every committed instance's entry is stored (those validated only after a second
        try are stored now); the first failure is raised."""
        for iid, ic in commit.instances.items():
            self._store_entry_soon(iid, ic)
        await asyncio.gather(*self._entries.values(), return_exceptions=True)
        for iid, task in list(self._entries.items()):
            if task.cancelled():
                raise asyncio.CancelledError()
            e = task.exception()
            if e is None:
                continue
            if database_away(e) is not None:
                # Written while the database was away: once more (an upsert). Still away, the
                # error ends the snapshot as a phase move's would (database_unavailable, Gym
                # resumed) rather than keep Gym parked until the run's lease is lost.
                self._entries[iid] = again = asyncio.ensure_future(self._store_entry(iid, commit.instances[iid]))
                try:
                    await again
                    continue
                except Exception as retried:
                    e = retried
            if isinstance(e, Fenced):
                await self._fenced_write(e)
            raise e

    def _close_entries(self) -> list[asyncio.Future[None]]:
        """No entry write starts any more; those in flight are cancelled (and returned)."""
        self._entries_closed = True
        tasks = list(self._entries.values())
        for task in tasks:
            task.cancel()
        return tasks

    async def _drop_entry_writes(self) -> None:
        """Cancel and wait for the entry writes still in flight, before the snapshot ends (its
        end deletes the entries: none may land after it)."""
        for task in self._close_entries():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # --- the pre-cut ----------------------------------------------------------------------------

    async def _take_pre_cut(self) -> None:
        t = time.monotonic()
        try:
            # Its key rows are written after it, beside Gym's commit and whatever follows: only a
            # barrier that copies groups again waits for them.
            taken = await repo.pre_cut(self.engine, self.run_id, self.snapshot_id, self.fence, defer_key_rows=True)
        except Exception as e:  # the barrier then copies the whole run: slower, not wrong
            log.warning("snapshot %s of run %s: pre-cut failed (%s: %s); the barrier will copy the whole ledger",
                        self.snapshot_id, self.run_id, type(e).__name__, str(e)[:500])
            return
        if taken is not None:
            self._pre_cut_keys, self.pre_cut_keys_json = taken.keys, taken.keys_json
            self.timings["pre_cut"] = time.monotonic() - t
            self._key_rows = taken.key_rows
            if self._key_rows is not None:
                self._key_rows.add_done_callback(self._key_rows_written)

    def _key_rows_written(self, task: asyncio.Future[int]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:  # a barrier that needs them copies the whole run instead
            log.warning("snapshot %s of run %s: writing the pre-cut's key rows failed: %s", self.snapshot_id, self.run_id, task.exception())

    async def _drop_key_rows(self) -> None:
        """Stop the writing of the pre-cut's key rows if it is still going on (the snapshot is over
        for this replica: a reader after its end needs none)."""
        if self._key_rows is not None and not self._key_rows.done():
            self._key_rows.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._key_rows

    async def _settle_pre_cut(self) -> None:
        # An unfinished pre-cut would otherwise write its copy after ``end`` deleted the cut rows
        # (it checks the snapshot again before committing; waiting keeps the log and timings clean).
        if self._pre_cut is not None:
            try:
                await asyncio.shield(self._pre_cut)
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():
                    raise  # this snapshot is being cancelled, not only the pre-cut
            except Exception:
                pass  # a failed pre-cut leaves the barrier to copy the whole run

    def _timings(self) -> dict[str, float]:
        t = dict(self.timings)
        save = self.save
        if save is not None:
            st = save.timings
            for out, names in (
                (SnapshotTiming.prepare, ("prepare",)),
                (SnapshotTiming.commit, ("commit",)),
                (SnapshotTiming.drain, ("drain", "manifest")),
                (SnapshotTiming.data_plane, ("capture",)),
                (SnapshotTiming.resume, ("resume",)),
            ):
                if any(n in st for n in names):
                    t[out] = sum(st.get(n, 0.0) for n in names)
            if save.gym_parked_seconds is not None:
                t[SnapshotTiming.gym_parked] = save.gym_parked_seconds
        t[SnapshotTiming.total] = time.monotonic() - self._started
        return {str(k): v for k, v in t.items()}


_TIMED = frozenset(t.value for t in SnapshotTiming)


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A side task whose result no longer matters: its failure is logged, not left unretrieved."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a snapshot side task failed after its snapshot ended: %s", task.exception())


def _gym_detail(e: GymControlError) -> dict[str, Any]:
    d = e.to_dict()
    d["message"] = str(e)[:4000]
    return d
