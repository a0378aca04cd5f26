"""The pending snapshot's work beside its Gym calls: the pre-cut copy of the ledger, each
instance's Gym manifest entry, the candidates' query, and the waits on the trainer's reports.

A mixin of :class:`~.machine.PendingSnapshot`: every task started here is cancelled and awaited
before the snapshot ends (``_drop_side_work``), so none outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from ...domain.snapshot_state import SnapshotPhase, SnapshotReason
from ...gym.manifest import encode_instance_entry
from ...gym.models import Episode, Topology
from ...gym.races import first_of
from ...gym.results import CommitResult, InstanceCommit
from ...gym.save import GymSave
from ...ledger.db import JsonText
from ...ledger.leases import Fenced
from .. import store as repo
from .support import (
    DRAIN_POLL_S,
    SnapshotFailed,
    database_away,
    log,
    wait_event,
)

# How long the end of a snapshot waits for its Gym manifest file still being written.
MANIFEST_WRITE_GRACE_S = 5.0

if TYPE_CHECKING:
    from .machine import PendingSnapshot as _Base
else:
    _Base = object

P = SnapshotPhase


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (a no-op once it ended) and wait for it to end."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class SideWork(_Base):
    # --- the trainer's reports -------------------------------------------------------------------

    async def _captured(self, timeout_s: float) -> None:
        """Until the trainer reported its capture (after its barrier took the cut)."""
        deadline = self.clock.time() + timeout_s
        self._wake.set()  # read once now: the barrier may have come before this phase was written
        while True:
            p = self.progress
            if p is not None and p.phase == P.data_plane and p.captured:
                return
            left = deadline - self.clock.time()
            if left <= 0:
                awaiting = p.awaiting if p is not None and p.phase == P.data_plane else "barrier"
                raise SnapshotFailed(SnapshotReason.data_plane_timeout, {"awaiting": awaiting, "timeout_s": timeout_s})
            self._progressed.clear()
            await wait_event(self._progressed, left, self.clock)

    async def _drained(self, pending: dict[str, set[Episode]]) -> None:
        """Until the trainer reported every pending attempt (discarding each one as it resolves)."""
        while any(pending.values()):
            keys = [(e.rollout_id, e.attempt) for eps in pending.values() for e in eps]
            try:
                still = await self.store.still_pending(self.run_id, keys)
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
                await self.clock.sleep(DRAIN_POLL_S)

    async def _load_candidates(self, save: GymSave, topology: Topology) -> dict[str, Any]:
        """The candidates, handed to ``save`` for its commit; returns their counts."""
        found = await self.store.candidates(self.run_id)
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
        await self.store.store_gym_entry(self.run_id, self.snapshot_id, self.fence, self._gym_entry(instance_id, ic))

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

    # --- the pre-cut ----------------------------------------------------------------------------

    async def _take_pre_cut(self) -> None:
        t = self.clock.time()
        try:
            taken = await self.store.pre_cut(self.run_id, self.snapshot_id, self.fence)
        except Exception as e:  # the barrier then copies the whole run: slower, not wrong
            log.warning("snapshot %s of run %s: pre-cut failed (%s: %s); the barrier will copy the whole ledger",
                        self.snapshot_id, self.run_id, type(e).__name__, str(e)[:500])
            return
        if taken is not None:
            self._pre_cut_keys, self.pre_cut_keys_json = taken.keys, taken.keys_json
            self.timings["pre_cut"] = self.clock.time() - t
            self._key_rows = taken.key_rows
            if self._key_rows is not None:
                self._key_rows.add_done_callback(self._key_rows_written)

    def _key_rows_written(self, task: asyncio.Future[int]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:  # a barrier that needs them copies the whole run instead
            log.warning("snapshot %s of run %s: writing the pre-cut's key rows failed: %s", self.snapshot_id, self.run_id, task.exception())

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

    # --- the end of everything started here --------------------------------------------------------

    async def _drop_entry_writes(self) -> None:
        """Cancel and wait for the entry writes still in flight, before the snapshot ends (its
        end deletes the entries: none may land after it)."""
        for task in self._close_entries():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _drop_side_work(self) -> None:
        """Every side task still running is cancelled and awaited: the snapshot is over for this
        replica (a reader after its end needs none of it)."""
        await self._drop_entry_writes()
        for task in (self._key_rows, self._pre_cut, self._candidates, self._deadline_task):
            await cancel_and_wait(task)
        mf = self._manifest_file
        if mf is not None:
            # A thread, which cannot be cancelled: waited for a moment only (a stalled shared
            # filesystem must not hold the snapshot's end or a shutdown); its failure is logged
            # when it ends.
            if not mf.done():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await first_of(asyncio.shield(mf), self.clock.sleep(MANIFEST_WRITE_GRACE_S))
            mf.add_done_callback(self._manifest_file_ended)

    def _manifest_file_ended(self, task: asyncio.Future[None]) -> None:
        if not self.cut_taken and not task.cancelled() and task.exception() is not None:
            log.warning("snapshot %s of run %s: writing the Gym manifest file failed: %s", self.snapshot_id, self.run_id, task.exception())
