"""Two coordinator processes on one database: the run's lease decides who drives its background
work, and every background write is fenced by it.

* the owner of a running snapshot is SIGKILLed: the other replica takes the run over once the lease
  expired, resumes Gym and ends the snapshot ``aborted/coordinator_restart``;
* an owner frozen (SIGSTOP) past its lease and then thawed (SIGCONT) finds its writes refused and
  stops: the row stays as the replica that took over left it, and the thawed one says it was fenced;
* outbox items of runs driven by both replicas, with a handoff between them, reach Gym once each.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from checkpoint_coordinator.ledger.db import sqlalchemy_url
from gymsim.testing import GymsimInstance, default_instance_config

from ..e2e.harness import Trainer, drive_snapshot, register_by_discovery
from ..conftest import ADMIN_TOKEN
from ..integration.ledger_helpers import RunApi, group_body, new_run
from .coordinator_process import CoordinatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LEASE_S = 2.0
PARTICIPANTS = ("policy_model", "workplace_agent", "calendar_resources")


def _pair(database_url: str, tmp_path: Path) -> tuple[CoordinatorProcess, CoordinatorProcess]:
    env = {"CKPTC_OWNERSHIP_LEASE_S": str(LEASE_S), "CKPTC_SNAPSHOT_POLL_S": "0.5"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return (
        CoordinatorProcess(database_url, tmp_path / "a", coordinator_id="coord-a", **env),
        CoordinatorProcess(database_url, tmp_path / "b", coordinator_id="coord-b", **env),
    )


async def _until(what: str, check: Any, timeout: float = 30) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            got = await check()
            if got:
                return got
            await asyncio.sleep(0.05)


async def _lease(engine: AsyncEngine, run_id: str) -> tuple[str, int]:
    async with engine.connect() as conn:
        r = (await conn.execute(text("SELECT owner, epoch FROM ownership_leases WHERE run_id = :r"), {"r": run_id})).one()
    return str(r.owner), int(r.epoch)


async def _parked_snapshot(api_a: RunApi, api_b: RunApi, gym: GymsimInstance, tmp_path: Path) -> dict[str, Any]:
    """s0 published by coord-a; s1 requested through coord-b (coord-a holds the lease, so it
    drives it) and waiting for the trainer's barrier, Gym parked."""
    trainer = Trainer(api_a, {gym.instance_id: gym}, turns=2)
    await trainer.admit_and_dispatch([group_body("warm", 2)], gym.instance_id)
    await trainer.wait_idle()
    await trainer.aclose()
    s0 = await drive_snapshot(api_a, "s0", 0, tmp_path / "dp")
    assert s0["outcome"] == "published", s0
    r = await api_b.c.post(f"/v1/runs/{api_b.run_id}/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api_b.h)
    assert r.status_code == 202, r.text

    async def awaiting_barrier() -> dict[str, Any] | None:
        s = await api_b.get("/snapshots/s1")
        assert s["outcome"] is None, s
        return s if s["awaiting"] == "barrier" else None

    s1 = await _until("s1 awaits the barrier", awaiting_barrier)
    assert all(not x["admission_open"] for x in gym.state()["servers"].values() if x.get("participant"))
    return s1


async def _gym_idle(gym: GymsimInstance) -> bool:
    st = gym.state()["servers"]
    return all(x["phase"] == "idle" and x["admission_open"] for x in st.values() if x.get("participant"))


async def _ended(api: RunApi, sid: str) -> dict[str, Any] | None:
    s = await api.get(f"/snapshots/{sid}")
    return s if s["outcome"] else None


async def _setup(database_url: str, tmp_path: Path) -> tuple[CoordinatorProcess, CoordinatorProcess, GymsimInstance, AsyncEngine]:
    a, b = _pair(database_url, tmp_path)
    a.start()
    b.start()
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.05))
    return a, b, gym, create_async_engine(sqlalchemy_url(database_url))


