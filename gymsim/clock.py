"""The instance clock and a broadcast wake-up used by everything that waits.

Deadlines, leases and turn times all read `Clock.now()`, which is wall time plus an offset that the
admin API can advance, so tests of expiry never sleep for the real duration.
"""

from __future__ import annotations

import asyncio
import time


class Notifier:
    """Wakes every waiter on any relevant change. Waiters always re-check their own condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        event = self._event
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await event.wait()
        except TimeoutError:
            pass


class Clock:
    # Waits never block longer than this on one wake-up, so every waiter re-checks at least once a
    # second (prepare must re-check readiness that often, docs/gym-protocol.md#prepare).
    MAX_WAIT = 1.0

    def __init__(self, notifier: Notifier) -> None:
        self.offset = 0.0
        self._notifier = notifier
        # Sleepers only care about the clock moving, not about every state change.
        self._advanced = Notifier()

    def now(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds
        self._advanced.notify()
        self._notifier.notify()

    async def sleep(self, seconds: float) -> None:
        """Sleep `seconds` of instance time; an advance of the clock shortens it."""
        until = self.now() + seconds
        while (remaining := until - self.now()) > 0:
            await self._advanced.wait(min(remaining, self.MAX_WAIT))

    async def wait_for(self, condition, deadline: float | None = None) -> bool:
        """Wait until `condition()` holds; False if `deadline` (instance time) passes first."""
        while not condition():
            if deadline is not None:
                remaining = deadline - self.now()
                if remaining <= 0:
                    return False
                await self._notifier.wait(min(remaining, self.MAX_WAIT))
            else:
                await self._notifier.wait(self.MAX_WAIT)
        return True
