"""One pending snapshot as a state machine, owned by one replica (docs/architecture.md#the-pending-snapshot).

requested -> gate -> retire -> prepare -> commit -> drain -> data_plane -> resume -> publish
-> published (``retire`` and ``drain`` only when they have something to do); before the cut, a
failure or abort once Gym was prepared goes through resume (Gym's abort) to failed or aborted;
before Gym's prepare was sent it ends from the phase it reached.

This package is the one writer of a snapshot's phase and outcome. Each transition is one write,
checked against the phase table and fenced by the phase it leaves and the owner's lease epoch;
the gate's close is the one write that may take two (``gate``, and ``prepare`` when nothing is
owed to Gym). The request that creates a snapshot on its owner's replica makes that write in its
own transaction (``ownership.create_in_request``), and a takeover after a crash is
``ownership.end_orphan``. A write that matches nothing raises ``Fenced`` and the object stops at
once, with no further Gym call: whoever holds the run's lease now ends it.

What each phase does is the table ``Steps.STEPS``; the work beside the Gym calls (pre-cut,
manifest entries, candidates, the trainer's reports) is ``SideWork``; the steps after the cut are
``Finishing``. Trainer handshakes reach it as events (:meth:`PendingSnapshot.wake`), with a
timer's read as the fallback for a lost notification. Time is the context's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ...domain.errors import IdentityError
from ...domain.identity import parse_capture_key
from ...domain.snapshot_state import (
    UNFLUSHED_MOVES,
    SnapshotPhase,
    SnapshotReason,
    SnapshotTiming,
    check_snapshot_transition,
    reason_for_gym_failure,
)
from ...domain.vocabulary import GymOperation
from ...gym.errors import BLOCKED_EPISODES, GymControlError
from ...gym.models import Episode
from ...gym.races import first_of, unless_set
from ...gym.results import CommitResult, InstanceCommit
from ...gym.save import GymSave
from ...gym.timings import SlowestCalls, recording
from ...ledger.leases import Fence, Fenced
from ...observability import metrics
from .. import store as repo
from .finishing import Finishing
from .side_work import SideWork, cancel_and_wait
from .steps import Move, Steps
from .support import (
    SHUTDOWN_GRACE_S,
    Opened,
    SnapshotAborted,
    SnapshotContext,
    SnapshotFailed,
    database_away,
    log,
    outcome_of,
    until_database_answers,
    wait_event,
)

T = TypeVar("T")
P = SnapshotPhase


class PendingSnapshot(Steps, SideWork, Finishing):
    def __init__(self, ctx: SnapshotContext, run_id: str, snapshot_id: str, epoch: int, *, opened: Opened | None = None) -> None:
        self.ctx = ctx
        self.clock = ctx.clock
        self.store = ctx.store
        self._opened = opened
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
        self.stop = False
        self.done = asyncio.Event()
        self._finishing: asyncio.Future[None] | None = None
        self._interrupt = asyncio.Event()
        self._wake = asyncio.Event()
        self._progressed = asyncio.Event()
        self._started = opened.requested_at if opened is not None else self.clock.time()
        self._config: dict[str, Any] = {}
        self._deadline: float | None = None
        self._deadline_task: asyncio.Task[None] | None = None
        # What the steps hand each other (``steps.py``).
        self._checkpoint_id = ""
        self._snapshot_dir = ""
        self._owed = False
        self._counts: dict[str, Any] = {"unknown_instances": []}
        self._commit_result: CommitResult | None = None
        self._pending: dict[str, set[Episode]] = {}
        self._drained_count = 0
        self._manifest_file: asyncio.Future[None] | None = None
        self._data_plane_reached = False
        # The side work (``side_work.py``): the pre-cut, its key rows written after it, the
        # candidates' query; the pre-cut's keys once it is in (each Gym entry's new keys are
        # found against them; as JSON, what a trainer's fetch is answered on this replica).
        self._pre_cut: asyncio.Task[None] | None = None
        self._key_rows: asyncio.Future[int] | None = None
        self._candidates: asyncio.Task[dict[str, Any]] | None = None
        self._pre_cut_keys: frozenset[str] | None = None
        self.pre_cut_keys_json: str | None = None
        # Each instance's Gym manifest entry, stored while the other instances still commit;
        # closed once the snapshot ends (an entry written after its end would be left behind).
        # The last instance's is stored by the move to data_plane (one statement fewer).
        self._entries: dict[str, asyncio.Future[None]] = {}
        self._entries_closed = False
        self._last_entry: tuple[str, InstanceCommit] | None = None
        # The phase before the last move, when that move was unflushed (its own is ``phase``).
        self._unflushed_from: SnapshotPhase | None = None
        # (instance, rollout id) of the episodes that kept it from its cut, recorded by its end
        # (docs/ledger.md#stragglers).
        self._blockers: list[tuple[str, str]] = []

    # --- events from outside -------------------------------------------------------------------

    def wake(self) -> None:
        """A handshake for this snapshot was recorded (possibly on another replica)."""
        self._wake.set()

    def abort(self, reason: SnapshotReason | str) -> None:
        """Abort before the cut (train step, the trainer, a restore, the deadline): Gym is resumed
        and the snapshot ends under the reason's outcome. Ignored once the cut is taken."""
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
            await self._shut_down()
            raise
        except SnapshotAborted as e:
            await self._ending(self._end_before_cut(e.reason, {}))
        except SnapshotFailed as e:
            await self._ending(self._end_before_cut(e.reason, e.detail))
        except GymControlError as e:
            self._blockers = _blocked(e)
            await self._ending(self._end_before_cut(reason_for_gym_failure(e.failure_class), _gym_detail(e)))
        except Exception as e:  # neither a database outage nor a bug may leave the gate closed
            await self._ending(self._crashed(e))
        finally:
            await self._drop_side_work()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            metrics.SNAPSHOTS_IN_PROGRESS.dec()
            self.done.set()

    async def _drive(self) -> None:
        """Each phase's step (``Steps.STEPS``), then the move it asks for, until the cut."""
        while not self.cut_taken:
            move = await self.STEPS[self.phase](self)
            if move is not None:
                await self._apply(move)
        self._finishing = asyncio.ensure_future(self._after_cut())
        await asyncio.shield(self._finishing)

    async def _apply(self, move: Move) -> None:
        if move.beside is None:
            await self._move(move.to, **move.fields)
            return
        moved = asyncio.ensure_future(self._move(move.to, **move.fields))
        try:
            await asyncio.to_thread(move.beside)
        finally:
            await moved  # no step after it before the phase is written

    def _start_deadline(self, left: float) -> None:
        """Past the deadline before the cut: abort cleanly (Gym resumed, gate reopened)."""
        self._deadline = self.clock.time() + left
        if left <= 0:
            self.abort(SnapshotReason.deadline_exceeded)
        else:
            self._deadline_task = asyncio.ensure_future(self._abort_after(left))

    async def _abort_after(self, seconds: float) -> None:
        await self.clock.sleep(seconds)
        self.abort(SnapshotReason.deadline_exceeded)

    async def _shut_down(self) -> None:
        """Cancelled (shutdown). After the cut the snapshot is finished (the trainer has its
        capture; a stopping snapshot must not resume Gym); before it Gym is resumed and the record
        ended, so the gate does not stay closed until the next start. Both are bounded: with the
        database away the row is left to the recovery of the next start."""
        ending = self._finishing or asyncio.ensure_future(
            self._end_before_cut(SnapshotReason.cancelled, {"why": "coordinator shutting down"})
        )
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await first_of(asyncio.shield(ending), self.clock.sleep(SHUTDOWN_GRACE_S))

    async def _crashed(self, e: Exception) -> None:
        why = database_away(e)
        if why is not None:
            log.warning("snapshot %s of run %s: a write failed in phase %s (%s); it ends when the database answers",
                        self.snapshot_id, self.run_id, self.phase, why)
            await self._end_before_cut(SnapshotReason.database_unavailable, {"phase": self.phase.value, "why": why}, write_resume=False)
        else:
            log.exception("snapshot %s of run %s crashed", self.snapshot_id, self.run_id, exc_info=e)
            await self._end_before_cut(SnapshotReason.gym_invariant, {"error": type(e).__name__, "message": str(e)[:2000]})

    async def _ending(self, end: Awaitable[None]) -> None:
        try:
            await end
        except Fenced as e:
            await self._stop_fenced(e)

    # --- transitions: one fenced write each ----------------------------------------------------

    async def _move(self, to: SnapshotPhase, **fields: Any) -> None:
        before = self.phase
        try:
            await self._write(to, lambda: self.store.move(self.run_id, self.snapshot_id, self.fence, self.phase, to, **fields))
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
            raise SnapshotFailed(
                SnapshotReason.database_unavailable, {"phase": lost.value, "why": f"the database lost the move to {lost_to} (restarted?)"}
            ) from None

    async def _lost_unflushed_move(self) -> SnapshotPhase | None:
        """The phase the row fell back to when the database lost this owner's last unflushed
        move (``UNFLUSHED_MOVES``); None for any other refusal."""
        if self._unflushed_from is None:
            return None
        try:
            progress = await self.store.poll(self.run_id, self.snapshot_id)
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
        await cancel_and_wait(self._candidates)
        timings = self._timings()
        save = self.save
        _, streaks = await until_database_answers(
            lambda: self.store.end(
                self.run_id, self.snapshot_id, outcome, reason, fence=self.fence, expected=self.phase,
                detail=detail, timings=timings, gym_parked_seconds=save.gym_parked_seconds if save else None,
                gym_restarted_episodes=restarted, resume_failure=resume_failure, keep_latest_k=int(self._config.get("keep_latest_k", 2)),
                keep_gate=self.stop, keep_gym_manifest=self._data_plane_reached,
                **({"blockers": self._blockers} if self._blockers else {}),
            ),
            f"snapshot {self.snapshot_id} of run {self.run_id}: ending it {outcome}/{reason}", self.clock,
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
        # The side work (pre-cut, entry writes, candidates) ends in ``run``'s ``_drop_side_work``.

    # --- waiting ------------------------------------------------------------------------------

    def _clipped(self, timeout_s: float) -> float:
        """A phase timeout, clipped to what is left of the deadline; past the clip the deadline's
        own abort (``deadline_exceeded``) comes first, so that is the reason given."""
        if self._deadline is None:
            return timeout_s
        left = self._deadline - self.clock.time()
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
        # Cancelled itself (a shutdown), or interrupted: the step goes with it.
        task = await unless_set(aw, self._interrupt)
        self._raise_interrupt()
        return task.result()

    def _raise_interrupt(self) -> None:
        if self.fenced is not None:
            raise self.fenced
        if self.abort_reason is not None and not self.cut_taken:
            raise SnapshotAborted(self.abort_reason)

    async def _watch(self) -> None:
        """Read the progress columns on every event and every ``poll_s`` (the fallback)."""
        while True:
            await wait_event(self._wake, self.ctx.poll_s, self.clock)
            self._wake.clear()
            try:
                progress = await self.store.poll(self.run_id, self.snapshot_id)
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

    def _timings(self) -> dict[str, float]:
        t = dict(self.timings)
        save = self.save
        if save is not None:
            st = save.timings
            for out, names in (
                (SnapshotTiming.prepare, (GymOperation.prepare,)),
                (SnapshotTiming.commit, (GymOperation.commit,)),
                (SnapshotTiming.drain, ("drain", "manifest")),
                (SnapshotTiming.data_plane, ("capture",)),
                (SnapshotTiming.resume, (GymOperation.resume,)),
            ):
                if any(n in st for n in names):
                    t[out] = sum(st.get(n, 0.0) for n in names)
            if save.gym_parked_seconds is not None:
                t[SnapshotTiming.gym_parked] = save.gym_parked_seconds
        t[SnapshotTiming.total] = self.clock.time() - self._started
        return {str(k): v for k, v in t.items()}


_TIMED = frozenset(t.value for t in SnapshotTiming)


def _gym_detail(e: GymControlError) -> dict[str, Any]:
    d = e.to_dict()
    d.pop(BLOCKED_EPISODES, None)  # recorded as the snapshot's blockers, not in its detail
    d["message"] = str(e)[:4000]
    return d


def _blocked(e: GymControlError) -> list[tuple[str, str]]:
    """(instance, rollout id) of every episode a not-ready prepare or a timed-out drain named.
    Gym's blockers are capture keys, or names of its own (a worker that never reported): those
    name no attempt, and the store leaves them out."""
    named = e.extra.get(BLOCKED_EPISODES) or {}
    out = []
    for iid, keys in sorted(named.items()):
        for key in keys:
            try:
                out.append((iid, parse_capture_key(key)[0]))
            except IdentityError:
                continue
    return out
