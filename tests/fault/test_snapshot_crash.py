"""SIGKILL the coordinator inside each snapshot phase; after a restart (under the same coordinator
id, or under another one that takes the run over once the dead one's lease expired) nothing is
stuck or lost: the snapshot ends, the gate is open, Gym is resumed, no ledger row is missing.

Phases with a Gym call are held there by a gymsim fault. The others (``requested``, ``gate``,
``retire``'s write, ``publish``) pass in a moment, so a PostgreSQL trigger holds the runner's
next phase write: the phase before it is the one persisted when the process dies. A snapshot
requested on its owner's replica closes its gate in the request's own transaction: ``request``
kills the process inside it (nothing persisted; the trainer's retried request runs it), and
``requested`` is a snapshot created on another replica, whose owner's close is held."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from gymsim.testing import GymsimInstance, default_instance_config

from ..e2e.harness import Trainer, drive_snapshot, register_by_discovery
from ..integration.ledger_helpers import group_body, new_run
from .coordinator_process import CoordinatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# phase to kill in -> the gymsim fault that holds the snapshot there, or the phase whose write a
# trigger holds ("db:<next phase>")
PHASES: dict[str, dict[str, Any] | str | None] = {
    "request": "db:gate",  # the creating request's own transaction
    "requested": "db:gate",
    "gate": "db:prepare",  # owed only to an unregistered instance: gate, then prepare in a write of its own
    "retire": {"server_name": "workplace_agent", "op": "retire", "type": "delay", "seconds": 4, "times": 1},
    "prepare": {"server_name": "calendar_resources", "op": "prepare", "type": "delay", "seconds": 4, "times": 1},
    "commit": {"server_name": "calendar_resources", "op": "commit", "type": "delay", "seconds": 4, "times": 1},
    "drain": {"server_name": "workplace_agent", "op": "run_reply", "type": "delay", "seconds": 4, "times": 1},
    "data_plane": None,  # the trainer never posts its barrier
    "resume": {"server_name": "policy_model", "op": "resume", "type": "delay", "seconds": 4, "times": 1},
    "publish": "db:published",
}
HOLD_FUNCTION = (
    "CREATE OR REPLACE FUNCTION ckptc_test_hold() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(30); RETURN NEW; END $$ LANGUAGE plpgsql"
)


async def _hold_write_of(database_url: str, phase: str) -> None:
    """Make the runner's write of ``phase`` hang inside PostgreSQL (its transaction never commits)."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from checkpoint_coordinator.ledger.db import sqlalchemy_url

    engine = create_async_engine(sqlalchemy_url(database_url))
    async with engine.begin() as conn:
        await conn.execute(text(HOLD_FUNCTION))
        await conn.execute(
            text(
                "CREATE TRIGGER ckptc_test_hold BEFORE UPDATE ON snapshots FOR EACH ROW "
                f"WHEN (NEW.phase = '{phase}' AND OLD.phase IS DISTINCT FROM NEW.phase) EXECUTE FUNCTION ckptc_test_hold()"
            )
        )
    await engine.dispose()


