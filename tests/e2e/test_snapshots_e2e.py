"""Snapshots end to end: the coordinator app, real gymsim instances over HTTP, live multi-turn traffic."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gymsim.testing import GymsimInstance, default_instance_config, server_config

from ..integration.ledger_helpers import group_body, new_run
from .harness import Trainer, drive_snapshot, register_by_discovery

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gyms():
    a = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.05))
    cfg_b = server_config(default_instance_config("math/replica-1", token="tok-b", turn_seconds=0.05), "calendar_resources", mode="restart_only")
    b = GymsimInstance.start(cfg_b)
    try:
        yield {"math/replica-0": a, "math/replica-1": b}
    finally:
        a.stop()
        b.stop()


async def _setup(client, admin, app, gyms, **recovery):  # type: ignore[no-untyped-def]
    cfg = dict(target_level="turn", allow_restart_only_gym_servers=True, drain_timeout_s=20, data_plane_timeout_s=20)
    cfg.update(recovery)
    api = await new_run(client, admin, **cfg)
    await register_by_discovery(app.state.engine, "run-1", list(gyms.values()))
    return api


async def test_publish_under_live_traffic(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await _setup(client, admin, app, gyms)
    trainer = Trainer(api, gyms, turns=8)
    for iid in gyms:
        tag = iid[-1]
        await trainer.admit_and_dispatch([group_body(f"g{tag}{k}", 2) for k in range(4)], iid)
    await asyncio.sleep(0.12)  # episodes are mid-way through their turns
    snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
    await trainer.wait_idle()
    assert snap["outcome"] == "published", snap
    full = await api.get("/snapshots/s1?manifest=true")
    manifest = full["gym_manifest"]
    inst_a, inst_b = manifest["instances"]["math/replica-0"], manifest["instances"]["math/replica-1"]
    # replica-0 exports every parked episode; replica-1's restart-only resources make them restarts
    assert inst_a["episodes"], manifest
    assert inst_b["episodes"] == [] and inst_b["restarts"], manifest
    assert sorted(inst_a["participants"]) == ["calendar_resources", "policy_model", "workplace_agent"]
    # restart-only episodes never reached a commit scope
    b_state = gyms["math/replica-1"].state()
    for server in ("policy_model", "workplace_agent", "calendar_resources"):
        assert b_state["servers"][server]["commit_count"] == 1
    # the gym_checkpoint.json on disk agrees with the stored manifest
    import json

    on_disk = json.loads((Path(full["snapshot_dir"]) / "gym_checkpoint.json").read_text())
    assert on_disk == manifest
    # every episode in the manifest was still in flight (dispatched) at the ledger cut; others drained
    from sqlalchemy import text

    async with app.state.engine.connect() as conn:
        cut = {r.rollout_id: r.status for r in (await conn.execute(text("SELECT rollout_id, status FROM snapshot_attempts WHERE snapshot_id = 's1'"))).all()}
    for ep in inst_a["episodes"]:
        assert cut[ep["rollout_id"]] == "dispatched"
    # Gym resumed and the gate reopened before publish; every row sealed in the end
    for g in gyms.values():
        assert all(s["phase"] == "idle" for s in g.state()["servers"].values() if s.get("participant"))
    run = await api.get("")
    assert run["dispatch_gate"]["open"]
    counts = await api.get("/counts")
    assert counts["live_attempts"] == {"sealed": 16}
    assert full["phase_timings"]["gym_parked"] > 0 and full["gym_restarted_episodes"] == len(inst_b["restarts"])
    assert full["resume_failure"] is None


async def test_every_gym_entry_carries_its_new_keys_to_the_barrier(client, admin, app, gyms, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # With a pre-cut in, each entry's new keys are found as it is stored (the last one's by the
    # move to data_plane): the barrier looks none up. What the barrier finds is recorded here.
    from sqlalchemy import text

    from checkpoint_coordinator.snapshots import store as ledger_snapshots

    api = await _setup(client, admin, app, gyms)
    take_cut = ledger_snapshots.take_cut
    found: list[list[tuple[str, bool]]] = []

    async def recording_take_cut(engine, run_id, snapshot_id, **kwargs):  # type: ignore[no-untyped-def]
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT instance_id, new_keys IS NOT NULL FROM snapshot_gym_entries WHERE run_id = :r AND snapshot_id = :s "
                                            "ORDER BY 1"), {"r": run_id, "s": snapshot_id})).all()
        found.append([tuple(r) for r in rows])
        return await take_cut(engine, run_id, snapshot_id, **kwargs)

    monkeypatch.setattr(ledger_snapshots, "take_cut", recording_take_cut)
    trainer = Trainer(api, gyms, turns=8)
    for iid in gyms:
        await trainer.admit_and_dispatch([group_body(f"g{iid[-1]}{k}", 2) for k in range(2)], iid)
    await asyncio.sleep(0.12)
    snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
    await trainer.wait_idle()
    assert snap["outcome"] == "published", snap
    assert snap["counts"]["cut_pre_cut_groups"] > 0
    assert found[0] == [("math/replica-0", True), ("math/replica-1", True)]


async def test_the_owner_answers_the_pre_cut_keys_fetch_with_the_keys_it_holds(client, admin, app, gyms, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The fetch lands while Gym commits; the replica driving the snapshot answers it with the
    # pre-cut's keys it holds (no aggregation of the key rows), the same text the rows give.
    from checkpoint_coordinator.snapshots import store as ledger_snapshots

    api = await _setup(client, admin, app, gyms)
    for g in gyms.values():
        g.admin("POST", "/admin/faults", {"server_name": "policy_model", "op": "commit", "type": "delay", "seconds": 1.5})
    done = Trainer(api, gyms, turns=1)  # sealed before the snapshot: their keys are the pre-cut's
    for iid in gyms:
        await done.admit_and_dispatch([group_body(f"d{iid[-1]}", 2)], iid)
    await done.wait_idle()
    trainer = Trainer(api, gyms, turns=8)
    for iid in gyms:
        await trainer.admit_and_dispatch([group_body(f"g{iid[-1]}{k}", 2) for k in range(2)], iid)
    await asyncio.sleep(0.12)
    cut_keys = ledger_snapshots.cut_keys
    held: list[str | None] = []

    async def recording_cut_keys(engine, run_id, snapshot_id, **kwargs):  # type: ignore[no-untyped-def]
        held.append(kwargs.get("pre_cut_keys"))
        return await cut_keys(engine, run_id, snapshot_id, **kwargs)

    monkeypatch.setattr(ledger_snapshots, "cut_keys", recording_cut_keys)
    r = await api.c.post(f"/v1/runs/{api.run_id}/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
    assert r.status_code in (200, 202), r.text
    async with asyncio.timeout(30):
        while not ((s := await api.get("/snapshots/s1"))["phase"] == "commit" and s["counts"].get("cut_pre_cut_keys") is not None):
            assert s["outcome"] is None, s
            await asyncio.sleep(0.02)
    fetched = await api.get("/snapshots/s1/staging-keys")
    from_rows = await cut_keys(app.state.engine, api.run_id, "s1")
    assert fetched["as_of"] == "pre_cut" and len(fetched["staging_keys"]) == s["counts"]["cut_pre_cut_keys"] > 0
    assert held and held[-1] is not None and from_rows == ("pre_cut", held[-1])
    snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
    await trainer.wait_idle()
    assert snap["outcome"] == "published", snap


async def test_drained_rows_are_sealed_not_exported(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await _setup(client, admin, app, gyms)
    gyms["math/replica-0"].admin("POST", "/admin/faults", {"server_name": "workplace_agent", "op": "run_reply", "type": "delay", "seconds": 0.6, "times": 2})
    trainer = Trainer(api, gyms, turns=1)
    rows = await trainer.admit_and_dispatch([group_body("g1", 2)], "math/replica-0")
    await asyncio.sleep(0.2)  # both episodes finished; their replies are on the wire
    snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
    await trainer.wait_idle()
    assert snap["outcome"] == "published", (snap["reason"], snap["detail"])
    full = await api.get("/snapshots/s1?manifest=true")
    exported = {e["rollout_id"] for e in full["gym_manifest"]["instances"]["math/replica-0"]["episodes"]}
    assert exported.isdisjoint({r["rollout_id"] for r in rows})
    assert full["detail"]["drained"] == 2
    assert full["counts"]["cut_siblings"] == 2
    # The runner copied the ledger beside prepare and commit (the pre-cut); the drained seals came
    # later or not, the cut shows them sealed either way (the barrier re-copies what changed).
    assert full["counts"]["cut_pre_cut_groups"] == 1 and full["phase_timings"]["pre_cut"] > 0
    from sqlalchemy import text

    async with app.state.engine.connect() as conn:
        cut = {r.rollout_id: r.status for r in (await conn.execute(text("SELECT rollout_id, status FROM snapshot_attempts WHERE snapshot_id = 's1'"))).all()}
    assert {cut[r["rollout_id"]] for r in rows} == {"sealed"}


async def _log_phase_moves(engine) -> None:  # type: ignore[no-untyped-def]
    """Every phase move of a snapshot row, as the database saw it, into ``test_phase_moves``."""
    from sqlalchemy import text

    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE test_phase_moves (n bigserial, snapshot_id text, phase_from text, phase_to text)"))
        await conn.execute(text(
            "CREATE FUNCTION test_log_phase_move() RETURNS trigger AS $$ BEGIN INSERT INTO test_phase_moves (snapshot_id, phase_from, phase_to) "
            "VALUES (NEW.snapshot_id, OLD.phase, NEW.phase); RETURN NEW; END $$ LANGUAGE plpgsql"
        ))
        await conn.execute(text(
            "CREATE TRIGGER test_log_phase_move AFTER UPDATE OF phase ON snapshots FOR EACH ROW "
            "WHEN (OLD.phase IS DISTINCT FROM NEW.phase) EXECUTE FUNCTION test_log_phase_move()"
        ))


async def _phase_path(engine, sid: str) -> list[str]:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT phase_from, phase_to FROM test_phase_moves WHERE snapshot_id = :s ORDER BY n"), {"s": sid})).all()
    assert all(a.phase_to == b.phase_from for a, b in zip(rows, rows[1:])), rows
    return [rows[0].phase_from] + [r.phase_to for r in rows] if rows else []


async def test_a_phase_with_nothing_to_do_is_not_entered(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Nothing owed to Gym and every candidate exported: the snapshot goes gate -> prepare and
    commit -> data_plane (two flushed writes and two wakes of every waiter less while Gym is
    parked). A retire owed and a reply on the wire bring ``retire`` and ``drain`` back."""
    api = await _setup(client, admin, app, gyms)
    await _log_phase_moves(app.state.engine)
    trainer = Trainer(api, gyms, turns=8)
    await trainer.admit_and_dispatch([group_body("g0", 2)], "math/replica-0")
    await asyncio.sleep(0.12)  # mid-way through their turns: exported, nothing to drain
    s1 = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
    assert s1["outcome"] == "published", s1
    assert s1["detail"]["drained"] == 0
    assert await _phase_path(app.state.engine, "s1") == [
        "requested", "gate", "prepare", "commit", "data_plane", "resume", "publish", "published"
    ]
    await trainer.wait_idle()

    # A retire owed (a group abandoned with a row dispatched in the ledger only; its first
    # delivery fails, so it is still owed, in backoff, when the snapshot starts) and two replies
    # held on the wire after their episodes finished.
    gyms["math/replica-0"].admin("POST", "/admin/faults", {"server_name": "workplace_agent", "op": "retire", "type": "error", "status": 500, "times": 1})
    owed = [r["rollout_id"] for g in (await api.admit(group_body("owed", 1)))["groups"] for r in g["rows"]]
    await api.dispatch(owed)
    gyms["math/replica-0"].admin("POST", "/admin/faults", {"server_name": "workplace_agent", "op": "run_reply", "type": "delay", "seconds": 0.6, "times": 2})
    trainer = Trainer(api, gyms, turns=1)
    await trainer.admit_and_dispatch([group_body("g1", 2)], "math/replica-0")
    await asyncio.sleep(0.2)
    # Right before the request: the outbox's first try fails and waits out its backoff (0.5 s).
    await api.post("/groups/abandon", {"group_ids": ["owed"]})
    s2 = await drive_snapshot(api, "s2", 0, tmp_path / "dp")
    await trainer.wait_idle()
    assert s2["outcome"] == "published", s2
    assert s2["detail"]["drained"] == 2
    assert await _phase_path(app.state.engine, "s2") == [
        "requested", "gate", "retire", "prepare", "commit", "drain", "data_plane", "resume", "publish", "published"
    ]
    # The owed retire is delivered in the end (by the snapshot, or after its backoff if the
    # snapshot's delivery took the injected failure).
    for _ in range(200):
        if (await api.get("/counts"))["outbox_pending"] == {}:
            break
        await asyncio.sleep(0.05)
    assert (await api.get("/counts"))["outbox_pending"] == {}