async def test_the_other_replica_takes_over_a_snapshot_whose_owner_was_killed(database_url: str, tmp_path: Path) -> None:
    from ..conftest import admin_headers

    a, b, gym, engine = await _setup(database_url, tmp_path)
    try:
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as ca, httpx.AsyncClient(base_url=b.url, timeout=30) as cb:
            api_a = await new_run(ca, admin_headers(), target_level="turn", data_plane_timeout_s=120)
            api_b = RunApi(cb, api_a.run_id, api_a.h["Authorization"].removeprefix("Bearer "))
            await register_by_discovery(engine, api_a.run_id, [gym])
            s1 = await _parked_snapshot(api_a, api_b, gym, tmp_path)
            owner, epoch = await _lease(engine, api_a.run_id)
            assert owner == "coord-a"
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT owner FROM snapshots WHERE snapshot_id = 's1'"))).scalar() == "coord-a"

            a.kill()
            ended = await _until("coord-b ends s1", lambda: _ended(api_b, "s1"), timeout=LEASE_S + 20)
            assert (ended["outcome"], ended["reason"]) == ("aborted", "coordinator_restart"), ended
            assert ended["detail"]["previous_owner"] == "coord-a" and ended["detail"]["phase_at_restart"] == s1["phase"]
            assert await _lease(engine, api_a.run_id) == ("coord-b", epoch + 1)
            await _until("Gym resumed", lambda: _gym_idle(gym), timeout=15)
            assert (await api_b.get(""))["dispatch_gate"]["open"]
            # coord-b now drives the run's snapshots itself.
            s2 = await drive_snapshot(api_b, "s2", 0, tmp_path / "dp2")
            assert s2["outcome"] == "published", s2
            hist = [(h["snapshot_id"], h["outcome"]) for h in (await api_b.get("/snapshots"))["snapshots"]]
            assert hist == [("s2", "published"), ("s1", "aborted"), ("s0", "published")]
    finally:
        await engine.dispose()
        a.stop()
        b.stop()
        gym.stop()


async def test_a_frozen_owner_thawed_past_its_lease_is_fenced_and_stops(database_url: str, tmp_path: Path) -> None:
    from ..conftest import admin_headers

    a, b, gym, engine = await _setup(database_url, tmp_path)
    try:
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as ca, httpx.AsyncClient(base_url=b.url, timeout=30) as cb:
            # A short data-plane timeout: thawed, the frozen owner's timers have all run out, so it
            # tries to fail the snapshot (resume Gym, write the end) at once.
            api_a = await new_run(ca, admin_headers(), target_level="turn", data_plane_timeout_s=3)
            api_b = RunApi(cb, api_a.run_id, api_a.h["Authorization"].removeprefix("Bearer "))
            await register_by_discovery(engine, api_a.run_id, [gym])
            await _parked_snapshot(api_a, api_b, gym, tmp_path)
            _, epoch = await _lease(engine, api_a.run_id)

            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            try:
                ended = await _until("coord-b ends s1", lambda: _ended(api_b, "s1"), timeout=LEASE_S + 20)
                assert (ended["outcome"], ended["reason"]) == ("aborted", "coordinator_restart"), ended
                assert ended["detail"]["previous_owner"] == "coord-a"
                await _until("Gym resumed", lambda: _gym_idle(gym), timeout=15)
                resumes_before = {s: x.get("resume_count", 0) for s, x in gym.state()["servers"].items()}
            finally:
                a.proc.send_signal(signal.SIGCONT)

            async def says_fenced() -> bool:
                return "fenced" in "".join(p.read_text(errors="replace") for p in (tmp_path / "a").glob("coordinator-*.log"))

            await _until("coord-a logs that it was fenced", says_fenced, timeout=15)
            metrics = (await ca.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).text
            assert 'ckptc_fenced_writes_total{work="snapshot"} 1.0' in metrics, [m for m in metrics.splitlines() if "fenced" in m]
            await asyncio.sleep(1.0)
            # Nothing coord-a did after the thaw reached the row, the gate or the lease.
            after = await api_b.get("/snapshots/s1")
            assert {k: after[k] for k in ("phase", "outcome", "reason", "ended_at", "detail")} == {
                k: ended[k] for k in ("phase", "outcome", "reason", "ended_at", "detail")
            }
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT owner FROM snapshots WHERE snapshot_id = 's1'"))).scalar() == "coord-b"
            assert await _lease(engine, api_a.run_id) == ("coord-b", epoch + 1)
            assert (await api_b.get(""))["dispatch_gate"]["open"]
            assert await _gym_idle(gym)
            assert {s: x.get("resume_count", 0) for s, x in gym.state()["servers"].items()} == resumes_before
            # The thawed process still serves the API; the run's work stays with coord-b.
            s2 = await drive_snapshot(api_a, "s2", 0, tmp_path / "dp2")
            assert s2["outcome"] == "published", s2
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT owner FROM snapshots WHERE snapshot_id = 's2'"))).scalar() == "coord-b"
    finally:
        await engine.dispose()
        a.stop()
        b.stop()
        gym.stop()


