"""Trainers waiting on a snapshot's progress (``GET .../snapshots/{id}?wait_s=``).

A trainer that polls finds the barrier up to one poll interval late, and all that time Gym stays
parked. A waiting request instead sleeps on an event of this replica that the snapshot event
listener sets for every notification about that snapshot (its phase moves, the pre-cut, the
handshakes: ``ledger.snapshots`` notifies in each of those transactions); the request then reads
the row again. A re-read every ``FALLBACK_S`` bounds the wait when a notification is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .pending import wait_event

T = TypeVar("T")

# The longest a request may wait (the API's bound on ``wait_s``): a waiting request delays a
# graceful shutdown by at most this.
MAX_WAIT_S = 20.0
FALLBACK_S = 1.0


class SnapshotWatch:
    def __init__(self) -> None:
        self._events: dict[tuple[str, str], set[asyncio.Event]] = {}

    def changed(self, run_id: str, snapshot_id: str) -> None:
        for ev in self._events.get((run_id, snapshot_id), ()):
            ev.set()

    def changed_all(self) -> None:
        """Notifications may have been missed (the listener reconnected): every waiter reads again."""
        for evs in self._events.values():
            for ev in evs:
                ev.set()

    def waiting(self) -> int:
        return sum(len(v) for v in self._events.values())

    async def until(self, run_id: str, snapshot_id: str, read: Callable[[], Awaitable[T]], done: Callable[[T], bool], wait_s: float) -> T:
        """``read()`` until ``done`` holds for its answer or ``wait_s`` passed; the last answer.
        Registered before the first read, so a change committed between that read and the wait
        still wakes it."""
        key = (run_id, snapshot_id)
        ev = asyncio.Event()
        self._events.setdefault(key, set()).add(ev)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                ev.clear()
                got = await read()
                left = deadline - time.monotonic()
                if done(got) or left <= 0:
                    return got
                await wait_event(ev, min(left, FALLBACK_S))
        finally:
            evs = self._events.get(key)
            if evs is not None:
                evs.discard(ev)
                if not evs:
                    del self._events[key]
