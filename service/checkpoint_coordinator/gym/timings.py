"""The slowest participant of each control operation, per instance, for a snapshot's figures.

A snapshot's Gym phase lasts as long as its slowest participant; operators reading the history
want to know which one that was (docs/ledger.md#snapshot-history). The recorder is scoped by a
context variable, so the channel records for whichever snapshot (or restore) drives the call, and
concurrent calls of one fan-out share it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["SlowestCalls", "recording", "record_call"]


class SlowestCalls:
    """Per instance and operation, the participant whose call took longest."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, str], tuple[str, float]] = {}

    def record(self, instance_id: str, op: str, server: str, seconds: float) -> None:
        key = (instance_id, op)
        best = self._by.get(key)
        if best is None or seconds > best[1]:
            self._by[key] = (server, seconds)

    def of_instance(self, instance_id: str) -> dict[str, dict[str, Any]]:
        """``{op: {"participant": server, "seconds": s}}`` for one instance, ops sorted."""
        return {
            op: {"participant": server, "seconds": round(seconds, 6)}
            for (iid, op), (server, seconds) in sorted(self._by.items())
            if iid == instance_id
        }


_CURRENT: ContextVar[SlowestCalls | None] = ContextVar("ckptc_gym_slowest_calls", default=None)


@contextlib.contextmanager
def recording(recorder: SlowestCalls) -> Iterator[SlowestCalls]:
    token = _CURRENT.set(recorder)
    try:
        yield recorder
    finally:
        _CURRENT.reset(token)


def record_call(instance_id: str, op: str, server: str, seconds: float) -> None:
    recorder = _CURRENT.get()
    if recorder is not None:
        recorder.record(instance_id, op, server, seconds)
