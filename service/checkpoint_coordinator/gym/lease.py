"""Keeping a prepared checkpoint's leases alive until resume (spec section 6)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from .errors import FailureClass, GymControlError, server_failure
from .results import PrepareResult

if TYPE_CHECKING:
    from .client import GymControlClient, Topology

__all__ = ["LeaseRenewer"]

log = logging.getLogger("checkpoint_coordinator.gym")


class LeaseRenewer:
    """Renews once when started, then every ``max(0.01, min(T/3, 10))`` s until stopped.

    Nobody waits for the first round: a save starts it once the commit that follows prepare is
    answered (that commit set every participant's lease as a renew does, spec 6), so the round
    checks the grace and starts the cadence; waiting for it would only keep Gym parked longer.

    ``lost`` is set, and ``failure`` holds the reason, when the lease is lost (a renew answered
    ``stale_checkpoint``, or the clock passed the earliest ``lease_expires_at`` known) or a renew
    failed non-transiently. A transient renew failure is only logged: the lease is still valid
    until its known expiry, which is checked on every round and by :meth:`check`.

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
        self.renewals = 0
        self._leases: dict[tuple[str, str], float] = {}
        # The largest deadline_ts sent to each participant: its lease is at least that plus its
        # grace, which is how the observed grace is told apart from a long prepare deadline.
        self._sent: dict[tuple[str, str], float] = {}
        if prepare is not None:
            for iid, servers in prepare.deadlines.items():
                for server, deadline in servers.items():
                    self._sent[(iid, server)] = deadline
        self._graced: set[tuple[str, str]] = set()
        self._task: asyncio.Task[None] | None = None

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

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def check(self) -> None:
        """Raise the lease failure, if any; also notices an expiry the loop has not seen yet."""
        self._check_expiry()
        if self.failure is not None:
            raise self.failure

    async def _loop(self) -> None:
        while not self.lost.is_set():
            await self.renew_once()
            await self.client.clock.sleep(self.interval_s)

    async def renew_once(self) -> None:
        if self.lost.is_set():
            return
        result = await self.client.renew_round(self.checkpoint_id, self.topology)
        self.renewals += 1
        T = self.client.control_timeout_s
        misconfigured: list[str] = []
        for iid, servers in result.leases.items():
            for server, expires in servers.items():
                key = (iid, server)
                sent = max(self._sent.get(key, result.deadline_ts), result.deadline_ts)
                self._sent[key] = sent
                self._leases[key] = expires
                if key not in self._graced:
                    self._graced.add(key)
                    observed = expires - sent
                    if observed < T or observed > 4 * T:
                        text = (
                            f"{iid}/{server}: observed lease grace {observed:.1f}s is "
                            f"{'below' if observed < T else 'above 4x'} control_timeout_s={T:g}s; "
                            f"configure Gym's lease_grace_seconds = control_timeout_s"
                        )
                        self.warnings.append(text)
                        misconfigured.append(text)
        if misconfigured:
            # One line per round, not one per participant: a deployment set up this way says so
            # on every snapshot, for every participant at once.
            log.warning("lease grace of %s: %s", self.checkpoint_id, "; ".join(misconfigured))
        failure = result.failure
        if failure is not None:
            if failure.failure_class is FailureClass.LEASE_LOST or not failure.transient:
                self._fail(failure)
                return
            log.warning("renew of %s failed, lease still held: %s", self.checkpoint_id, failure)
        self._check_expiry()

    def _check_expiry(self) -> None:
        if self.failure is not None or not self._leases:
            return
        now = self.client.clock.time()
        expired = {key: t for key, t in self._leases.items() if t < now}
        if not expired:
            return
        parts: dict[str, dict[str, dict[str, object]]] = {}
        for (iid, server), t in expired.items():
            parts.setdefault(iid, {})[server] = server_failure(
                FailureClass.LEASE_LOST, "renew", f"lease expired at {t:.3f}, now {now:.3f}"
            )
        self._fail(
            GymControlError.from_parts(
                parts, f"lease of {self.checkpoint_id} expired on {len(expired)} participant(s)"
            )
        )

    def _fail(self, failure: GymControlError) -> None:
        if self.failure is None:
            self.failure = failure
            log.warning("lease of %s lost: %s", self.checkpoint_id, failure)
        self.lost.set()