async def test_the_request_closes_the_gate_in_its_own_transaction_on_the_owner_s_replica(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Created by its owner's replica, a snapshot's gate is closed, and what its owner starts
    from is read, in the creating request's transaction: one commit before Gym's prepare. One
    that replica starts later (created elsewhere, found at a start) closes it in a transaction
    of its own, sent before the four reads beside it on their own connections."""
    from sqlalchemy import event

    from checkpoint_coordinator.ledger import leases
    from checkpoint_coordinator.snapshots import store as ledger_snapshots

    api = await _setup(client, admin, app, gyms)
    engine = app.state.engine
    sent: list[tuple[int, str]] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        sent.append((id(conn.connection.dbapi_connection), " ".join(statement.split())))

    def committed(conn):  # type: ignore[no-untyped-def]
        sent.append((id(conn.connection.dbapi_connection), "COMMIT"))

    def first(marker: str, since: int = 0) -> int:
        return next(i for i, (_, st) in enumerate(sent) if i >= since and marker in st)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    event.listen(engine.sync_engine, "commit", committed)
    try:
        s1 = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
        created = first("INSERT INTO snapshots")
        conn = sent[created][0]
        mine = [(i, st) for i, (c, st) in enumerate(sent) if c == conn and i >= created]
        commit = next(i for i, st in mine if st == "COMMIT")
        close = first("WITH g AS (UPDATE runs SET gate_snapshot_id", created)
        reads = [first(marker, created) for marker in ("EXTRACT(EPOCH FROM deadline_at - clock_timestamp())", "FROM gym_participants")]
        assert created < close < min(reads) and max(reads) < commit, (created, close, reads, commit)
        assert all(sent[i][0] == conn for i in (close, *reads))  # the request's own transaction
        assert "UPDATE snapshots SET phase = %(to)s, gym_checkpoint_id" in " ".join(st for i, st in mine if i < commit)  # on to prepare

        # A snapshot found in phase requested (created on another replica): its owner closes the gate.
        del sent[:]
        async with engine.begin() as c:
            await ledger_snapshots.create_in(c, "run-1", "s2", 0, app.state.snapshots.owner, str(tmp_path / "s2"))
        epoch = await leases.acquire(engine, "run-1", app.state.snapshots.owner, 600)
        app.state.snapshots.start("run-1", "s2", epoch)
        s2 = await drive_snapshot(api, "s2", 0, tmp_path / "dp")
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
        event.remove(engine.sync_engine, "commit", committed)
    assert s1["outcome"] == "published" and s2["outcome"] == "published", (s1, s2)
    close = first("WITH g AS (UPDATE runs SET gate_snapshot_id")
    reads = [first(marker) for marker in ("EXTRACT(EPOCH FROM deadline_at - clock_timestamp())", "FROM gym_participants")]
    assert all(close < i and sent[i][0] != sent[close][0] for i in reads), (close, reads)


async def test_a_snapshot_past_its_deadline_before_the_gate_opened_touches_no_gym(client, admin, app, gyms) -> None:  # type: ignore[no-untyped-def]
    """A deadline already past when the owner starts (a late start, a takeover): the gate's
    close is undone and the snapshot ends aborted/deadline_exceeded with no Gym call at all."""
    api = await _setup(client, admin, app, gyms)
    await _log_phase_moves(app.state.engine)
    # A microsecond from the request: past by the time its owner closes the gate.
    await api.post("/snapshots", {"snapshot_id": "s1", "anchor_step": 0, "stop": True, "deadline_s": 1e-6}, expect=202)
    s = await _ended(api)
    assert (s["outcome"], s["reason"]) == ("aborted", "deadline_exceeded"), s
    # Nothing owed to Gym, but the close does not go on to prepare past the deadline.
    assert await _phase_path(app.state.engine, "s1") == ["requested", "gate", "aborted"]
    assert (await api.get("/snapshots/s1"))["gym_checkpoint_id"] is None
    assert (await api.get(""))["dispatch_gate"]["open"]
    for g in gyms.values():
        assert all(x["prepare_count"] == 0 for x in g.state()["servers"].values() if x.get("participant"))


async def test_train_step_during_prepare_aborts_and_reopens(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await _setup(client, admin, app, gyms)
    gyms["math/replica-0"].admin("POST", "/admin/faults", {"server_name": "policy_model", "op": "prepare", "type": "delay", "seconds": 1.0, "times": 1})
    r = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 3}, headers=api.h)
    assert r.status_code == 202
    for _ in range(100):
        if (await api.get("/snapshots/s1"))["phase"] in ("prepare", "commit"):
            break
        await asyncio.sleep(0.02)
    ann = await api.post("/train-steps", {"step": 4})
    assert ann["aborted_snapshots"] == ["s1"]
    for _ in range(200):
        s = await api.get("/snapshots/s1")
        if s["outcome"]:
            break
        await asyncio.sleep(0.02)
    assert (s["outcome"], s["reason"]) == ("aborted", "train_step_committed")
    assert (await api.get(""))["dispatch_gate"]["open"]
    assert (await api.get(""))["consecutive_snapshot_losses"] == 1
    for g in gyms.values():
        st = g.state()["servers"]
        assert all(x["phase"] == "idle" and x["admission_open"] for x in st.values() if x.get("participant"))
    # an anchor older than the newest train step is refused
    old = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s2", "anchor_step": 3}, headers=api.h)
    assert old.status_code == 409 and old.json()["code"] == "snapshot_anchor_stale"
    again = await drive_snapshot(api, "s3", 4, tmp_path / "dp")
    assert again["outcome"] == "published"
    assert (await api.get(""))["consecutive_snapshot_losses"] == 0


async def _held_in_commit(client, api, gyms) -> None:  # type: ignore[no-untyped-def]
    """Request snapshot s1 with one participant's commit delayed a second; return once the
    snapshot is in phase commit."""
    gyms["math/replica-1"].admin("POST", "/admin/faults", {"server_name": "workplace_agent", "op": "commit", "type": "delay", "seconds": 1.0, "times": 1})
    await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
    for _ in range(200):
        if (await api.get("/snapshots/s1"))["phase"] == "commit":
            break
        await asyncio.sleep(0.02)
    assert (await api.get("/snapshots/s1"))["phase"] == "commit"


async def _ended(api) -> dict:  # type: ignore[no-untyped-def,type-arg]
    for _ in range(300):
        s = await api.get("/snapshots/s1")
        if s["outcome"]:
            return s
        await asyncio.sleep(0.02)
    return s


async def test_train_step_during_commit_aborts(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await _setup(client, admin, app, gyms)
    await _held_in_commit(client, api, gyms)
    await api.post("/train-steps", {"step": 1})
    s = await _ended(api)
    assert (s["outcome"], s["reason"]) == ("aborted", "train_step_committed")
    assert (await api.get(""))["dispatch_gate"]["open"]


async def test_a_commit_move_the_database_lost_ends_the_snapshot_and_resumes_gym(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The move to ``commit`` is not flushed: a database crash can lose it while the owner goes on.
    The owner's next move then finds the row in ``prepare``, still its own: it resumes Gym and
    ends the snapshot as ``database_unavailable`` instead of stopping as if fenced."""
    from sqlalchemy import text

    api = await _setup(client, admin, app, gyms)
    await _held_in_commit(client, api, gyms)
    async with app.state.engine.begin() as conn:  # what a crash that lost the unflushed move leaves
        n = (await conn.execute(text("UPDATE snapshots SET phase = 'prepare' WHERE run_id = 'run-1' AND snapshot_id = 's1' AND phase = 'commit'"))).rowcount
    assert n == 1
    s = await _ended(api)
    assert (s["outcome"], s["reason"]) == ("failed", "database_unavailable"), s
    assert s["detail"]["phase"] == "prepare" and "commit" in s["detail"]["why"], s
    assert (await api.get(""))["dispatch_gate"]["open"]
    for g in gyms.values():
        assert all(x["phase"] == "idle" for x in g.state()["servers"].values() if x.get("participant"))


async def test_not_ready_fails_with_blockers_and_resumes(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await _setup(client, admin, app, gyms, prepare_timeout_s=0.3, stall_timeout_s=2000)
    # a multi-worker policy model with a worker that never reports: never ready
    gyms["math/replica-0"].admin("POST", "/admin/servers/policy_model/knobs", {"workers": 2, "unreported_workers": 1})
    snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
    assert (snap["outcome"], snap["reason"]) == ("failed", "gym_not_ready"), snap
    # Published Gym names the policy model's workers "policy-"; strict Gym uses the kind.
    token = "policy" if gyms["math/replica-0"].config.gym_profile == "published" else "model"
    assert f"{token}-workers-unreported:1" in str(snap["detail"])
    # agents and resources of that instance never received prepare
    st = gyms["math/replica-0"].state()["servers"]
    assert st["workplace_agent"]["prepare_calls"] == 0 and st["calendar_resources"]["prepare_calls"] == 0
    assert (await api.get(""))["dispatch_gate"]["open"]
    for g in gyms.values():
        assert all(x["phase"] == "idle" for x in g.state()["servers"].values() if x.get("participant"))


async def test_snapshot_request_is_idempotent_and_one_at_a_time(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await _setup(client, admin, app, gyms)
    r1 = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
    r2 = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
    assert r1.status_code == 202 and r2.status_code == 200 and r2.json()["snapshot_id"] == "s1"
    other = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s2", "anchor_step": 0}, headers=api.h)
    assert other.status_code == 409 and other.json()["code"] == "snapshot_in_progress"
    conflict = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 9}, headers=api.h)
    assert conflict.status_code == 409 and conflict.json()["code"] == "snapshot_conflict"
    snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
    assert snap["outcome"] == "published"
    hist = await api.get("/snapshots")
    assert [s["snapshot_id"] for s in hist["snapshots"]] == ["s1"]


async def test_trainer_reports_failed_capture(client, admin, app, gyms, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await _setup(client, admin, app, gyms)
    await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
    for _ in range(300):
        s = await api.get("/snapshots/s1")
        if s["awaiting"] == "barrier":
            break
        await asyncio.sleep(0.02)
    await api.post("/snapshots/s1/barrier", {})
    aborted = await api.post("/snapshots/s1/abort", {"reason": "data_plane_failed", "detail": "disk full"})
    assert aborted["outcome"] is None
    for _ in range(300):
        s = await api.get("/snapshots/s1")
        if s["outcome"]:
            break
        await asyncio.sleep(0.02)
    assert (s["outcome"], s["reason"]) == ("failed", "data_plane_failed"), s
    assert (await api.get(""))["dispatch_gate"]["open"]
    for g in gyms.values():
        assert all(x["phase"] == "idle" for x in g.state()["servers"].values() if x.get("participant"))
    late = await client.post("/v1/runs/run-1/snapshots/s1/captured", json={"reference": {"path": "/x", "digest": "d"}}, headers=api.h)
    assert late.status_code == 409 and late.json()["code"] == "snapshot_not_awaiting"


async def test_no_snapshot_while_a_restore_runs(client, admin, app, gyms) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    api = await _setup(client, admin, app, gyms)
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state) VALUES ('run-1', 'r1', 'sx', 'running', true)")
        )
    r = await client.post("/v1/runs/run-1/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
    assert r.status_code == 409 and r.json()["code"] == "restore_in_progress" and r.json()["restore_id"] == "r1"


LEVELS = {
    "turn": {"target_level": "turn"},
    "sibling": {"target_level": "sibling"},
    "prompt_group": {"target_level": "prompt_group"},
    # turn level, with one task source's groups recovered at sibling level
    "mixed": {"target_level": "turn", "task_source_target_level_overrides": {"coarse": "sibling"}},
}


@pytest.mark.parametrize("profile", ["published", "pinned", "strict"])
@pytest.mark.parametrize("level", list(LEVELS))
async def test_a_snapshot_with_rollouts_in_flight_publishes_at_every_level(client, admin, app, tmp_path: Path, level: str, profile: str) -> None:  # type: ignore[no-untyped-def]
    """Every Gym variant (docs/gym-protocol.md#gym-variants): Gym as published (agents and
    resources export every live session whatever the scope, no run_episode_ids), as NeMo RL pins
    it (the same, with run_episode_ids naming the /run sessions among every export, P8 in
    docs/gym-protocol.md#what-differs-rule-by-rule) and strict Gym."""
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.05, gym_profile=profile))
    try:
        iid = gym.instance_id
        api = await new_run(client, admin, drain_timeout_s=20, data_plane_timeout_s=20, **LEVELS[level])
        await register_by_discovery(app.state.engine, "run-1", [gym])
        trainer = Trainer(api, {iid: gym}, turns=10)
        groups = [group_body(f"g{k}", 2) for k in range(3)]
        if level == "mixed":
            groups += [group_body(f"c{k}", 2, task_source="coarse") for k in range(2)]
        await trainer.admit_and_dispatch(groups, iid)
        await asyncio.sleep(0.15)  # mid-way through their turns
        snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
        await trainer.wait_idle()
        assert (snap["outcome"], snap["reason"]) == ("published", "ok"), snap
        full = await api.get("/snapshots/s1?manifest=true")
        saved = {e["rollout_id"] for e in full["gym_manifest"]["instances"][iid]["episodes"]}
        figures = full["detail"]["gym"][iid]
        async with app.state.engine.connect() as conn:
            from sqlalchemy import text

            levels = dict((await conn.execute(text(
                "SELECT a.rollout_id, g.restore_level FROM snapshot_attempts a JOIN snapshot_groups g USING (run_id, snapshot_id, group_id) "
                "WHERE a.snapshot_id = 's1'"))).all())
        # Only turn-level rows are ever saved from Gym state; what Gym exported beyond the scope
        # (every other live session, on published Gym) is counted, not kept.
        assert all(levels[r] == "turn" for r in saved), (saved, levels)
        if level in ("turn", "mixed"):
            assert saved, full["gym_manifest"]
        else:
            assert saved == set()
        # The slowest participant of each control call (docs/ledger.md#snapshot-history): one of
        # this instance's participants, with a duration, for every operation the snapshot sent.
        participants = set(full["gym_manifest"]["instances"][iid]["participants"])
        assert {"prepare", "commit", "resume"} <= set(figures["slowest"]), figures
        assert all(v["participant"] in participants and v["seconds"] > 0 for v in figures["slowest"].values()), figures
        outside = figures["exported_outside_scope"]
        coarse_in_flight = level in ("sibling", "prompt_group", "mixed")
        assert (outside > 0) == (profile != "strict" and coarse_in_flight), figures
        # No staging key of an episode left out of the snapshot is kept.
        keys = full["gym_manifest"]["instances"][iid]["staging_keys"]
        assert all(k.split("/")[1] in saved for k in keys), (keys, saved)
        counts = await api.get("/counts")
        assert counts["live_attempts"] == {"sealed": 2 * len(groups)}
        assert all(s["phase"] == "idle" for s in gym.state()["servers"].values() if s.get("participant"))
        await trainer.aclose()
    finally:
        gym.stop()


