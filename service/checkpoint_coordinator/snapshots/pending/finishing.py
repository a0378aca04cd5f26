"""After the cut: Gym resumed beside the phase write, the snapshot published and ended.

A mixin of :class:`~.machine.PendingSnapshot`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...domain.snapshot_state import SnapshotPhase, SnapshotReason
from ...gym.results import CommitResult
from ...observability import metrics
from .support import all_ended, log, until_database_answers

if TYPE_CHECKING:
    from .machine import PendingSnapshot as _Base
else:
    _Base = object

P = SnapshotPhase


class Finishing(_Base):
    async def _after_cut(self) -> None:
        """resume -> publish -> published, shielded from cancellation: nothing turns the
        snapshot into an abort after its cut, a shutdown waits for this, and a database outage
        only delays its writes."""
        save, commit = self.save, self._commit_result
        assert save is not None and commit is not None
        drained, unknown = self._drained_count, self._counts["unknown_instances"]
        # Gym is resumed beside the phase write, not after it: recovery resumes Gym from either
        # phase, and a resume of an ended checkpoint changes nothing in Gym (docs/gym-protocol.md#resume). A
        # refused write is raised once the resume is answered.
        _, result = await all_ended(
            until_database_answers(lambda: self._move(P.resume), f"snapshot {self.snapshot_id}: resume phase", self.clock), save.finish()
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
            lambda: self._write(P.publish, lambda: self.store.publish(self.run_id, self.snapshot_id, self.fence, keep_gate=self.stop)),
            f"snapshot {self.snapshot_id}: publishing", self.clock,
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

        return await until_database_answers(
            lambda: self.store.saved_episodes_ended(self.run_id, self.snapshot_id, saved),
            f"snapshot {self.snapshot_id}: checking the lapsed instances' episodes", self.clock,
        )

