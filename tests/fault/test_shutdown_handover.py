"""SIGTERM hands a replica's runs back, with real processes on a real PostgreSQL.

The leases are long here (120 s): a run taken over only after its lease's expiry would show. A
replica told to stop releases the lease of every run it holds as that run's work here ends: an
idle run at once, a run with a snapshot in flight once that snapshot ended (it is finished, not
cancelled, within the drain). The other replica then drives the run's next snapshot at once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from checkpoint_coordinator.ledger.db import sqlalchemy_url
from gymsim.testing import GymsimInstance, default_instance_config

from ..conftest import admin_headers
from ..e2e.harness import Trainer, drive_snapshot, register_by_discovery
from ..integration.ledger_helpers import RunApi, group_body, new_run
from .coordinator_process import CoordinatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LEASE_S = 120.0
# Well under the lease: the other replica must not be waiting for it to run out.
HANDOVER_S = 15.0


async def _lease(engine: AsyncEngine, run_id: str) -> tuple[str, int, bool]:
    async with engine.connect() as conn:
        r = (await conn.execute(text("SELECT owner, epoch, expires_at > now() AS live FROM ownership_leases WHERE run_id = :r"), {"r": run_id})).one()
    return str(r.owner), int(r.epoch), bool(r.live)


async def _owner_of(engine: AsyncEngine, snapshot_id: str) -> str:
    async with engine.connect() as conn:
        return str((await conn.execute(text("SELECT owner FROM snapshots WHERE snapshot_id = :s"), {"s": snapshot_id})).scalar())


async def _terminate(replica: CoordinatorProcess, timeout: float = 60) -> float:
    """SIGTERM, and the seconds until the process exited (0: cleanly)."""
    assert replica.proc is not None
    started = time.monotonic()
    replica.proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(replica.proc.wait, timeout)
    assert code == 0, code
    return time.monotonic() - started


async def _setup(database_url: str, tmp_path: Path) -> tuple[CoordinatorProcess, CoordinatorProcess, GymsimInstance, AsyncEngine]:
    env = {"CKPTC_OWNERSHIP_LEASE_S": str(LEASE_S), "CKPTC_SNAPSHOT_POLL_S": "0.5"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = CoordinatorProcess(database_url, tmp_path / "a", coordinator_id="coord-a", **env)
    b = CoordinatorProcess(database_url, tmp_path / "b", coordinator_id="coord-b", **env)
    a.start()
    b.start()
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-h", turn_seconds=0.05))
    return a, b, gym, create_async_engine(sqlalchemy_url(database_url))


async def _run_on_both(ca: httpx.AsyncClient, cb: httpx.AsyncClient, engine: AsyncEngine, gym: GymsimInstance, tmp_path: Path) -> tuple[RunApi, RunApi]:
    api_a = await new_run(ca, admin_headers(), target_level="turn", data_plane_timeout_s=120)
    api_b = RunApi(cb, api_a.run_id, api_a.h["Authorization"].removeprefix("Bearer "))
    await register_by_discovery(engine, api_a.run_id, [gym])
    trainer = Trainer(api_a, {gym.instance_id: gym}, turns=2)
    await trainer.admit_and_dispatch([group_body("warm", 2)], gym.instance_id)
    await trainer.wait_idle()
    await trainer.aclose()
    s0 = await drive_snapshot(api_a, "s0", 0, tmp_path / "dp")
    assert s0["outcome"] == "published", s0
    return api_a, api_b


async def test_sigterm_hands_an_idle_run_to_the_other_replica_at_once(database_url: str, tmp_path: Path) -> None:
    a, b, gym, engine = await _setup(database_url, tmp_path)
    try:
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as ca, httpx.AsyncClient(base_url=b.url, timeout=30) as cb:
            api_a, api_b = await _run_on_both(ca, cb, engine, gym, tmp_path)
            owner, epoch, live = await _lease(engine, api_a.run_id)
            assert (owner, live) == ("coord-a", True)

            stopped_in = await _terminate(a)
            assert stopped_in < HANDOVER_S, stopped_in
            assert await _lease(engine, api_a.run_id) == ("coord-a", epoch, False)  # released, not left to expire

            started = time.monotonic()
            s1 = await drive_snapshot(api_b, "s1", 0, tmp_path / "dp")
            assert s1["outcome"] == "published", s1
            assert time.monotonic() - started < HANDOVER_S
            assert await _owner_of(engine, "s1") == "coord-b"
            assert await _lease(engine, api_a.run_id) == ("coord-b", epoch + 1, True)
            log = "".join(p.read_text(errors="replace") for p in (tmp_path / "a").glob("coordinator-*.log"))
            assert "released the lease of 1 run(s)" in log, log[-3000:]
    finally:
        await engine.dispose()
        a.stop()
        b.stop()
        gym.stop()


async def test_sigterm_finishes_the_snapshot_in_flight_then_hands_the_run_over(database_url: str, tmp_path: Path) -> None:
    a, b, gym, engine = await _setup(database_url, tmp_path)
    try:
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as ca, httpx.AsyncClient(base_url=b.url, timeout=30) as cb:
            api_a, api_b = await _run_on_both(ca, cb, engine, gym, tmp_path)
            _, epoch, _ = await _lease(engine, api_a.run_id)
            r = await api_a.c.post(f"/v1/runs/{api_a.run_id}/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api_a.h)
            assert r.status_code == 202, r.text

            async def awaiting_barrier() -> dict[str, Any] | None:
                s = await api_b.get("/snapshots/s1")
                return s if s["awaiting"] == "barrier" else None

            async with asyncio.timeout(30):
                while await awaiting_barrier() is None:
                    await asyncio.sleep(0.05)
            assert await _owner_of(engine, "s1") == "coord-a"

            stopping = asyncio.create_task(_terminate(a))
            # The trainer goes on through the other replica; the stopping one still drives s1.
            s1 = await drive_snapshot(api_b, "s1", 0, tmp_path / "dp")
            assert s1["outcome"] == "published", s1
            stopped_in = await stopping
            assert stopped_in < HANDOVER_S + 10, stopped_in
            assert await _owner_of(engine, "s1") == "coord-a"
            assert (await _lease(engine, api_a.run_id))[2] is False

            started = time.monotonic()
            s2 = await drive_snapshot(api_b, "s2", 0, tmp_path / "dp")
            assert s2["outcome"] == "published", s2
            assert time.monotonic() - started < HANDOVER_S
            assert await _owner_of(engine, "s2") == "coord-b"
            assert await _lease(engine, api_a.run_id) == ("coord-b", epoch + 1, True)
    finally:
        await engine.dispose()
        a.stop()
        b.stop()
        gym.stop()
