"""Restore with Gym state (docs/ledger.md#restore, docs/gym-protocol.md#restore) against
in-process gymsim: a real Gym save through the control client, a crash, fresh instances, then the
restore."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymsim.testing import GymsimInstance

from .ledger_helpers import RunApi, group_body, new_run
from .test_restore_support import Player, fetch, gym_save, register, start_gym, wait_dispatched_at_boundary

TURNS = 30


@dataclass
class Scene:
    api: RunApi
    engine: Any
    gyms: dict[str, GymsimInstance]
    player: Player
    rows: dict[str, list[dict[str, Any]]]
    manifest: dict[str, Any]
    snapshot_dir: Path
    fresh: dict[str, GymsimInstance] = field(default_factory=dict)

    def all_gyms(self) -> list[GymsimInstance]:
        return list(self.gyms.values()) + list(self.fresh.values())


async def _scene(client: Any, admin: Any, app: Any, tmp_path: Path, instances: tuple[str, ...] = ("math/replica-0",)) -> Scene:
    api = await new_run(client, admin, target_level="turn", agent_target_level_overrides={"sib_agent": "sibling"}, control_timeout_s=10)
    gyms = {iid: start_gym(iid, turn_seconds=0.02) for iid in instances}
    await register(api, *gyms.values())
    player = Player(api, gyms, turns=TURNS)
    rows: dict[str, list[dict[str, Any]]] = {}
    for k, iid in enumerate(instances):
        admitted = (await api.admit(group_body(f"T{k}", 3), group_body(f"S{k}", 2, agent_name="sib_agent")))["groups"]
        t, s = admitted[0]["rows"], admitted[1]["rows"]
        rows[f"T{k}"], rows[f"S{k}"] = t, s
        await api.dispatch([r["rollout_id"] for r in t + s], iid)
        player.play(t[:1], iid, turns=1)  # finishes and seals before the save
        player.play(t[1:] + s, iid)
    for k in range(len(instances)):
        await player.tasks[rows[f"T{k}"][0]["capture_key"]]
    await wait_dispatched_at_boundary(gyms.values(), min_turn=2)
    snap_dir = tmp_path / "snapshots" / "s1"
    manifest = await gym_save(app.state.engine, api.run_id, "s1", gyms.values(), snap_dir, player, anchor_step=4)
    return Scene(api, app.state.engine, gyms, player, rows, manifest, snap_dir)


async def _crash(scene: Scene, *, restart: tuple[str, ...] | None = None, **fresh_overrides: Any) -> None:
    """The trainer dies and the named Gym instances (default: all) are killed and started
    fresh (new ports), then registered again."""
    await scene.player.stop()
    names = tuple(scene.gyms) if restart is None else restart
    for iid in names:
        await asyncio.to_thread(scene.gyms[iid].kill)
    for iid in names:
        overrides = fresh_overrides.get(iid.replace("/", "_").replace("-", "_"), {})
        scene.fresh[iid] = start_gym(iid, turn_seconds=0.02, **overrides)
    live = {**scene.gyms, **scene.fresh}
    if names:
        await register(scene.api, *(live[i] for i in names))


def _stop_all(scene: Scene) -> None:
    for g in scene.all_gyms():
        try:
            g.stop()
        except Exception:
            pass


async def _fingerprint(scene: Scene) -> Any:
    run = scene.api.run_id
    return (
        await fetch(scene.engine, "SELECT attempt_id, status, is_current, rollout_id, gym_attempt, gym_owned, retirement FROM attempts WHERE run_id = :r ORDER BY attempt_id", r=run),
        await fetch(scene.engine, "SELECT group_id, status, group_attempt FROM prompt_groups WHERE run_id = :r ORDER BY group_id", r=run),
        await fetch(scene.engine, "SELECT epoch, restored_from_rollout_snapshot FROM runs WHERE run_id = :r", r=run),
        await fetch(scene.engine, "SELECT item_id FROM outbox_items WHERE run_id = :r ORDER BY item_id", r=run),
    )


def _saved(manifest: dict[str, Any]) -> dict[str, set[str]]:
    return {iid: {e["rollout_id"] for e in body["episodes"]} for iid, body in manifest["instances"].items()}


async def test_restore_continues_exported_episodes_on_their_instance(client, admin, app, tmp_path) -> None:  # type: ignore[no-untyped-def]
    scene = await _scene(client, admin, app, tmp_path)
    try:
        iid = "math/replica-0"
        T = scene.rows["T0"]
        saved = _saved(scene.manifest)[iid]
        assert saved == {T[1]["rollout_id"], T[2]["rollout_id"]}
        assert (scene.snapshot_dir / "gym-instances" / iid / "gym").is_dir()
        await _crash(scene)
        preview = await scene.api.get("/restore-plan")
        ans = await scene.api.post("/restores", {"restore_id": "r1", "step": 4})
        gym = scene.fresh[iid]
        assert ans["gym"]["installed"] is True and ans["gym"]["restore_id"].startswith("restore-")
        assert ans["gym"]["source_checkpoint_id"] == scene.manifest["checkpoint_id"] and ans["gym"]["resume"]["ok"]
        assert ans["counts"] == {"reused": 1, "continued": 2, "restarted": 0, "gym_restarted": 0, "rerun": 2, "dispatch": 0}
        assert ans["rows"] == preview["rows"]
        cont = [r for r in ans["rows"] if r["disposition"] == "continued"]
        assert {r["rollout_id"] for r in cont} == saved
        assert all(r["gym_attempt"] == 1 and r["instance_id"] == iid and r["capture_key"] == r["rollout_id"] + "-a1" for r in cont)
        # Gym holds the N+1 state unclaimed and was resumed; strict Gym also marks N, published Gym
        # does not (P5, docs/gym-protocol.md#what-differs-rule-by-rule): its restored binding
        # refuses N while it waits.
        agent = await asyncio.to_thread(gym.state, "workplace_agent")
        assert agent["phase"] == "idle" and agent["admission_open"] is True
        assert set(agent["unclaimed"]) == {r["capture_key"] for r in cont}
        assert agent["marks"] == ({r: 0 for r in saved} if gym.config.gym_profile == "strict" else {})
        # With no mark to rely on, the ledger is what refuses a late seal of the saved attempt N.
        late = await scene.api.post(
            "/attempts/sealed", {"rows": [{"rollout_id": cont[0]["rollout_id"], "receipt": {"rollout_id": cont[0]["rollout_id"]}}]}, 409
        )
        assert late["rows"][0]["code"] == "receipt_mismatch", late
        # The ledger: Gym-owned reserved continuations on their instance.
        live = {x["rollout_id"]: x for x in await fetch(scene.engine, "SELECT * FROM attempts WHERE run_id = :r AND is_current", r=scene.api.run_id)}
        for r in cont:
            a = live[r["rollout_id"]]
            assert (a["status"], a["gym_attempt"], a["gym_owned"], a["gym_instance_id"]) == ("reserved", 1, True, iid)
        # A repeat answers the stored result and touches Gym no more.
        calls = agent["restore_calls"]
        assert await scene.api.post("/restores", {"restore_id": "r1", "step": 4}) == (await scene.api.get("/restores/r1"))["answer"]
        assert (await asyncio.to_thread(gym.state, "workplace_agent"))["restore_calls"] == calls
        # The trainer sends the continuations to their instance; each continues from its saved turn.
        player = Player(scene.api, {iid: gym}, turns=TURNS)
        await scene.api.dispatch([r["rollout_id"] for r in cont], iid)
        player.play(cont, iid)
        await asyncio.gather(*player.tasks.values())
        for r in cont:
            reply = player.replies[r["capture_key"]]
            assert reply["capture_key"] == r["capture_key"] and reply["turns_completed"] == TURNS
            assert reply["resumed_from_turn"] is not None and reply["resumed_from_turn"] >= 2
        # No mutation applied twice: each session's history holds every turn exactly once.
        sessions = (await asyncio.to_thread(gym.admin, "GET", "/resources/calendar_resources/sessions"))["sessions"]
        for r in cont:
            hist = sessions[r["capture_key"]]["history"]
            k = player.replies[r["capture_key"]]["resumed_from_turn"]
            assert [h["turn"] for h in hist] == list(range(TURNS))
            assert [h["attempt"] for h in hist] == [0] * k + [1] * (TURNS - k)
        await player.stop()
        sealed = await fetch(scene.engine, "SELECT attempt_id, status FROM attempts WHERE run_id = :r AND rollout_id = ANY(:ids)", r=scene.api.run_id, ids=list(saved))
        assert {x["status"] for x in sealed} == {"sealed"}
        # Once sealed, the restored rollouts are forgotten on their instance: the seal queued it.
        from checkpoint_coordinator.rollouts.store import forget_restored_on_seal

        async with scene.engine.begin() as conn:
            assert await forget_restored_on_seal(conn, scene.api.run_id, [x["attempt_id"] for x in sealed]) == 0  # already queued
        forgets = await fetch(scene.engine, "SELECT rollout_id, instance_id FROM outbox_items WHERE run_id = :r AND op = 'forget'", r=scene.api.run_id)
        assert {(f["rollout_id"], f["instance_id"]) for f in forgets} == {(r, iid) for r in saved}
    finally:
        _stop_all(scene)


async def test_failed_restore_on_one_instance_turns_every_continuation_into_a_restart(client, admin, app, tmp_path) -> None:  # type: ignore[no-untyped-def]
    scene = await _scene(client, admin, app, tmp_path, ("math/replica-0", "math/replica-1"))
    try:
        fault = [{"server_name": "workplace_agent", "op": "restore", "type": "error", "status": 500, "detail": "disk on fire"}]
        await _crash(scene, math_replica_1={"faults": fault})
        saved = _saved(scene.manifest)
        assert all(len(v) == 2 for v in saved.values())
        ans = await scene.api.post("/restores", {"restore_id": "r1"})
        assert ans["state"] == "applied" and ans["gym"]["installed"] is False and ans["gym"]["continuations_retired"] is True
        assert "math/replica-1" in ans["gym"]["failure"]["instances"]
        # The cleanup's resume was sent, and the answer says how it went.
        assert ans["gym"]["resume"] == {"ok": True, "failure": None}
        assert (await scene.api.get("/restores/r1"))["answer"]["gym"]["resume"] == {"ok": True, "failure": None}
        assert ans["counts"] == {"reused": 2, "continued": 0, "restarted": 4, "gym_restarted": 0, "rerun": 4, "dispatch": 0}
        restarted = {r["replaces_rollout_id"]: r for r in ans["rows"] if r["disposition"] == "restarted"}
        assert set(restarted) == saved["math/replica-0"] | saved["math/replica-1"]
        assert all(r["rollout_id"] != old and r["instance_id"] is None for old, r in restarted.items())
        # Each says why: the Gym restore failed, so its continuations restart.
        assert {r["reason"] for r in restarted.values()} == {"gym_restore_failed"}
        assert ans["reasons"]["restarted"] == {"gym_restore_failed": 4}
        # Nothing half-installed: no instance holds restored state; every N+1 is retired (mark 1).
        for iid, gym in scene.fresh.items():
            state = await asyncio.to_thread(gym.state)
            for name in ("policy_model", "workplace_agent", "calendar_resources"):
                s = state["servers"][name]
                assert s["phase"] == "idle" and s["unclaimed"] == [] and s["admission_open"], (iid, name, s)
                assert s["marks"] == {r: 1 for r in saved[iid]}, (iid, name, s["marks"])
        # The ledger: each replaced attempt gave way to a new one, reserved under its new id; the
        # old ones are retired on their instance.
        live = {x["rollout_id"]: x for x in await fetch(scene.engine, "SELECT * FROM attempts WHERE run_id = :r", r=scene.api.run_id)}
        for old, r in restarted.items():
            assert old not in live
            assert live[r["rollout_id"]]["status"] == "reserved" and live[r["rollout_id"]]["is_current"] and not live[r["rollout_id"]]["gym_owned"]
        retires = await fetch(scene.engine, "SELECT rollout_id, gym_attempt, instance_id FROM outbox_items WHERE run_id = :r AND op = 'retire'", r=scene.api.run_id)
        assert {(x["rollout_id"], x["instance_id"]) for x in retires} >= {(r, iid) for iid, rs in saved.items() for r in rs}
        # The restarted rows run from their tasks on any instance.
        run_rows = list(restarted.values())[:1]
        await scene.api.dispatch([r["rollout_id"] for r in run_rows], "math/replica-0")
        player = Player(scene.api, {"math/replica-0": scene.fresh["math/replica-0"]}, turns=2)
        player.play(run_rows, "math/replica-0")
        await asyncio.gather(*player.tasks.values())
        assert player.replies[run_rows[0]["capture_key"]]["resumed_from_turn"] is None
        await player.stop()
    finally:
        _stop_all(scene)


async def test_checks_before_gym_is_touched_name_what_is_wrong(client, admin, app, tmp_path) -> None:  # type: ignore[no-untyped-def]
    scene = await _scene(client, admin, app, tmp_path)
    iid = "math/replica-0"
    api = scene.api
    try:
        await scene.player.stop()
        before = await _fingerprint(scene)

        async def refused(expect: int, code: str, **body: Any) -> dict[str, Any]:
            r = await api.post("/restores", {"restore_id": "r1", **body}, expect)
            assert r["code"] == code, r
            assert await _fingerprint(scene) == before
            assert (await fetch(scene.engine, "SELECT count(*) AS n FROM restores WHERE run_id = :r", r=api.run_id))[0]["n"] == 0
            return r

        # The instances kept running: not fresh, named.
        r = await refused(409, "gym_not_fresh")
        assert r["instances"] == [iid] and any(s.startswith(f"{iid}/") for s in r["servers"])
        assert (await asyncio.to_thread(scene.gyms[iid].state, "workplace_agent"))["restore_calls"] == 0

        # The crashed instance's old address: discovery fails, naming the servers.
        await asyncio.to_thread(scene.gyms[iid].kill)
        r = await refused(502, "gym_unavailable")
        assert f"{iid}/policy_model" in r["servers"]

        # A live instance the snapshot does not know, and one it knows that is not registered.
        extra = start_gym("math/replica-9")
        scene.fresh["math/replica-9"] = extra
        await register(api, extra)
        r = await refused(409, "gym_topology_mismatch")
        assert r["unknown_instances"] == ["math/replica-9"] and r["missing_instances"] == []
        await client.delete(f"/v1/runs/{api.run_id}/gym-instances/math/replica-9", headers=api.h)
        await client.delete(f"/v1/runs/{api.run_id}/gym-instances/{iid}", headers=api.h)
        r = await refused(409, "gym_topology_mismatch")
        assert r["missing_instances"] == [iid] and iid in r["detail"]

        # A participant that committed the instance is missing from the fresh deployment.
        no_res = start_gym(
            iid,
            servers=[
                {"server_name": "policy_model", "kind": "model", "mode": "exported"},
                {"server_name": "workplace_agent", "kind": "agent", "mode": "exported"},
                {"server_name": "calendar_resources", "kind": None},
            ],
        )
        scene.fresh[iid] = no_res
        await register(api, no_res)
        r = await refused(409, "gym_participants_missing")
        assert r["missing_participants"] == {iid: ["calendar_resources"]} and "calendar_resources" in r["detail"]
        assert (await asyncio.to_thread(no_res.state, "workplace_agent"))["restore_calls"] == 0

        # Without Gym state the same deployment is fine: nothing is installed on Gym.
        ans = await api.post("/restores", {"restore_id": "r2", "with_gym_state": False})
        assert ans["gym"]["installed"] is False and ans["counts"]["continued"] == 0 and ans["counts"]["restarted"] == 2
        assert (await asyncio.to_thread(no_res.state, "workplace_agent"))["restore_calls"] == 0
    finally:
        _stop_all(scene)


async def test_gym_refusing_as_not_fresh_refuses_the_restore(client, admin, app, tmp_path) -> None:  # type: ignore[no-untyped-def]
    scene = await _scene(client, admin, app, tmp_path)
    iid = "math/replica-0"
    try:
        # Looks fresh from its status, but Gym itself says it has served work.
        servers = [
            {"server_name": "policy_model", "kind": "model", "mode": "exported", "non_fresh": True},
            {"server_name": "workplace_agent", "kind": "agent", "mode": "exported"},
            {"server_name": "calendar_resources", "kind": "resources", "mode": "exported"},
            {"server_name": "judge_model", "kind": None},
        ]
        await _crash(scene, math_replica_0={"servers": servers})
        before = await _fingerprint(scene)
        r = await scene.api.post("/restores", {"restore_id": "r1"}, 409)
        assert r["code"] == "gym_not_fresh" and r["servers"] == [f"{iid}/policy_model"]
        assert await _fingerprint(scene) == before
        # Gym was touched and cleaned up: the refusal is the answer of this restore id from now on.
        again = await scene.api.post("/restores", {"restore_id": "r1"}, 409)
        assert again == r
        assert (await scene.api.get("/restores/r1"))["state"] == "refused"
        for name in ("workplace_agent", "calendar_resources"):
            s = await asyncio.to_thread(scene.fresh[iid].state, name)
            assert s["phase"] == "idle" and s["unclaimed"] == [] and s["admission_open"]
        # Those instances now hold marks, so a new attempt with Gym state is refused before Gym.
        r2 = await scene.api.post("/restores", {"restore_id": "r2"}, 409)
        assert r2["code"] == "gym_not_fresh" and "marks" in r2["detail"]
        ans = await scene.api.post("/restores", {"restore_id": "r3", "with_gym_state": False})
        assert ans["state"] == "applied"
    finally:
        _stop_all(scene)


async def test_snapshot_gym_manifest_export(client, admin, app, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from checkpoint_coordinator.restore.gym_manifest_file import read_gym_manifest, write_gym_manifest

    scene = await _scene(client, admin, app, tmp_path)
    try:
        await scene.player.stop()
        doc = await scene.api.get("/snapshots/s1/gym-manifest")
        assert doc["schema_version"] == 2 and doc["checkpoint_id"] == scene.manifest["checkpoint_id"]
        assert doc["instances"] == scene.manifest["instances"]
        path = write_gym_manifest(str(scene.snapshot_dir), doc)
        assert path == str(scene.snapshot_dir / "gym_checkpoint.json")
        raw = Path(path).read_bytes()
        assert raw.startswith(b'{"checkpoint_id"') and not Path(path + ".tmp").exists()
        assert read_gym_manifest(str(scene.snapshot_dir)).checkpoint_id == doc["checkpoint_id"]
        r = await client.get(f"/v1/runs/{scene.api.run_id}/snapshots/nope/gym-manifest", headers=scene.api.h)
        assert r.status_code == 404 and r.json()["code"] == "snapshot_not_found"
    finally:
        _stop_all(scene)
