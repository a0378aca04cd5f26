"""PostgreSQL stops under a running coordinator and comes back: the trainer rides it out.

A real coordinator process on a PostgreSQL server of the test's own, gymsim over HTTP, and the
real blocking client, with a rollout thread (admit, dispatch, /run, seal, finalize, announce) and
a snapshot thread. The database is stopped (fast shutdown, as an operator or a failover does)
while a snapshot is in Gym's commit and rows are in flight, and started again seconds later.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from checkpoint_coordinator.ledger.db import sqlalchemy_url
from ckpt_client import CoordinatorClient, GroupSpec, GymInstance, SealedRow
from ckpt_client.errors import Conflict, SnapshotFailed
from gymsim.testing import GymsimInstance, default_instance_config

from ..conftest import ADMIN_TOKEN
from .coordinator_process import CoordinatorProcess
from ..accounting_check import assert_conserved
from .own_postgres import OwnPostgres

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN = "outage-run"
STEPS = 6
GROUPS = 4
N = 4
OUTAGE_S = 3.0


class Recorder(httpx.HTTPTransport):
    """Every answer the trainer got, with the time it arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, str, str, int, str | None]] = []
        self.lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        code = None
        if response.status_code >= 400:
            response.read()
            try:
                code = response.json().get("code")
            except ValueError:
                code = None
        with self.lock:
            self.seen.append((time.monotonic(), request.method, request.url.path, response.status_code, code))
        return response


class Trainer:
    def __init__(self, client: CoordinatorClient, gym: GymsimInstance) -> None:
        self.c = client
        self.gym = gym
        self.http = httpx.Client(timeout=60)
        self.lock = threading.Lock()  # the data-plane barrier: finalize + announce vs the cut
        self.admitted: Counter[str] = Counter()
        self.finalized: Counter[str] = Counter()
        self.announced = threading.Condition()
        self.step = -1
        self.done = threading.Event()
        self.snapshots: list[tuple[str, str | None, str | None]] = []
        self.errors: list[BaseException] = []
        self.stale: list[int] = []
        self.pool = ThreadPoolExecutor(max_workers=8)

    def run_row(self, row: Any) -> SealedRow:
        agent = self.gym.servers["workplace_agent"]
        body = {"_ng_rollout_id": row.rollout_id, "_ng_attempt_index": row.gym_attempt, "task": {"group": row.group_id}, "turns": 2}
        while True:
            r = self.http.post(f"{agent}/run", json=body)
            if r.status_code == 409 and r.json()["error"]["code"] in ("checkpoint_parked", "admission_closed"):
                # Parked by a snapshot: same row, same attempt, once the gate reopens.
                self.c.report_refused([row.rollout_id])
                self.c.dispatch_when_open([row.rollout_id], instance_id=self.gym.instance_id)
                continue
            r.raise_for_status()
            reply = r.json()
            return SealedRow(row.rollout_id, {"rollout_id": reply["capture_key"]}, reply["staging_keys"], reply["reward"])

    def rollouts(self) -> None:
        try:
            for step in range(STEPS):
                specs = [GroupSpec(f"s{step}-g{k}", f"{step}-{k}", "math", hashlib.sha256(f"{step}{k}".encode()).hexdigest()[:16], N) for k in range(GROUPS)]
                rows = self.c.admit_groups(specs).rows
                self.admitted.update(s.group_id for s in specs)
                sent = self.c.dispatch_when_open([r.rollout_id for r in rows], instance_id=self.gym.instance_id).rows
                sealed = list(self.pool.map(self.run_row, sent))
                ready = set(self.c.report_sealed(sealed).ready_groups)
                assert ready == {s.group_id for s in specs}, ready
                with self.lock:
                    self.c.finalize_groups(sorted(ready))
                    self.finalized.update(ready)
                    self.c.announce_train_step(step, checkpoint_ref=f"ckpt-{step}")
                with self.announced:
                    self.step = step
                    self.announced.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)
        finally:
            self.done.set()
            with self.announced:
                self.announced.notify_all()

    def snapshotter(self) -> None:
        taken = -1
        try:
            while not self.done.is_set():
                with self.announced:
                    while self.step == taken and not self.done.is_set():
                        self.announced.wait(0.5)
                    step = self.step
                if step == taken or self.done.is_set():
                    continue
                taken = step
                try:
                    snap = self.c.snapshot(step, capture=lambda keys: ("/tmp/dp", hashlib.sha256(repr(sorted(keys)).encode()).hexdigest()),
                                           barrier=self.lock, poll_interval=0.1, timeout=120)
                    self.snapshots.append((snap.snapshot_id, snap.outcome, snap.reason))
                except SnapshotFailed as e:
                    self.snapshots.append((e.snapshot.snapshot_id, e.outcome, e.reason))
                except Conflict as e:
                    # The rollout thread announced a newer step while this request waited out the
                    # outage's 503s: the ledger refuses the older anchor, and the loop takes the newer.
                    if e.code != "snapshot_anchor_stale":
                        raise
                    self.stale.append(step)
        except BaseException as e:  # noqa: BLE001
            self.errors.append(e)


