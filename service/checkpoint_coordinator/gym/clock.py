"""Injectable time source, so deadline and lease tests need not sleep for real."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    def time(self) -> float:
        """Unix seconds, the time base of every ``deadline_ts`` the client sends."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told to, or when someone sleeps on it.

    ``sleep`` advances the time at once and yields to the loop, so a renewer or drain loop runs
    through its cadence without waiting. HTTP waits still take real time: only the deadline
    arithmetic is virtual.
    """

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else float(start)
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self._now += max(0.0, seconds)
        await asyncio.sleep(0)