async def _queue_retires(api: RunApi, gym: GymsimInstance, prefix: str, groups: int) -> list[dict[str, Any]]:
    bodies = [group_body(f"{prefix}{k}", 4) for k in range(groups)]
    rows = [r for g in (await api.admit(*bodies))["groups"] for r in g["rows"]]
    await api.dispatch([r["rollout_id"] for r in rows], instance_id=gym.instance_id)
    await api.post("/groups/abandon", {"group_ids": [g["group_id"] for g in bodies]})
    return rows


async def test_outbox_items_reach_gym_once_across_both_replicas(database_url: str, tmp_path: Path) -> None:
    from ..conftest import admin_headers

    a, b = _pair(database_url, tmp_path)
    a.start()
    b.start()
    engine = create_async_engine(sqlalchemy_url(database_url))
    gyms = {
        "run-a": GymsimInstance.start(default_instance_config("math/replica-a", token="tok-a")),
        "run-b": GymsimInstance.start(default_instance_config("math/replica-b", token="tok-b")),
    }
    try:
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as ca, httpx.AsyncClient(base_url=b.url, timeout=30) as cb:
            apis: dict[str, RunApi] = {}
            for run_id, client in (("run-a", ca), ("run-b", cb)):
                apis[run_id] = await new_run(client, admin_headers(), run_id=run_id)
                await register_by_discovery(engine, run_id, [gyms[run_id]])
            async with engine.begin() as conn:  # each replica holds one run's lease
                await conn.execute(
                    text(
                        "INSERT INTO ownership_leases (run_id, owner, epoch, expires_at) VALUES "
                        "('run-a', 'coord-a', 1, now() + make_interval(secs => :t)), ('run-b', 'coord-b', 1, now() + make_interval(secs => :t))"
                    ),
                    {"t": LEASE_S},
                )
            rows = {run_id: await _queue_retires(api, gyms[run_id], "g", 5) for run_id, api in apis.items()}

            # Asked through coord-b only: coord-a does not answer while it is frozen.
            via_b = {run_id: RunApi(cb, run_id, api.h["Authorization"].removeprefix("Bearer ")) for run_id, api in apis.items()}

            async def drained() -> bool:
                return all([not (await api.get("/outbox"))["items"] for api in via_b.values()])

            await _until("both outboxes drained", drained)
            assert await _lease(engine, "run-a") == ("coord-a", 1) and await _lease(engine, "run-b") == ("coord-b", 1)

            # Hand run-a over: coord-a frozen past its lease, coord-b delivers run-a's next items.
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(LEASE_S + 0.5)
                rows["run-a"] += await _queue_retires(via_b["run-a"], gyms["run-a"], "h", 5)
                await _until("run-a drained by coord-b", drained)
                assert (await _lease(engine, "run-a"))[0] == "coord-b"
            finally:
                a.proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(LEASE_S)
            assert (await _lease(engine, "run-a"))[0] == "coord-b"

        for run_id, gym in gyms.items():
            st = gym.state()["servers"]
            keys = {r["capture_key"] for r in rows[run_id]}
            for s in PARTICIPANTS:
                retired = Counter(k for call in st[s]["retire_calls"] for k in call)
                assert set(retired) == keys and set(retired.values()) == {1}, (run_id, s)
                forgot = Counter(r for call in st[s]["forget_calls"] for r in call)
                assert set(forgot) == {r["rollout_id"] for r in rows[run_id]} and set(forgot.values()) == {1}, (run_id, s)
        async with engine.connect() as conn:
            states = dict((await conn.execute(text("SELECT state, count(*) FROM outbox_items GROUP BY state"))).all())
        assert states == {"delivered": 2 * sum(len(r) for r in rows.values())}
    finally:
        await engine.dispose()
        a.stop()
        b.stop()
        for g in gyms.values():
            g.stop()