def test_a_postgresql_restart_under_load_is_ridden_out(tmp_path: Path) -> None:
    pg = OwnPostgres(tmp_path / "pg")
    url = pg.database("ckptc")
    coord = CoordinatorProcess(url, tmp_path, coordinator_id="outage")
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-outage", turn_seconds=0.1))
    # Every snapshot spends a while in Gym's commit: the window the outage aims at.
    gym.admin("POST", "/admin/faults", {"server_name": "policy_model", "op": "commit", "type": "delay", "seconds": 1.5})
    recorder = Recorder()
    try:
        coord.start()
        admin = CoordinatorClient(coord.url, ADMIN_TOKEN)
        token = admin.create_run(RUN, str(tmp_path / "ckpt"), {"target_level": "sibling"}).run_token
        client = CoordinatorClient(coord.url, token, run_id=RUN, transport=recorder)
        client.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
        trainer = Trainer(client, gym)
        threads = [threading.Thread(target=trainer.rollouts), threading.Thread(target=trainer.snapshotter)]
        for t in threads:
            t.start()

        # Wait for a snapshot in Gym's commit while rows are in flight, then stop the database.
        watch = httpx.Client(base_url=coord.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            snaps = watch.get(f"/v1/runs/{RUN}/snapshots", params={"limit": 1}).json()["snapshots"]
            if snaps and snaps[0]["phase"] == "commit" and trainer.step >= 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail("no snapshot reached Gym's commit")
        in_flight = snaps[0]["snapshot_id"]
        outage_start = time.monotonic()
        pg.stop()
        time.sleep(OUTAGE_S)
        pg.start()
        outage_end = time.monotonic()

        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads)
        assert trainer.errors == [], trainer.errors

        # Every answer while the database was away (and until the coordinator noticed it was
        # back) was a success, a 503 to retry, or a refusal of the ledger's own (a closed gate).
        window = [s for s in recorder.seen if outage_start <= s[0] <= outage_end + 2.0]
        statuses = Counter(s[3] for s in window)
        assert statuses[503] > 0, statuses  # the outage was seen
        bad = [s for s in window if s[3] >= 400 and s[3] != 503 and s[4] not in ("gate_closed",)]
        assert bad == [], bad
        assert all(s[3] != 500 for s in recorder.seen), [s for s in recorder.seen if s[3] == 500]

        # Every group admitted once and finalized once, in the trainer's books and the ledger's.
        assert set(trainer.admitted) == set(trainer.finalized) and len(trainer.admitted) == STEPS * GROUPS
        assert max(trainer.admitted.values()) == 1 and max(trainer.finalized.values()) == 1
        engine = create_engine(sqlalchemy_url(url))
        with engine.connect() as conn:
            statuses_db = dict(conn.execute(text("SELECT status, count(*) FROM prompt_groups WHERE run_id = :r GROUP BY 1"), {"r": RUN}).all())
            snap = conn.execute(
                text("SELECT outcome, reason, detail, extract(epoch from ended_at) AS ended FROM snapshots WHERE run_id = :r AND snapshot_id = :s"),
                {"r": RUN, "s": in_flight},
            ).one()
            open_gate = conn.execute(text("SELECT gate_snapshot_id FROM runs WHERE run_id = :r"), {"r": RUN}).scalar()
            db_now = conn.execute(text("SELECT extract(epoch from now())")).scalar()
        engine.dispose()
        assert statuses_db == {"finalized": STEPS * GROUPS}, statuses_db
        assert assert_conserved(url) == 1  # and the ledger's accounting adds up (docs/accounting.md)

        # The snapshot in flight ended with a reason that says what happened, soon after the
        # database came back; every snapshot ended; the gate is open; Gym is not parked.
        assert snap.outcome in ("published", "failed"), snap
        if snap.outcome == "failed":
            assert snap.reason == "database_unavailable", snap
        ended_after_return = float(snap.ended) - (float(db_now) - (time.monotonic() - outage_end))
        assert ended_after_return < 3.0, ended_after_return
        assert all(outcome is not None for _, outcome, _ in trainer.snapshots), trainer.snapshots
        assert open_gate is None
        assert {s["phase"] for n, s in gym.state()["servers"].items() if s.get("kind")} == {"idle"}
        print(f"\noutage: {OUTAGE_S:.1f}s; answers in the window {dict(statuses)}; snapshot {in_flight} ended "
              f"{snap.outcome}/{snap.reason} {ended_after_return:.2f}s after the database returned; snapshots {trainer.snapshots}; stale anchors retried {trainer.stale}")
    finally:
        coord.stop()
        gym.kill()
        pg.close()