async def test_snapshots_that_keep_losing_to_train_steps_raise_the_warning(client, admin, app, gyms, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """snapshot_loss_warn_after losses in a row: a warning in the log and the per-run warning
    gauge at 1; a published snapshot clears both."""
    import logging

    api = await _setup(client, admin, app, gyms, snapshot_loss_warn_after=2)

    async def gauge() -> float:
        text = (await client.get("/metrics", headers=admin)).text
        line = next(x for x in text.splitlines() if x.startswith('ckptc_snapshot_losses_warning{run="run-1"}'))
        return float(line.split()[-1])

    caplog.set_level(logging.WARNING, logger="checkpoint_coordinator.snapshots.runner")
    for step in range(2):
        gyms["math/replica-0"].admin("POST", "/admin/faults", {"server_name": "policy_model", "op": "prepare", "type": "delay", "seconds": 0.6, "times": 1})
        await api.post("/snapshots", {"snapshot_id": f"lost{step}", "anchor_step": step}, 202)
        async with asyncio.timeout(10):
            while (await api.get(f"/snapshots/lost{step}"))["phase"] not in ("prepare", "commit"):
                await asyncio.sleep(0.02)
        assert (await api.post("/train-steps", {"step": step + 1}))["aborted_snapshots"] == [f"lost{step}"]
        async with asyncio.timeout(10):
            while (s := await api.get(f"/snapshots/lost{step}"))["outcome"] is None:
                await asyncio.sleep(0.02)
        assert (s["outcome"], s["reason"]) == ("aborted", "train_step_committed")
        assert (await api.get(""))["consecutive_snapshot_losses"] == step + 1
        assert await gauge() == (1.0 if step + 1 >= 2 else 0.0)
    warned = [r.getMessage() for r in caplog.records if "consecutive snapshots lost to train steps" in r.getMessage()]
    assert len(warned) == 1 and "run-1: 2 consecutive" in warned[0], warned
    ok = await drive_snapshot(api, "won", 2, tmp_path / "dp")
    assert ok["outcome"] == "published"
    assert (await api.get(""))["consecutive_snapshot_losses"] == 0 and await gauge() == 0.0


async def test_a_waiting_trainer_hears_of_each_step_when_it_is_written(client, admin, app, gyms, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`GET ...?wait_s=&watch_token=`: the answer comes when the snapshot moves on (the phase
    moves notify), not at the end of the wait; with the fallback re-read pushed past the wait,
    only the notifications can have woken it."""
    import json
    import time
    from urllib.parse import quote

    from checkpoint_coordinator.snapshots import watch

    from checkpoint_coordinator.snapshots import store as ledger_snapshots

    monkeypatch.setattr(watch, "FALLBACK_S", 60.0)
    api = await _setup(client, admin, app, gyms)
    # Gym's commit takes a second and the pre-cut starts half a second late: it ends inside the
    # commit, and only its own notification can tell a waiting trainer.
    gyms["math/replica-0"].admin("POST", "/admin/faults", {"server_name": "policy_model", "op": "commit", "type": "delay", "seconds": 1.0})
    pre_cut = ledger_snapshots.pre_cut

    async def late_pre_cut(*args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.5)
        return await pre_cut(*args, **kwargs)

    monkeypatch.setattr(ledger_snapshots, "pre_cut", late_pre_cut)
    trainer = Trainer(api, gyms, turns=8)
    await trainer.admit_and_dispatch([group_body("g0", 2)], "math/replica-0")
    await asyncio.sleep(0.12)
    await api.post("/snapshots", {"snapshot_id": "s1", "anchor_step": 0}, expect=202)
    snap = await api.get("/snapshots/s1")
    seen = [snap["watch_token"]]
    waits = []

    async def next_state(s: dict) -> dict:  # type: ignore[type-arg]
        t = time.monotonic()
        got = await api.get(f"/snapshots/s1?wait_s=15&watch_token={quote(s['watch_token'])}")
        waits.append(time.monotonic() - t)
        assert got["watch_token"] != s["watch_token"], (s["watch_token"], waits)  # it moved on: no timed-out wait
        seen.append(got["watch_token"])
        return got

    while snap["awaiting"] != "barrier":
        assert snap["outcome"] is None, snap
        snap = await next_state(snap)
    # Pending in data_plane: its manifest is its per-instance entries, every instance's in.
    pending_manifest = await api.get("/snapshots/s1/gym-manifest")
    assert sorted(pending_manifest["instances"]) == sorted(gyms), pending_manifest
    b = await api.post("/snapshots/s1/barrier", {})
    f = tmp_path / "dp.json"
    f.write_text(json.dumps(b["staging_keys"]))
    await api.post("/snapshots/s1/captured", {"reference": {"path": str(f), "digest": "sha256:x"}})
    snap = await api.get("/snapshots/s1")
    while snap["outcome"] is None:
        snap = await next_state(snap)
    await trainer.wait_idle()
    assert snap["outcome"] == "published", snap
    assert await api.get("/snapshots/s1/gym-manifest") == pending_manifest  # joined into the row at its end
    assert max(waits) < 10, waits
    assert any(t.startswith("data_plane.-.barrier.") for t in seen), seen
    assert {"commit.-.-.0", "commit.-.-.1"} <= set(seen), seen  # the pre-cut's keys became fetchable while Gym committed
    # A wait on the document as it stands (nothing moves any more) answers it unchanged at the end.
    t = time.monotonic()
    same = await api.get(f"/snapshots/s1?wait_s=0.3&watch_token={quote(snap['watch_token'])}")
    assert same["watch_token"] == snap["watch_token"] and time.monotonic() - t >= 0.3
    assert app.state.snapshots.watch.waiting() == 0  # no waiter left registered
    # The waits are timed under a route label of their own, apart from the plain reads.
    exposed = (await client.get("/metrics", headers=admin)).text
    assert 'route="/v1/runs/{run_id}/snapshots/{snapshot_id}?wait_s"' in exposed
    assert 'route="/v1/runs/{run_id}/snapshots/{snapshot_id}"' in exposed


@pytest.mark.parametrize(
    ("query", "field"),
    [("wait_s=5", "watch_token"), ("watch_token=x", "wait_s"), ("wait_s=21&watch_token=x", "wait_s"), ("wait_s=0&watch_token=x", "wait_s"),
     ("wait_s=1&watch_token=", "watch_token")],
)
async def test_a_bad_wait_is_a_clear_422(client, admin, query: str, field: str) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    await api.register_placeholders("math/replica-0")
    await api.post("/snapshots", {"snapshot_id": "s1", "anchor_step": 0}, expect=202)
    r = await client.get(f"/v1/runs/run-1/snapshots/s1?{query}", headers=api.h)
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_request" and field in {e["field"].split(".")[-1] for e in r.json()["errors"]}, r.text
    missing = await client.get("/v1/runs/run-1/snapshots/nope?wait_s=1&watch_token=x", headers=api.h)
    assert missing.status_code == 404 and missing.json()["code"] == "snapshot_not_found"


@pytest.mark.parametrize("finished", [False, True], ids=["still-running", "finished-before-the-barrier"])
async def test_a_lease_that_lapses_before_the_barrier(client, admin, app, tmp_path: Path, finished: bool) -> None:  # type: ignore[no-untyped-def]
    """Gym committed, then its lease ran out before the trainer's barrier, so Gym resumed on its
    own. With the saved episodes still running at the barrier the snapshot publishes and its
    detail names the participants that lapsed; with saved episodes finished (sealed) before the
    barrier, the ledger cut and the Gym manifest disagree, and the snapshot fails ``lease_lost``
    instead of publishing a Gym state no restore could continue."""
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.05, lease_grace_seconds=10))
    try:
        iid = gym.instance_id
        api = await new_run(client, admin, target_level="turn", control_timeout_s=10, drain_timeout_s=20, data_plane_timeout_s=20)
        await register_by_discovery(app.state.engine, "run-1", [gym])
        trainer = Trainer(api, {iid: gym}, turns=8 if finished else 400)
        rows = await trainer.admit_and_dispatch([group_body("g1", 2)], iid)
        await asyncio.sleep(0.2)  # a few turns in
        r = await api.c.post(f"/v1/runs/{api.run_id}/snapshots", json={"snapshot_id": "s1", "anchor_step": 0}, headers=api.h)
        assert r.status_code in (200, 202), r.text
        async with asyncio.timeout(30):
            while (await api.get("/snapshots/s1"))["awaiting"] != "barrier":
                await asyncio.sleep(0.02)
        saved = {e["rollout_id"] for e in (await api.get("/snapshots/s1?manifest=true"))["gym_manifest"]["instances"][iid]["episodes"]}
        assert saved == {x["rollout_id"] for x in rows}
        # Gym's clock runs past its leases: it resumes on its own.
        await asyncio.to_thread(gym.admin, "POST", "/admin/clock", {"advance": 3600})
        if finished:
            await trainer.wait_idle()  # the saved episodes finish and are sealed before the barrier
        snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
        for t in list(trainer.tasks):
            t.cancel()
        await trainer.aclose()
        lapsed = snap["detail"]["lease_lapsed"]
        assert set(lapsed) == {iid} and set(lapsed[iid]) == {"policy_model", "workplace_agent", "calendar_resources"}, snap["detail"]
        if finished:
            assert (snap["outcome"], snap["reason"]) == ("failed", "lease_lost"), snap
            assert snap["detail"]["ended_count"] == 2 and set(snap["detail"]["ended_samples"]) == saved
        else:
            assert (snap["outcome"], snap["reason"]) == ("published", "ok"), snap
            for server in lapsed[iid]:
                assert any(f"{iid}/{server}: lease lapsed" in w for w in snap["detail"]["warnings"]), snap["detail"]["warnings"]
    finally:
        gym.stop()