class _RoundRobinProxy:
    """A Service in front of the two replicas: each new connection goes to the next backend in
    turn (the first to ``first``), and stays with it."""

    def __init__(self, backends: list[int], first: int) -> None:
        self.backends = backends
        self.next = backends.index(first)
        self.routed: list[int] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = self.backends[self.next]
        self.next = (self.next + 1) % len(self.backends)
        self.routed.append(port)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer), return_exceptions=True)

    def close(self) -> None:
        self.server.close()


async def test_a_frozen_replica_holding_the_trainer_s_connection_delays_the_handshake_seconds(database_url: str, tmp_path: Path) -> None:
    """The trainer reaches both replicas through one address. coord-a drives the run; the
    trainer's kept-alive connection goes to coord-b, which freezes (SIGSTOP) as the trainer takes
    its barrier. The barrier call gets no answer, is sent again on a fresh connection after the
    client's handshake timeout, reaches coord-a, and the snapshot publishes: the trainer held its
    barrier seconds, not the client's 30 s timeout."""
    import time

    from ckpt_client import CoordinatorClient

    from ..conftest import admin_headers

    a, b, gym, engine = await _setup(database_url, tmp_path)
    proxy = _RoundRobinProxy([a.port, b.port], first=b.port)
    frozen = False
    try:
        url = f"http://127.0.0.1:{await proxy.start()}"
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as ca:
            api_a = await new_run(ca, admin_headers(), target_level="turn", data_plane_timeout_s=120)
            await register_by_discovery(engine, api_a.run_id, [gym])
            s0 = await drive_snapshot(api_a, "s0", 0, tmp_path / "dp")  # coord-a takes the run's lease
            assert s0["outcome"] == "published" and (await _lease(engine, api_a.run_id))[0] == "coord-a"
            token = api_a.h["Authorization"].removeprefix("Bearer ")
            held: list[float] = []

            def trainer() -> Any:
                nonlocal frozen
                import contextlib
                import hashlib

                @contextlib.contextmanager
                def barrier() -> Any:
                    nonlocal frozen
                    b.proc.send_signal(signal.SIGSTOP)  # the replica behind the trainer's connection stops answering
                    frozen = True
                    start = time.monotonic()
                    try:
                        yield
                    finally:
                        held.append(time.monotonic() - start)

                def capture(keys: list[str]) -> tuple[str, str]:
                    f = tmp_path / "s1.json"
                    f.write_text(repr(sorted(keys)))
                    return str(f), hashlib.sha256(f.read_bytes()).hexdigest()

                with CoordinatorClient(url, token, run_id=api_a.run_id, timeout=30, handshake_timeout=2.0, retries=2, backoff=0.05) as c:
                    c.get_run()  # the pooled connection: to coord-b
                    return c.snapshot(0, capture, snapshot_id="s1", barrier=barrier, timeout=90)

            started = time.monotonic()
            snap = await asyncio.to_thread(trainer)
            took = time.monotonic() - started
        assert snap.published, snap
        assert proxy.routed[0] == b.port and a.port in proxy.routed
        # The barrier was held for one unanswered try (2 s) and the calls through coord-a.
        assert held and held[0] < 10, held
        assert took < 60, took
    finally:
        if frozen:
            b.proc.send_signal(signal.SIGCONT)
        proxy.close()
        await engine.dispose()
        a.stop()
        b.stop()
        gym.stop()
