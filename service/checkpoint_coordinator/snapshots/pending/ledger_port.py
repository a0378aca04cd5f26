"""The ledger as a pending snapshot reads and writes it.

One method per store call the state machine makes, bound to the engine; the unit suite gives a
fake with the same methods. Each call looks its store function up when it runs, so that a trace
(``bench/snapshot_overhead.py --trace``) that wraps the store's functions sees every call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.snapshot_state import SnapshotOutcome, SnapshotPhase, SnapshotReason
from ...gym.models import Topology
from ...gym_runtime import load_topology
from ...ledger.leases import Fence
from ...ledger.runs import RunRow, get_run
from ...restore.store.plan_sql import saved_episodes_ended
from .. import store as repo

T = TypeVar("T")


class LedgerStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _read(self, read: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        await asyncio.sleep(0)  # a write started beside it sends its statement first
        async with self.engine.connect() as conn:
            return await read(conn)

    # --- reads ----------------------------------------------------------------------------------

    async def run(self, run_id: str) -> RunRow:
        return await self._read(lambda c: get_run(c, run_id))

    async def snapshot(self, run_id: str, snapshot_id: str) -> repo.SnapshotRow:
        return await self._read(lambda c: repo.get(c, run_id, snapshot_id))

    async def topology(self, run_id: str) -> Topology:
        return await self._read(lambda c: load_topology(c, run_id))

    async def deadline_left_s(self, run_id: str, snapshot_id: str) -> float | None:
        return await self._read(lambda c: repo.deadline_left_s(c, run_id, snapshot_id))

    async def poll(self, run_id: str, snapshot_id: str) -> repo.SnapshotProgress:
        return await repo.poll(self.engine, run_id, snapshot_id)

    async def still_pending(self, run_id: str, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
        return await repo.still_pending(self.engine, run_id, keys)

    async def candidates(self, run_id: str) -> dict[str, list[tuple[str, int]]]:
        return await repo.candidates(self.engine, run_id)

    async def saved_episodes_ended(self, run_id: str, snapshot_id: str, saved: list[tuple[str, str, int]]) -> list[str]:
        return await self._read(lambda c: saved_episodes_ended(c, run_id, snapshot_id, saved))

    # --- the snapshot's writes (fenced by its owner's lease) -------------------------------------

    async def close_gate(self, run_id: str, snapshot_id: str, fence: Fence, *, prepare_as: str) -> repo.GateClosure:
        return await repo.close_gate(self.engine, run_id, snapshot_id, fence, prepare_as=prepare_as)

    async def move(self, run_id: str, snapshot_id: str, fence: Fence, expected: SnapshotPhase, to: SnapshotPhase, **fields: Any) -> None:
        await repo.move(self.engine, run_id, snapshot_id, fence, expected, to, **fields)

    async def publish(self, run_id: str, snapshot_id: str, fence: Fence, *, keep_gate: bool) -> None:
        await repo.publish_phase(self.engine, run_id, snapshot_id, fence, keep_gate=keep_gate)

    async def take_over(self, run_id: str, snapshot_id: str, fence: Fence, expected: SnapshotPhase) -> None:
        await repo.take_over(self.engine, run_id, snapshot_id, fence, expected)

    async def end(self, run_id: str, snapshot_id: str, outcome: SnapshotOutcome, reason: SnapshotReason, **kwargs: Any) -> Any:
        return await repo.end(self.engine, run_id, snapshot_id, outcome, reason, **kwargs)

    async def pre_cut(self, run_id: str, snapshot_id: str, fence: Fence) -> Any:
        # Its key rows are written after it, beside Gym's commit and whatever follows: only a
        # barrier that copies groups again waits for them.
        return await repo.pre_cut(self.engine, run_id, snapshot_id, fence, defer_key_rows=True)

    async def store_gym_entry(self, run_id: str, snapshot_id: str, fence: Fence, entry: repo.GymEntry) -> None:
        await repo.store_gym_entry(self.engine, run_id, snapshot_id, fence, entry)
