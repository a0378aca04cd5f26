"""What a pending snapshot is given: its context (clock, store, Gym, outbox), the request's
opening, and the small waiting helpers it shares with the replica's background work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ...domain.snapshot_state import REASON_OUTCOME, SnapshotOutcome, SnapshotReason
from ...gym.clock import Clock, SystemClock
from ...gym.models import Topology
from ...gym.races import unless_set
from ...gym.save import GymSave
from ...gym_runtime import GymClients
from ...ledger.db import classify_database_error
from ...ledger.runs import RunRow
from .. import store as repo
from .ledger_port import LedgerStore

log = logging.getLogger("checkpoint_coordinator.snapshots.pending")
T = TypeVar("T")

# The drain waits for trainer reports on the pending attempts themselves (not on this snapshot's
# row), a few index lookups per pass.
DRAIN_POLL_S = 0.05
# While the database is away, a write that must happen (the snapshot's end, the writes after its
# cut) is tried again this often, so the snapshot ends within a moment of the database's return.
DB_RETRY_S = 0.25
# How long a shutdown waits for a snapshot to end (or, after its cut, to publish).
SHUTDOWN_GRACE_S = 30.0



class MonotonicClock(SystemClock):
    """The loop's own time: deadlines and timings that a change of the wall clock cannot move."""

    def time(self) -> float:
        return time.monotonic()


_SYSTEM_CLOCK = MonotonicClock()


def database_away(error: BaseException) -> str | None:
    verdict = classify_database_error(error)
    return verdict[1] if verdict is not None and verdict[0] == "unavailable" else None


def outcome_of(reason: SnapshotReason | str) -> SnapshotOutcome:
    return REASON_OUTCOME[SnapshotReason(reason)]


async def wait_event(event: asyncio.Event, timeout_s: float, clock: Clock | None = None) -> None:
    """Until ``event`` is set or ``timeout_s`` passed on ``clock`` (the loop's own by default).
    ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` swallows a cancellation
    that arrives as the event is set, and a loop around it then never stops."""
    if clock is None or isinstance(clock, SystemClock):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()
        return
    if not event.is_set():
        await unless_set(clock.sleep(timeout_s), event)


async def until_database_answers(write: Callable[[], Awaitable[T]], what: str, clock: Clock = _SYSTEM_CLOCK) -> T:
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
            await clock.sleep(DB_RETRY_S)


async def all_ended(*aws: Awaitable[Any]) -> list[Any]:
    """Their results, once every one of them has ended; the first failure (in argument order) is
    raised then, so that none is left running, or unretrieved, behind the error handling."""
    done = await asyncio.gather(*aws, return_exceptions=True)
    for d in done:
        if isinstance(d, BaseException):
            raise d
    return done


class SnapshotFailed(Exception):
    """The snapshot fails for ``reason`` (before its cut, Gym is resumed first)."""

    def __init__(self, reason: SnapshotReason, detail: dict[str, Any]) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail


class SnapshotAborted(Exception):
    """An abort reached the snapshot before its cut."""

    def __init__(self, reason: SnapshotReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class OutboxPort(Protocol):
    async def deliver_run(self, run_id: str, epoch: int, *, ignore_schedule: bool = False) -> Any: ...


SaveFactory = Callable[[str, Mapping[str, Any], Topology, dict[str, Any]], GymSave]
"""``(run id, run config, topology, GymSave keyword arguments)`` -> the save on that run's Gym."""


@dataclass(frozen=True)
class SnapshotContext:
    """What every pending snapshot of a replica shares. ``clock`` times every wait and deadline;
    ``store`` is the ledger as the snapshot reads and writes it; ``new_save`` makes its Gym save.
    Tests give fakes of all three."""

    store: LedgerStore
    gym: GymClients | None
    outbox: OutboxPort
    owner: str
    poll_s: float
    clock: Clock = field(default=_SYSTEM_CLOCK)
    new_save: SaveFactory | None = None

    def save_for(self, run_id: str, config: Mapping[str, Any], topology: Topology, **kwargs: Any) -> GymSave:
        if self.new_save is not None:
            return self.new_save(run_id, config, topology, kwargs)
        assert self.gym is not None
        return GymSave(self.gym.for_run(run_id, config), topology, **kwargs)


@dataclass(frozen=True)
class Opened:
    """A snapshot whose creating request closed its gate (on its owner's replica): what that
    transaction wrote and read, from which the owner goes straight on to Gym's prepare.
    ``requested_at``: when the request began (the snapshot's time counts from there)."""

    run: RunRow
    row: repo.SnapshotRow
    topology: Topology
    deadline_left_s: float | None
    deadline_read_at: float  # when ``deadline_left_s`` was read (the context's clock)
    gate: repo.GateClosure
    checkpoint_id: str
    requested_at: float
