"""The save's steps run in order for a caller without a ledger: the conformance suite.

The coordinator sequences :class:`GymSave`'s steps itself (its pending snapshot writes a phase
between each); these tests drive the same steps with a drain waiter and a capture step, and can
abort before the cut as a committed train step would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from checkpoint_coordinator.gym.errors import GymControlError
from checkpoint_coordinator.gym.models import Episode
from checkpoint_coordinator.gym.results import SaveResult
from checkpoint_coordinator.gym.save import GymSave, GymSaveAborted

DrainHook = Callable[[dict[str, set[Episode]]], Awaitable[None]]
"""Waits until every pending ``/run`` resolved; discards from its argument those that did."""

CaptureHook = Callable[[dict[str, Any]], Awaitable[None]]
"""Takes the data-plane capture; receives the complete Gym manifest."""


class SequencedGymSave(GymSave):
    """prepare, commit, drain (``drain_hook``), manifest, capture (``capture_hook``), cut, finish;
    any failure before the cut resumes everyone and re-raises it; :meth:`abort` before the cut
    resumes Gym and makes :meth:`run` raise :class:`GymSaveAborted`."""

    def __init__(self, *args: Any, drain_hook: DrainHook | None = None, capture_hook: CaptureHook | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drain_hook = drain_hook
        self.capture_hook = capture_hook
        self._aborted = asyncio.Event()
        self._abort_reason = ""
        self._started = False

    def abort(self, reason: str = "train_step_committed") -> bool:
        if self.cut_done:
            return False
        self._abort_reason = reason
        self._aborted.set()
        return True

    async def run(self) -> SaveResult:
        if self._started:
            raise RuntimeError("a GymSave runs once; make a new one (with a new checkpoint id)")
        self._started = True
        self._run_started = self.client.clock.time()
        work = asyncio.create_task(self._steps(), name=f"gym-save-{self.checkpoint_id}")
        aborted = asyncio.create_task(self._aborted.wait())
        try:
            await asyncio.wait({work, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if work.done() or self.cut_done:
                return await work
            # A prepare still waiting on a participant replies idle once resumed.
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            report = await self.resume_before_cut()
            raise GymSaveAborted(self._abort_reason, report.failure if report else None)
        except asyncio.CancelledError:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
            if not self.cut_done:
                await asyncio.shield(self.resume_before_cut())
            raise
        finally:
            aborted.cancel()
            self.timings.setdefault("total", self.client.clock.time() - self._run_started)

    async def _steps(self) -> SaveResult:
        await self.prepare()
        try:
            await self.commit()
            pending = self.pending()
            await self.drain(self.drain_hook(pending) if self.drain_hook and pending else None, pending)
            manifest = await self.manifest()
            if self.capture_hook is not None:
                await self.within_lease(self.capture_hook(manifest))
            self.cut()
        except asyncio.CancelledError:
            await self._stop_renewer(settle=False)  # run() resumes everyone
            raise
        except BaseException as exc:
            report = await self.resume_before_cut()
            failure = report.failure if report is not None else None
            if isinstance(exc, GymControlError):
                if failure is not None:
                    exc.resume_failure = failure
                exc.extra.setdefault("timings", dict(self.timings))
                exc.extra.setdefault("gym_parked_seconds", self.gym_parked_seconds)
            elif failure is not None:
                exc.add_note(f"Gym resume after this failure also failed: {failure}")
                exc.resume_failure = failure  # type: ignore[attr-defined]
            raise
        return await self.finish()
