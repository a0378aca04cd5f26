"""The Gym side of the save choreography (spec 5.0), with the caller's steps as hooks.

prepare -> renew -> commit -> drain (caller) -> Gym manifest -> capture (caller) -> resume.
Resume comes before the caller publishes, so new rollouts wait only for the Gym commit and the
capture. Any failure before the cut resumes everyone and re-raises the original failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from .client import GymControlClient, Topology
from .errors import INSTANCE_WIDE, FailureClass, GymControlError, server_failure
from .lease import LeaseRenewer
from .manifest import build_gym_manifest, write_gym_manifest
from .models import Episode, instance_checkpoint_dir
from .policy import compute_scope
from .results import CommitResult, ResumeReport, SaveResult

__all__ = ["CaptureHook", "DrainHook", "GymSave", "GymSaveAborted"]

log = logging.getLogger("checkpoint_coordinator.gym")

DrainHook = Callable[[dict[str, set[Episode]]], Awaitable[None]]
"""Waits until the caller has resolved every pending ``/run`` (any reply, or a transport
failure). It receives a mutable copy of the pending episodes per instance and may discard those
that resolve, so that a drain timeout reports only the ones still pending."""

CaptureHook = Callable[[dict[str, Any]], Awaitable[None]]
"""Takes the caller's data-plane capture; receives the complete Gym manifest."""

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


