"""Placeholder Gym instances for tests that dispatch rows without a Gym deployment.

Dispatch to an instance the run has not registered is refused (``unknown_instance``), as a
trainer must register its Gym first. A test of the ledger alone registers a placeholder row
straight in the ledger instead: an instance with no participants, which a real registration
of the same id replaces.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

_INSERT = (
    "INSERT INTO gym_instances (run_id, instance_id, servers, control_token, discovered_at) "
    "VALUES (:r, :i, CAST('{}' AS jsonb), 'placeholder', now()) ON CONFLICT (run_id, instance_id) DO NOTHING"
)


async def register_placeholders(engine: Any, run_id: str, *instance_ids: str) -> None:
    async with engine.begin() as conn:
        for iid in instance_ids:
            await conn.execute(text(_INSERT), {"r": run_id, "i": iid})


def register_placeholders_sync(database_url: str, run_id: str, *instance_ids: str) -> None:
    """The same from a synchronous test (its own short-lived engine)."""
    import asyncio

    from checkpoint_coordinator.ledger.db import make_async_engine

    async def go() -> None:
        engine = make_async_engine(database_url, pool_size=1)
        try:
            await register_placeholders(engine, run_id, *instance_ids)
        finally:
            await engine.dispose()

    asyncio.run(go())