async def _release_holds(database_url: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from checkpoint_coordinator.ledger.db import sqlalchemy_url

    engine = create_async_engine(sqlalchemy_url(database_url))
    async with engine.begin() as conn:
        # The killed coordinator's held statement: its client is gone, end it now (before the
        # DROP, which would wait for the statement's lock on the table).
        await conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND pid <> pg_backend_pid()"))
    async with engine.begin() as conn:
        await conn.execute(text("DROP TRIGGER IF EXISTS ckptc_test_hold ON snapshots"))
    await engine.dispose()


async def _held(database_url: str, timeout: float = 20) -> None:
    """Until a statement waits in the hold's trigger."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from checkpoint_coordinator.ledger.db import sqlalchemy_url

    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        async with asyncio.timeout(timeout):
            while True:
                async with engine.connect() as conn:
                    if (await conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'"))).scalar():
                        return
                await asyncio.sleep(0.02)
    finally:
        await engine.dispose()


async def _request_on_another_replica(database_url: str, sid: str, *, owner: str) -> None:
    """What a replica that does not hold the run's lease does with a request: create the row
    for the lease holder (``owner``) and notify it."""
    from pathlib import PurePath

    from sqlalchemy.ext.asyncio import create_async_engine

    from checkpoint_coordinator.snapshots import store as ledger_snapshots
    from checkpoint_coordinator.ledger.db import sqlalchemy_url
    from checkpoint_coordinator.ledger.runs import get_run

    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        async with engine.begin() as conn:
            run = await get_run(conn, "run-1")
            _, created = await ledger_snapshots.create_in(conn, "run-1", sid, 0, owner, str(PurePath(run.checkpoint_root) / "snapshots" / sid))
            assert created
            await ledger_snapshots.notify_created(conn, "run-1", sid)
    finally:
        await engine.dispose()


async def _wait_phase(api: Any, sid: str, phase: str, timeout: float = 20) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            s = await api.get(f"/snapshots/{sid}")
            if s["phase"] == phase or s["outcome"]:
                return s
            await asyncio.sleep(0.02)


async def _wait_ready(client: httpx.AsyncClient, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while True:
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("successor", ["same-id", "other-id"])
@pytest.mark.parametrize("phase", list(PHASES))
async def test_kill_coordinator_inside_phase(phase: str, successor: str, database_url: str, tmp_path: Path) -> None:
    from ..conftest import admin_headers

    coord = CoordinatorProcess(database_url, tmp_path, coordinator_id="crash-a")
    coord.start()
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.05))
    try:
        async with httpx.AsyncClient(base_url=coord.url, timeout=30) as client:
            api = await new_run(client, admin_headers(), target_level="turn", drain_timeout_s=60, data_plane_timeout_s=60)
            from sqlalchemy.ext.asyncio import create_async_engine

            from checkpoint_coordinator.ledger.db import sqlalchemy_url

            engine = create_async_engine(sqlalchemy_url(database_url))
            await register_by_discovery(engine, "run-1", [gym])
            await engine.dispose()
            trainer = Trainer(api, {"math/replica-0": gym}, turns=3)
            await trainer.admit_and_dispatch([group_body("warm", 2)], "math/replica-0")
            await trainer.wait_idle()
            s0 = await drive_snapshot(api, "s0", 0, tmp_path / "dp")
            assert s0["outcome"] == "published"

            fault = PHASES[phase]
            if isinstance(fault, dict):
                gym.admin("POST", "/admin/faults", fault)
            elif isinstance(fault, str):
                await _hold_write_of(database_url, fault.removeprefix("db:"))
            if phase == "retire":
                # A retire owed before the prepare: the snapshot delivers it in phase retire.
                # (dispatched in the ledger only, so no reply ends it first).
                owed = [r["rollout_id"] for g in (await api.admit(group_body("owed", 1)))["groups"] for r in g["rows"]]
                await api.dispatch(owed)
                await api.post("/groups/abandon", {"group_ids": ["owed"]})
            if phase == "gate":
                from sqlalchemy import text

                # With nothing owed at all the close's own transaction moves on to prepare (held
                # here, it would never commit gate). An item for an instance no longer registered
                # is owed but not delivered: gate commits, and prepare is a write of its own.
                engine = create_async_engine(sqlalchemy_url(database_url))
                async with engine.begin() as conn:
                    await conn.execute(text(
                        "INSERT INTO outbox_items (run_id, instance_id, op, rollout_id, checkpoint_id, state, next_attempt_at) "
                        "VALUES ('run-1', 'math/gone', 'retire', 'gone-0', 'retire', 'pending', now())"
                    ))
                await engine.dispose()
            rows = await trainer.admit_and_dispatch([group_body("g1", 2)], "math/replica-0")
            if phase == "drain":
                await asyncio.sleep(0.4)  # episodes done; one reply is held on the wire
            else:
                await trainer.wait_idle()
            counts_before = (await api.get("/counts"))
            request = None
            if phase == "request":
                request = asyncio.ensure_future(client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h))
                await _held(database_url)
            elif phase == "requested":
                await _request_on_another_replica(database_url, "s1", owner="crash-a")
            else:
                r = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
                assert r.status_code == 202
            if phase in ("resume", "publish"):
                s = await _wait_phase(api, "s1", "data_plane")
                while s["awaiting"] != "barrier":
                    s = await api.get("/snapshots/s1")
                await api.post("/snapshots/s1/barrier", {})
                await api.post("/snapshots/s1/captured", {"reference": {"path": "/x", "digest": "d"}})
            if request is None:
                s = await _wait_phase(api, "s1", phase)
                assert s["phase"] == phase and s["outcome"] is None, s
            await asyncio.sleep(0.3)
            coord.kill()
            if request is not None:
                with pytest.raises(httpx.HTTPError):
                    await request
            await _release_holds(database_url)

            if successor == "other-id":
                # Another pod takes over: it waits for the dead one's run lease to expire.
                coord = CoordinatorProcess(database_url, tmp_path, coordinator_id="crash-b", port=coord.port)
            coord.start()
            await _wait_ready(client)
            if phase == "request":
                # The request's transaction never committed: no snapshot, until the trainer asks again.
                assert (await client.get("/v1/runs/run-1/snapshots/s1", headers=api.h)).status_code == 404
            if phase in ("request", "requested"):
                # Nothing had happened yet: the successor runs it rather than abort it.
                s1 = await drive_snapshot(api, "s1", 0, tmp_path / "dp", timeout=40)
                assert (s1["outcome"], s1["reason"]) == ("published", "ok"), s1
            else:
                async with asyncio.timeout(40):
                    while True:
                        s1 = await api.get("/snapshots/s1")
                        if s1["outcome"]:
                            break
                        await asyncio.sleep(0.05)
                assert (s1["outcome"], s1["reason"]) == ("aborted", "coordinator_restart"), s1
                assert s1["detail"]["phase_at_restart"] == phase
                assert s1["detail"]["previous_owner"] == "crash-a"
            run = await api.get("")
            assert run["dispatch_gate"]["open"]
            # every participant is idle again, admission open
            async with asyncio.timeout(15):
                while True:
                    st = gym.state()["servers"]
                    if all(x["phase"] == "idle" and x["admission_open"] for x in st.values() if x.get("participant")):
                        break
                    await asyncio.sleep(0.05)
            # the previous published snapshot is still the authoritative one
            hist = (await api.get("/snapshots"))["snapshots"]
            if phase in ("request", "requested"):
                assert [(h["snapshot_id"], h["outcome"]) for h in hist] == [("s1", "published"), ("s0", "published")]
            else:
                assert [(h["snapshot_id"], h["outcome"]) for h in hist] == [("s1", "aborted"), ("s0", "published")]
            # the aborted snapshot's cut (or the pre-cut the runner took beside prepare and commit)
            # is gone with it; the published one's is intact
            from sqlalchemy import text

            engine = create_async_engine(sqlalchemy_url(database_url))
            async with engine.connect() as conn:
                cut_rows = dict((await conn.execute(text("SELECT snapshot_id, count(*) FROM snapshot_cut_groups WHERE run_id = 'run-1' GROUP BY 1"))).all())
            await engine.dispose()
            assert cut_rows == ({"s0": 1, "s1": 2} if phase in ("request", "requested") else {"s0": 1})
            # no ledger row lost: the rows of g1 are all there, and the held reply still seals
            await trainer.wait_idle()
            g1 = await api.group("g1")
            assert sorted(s["generation_index"] for s in g1["siblings"]) == [0, 1]
            assert {a["rollout_id"] for s in g1["siblings"] for a in s["attempts"]} >= {r["rollout_id"] for r in rows}
            after = await api.get("/counts")
            assert sum(after["live_attempts"].values()) == sum(counts_before["live_attempts"].values())
            assert after["live_attempts"].get("sealed", 0) == 4
            # and a new snapshot goes through
            s2 = await drive_snapshot(api, "s2", 0, tmp_path / "dp")
            assert s2["outcome"] == "published"
            await trainer.aclose()
    finally:
        coord.stop()
        gym.stop()
