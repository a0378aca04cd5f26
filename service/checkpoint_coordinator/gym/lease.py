"""Keeping a prepared checkpoint's leases alive until resume
(docs/gym-protocol.md#leases-and-renewals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..domain.vocabulary import GymOperation
from .errors import FailureClass, GymControlError, ServerFailure, server_failure
from .results import PrepareResult

if TYPE_CHECKING:
    from .client import GymControlClient, Topology

__all__ = ["SETTLE_S", "LeaseRenewer"]

log = logging.getLogger("checkpoint_coordinator.gym")


# How long the end of a save waits for a renew round still in flight, so that its answers are
# seen (a lapse it reports is told to the operator). Bounded: a participant that answers nothing
# delays the end no more than this.
SETTLE_S = 2.0


class LeaseRenewer:
    """Renews once when started, then every ``max(0.01, min(T/3, 10))`` s until stopped.

    Nobody waits for the first round: a save starts it once the commit that follows prepare is
    answered (that commit set every participant's lease as a renew does), so the round
    checks the grace and starts the cadence; waiting for it would only keep Gym parked longer.
    Its answers are never lost: :meth:`halt` sends no further round, and :meth:`settle` waits
    for the one in flight (``SETTLE_S`` at most). A save halts it, resumes Gym, then settles it:
    a lapse seen after the halt may be only the save's own resume overtaking the renew, and
    :meth:`confirm_late` keeps it only when the resume's answer confirms it.

    A lapsed lease (a renew answered ``stale_checkpoint``, or the clock past a participant's
    ``lease_expires_at``: Gym resumed that participant on its own) means one of two things
    (docs/gym-protocol.md#leases-and-renewals; why:
    docs/deviations.md#a-lease-lapse-after-commit-is-a-warning):

    * before the participant's instance committed (:meth:`committed`), work moved past a state
      nothing saved: ``lost`` is set and ``failure`` holds the ``lease_lost`` reason;
    * after it, that instance's records are written: the lapse is kept in ``lapsed`` (instance
      -> server -> what was seen) with a warning naming the participant, and the save goes on.

    A renew failing non-transiently fails the lease too. A transient renew failure is only
    logged: the lease is still valid until its known expiry, which is checked on every round
    and by :meth:`check`.

    The observed lease grace (docs/gym-protocol.md#leases-and-renewals) is checked once per run and participant: ``client``
    remembers the participants it checked, and a grace out of range gives one warning per
    instance.

    Use as ``async with LeaseRenewer(...) as renewer:``.
    """

    def __init__(
        self,
        client: GymControlClient,
        checkpoint_id: str,
        topology: Topology,
        *,
        prepare: PrepareResult | None = None,
    ) -> None:
        self.client = client
        self.checkpoint_id = checkpoint_id
        self.topology = topology
        self.interval_s = client.lease_renew_interval_s
        self.lost = asyncio.Event()
        self.failure: GymControlError | None = None
        self.warnings: list[str] = []
        self.lapsed: dict[str, dict[str, str]] = {}
        self.renewals = 0
        self._leases: dict[tuple[str, str], float] = {}
        # The largest deadline_ts sent to each participant: its lease is at least that plus its
        # grace, which is how the observed grace is told apart from a long prepare deadline.
        self._sent: dict[tuple[str, str], float] = {}
        if prepare is not None:
            for iid, servers in prepare.deadlines.items():
                for server, deadline in servers.items():
                    self._sent[(iid, server)] = deadline
        self._committed: set[str] = set()
        # Lapses seen after the halt, unconfirmed until the resume answers (``confirm_late``).
        self._late: dict[tuple[str, str], str] = {}
        self._task: asyncio.Task[None] | None = None
        self._renewing = False
        self._halted = False

    async def __aenter__(self) -> LeaseRenewer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def earliest_expiry(self) -> float | None:
        return min(self._leases.values()) if self._leases else None

    @property
    def started(self) -> bool:
        return self._task is not None

    def committed(self, instance_id: str) -> None:
        """``instance_id``'s commit was answered and validated: its records are written, so a
        lapse there from now on is a warning, not a lost lease."""
        self._committed.add(instance_id)

    def start_soon(self) -> None:
        """Send the first round now, then keep renewing; returns at once, without waiting for
        the round's replies."""
        if self._task is not None:
            raise RuntimeError("renewer already started")
        self._task = asyncio.create_task(self._loop(), name=f"gym-lease-{self.checkpoint_id}")

    async def start(self) -> None:
        """:meth:`start_soon`, with the first round's calls on their way when it returns."""
        self.start_soon()
        await asyncio.sleep(0)

    async def stop(self, *, settle: bool = True, last_round: bool = False) -> None:
        """No further round; a round in flight is let finish (:meth:`settle`) unless ``settle``
        is False (an abort: the save fails whatever it says). ``last_round``: then one more
        round, whose answers say which participants are still parked (a stopping save leaves
        them so). Lapses seen count as seen before any resume."""
        self.halt()
        if settle:
            await self.settle()
        if last_round and not self.lost.is_set():
            await self.renew_once()
        self.confirm_late(None)
        await self._cancel()

    def halt(self) -> None:
        """Send no further round; a round in flight goes on (:meth:`settle` waits for it)."""
        self._halted = True
        if self._task is not None and not self._renewing:
            self._task.cancel()  # it sleeps until the next round: nothing to wait for

    async def settle(self) -> None:
        """Wait for the round in flight when halted, ``SETTLE_S`` at most; then it is cancelled
        and the save's warnings say its answers were not seen."""
        task = self._task
        if task is None or task.done():
            return
        try:
            async with asyncio.timeout(min(SETTLE_S, self.client.control_timeout_s)):
                await asyncio.shield(task)
        except TimeoutError:
            self.warnings.append(
                f"a renew round of {self.checkpoint_id} was still unanswered when the save ended; its answers were not seen"
            )
        except (asyncio.CancelledError, Exception):
            if not task.done():
                raise  # this coroutine is cancelled, not the round
        await self._cancel()

    def confirm_late(self, resumed: Mapping[str, Mapping[str, bool]] | None) -> None:
        """Judge the lapses seen after the halt. ``resumed``: the idempotent flag of each
        server's first answer to the save's resume, per instance (None: no resume was sent). A
        server whose resume ended the checkpoint (``idempotent: false``) had not lapsed: its
        renew was answered after that resume. Any other is a lapse, and so is a committed
        server whose resume found the checkpoint already ended (``idempotent: true``)."""
        late, self._late = self._late, {}
        for (iid, server), seen in sorted(late.items()):
            if resumed is not None and resumed.get(iid, {}).get(server) is False:
                continue
            self._record_lapse(iid, server, seen)
        for iid, servers in sorted((resumed or {}).items()):
            for server, already in sorted(servers.items()):
                if already and iid in self._committed:
                    self._record_lapse(iid, server, "its resume found the checkpoint already ended")

    async def _cancel(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def check(self) -> None:
        """Raise the lease failure, if any; also notices an expiry the loop has not seen yet."""
        self._check_expiry()
        if self.failure is not None:
            raise self.failure

    async def _loop(self) -> None:
        while not self.lost.is_set() and not self._halted:
            self._renewing = True
            try:
                await self.renew_once()
            finally:
                self._renewing = False
            if self._halted:
                return
            await self.client.clock.sleep(self.interval_s)

    async def renew_once(self) -> None:
        if self.lost.is_set():
            return
        result = await self.client.renew_round(self.checkpoint_id, self.topology)
        self.renewals += 1
        for iid, servers in result.leases.items():
            for server, expires in servers.items():
                key = (iid, server)
                sent = max(self._sent.get(key, result.deadline_ts), result.deadline_ts)
                self._sent[key] = sent
                self._leases[key] = expires
        self._check_grace(result.leases)
        failure = result.failure
        if failure is not None:
            failure = self._lapses_of(failure)
        if failure is not None:
            if failure.failure_class is FailureClass.LEASE_LOST or not failure.transient:
                self._fail(failure)
                return
            log.warning("renew of %s failed, lease still held: %s", self.checkpoint_id, failure)
        self._check_expiry()

    def _check_grace(self, leases: dict[str, dict[str, float]] | Any) -> None:
        """Warn, once per run and instance, of a Gym lease grace out of ``[T, 4T]``."""
        T = self.client.control_timeout_s
        checked = self.client.grace_checked
        off: dict[str, list[str]] = {}
        for iid, servers in leases.items():
            for server, expires in servers.items():
                key = (iid, server)
                if key in checked:
                    continue
                checked.add(key)
                observed = expires - self._sent[key]
                if observed < T or observed > 4 * T:
                    off.setdefault(iid, []).append(
                        f"{server} {observed:.1f}s ({'below' if observed < T else 'above 4x'} control_timeout_s={T:g}s)"
                    )
        texts = [
            f"{iid}: observed lease grace of {', '.join(parts)}; configure Gym's lease_grace_seconds = control_timeout_s"
            for iid, parts in sorted(off.items())
        ]
        if texts:
            self.warnings.extend(texts)
            # One line per round, not one per participant.
            log.warning("lease grace of %s: %s", self.checkpoint_id, "; ".join(texts))

    def _lapses_of(self, failure: GymControlError) -> GymControlError | None:
        """Record the lapses of committed instances out of ``failure``; what is left of it."""
        rest: dict[str, dict[str, ServerFailure]] = {}
        for iid, servers in failure.instances.items():
            for server, part in servers.items():
                if part.get("class") == FailureClass.LEASE_LOST and iid in self._committed:
                    self._lapse(iid, server, f"renew answered {part.get('code') or part.get('http_status')}")
                else:
                    rest.setdefault(iid, {})[server] = part
        if not rest:
            return None
        if rest == failure.instances:
            return failure
        return GymControlError.from_parts(rest, f"renew of {self.checkpoint_id} failed")

    def _lapse(self, iid: str, server: str, seen: str) -> None:
        self._leases.pop((iid, server), None)
        if self._halted:
            self._late.setdefault((iid, server), seen)
        else:
            self._record_lapse(iid, server, seen)

    def _record_lapse(self, iid: str, server: str, seen: str) -> None:
        if server in self.lapsed.get(iid, {}):
            return
        self.lapsed.setdefault(iid, {})[server] = seen
        text = (
            f"{iid}/{server}: lease lapsed after the instance committed ({seen}); Gym resumed that participant "
            "on its own, its records of this snapshot are kept"
        )
        self.warnings.append(text)
        log.warning("checkpoint %s: %s", self.checkpoint_id, text)

    def _check_expiry(self) -> None:
        if self.failure is not None or not self._leases:
            return
        now = self.client.clock.time()
        expired = {key: t for key, t in self._leases.items() if t < now}
        if not expired:
            return
        parts: dict[str, dict[str, ServerFailure]] = {}
        for (iid, server), t in expired.items():
            if iid in self._committed:
                self._lapse(iid, server, f"lease expired at {t:.3f}, now {now:.3f}")
                continue
            parts.setdefault(iid, {})[server] = server_failure(
                FailureClass.LEASE_LOST, GymOperation.renew, f"lease expired at {t:.3f}, now {now:.3f}"
            )
        if parts:
            count = sum(len(v) for v in parts.values())
            self._fail(GymControlError.from_parts(parts, f"lease of {self.checkpoint_id} expired on {count} participant(s)"))

    def _fail(self, failure: GymControlError) -> None:
        if self.failure is None:
            self.failure = failure
            log.warning("lease of %s lost: %s", self.checkpoint_id, failure)
        self.lost.set()