class GymSave:
    """One save attempt. ``await run()`` once; ``abort()`` may be called from another task."""

    def __init__(
        self,
        client: GymControlClient,
        topology: Topology,
        *,
        snapshot_dir: str,
        candidates: Mapping[str, Iterable[Episode]],
        drain_hook: DrainHook,
        capture_hook: CaptureHook,
        drain_timeout_s: float,
        checkpoint_id: str | None = None,
        snapshot_id: str | int | None = None,
        before_prepare_hook: Callable[[], Awaitable[None]] | None = None,
        candidates_hook: Callable[[], Awaitable[Mapping[str, Iterable[Episode]]]] | None = None,
        stop: bool = False,
        write_manifest_file: bool = False,
    ) -> None:
        self.client = client
        self.topology = topology
        self.snapshot_dir = snapshot_dir
        self._set_candidates(candidates)
        # When given, awaited once prepare answered (the candidates are first needed for the
        # commit scopes) and its answer replaces ``candidates``: the caller's query then runs
        # while the prepare calls are in flight.
        self.candidates_hook = candidates_hook
        self.drain_hook = drain_hook
        self.capture_hook = capture_hook
        self.drain_timeout_s = drain_timeout_s
        self.checkpoint_id = checkpoint_id or client.new_checkpoint_id(snapshot_id)
        self.before_prepare_hook = before_prepare_hook
        self.stop = stop
        self.write_manifest_file = write_manifest_file
        self.timings: dict[str, float] = {}
        self.warnings: list[str] = []
        self.gym_parked_seconds: float | None = None
        self._cut_done = False
        self._parked_since: float | None = None
        self._aborted = asyncio.Event()
        self._abort_reason = ""
        self._started = False
        self._run_started = 0.0

    def _set_candidates(self, candidates: Mapping[str, Iterable[Episode]]) -> None:
        unknown = set(candidates) - set(self.topology)
        if unknown:
            raise ValueError(f"candidates name instances outside the topology: {sorted(unknown)}")
        self.candidates = {iid: sorted(set(candidates.get(iid, ()))) for iid in self.topology}

    @property
    def cut_done(self) -> bool:
        return self._cut_done

    def abort(self, reason: str = "train_step_committed") -> bool:
        """Abort before the cut: the Gym phase is resumed at once and ``run`` raises
        :class:`GymSaveAborted`. Returns False when the cut has already happened."""
        if self._cut_done:
            return False
        self._abort_reason = reason
        self._aborted.set()
        return True

    async def run(self) -> SaveResult:
        if self._started:
            raise RuntimeError("a GymSave runs once; make a new one (with a new checkpoint id)")
        self._started = True
        self._run_started = started = self.client.clock.time()
        work = asyncio.create_task(self._choreography(), name=f"gym-save-{self.checkpoint_id}")
        aborted = asyncio.create_task(self._aborted.wait())
        try:
            await asyncio.wait({work, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if work.done() or self._cut_done:
                return await work
            # Abort before the cut: stop whatever step runs, then resume, since resume is also
            # the abort. A prepare still waiting on a participant then replies idle.
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            report = await self._resume_before_cut() if self._parked_since is not None else None
            raise GymSaveAborted(self._abort_reason, report.failure if report else None)
        except asyncio.CancelledError:
            # The caller's own task was cancelled: treat it as an abort so Gym is not left parked.
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
            if self._parked_since is not None and not self._cut_done:
                await asyncio.shield(self._resume_before_cut())
            raise
        finally:
            aborted.cancel()
            self.timings.setdefault("total", self.client.clock.time() - started)

    async def _choreography(self) -> SaveResult:
        clock = self.client.clock
        cid = self.checkpoint_id
        mark = clock.time()

        def lap(name: str) -> None:
            nonlocal mark
            now = clock.time()
            self.timings[name] = now - mark
            mark = now

        if self.before_prepare_hook is not None:
            # Queued retires and forgets go first: Gym refuses them once a checkpoint is open.
            await self.before_prepare_hook()
        lap("gate")
        self._parked_since = clock.time()
        try:
            prepared = await self.client.prepare(cid, self.topology)
        except GymControlError as exc:
            # prepare already resumed everyone; its failure carries that resume's outcome.
            self._note_parked(clock.time())
            exc.extra.setdefault("timings", dict(self.timings))
            raise
        lap("prepare")
        renewer = LeaseRenewer(self.client, cid, self.topology, prepare=prepared)
        try:
            await renewer.start()
            renewer.check()
            if self.candidates_hook is not None:
                self._set_candidates(await _race(self.candidates_hook(), renewer))
                renewer.check()
            lap("renew")
            scopes: dict[str, list[Episode]] = {}
            restarted: dict[str, list[Episode]] = {}
            for iid in self.topology:
                scopes[iid], restarted[iid] = compute_scope(
                    iid, self.candidates[iid], prepared.restarts.get(iid, frozenset())
                )
            commit = await _race(
                self.client.commit(
                    cid,
                    self.topology,
                    {iid: instance_checkpoint_dir(self.snapshot_dir, iid) for iid in self.topology},
                    scopes,
                    stop=self.stop,
                    restarts=restarted,
                ),
                renewer,
            )
            renewer.check()
            lap("commit")
            await self._drain(commit, renewer)
            renewer.check()
            lap("drain")
            manifest = build_gym_manifest(cid, commit)
            if self.write_manifest_file:
                await asyncio.to_thread(write_gym_manifest, self.snapshot_dir, manifest)
            lap("manifest")
            await _race(self.capture_hook(manifest), renewer)
            # A lease lost during the capture means Gym moved past the state just captured.
            renewer.check()
            self._cut_done = True
            lap("capture")
        except asyncio.CancelledError:
            # Aborted by the caller: run() resumes everyone.
            await renewer.stop()
            raise
        except BaseException as exc:
            await renewer.stop()
            report = await self._resume_before_cut()
            if isinstance(exc, GymControlError):
                if report.failure is not None:
                    exc.resume_failure = report.failure
                exc.extra.setdefault("timings", dict(self.timings))
                exc.extra.setdefault("gym_parked_seconds", self.gym_parked_seconds)
            elif report.failure is not None:
                exc.add_note(f"Gym resume after this failure also failed: {report.failure}")
                exc.resume_failure = report.failure  # type: ignore[attr-defined]
            raise
        await renewer.stop()
        self.warnings.extend(renewer.warnings)
        resume: ResumeReport | None = None
        to_resume = self.topology
        if self.stop:
            # A stopping snapshot leaves Gym parked, except on instances that refused `stop`
            # (section 13 P4): those resume as usual.
            parked = [iid for iid, ic in commit.instances.items() if ic.stop_supported]
            self.client.release(cid, parked)
            to_resume = {iid: inst for iid, inst in self.topology.items() if iid not in parked}
            if to_resume:
                self.warnings.append(
                    "stop not honoured by " + ", ".join(sorted(to_resume)) + ": those instances were resumed"
                )
        if to_resume:
            # After the cut a resume failure is reported, not raised: the snapshot is kept and
            # the leases reopen Gym.
            resume = await self.client.resume(cid, to_resume, raise_on_failure=False)
            self._note_parked(resume.answered_at)
            lap("resume")
        self.timings["total"] = clock.time() - self._run_started
        return SaveResult(
            checkpoint_id=cid,
            manifest=manifest,
            commit=commit,
            restarts={iid: frozenset(ic.restarts) for iid, ic in commit.instances.items()},
            resume=resume,
            timings=dict(self.timings),
            gym_parked_seconds=self.gym_parked_seconds,
            warnings=tuple(self.warnings),
        )

    async def _drain(self, commit: CommitResult, renewer: LeaseRenewer) -> None:
        pending = {iid: eps for iid, eps in commit.pending().items() if eps}
        if not pending:
            return
        hook = asyncio.ensure_future(self.drain_hook(pending))
        lost = asyncio.ensure_future(renewer.lost.wait())
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
            return
        renewer.check()
        remaining = {iid: sorted(eps) for iid, eps in pending.items() if eps}
        count = sum(len(eps) for eps in remaining.values())
        samples = sorted(ep.capture_key for eps in remaining.values() for ep in eps)[:SAMPLE]
        raise GymControlError(
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
            extra={"pending_count": count, "pending_samples": samples},
        )

    async def _resume_before_cut(self) -> ResumeReport:
        report = await self.client.resume(self.checkpoint_id, self.topology, raise_on_failure=False)
        self._note_parked(report.answered_at)
        return report

    def _note_parked(self, answered_at: float) -> None:
        if self._parked_since is not None:
            self.gym_parked_seconds = max(0.0, answered_at - self._parked_since)


async def _race(aw: Awaitable[Any], renewer: LeaseRenewer) -> Any:
    """Await ``aw`` unless the lease is lost first; then cancel it and raise the loss."""
    task = asyncio.ensure_future(aw)
    lost = asyncio.ensure_future(renewer.lost.wait())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    renewer.check()
    raise RuntimeError("lease lost without a recorded failure")  # unreachable: lost implies failure
