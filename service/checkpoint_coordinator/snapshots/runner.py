"""The pending snapshots this replica owns: start, events, lease keeping, recovery, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.snapshot_state import SnapshotPhase
from ..gym.clock import Clock
from ..gym_runtime import GymClients
from ..ledger import leases
from ..ledger.leases import Fence, Fenced
from ..observability import metrics
from ..outbox.worker import OutboxDeliverer
from . import store as repo
from .pending import (
    LedgerStore,
    MonotonicClock,
    Opened,
    PendingSnapshot,
    SnapshotContext,
    end_orphan,
    take_over,
)
from .watch import SnapshotWatch

log = logging.getLogger(__name__)


class SnapshotRunner:
    def __init__(
        self, engine: AsyncEngine, gym: GymClients, outbox: OutboxDeliverer, owner: str, *, poll_s: float = 1.0, clock: Clock | None = None
    ) -> None:
        self.ctx = SnapshotContext(LedgerStore(engine), gym, outbox, owner, poll_s, clock or MonotonicClock())
        self.engine = engine
        self.gym = gym
        self.owner = owner
        self.jobs: dict[tuple[str, str], PendingSnapshot] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        # Set by an event naming a snapshot this replica does not drive yet (one requested on
        # another replica for a run whose lease is here): the recovery pass starts it at once.
        self.recovery_wanted = asyncio.Event()
        # Trainers waiting on a snapshot's progress: woken by the same notifications.
        self.watch = SnapshotWatch()

    def start(self, run_id: str, snapshot_id: str, epoch: int, *, opened: Opened | None = None) -> PendingSnapshot:
        """Drive the snapshot here (once). ``opened``: the request that created it closed its gate."""
        key = (run_id, snapshot_id)
        job = self.jobs.get(key)
        if job is None:
            job = PendingSnapshot(self.ctx, run_id, snapshot_id, epoch, opened=opened)
            self.jobs[key] = job
            task = asyncio.create_task(self._run(job), name=f"snapshot-{run_id}-{snapshot_id}")
            task.add_done_callback(_log_crash)
            self._tasks[key] = task
        return job

    def pre_cut_keys_json(self, run_id: str, snapshot_id: str) -> str | None:
        """The pre-cut's keys of a snapshot this replica drives, as its fetch answers them (None:
        not driven here, or no pre-cut in yet; the fetch then reads them from the database)."""
        job = self.jobs.get((run_id, snapshot_id))
        return job.pre_cut_keys_json if job is not None else None

    async def _run(self, job: PendingSnapshot) -> None:
        try:
            await job.run()
        finally:
            self.jobs.pop((job.run_id, job.snapshot_id), None)
            self._tasks.pop((job.run_id, job.snapshot_id), None)

    def abort_local(self, run_id: str, snapshot_ids: list[str], reason: str) -> None:
        for sid in snapshot_ids:
            job = self.jobs.get((run_id, sid))
            if job is not None:
                job.abort(reason)

    def wake(self, run_id: str, snapshot_id: str, *, created: bool = False, progress: bool = False) -> None:
        self.watch.changed(run_id, snapshot_id)
        if progress:
            return  # the owner's own writes: news only to the waiting trainers
        job = self.jobs.get((run_id, snapshot_id))
        if job is not None:
            job.wake()
        elif created:
            self.recovery_wanted.set()  # a snapshot this replica may be the owner of

    def wake_all(self) -> None:
        """Events may have been missed (the listener reconnected): everyone reads again."""
        self.watch.changed_all()
        for job in list(self.jobs.values()):
            job.wake()
        self.recovery_wanted.set()

    async def keep_leases(self, ttl_s: float) -> None:
        """Renew the lease of every run with a snapshot running here; a run whose lease is gone,
        or was taken at another epoch, stops its snapshot."""
        for (run_id, _sid), job in list(self.jobs.items()):
            try:
                epoch = await leases.acquire(self.engine, run_id, self.owner, ttl_s)
            except Exception as e:  # not renewed: the next fenced write decides
                log.warning("run %s: renewing the lease failed: %s", run_id, e)
                continue
            if epoch != job.fence.lease_epoch:
                job.lease_lost(Fenced(run_id, "renewing the run's lease", job.fence))

    def running_runs(self) -> frozenset[str]:
        return frozenset(run_id for run_id, _ in self.jobs)

    async def wait_any_ended(self, timeout_s: float) -> None:
        """Until one of the snapshots driven here ends, or ``timeout_s`` passed."""
        waiters = [asyncio.ensure_future(job.done.wait()) for job in list(self.jobs.values())]
        if not waiters:
            return
        try:
            await asyncio.wait(waiters, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def recover_unfinished(runner: SnapshotRunner, lease_ttl_s: float) -> list[str]:
    """On start (and periodically): keep the leases of runs with a snapshot running here; start
    requested snapshots this coordinator owns; every other non-terminal snapshot it owns, or whose
    owner lost the run's lease, is resumed on Gym and ended ``aborted/coordinator_restart``. Every
    write is fenced by the lease this pass took."""
    engine, owner = runner.engine, runner.owner
    await runner.keep_leases(lease_ttl_s)
    ended = []
    for run_id, sid, snap_owner, cid, phase_name, abort_requested in await repo.unfinished(engine):
        # Looked up per row, after every await: a snapshot this replica started since the pass
        # began is driven here, not an orphan.
        if (run_id, sid) in runner.jobs:
            continue
        epoch = await leases.acquire(engine, run_id, owner, lease_ttl_s)
        if epoch is None or (run_id, sid) in runner.jobs:
            continue  # its owner is alive and will finish it
        fence = Fence(owner, epoch)
        phase = SnapshotPhase(phase_name)
        try:
            if snap_owner != owner:
                await take_over(runner.ctx, run_id, sid, fence, phase)
            if phase is SnapshotPhase.requested:
                runner.start(run_id, sid, epoch)  # nothing happened yet: run it rather than abort it
                continue
            await end_orphan(runner.ctx, run_id, sid, fence, phase, previous_owner=snap_owner,
                             gym_checkpoint_id=cid, abort_requested=abort_requested)
        except Fenced as e:
            metrics.record_fenced_write(metrics.FencedWork.SNAPSHOT)
            log.warning("snapshot %s of run %s: recovery fenced (%s)", sid, run_id, e)
            continue
        ended.append(sid)
    return ended


def _log_crash(task: asyncio.Task[None]) -> None:
    """Retrieve a snapshot task's exception, so none goes unobserved (``PendingSnapshot.run``
    ends every snapshot itself; reaching this means even that failed)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("snapshot task %s ended with an error", task.get_name(), exc_info=task.exception())
