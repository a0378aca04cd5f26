"""The Gym side of the save choreography (docs/gym-protocol.md#the-save-choreography), as steps a
caller sequences.

prepare -> (leases renewed) -> commit -> drain -> Gym manifest -> cut -> finish (resume, or leave
parked when stopping). Before the cut, ``resume_before_cut`` is the abort; ``abandon`` stops
driving the checkpoint without a Gym call (its owner was fenced: another coordinator drives it).

The pending snapshot (``snapshots/pending/``) calls the steps one by one, with its own phase
writes between them; the save's own state (:class:`GymSaveState`) says only where Gym stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from ..domain.vocabulary import GymOperation
from ..domain.vocabulary import StrEnum
from .client import GymControlClient, Topology
from .errors import BLOCKED_EPISODES, INSTANCE_WIDE, FailureClass, GymControlError, server_failure
from .files import make_dirs
from .lease import LeaseRenewer
from .manifest import build_gym_manifest, encode_gym_manifest_of, write_gym_manifest
from .models import Episode, instance_checkpoint_dir
from .policy import compute_scope
from .races import unless_set
from .results import CommitResult, InstanceCommit, ResumeReport, SaveResult

__all__ = ["GymSave", "GymSaveAborted", "GymSaveState"]

log = logging.getLogger("checkpoint_coordinator.gym")

SAMPLE = 10


class GymSaveAborted(Exception):
    """The caller aborted the save (for example, a train step committed first). Plain data."""

    def __init__(self, reason: str, resume_failure: GymControlError | None = None) -> None:
        super().__init__(f"Gym save aborted: {reason}")
        self.reason = reason
        self.resume_failure = resume_failure

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "resume_failure": self.resume_failure.to_dict() if self.resume_failure else None,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        return (GymSaveAborted, (self.reason, self.resume_failure))


class GymSaveState(StrEnum):
    """Where Gym stands in one save: nothing sent yet; parked (a prepare was sent); cut (the
    caller's capture taken, Gym still parked); ended after or before the cut (resumed, released,
    or abandoned to another coordinator)."""

    new = "new"
    parked = "parked"
    cut = "cut"
    ended_after_cut = "ended_after_cut"
    ended_before_cut = "ended_before_cut"


class GymSave:
    """One save attempt on Gym. Steps: :meth:`prepare`, :meth:`commit`, :meth:`drain`,
    :meth:`manifest`, :meth:`cut`, :meth:`finish`; or :meth:`resume_before_cut` /
    :meth:`abandon` to end it before the cut."""

    def __init__(
        self,
        client: GymControlClient,
        topology: Topology,
        *,
        snapshot_dir: str,
        drain_timeout_s: float,
        candidates: Mapping[str, Iterable[Episode]] | None = None,
        checkpoint_id: str | None = None,
        snapshot_id: str | int | None = None,
        stop: bool = False,
        write_manifest_file: bool = False,
    ) -> None:
        self.client = client
        self.topology = topology
        self.snapshot_dir = snapshot_dir
        self.candidates = self._checked(candidates or {})
        self.drain_timeout_s = drain_timeout_s
        self.checkpoint_id = checkpoint_id or client.new_checkpoint_id(snapshot_id)
        self.stop = stop
        self.write_manifest_file = write_manifest_file
        self.timings: dict[str, float] = {}
        self.warnings: list[str] = []
        self.gym_parked_seconds: float | None = None
        self.commit_result: CommitResult | None = None
        self.manifest_json = ""
        self._renewer: LeaseRenewer | None = None
        self._prepared: Any = None
        self._plan: tuple[dict[str, list[Episode]], dict[str, list[Episode]]] | None = None
        self._planned_for: dict[str, frozenset[Episode]] | None = None
        self._dirs_made: asyncio.Future[None] | None = None
        self.state = GymSaveState.new
        self._parked_since: float | None = None
        self._mark = 0.0
        self._run_started = 0.0

    def _checked(self, candidates: Mapping[str, Iterable[Episode]]) -> dict[str, list[Episode]]:
        unknown = set(candidates) - set(self.topology)
        if unknown:
            raise ValueError(f"candidates name instances outside the topology: {sorted(unknown)}")
        return {iid: sorted(set(candidates.get(iid, ()))) for iid in self.topology}

    @property
    def cut_done(self) -> bool:
        return self.state in (GymSaveState.cut, GymSaveState.ended_after_cut)

    @property
    def parked(self) -> bool:
        """Whether a prepare was sent and nothing has resumed (or released) Gym since."""
        return self.state in (GymSaveState.parked, GymSaveState.cut)

    def _ended(self) -> None:
        self.state = GymSaveState.ended_after_cut if self.cut_done else GymSaveState.ended_before_cut

    def _lap(self, name: str) -> None:
        now = self.client.clock.time()
        self.timings[name] = now - self._mark
        self._mark = now

    # --- the steps ------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Park Gym (prepare every instance) and start renewing its leases. A failure raised here
        has already resumed everyone (prepare's own failure path)."""
        clock = self.client.clock
        self._run_started = self._run_started or clock.time()
        self._mark = clock.time()
        self._parked_since = clock.time()
        self.state = GymSaveState.parked
        try:
            prepared = await self.client.prepare(self.checkpoint_id, self.topology)
        except GymControlError as exc:
            self._ended()
            self._note_parked(clock.time())
            exc.extra.setdefault("timings", dict(self.timings))
            raise
        self._lap(GymOperation.prepare)
        # Started by the commit (``_start_renewing``): a commit sets every lease as a renew does.
        self._renewer = LeaseRenewer(self.client, self.checkpoint_id, self.topology, prepare=prepared)
        self._prepared = prepared
        # The instances' directories are made now, in a thread beside the caller's work before
        # the commit, rather than by the commit while Gym waits for it.
        self._dirs_made = asyncio.ensure_future(asyncio.to_thread(make_dirs, self._checkpoint_dirs().values()))
        self._dirs_made.add_done_callback(_retrieved)

    def offer_candidates(self, candidates: Mapping[str, Iterable[Episode]]) -> None:
        """Replace the constructor's candidates (the caller's query may answer while prepare is
        in flight: they are checked and sorted then, not while Gym waits for its commit)."""
        self.candidates = self._checked(candidates)
        self._plan = self._planned_for = None

    async def commit(
        self, candidates: Mapping[str, Iterable[Episode]] | None = None, *, on_instance: Callable[[str, InstanceCommit], None] | None = None
    ) -> CommitResult:
        """Commit every instance; ``candidates`` (when given) replace the offered ones.
        ``on_instance``: see :meth:`GymControlClient.commit`."""
        if candidates is not None:
            self.offer_candidates(candidates)
        scopes, restarted = self.plan_commit()
        if self._dirs_made is not None:
            await self._dirs_made

        def validated(iid: str, ic: InstanceCommit) -> None:
            # The first renew round goes out once Gym answers the commit, not between prepare
            # and commit: its calls would hold the event loop while the commit is being sent,
            # and the commit itself renews every lease (docs/gym-protocol.md#leases-and-renewals).
            # The round still comes early enough to check the lease grace Gym was configured with.
            assert self._renewer is not None
            self._renewer.committed(iid)
            self._start_renewing()
            if on_instance is not None:
                on_instance(iid, ic)

        self.commit_result = await self.within_lease(
            self.client.commit(
                self.checkpoint_id,
                self.topology,
                self._checkpoint_dirs(),
                scopes,
                stop=self.stop,
                restarts=restarted,
                on_instance=validated,
                make_directories=self._dirs_made is None,
            )
        )
        for iid in self.commit_result.instances:  # those validated only at a second try
            self._renewer.committed(iid)
        self._start_renewing()  # when no instance validated at its first try
        self._lap(GymOperation.commit)
        return self.commit_result

    def plan_commit(self) -> tuple[dict[str, list[Episode]], dict[str, list[Episode]]]:
        """Each instance's commit scope and restarted candidates, from the offered candidates and
        prepare's restarts (none yet when prepare has not answered); :meth:`commit` uses them. A
        caller may compute them ahead, while prepare is in flight: they are computed again only
        if prepare's restarts differ from those they were computed with (:meth:`plan_is_current`)."""
        restarts = self._prepared_restarts()
        if self._plan is not None and self._planned_for == restarts:
            return self._plan
        scopes: dict[str, list[Episode]] = {}
        restarted: dict[str, list[Episode]] = {}
        for iid in self.topology:
            scopes[iid], restarted[iid] = compute_scope(iid, self.candidates[iid], restarts[iid])
        self._plan, self._planned_for = (scopes, restarted), restarts
        return self._plan

    def plan_is_current(self) -> bool:
        """Whether :meth:`plan_commit` would answer without computing (prepare's restarts known)."""
        return self._prepared is not None and self._plan is not None and self._planned_for == self._prepared_restarts()

    def _prepared_restarts(self) -> dict[str, frozenset[Episode]]:
        known = self._prepared.restarts if self._prepared is not None else {}
        return {iid: frozenset(known.get(iid, ())) for iid in self.topology}

    def _checkpoint_dirs(self) -> dict[str, str]:
        return {iid: instance_checkpoint_dir(self.snapshot_dir, iid) for iid in self.topology}

    def _start_renewing(self) -> None:
        assert self._renewer is not None
        if not self._renewer.started:
            self._renewer.start_soon()

    def pending(self) -> dict[str, set[Episode]]:
        """The committed candidates whose ``/run`` reply was on the wire, per instance (a copy)."""
        assert self.commit_result is not None
        return {iid: set(eps) for iid, eps in self.commit_result.pending().items() if eps}

    async def drain(self, resolved: Awaitable[None] | None, pending: dict[str, set[Episode]]) -> None:
        """Wait for ``resolved`` (the caller's wait until every pending reply was reported), at most
        the drain timeout and while the leases hold. The caller discards from ``pending`` what
        resolved, so that a timeout names only what is still pending. Nothing pending: no wait."""
        assert self._renewer is not None
        if resolved is None or not any(pending.values()):
            self._lap("drain")
            return
        hook = asyncio.ensure_future(resolved)
        lost = asyncio.ensure_future(self._renewer.lost.wait())
        timer = asyncio.ensure_future(self.client.clock.sleep(self.drain_timeout_s))
        try:
            await asyncio.wait({hook, lost, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (lost, timer):
                task.cancel()
            if not hook.done():
                hook.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await hook
        if hook.done() and not hook.cancelled():
            hook.result()
            self._renewer.check()
            self._lap("drain")
            return
        self._renewer.check()
        raise self._drain_timeout({iid: sorted(eps) for iid, eps in pending.items() if eps})

    async def manifest(self) -> dict[str, Any]:
        """The Gym manifest of the commit as a plain dict (written beside the snapshot when
        asked to)."""
        self.build_manifest()
        await self.write_manifest_file_now()
        assert self.commit_result is not None
        return build_gym_manifest(self.checkpoint_id, self.commit_result)

    def build_manifest(self) -> None:
        """The Gym manifest of the commit in its text form, ``manifest_json``."""
        assert self.commit_result is not None
        self.manifest_json = encode_gym_manifest_of(self.checkpoint_id, self.commit_result)
        self._lap("manifest")

    async def write_manifest_file_now(self) -> None:
        """Write ``manifest_json`` beside the snapshot (when asked to), in a thread. The caller
        may run it beside other work; it must end before the cut. No plain dict is built: in the
        coordinator's process that thread would hold the GIL while the barrier is answered."""
        assert self.manifest_json
        if self.write_manifest_file:
            await asyncio.to_thread(write_gym_manifest, self.snapshot_dir, encoded=self.manifest_json)

    async def within_lease(self, aw: Awaitable[Any]) -> Any:
        """Await ``aw`` unless a Gym lease is lost first; then cancel it and raise the loss."""
        assert self._renewer is not None
        result = await _race(aw, self._renewer)
        self._renewer.check()
        return result

    def cut(self) -> None:
        """The caller's capture is taken. A lease lost before this means Gym moved past the state
        just captured: raised, and the snapshot fails."""
        assert self._renewer is not None
        self._renewer.check()
        self.state = GymSaveState.cut
        self._lap("capture")

    async def finish(self) -> SaveResult:
        """After the cut: resume Gym, or, when stopping, leave parked every instance that honoured
        ``stop`` (docs/gym-protocol.md#stop-and-park; one that refused it, or whose lease lapsed, is
        resumed as usual).
        A resume failure is reported, not raised: the snapshot is kept and the leases reopen Gym.
        Every answer of the renew round in flight is in before this returns."""
        assert self.state is GymSaveState.cut and self.commit_result is not None and self._renewer is not None
        commit = self.commit_result
        resume: ResumeReport | None = None
        if self.stop:
            # Which instance stays parked depends on its lease: the round in flight and one more
            # are answered first (a stopping save's park ends with the process anyway).
            await self._stop_renewer(last_round=True)
            to_resume = self._release_stopped(commit)
            self._ended()
            if to_resume:
                resume = await self._resume_after_cut(to_resume)
        else:
            # Resume at once; the renew round still in flight is waited for beside it, and the
            # lapses it reports judged by the resume's answers (``LeaseRenewer.confirm_late``).
            self._renewer.halt()
            self._ended()
            resume, _ = await asyncio.gather(self._resume_after_cut(self.topology), self._renewer.settle())
            self._renewer.confirm_late(resume.idempotent)
            await self._stop_renewer()  # collects its warnings
        self.timings["total"] = self.client.clock.time() - self._run_started
        return SaveResult(
            checkpoint_id=self.checkpoint_id,
            commit=commit,
            restarts={iid: frozenset(ic.restarts) for iid, ic in commit.instances.items()},
            resume=resume,
            timings=dict(self.timings),
            gym_parked_seconds=self.gym_parked_seconds,
            warnings=tuple(self.warnings),
            lapsed={iid: tuple(sorted(servers)) for iid, servers in sorted(self.lapsed.items())},
        )

    def _release_stopped(self, commit: CommitResult) -> Topology:
        """A stopping save: release the instances that stay parked; the others, to resume."""
        lapsed = self.lapsed
        parked = [iid for iid, ic in commit.instances.items() if ic.stop_supported and iid not in lapsed]
        self.client.release(self.checkpoint_id, parked)
        to_resume = {iid: inst for iid, inst in self.topology.items() if iid not in parked}
        refused = sorted(iid for iid in to_resume if iid not in lapsed)
        if refused:
            self.warnings.append("stop not honoured by " + ", ".join(refused) + ": those instances were resumed")
        if lapsed:
            self.warnings.append("stop not honoured by " + ", ".join(sorted(lapsed)) + ": their lease lapsed and Gym resumed them on its own")
        return to_resume

    async def _resume_after_cut(self, topology: Topology) -> ResumeReport:
        report = await self.client.resume(self.checkpoint_id, topology, raise_on_failure=False)
        self._note_parked(report.answered_at)
        self._lap(GymOperation.resume)
        return report

    @property
    def lapsed(self) -> dict[str, dict[str, str]]:
        """The participants whose lease lapsed after their instance committed (Gym resumed them
        on its own), per instance: what showed it."""
        return self._renewer.lapsed if self._renewer is not None else {}

    async def resume_before_cut(self) -> ResumeReport | None:
        """The abort: resume every instance (None when Gym was never parked, or is no longer)."""
        await self._stop_renewer(settle=False)
        if not self.parked:
            return None
        self._ended()
        report = await self.client.resume(self.checkpoint_id, self.topology, raise_on_failure=False)
        self._note_parked(report.answered_at)
        return report

    async def abandon(self) -> None:
        """Stop driving the checkpoint without any Gym call (another coordinator now does)."""
        await self._stop_renewer(settle=False)
        self._ended()

    async def _stop_renewer(self, *, settle: bool = True, last_round: bool = False) -> None:
        if self._renewer is not None:
            await self._renewer.stop(settle=settle, last_round=last_round)
            self.warnings.extend(w for w in self._renewer.warnings if w not in self.warnings)

    def _drain_timeout(self, remaining: dict[str, list[Episode]]) -> GymControlError:
        count = sum(len(eps) for eps in remaining.values())
        samples = sorted(ep.capture_key for eps in remaining.values() for ep in eps)[:SAMPLE]
        return GymControlError(
            FailureClass.DRAIN_TIMEOUT,
            f"drain of {self.checkpoint_id} timed out after {self.drain_timeout_s:g}s: "
            f"{count} /run reply(ies) still pending, e.g. {', '.join(samples)}",
            instances={
                iid: {
                    INSTANCE_WIDE: server_failure(
                        FailureClass.DRAIN_TIMEOUT,
                        "drain",
                        f"{len(eps)} pending",
                        pending_count=len(eps),
                        samples=[ep.capture_key for ep in eps[:SAMPLE]],
                    )
                }
                for iid, eps in remaining.items()
            },
            extra={
                "pending_count": count, "pending_samples": samples,
                BLOCKED_EPISODES: {iid: [ep.capture_key for ep in eps] for iid, eps in remaining.items() if eps},
            },
        )

    def _note_parked(self, answered_at: float) -> None:
        if self._parked_since is not None:
            self.gym_parked_seconds = max(0.0, answered_at - self._parked_since)


async def _race(aw: Awaitable[Any], renewer: LeaseRenewer) -> Any:
    """Await ``aw`` unless the lease is lost first; then cancel it and raise the loss. Cancelled
    itself, it cancels ``aw`` too: nothing it started outlives it."""
    task = await unless_set(aw, renewer.lost)
    if not task.cancelled():
        return task.result()
    renewer.check()
    if not renewer.lost.is_set():
        raise asyncio.CancelledError()  # ``aw`` was cancelled on its own, as before
    raise RuntimeError("lease lost without a recorded failure")  # unreachable: lost implies failure


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a side task's failure as seen: the step that awaits it raises it (or it was abandoned)."""
    if not task.cancelled():
        task.exception()
