"""SIGKILL the coordinator in the middle of outbox delivery: no retire or forget is lost."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from checkpoint_coordinator.ledger.db import sqlalchemy_url
from gymsim.testing import GymsimInstance, default_instance_config

from ..e2e.harness import register_by_discovery
from ..integration.ledger_helpers import group_body, new_run
from .coordinator_process import CoordinatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
PARTICIPANTS = ("policy_model", "workplace_agent", "calendar_resources")


async def test_kill_during_retire_delivery_loses_nothing(database_url: str, tmp_path: Path) -> None:
    from ..conftest import admin_headers

    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a"))
    coord = CoordinatorProcess(database_url, tmp_path)
    coord.start()
    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        async with httpx.AsyncClient(base_url=coord.url, timeout=30) as client:
            api = await new_run(client, admin_headers())
            await register_by_discovery(engine, "run-1", [gym])
            # the callees' retire stage hangs long enough to kill the coordinator inside it
            gym.admin("POST", "/admin/faults", {"server_name": "calendar_resources", "op": "retire", "type": "delay", "seconds": 3, "times": 1})
            groups = [group_body(f"g{k}", 8) for k in range(20)]
            rows = [r for g in (await api.admit(*groups))["groups"] for r in g["rows"]]
            await api.dispatch([r["rollout_id"] for r in rows], instance_id="math/replica-0")
            await api.post("/groups/abandon", {"group_ids": [g["group_id"] for g in groups]})
            async with asyncio.timeout(10):
                while not gym.state()["servers"]["workplace_agent"]["retire_calls"]:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            coord.kill()
            async with engine.connect() as conn:
                progress = (await conn.execute(text("SELECT count(*) FROM outbox_items WHERE op = 'retire' AND state = 'pending' AND 'workplace_agent' = ANY(servers_done)"))).scalar()
            assert progress == len(rows)  # the caller stage was recorded before the callees were sent
            # Let the retire that was on the wire finish inside gymsim: it was sent, so it may have
            # been applied (at-least-once for an in-flight call; retire is idempotent).
            await asyncio.sleep(3.2)

            coord.start()
            async with asyncio.timeout(30):
                while (await api.get("/outbox"))["items"]:
                    await asyncio.sleep(0.1)
        st = gym.state()["servers"]
        keys = {r["capture_key"] for r in rows}
        for s in PARTICIPANTS:
            counts = Counter(k for call in st[s]["retire_calls"] for k in call)
            assert set(counts) == keys, s  # nothing lost
            forgot = Counter(r for call in st[s]["forget_calls"] for r in call)
            assert set(forgot) == {r["rollout_id"] for r in rows} and max(forgot.values()) == 1, s
            assert st[s]["marks"] == {}
        # the stage in flight at the kill is sent again; stages acknowledged before it are not
        assert max(Counter(k for call in st["calendar_resources"]["retire_calls"] for k in call).values()) <= 2
        assert max(Counter(k for call in st["workplace_agent"]["retire_calls"] for k in call).values()) == 1
        assert max(Counter(k for call in st["policy_model"]["retire_calls"] for k in call).values()) == 1
        async with engine.connect() as conn:
            states = dict((await conn.execute(text("SELECT state, count(*) FROM outbox_items GROUP BY state"))).all())
        assert states == {"delivered": 2 * len(rows)}
    finally:
        await engine.dispose()
        coord.stop()
        gym.stop()
