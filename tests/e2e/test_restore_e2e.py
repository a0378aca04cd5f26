"""Restore end to end: gymsim processes with live multi-turn /run traffic, a snapshot through the
coordinator's own choreography, a crash of the trainer and of one Gym instance, fresh Gym
processes registered again, and the restore (docs/ledger.md#restore,
docs/gym-protocol.md#restore)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gymsim.testing import GymsimInstance, default_instance_config

from ..integration.ledger_helpers import group_body, new_run
from ..integration.test_restore_support import fetch
from .harness import Trainer, kill_all, published_snapshot, wait_mid_way

pytestmark = pytest.mark.timeout(240)

TURNS = 12
IDS = ("math/replica-0", "math/replica-1")


def _start(iid: str, profile: str) -> GymsimInstance:
    config = default_instance_config(iid, token=f"tok-{iid[-1]}", turn_seconds=0.1, lease_grace_seconds=10, gym_profile=profile)
    return GymsimInstance.start(config, subprocess=True)


def _registration(*gyms: GymsimInstance) -> dict[str, Any]:
    return {"instances": [{"instance_id": g.instance_id, "control_token": g.token, "servers": g.servers} for g in gyms]}


async def _state(g: GymsimInstance, path: str = "/state") -> dict[str, Any]:
    return await asyncio.to_thread(g.admin, "GET", path)


@pytest.mark.parametrize("profile", ["published", "pinned", "strict"])
async def test_restore_after_trainer_and_gym_crash(client, admin, app, tmp_path: Path, profile: str) -> None:  # type: ignore[no-untyped-def]
    gyms = {iid: _start(iid, profile) for iid in IDS}
    fresh: dict[str, GymsimInstance] = {}
    trainer: Trainer | None = None
    try:
        api = await new_run(
            client, admin, target_level="turn", control_timeout_s=10, drain_timeout_s=20, data_plane_timeout_s=20,
            agent_target_level_overrides={"sib_agent": "sibling"},
        )
        reg = await api.post("/gym-instances", _registration(*gyms.values()))
        # Published Gym: the model and the agent report no mode (P3,
        # docs/gym-protocol.md#what-differs-rule-by-rule).
        assert all("reports no checkpoint mode" in w for w in reg["warnings"])
        assert len(reg["warnings"]) == (0 if profile == "strict" else 4)
        assert all(len(i["participants"]) == 3 for i in reg["instances"])

        # Live traffic: per instance, one short turn-level group that finishes before the snapshot
        # and long ones that are mid-way when it is taken, plus a sibling-level group.
        trainer = Trainer(api, gyms, turns=1)
        early = {}
        for iid in IDS:
            early[iid] = await trainer.admit_and_dispatch([group_body(f"early{iid[-1]}", 2)], iid)
        await trainer.wait_idle()
        trainer.turns = TURNS
        for iid in IDS:
            tag = iid[-1]
            await trainer.admit_and_dispatch([group_body(f"t{tag}{k}", 2) for k in range(3)], iid)
            await trainer.admit_and_dispatch([group_body(f"s{tag}", 2, agent_name="sib_agent")], iid)
        await wait_mid_way(gyms, TURNS)
        saved = await published_snapshot(api, tmp_path / "dp")
        manifest = (await api.get("/snapshots/s1?manifest=true"))["gym_manifest"]
        assert (await api.get("/snapshots/s1/gym-manifest"))["instances"] == manifest["instances"]
        await asyncio.sleep(0.15)  # traffic goes on after the snapshot: more turns, some seals

        # Crash: the trainer dies (its /run calls drop) and so does replica-0's Gym process.
        for t in list(trainer.tasks):
            t.cancel()
        await asyncio.gather(*list(trainer.tasks), return_exceptions=True)
        await trainer.http.aclose()
        trainer = None
        await asyncio.to_thread(gyms["math/replica-0"].kill)
        fresh["math/replica-0"] = _start("math/replica-0", profile)
        assert fresh["math/replica-0"].servers != gyms["math/replica-0"].servers  # a new port
        await api.post("/gym-instances", _registration(fresh["math/replica-0"]))

        # replica-1 kept running: Gym state cannot be installed there; the refusal names it and
        # leaves everything as it was.
        refused = await api.post("/restores", {"restore_id": "r1", "step": 0}, 409)
        assert refused["code"] == "gym_not_fresh" and refused["instances"] == ["math/replica-1"]
        assert (await _state(fresh["math/replica-0"]))["servers"]["workplace_agent"]["restore_calls"] == 0

        # The operator restarts replica-1 as well; the restore goes through.
        await asyncio.to_thread(gyms["math/replica-1"].kill)
        fresh["math/replica-1"] = _start("math/replica-1", profile)
        await api.post("/gym-instances", _registration(fresh["math/replica-1"]))
        plan = await api.get("/restore-plan?step=0")
        ans = await api.post("/restores", {"restore_id": "r2", "step": 0})
        assert ans["gym"]["installed"] is True and ans["gym"]["resume"]["ok"], ans["gym"]
        assert ans["snapshot_id"] == "s1" and ans["counts"] == plan["counts"]
        cont = [r for r in ans["rows"] if r["disposition"] == "continued"]
        for iid in IDS:
            mine = [r for r in cont if r["instance_id"] == iid]
            assert {r["rollout_id"] for r in mine} == saved[iid]
            assert all(r["gym_attempt"] == 1 and r["capture_key"] == r["rollout_id"] + "-a1" for r in mine)
        # Sealed siblings are reused: the early groups keep their sealed attempts.
        for iid in IDS:
            g = await api.group(f"early{iid[-1]}")
            assert g["status"] == "ready"
            assert {a["rollout_id"] for s in g["siblings"] for a in s["attempts"] if a["is_current"]} == {r["rollout_id"] for r in early[iid]}
        run = await api.get("")
        assert run["restored_from_rollout_snapshot"] == "s1" and run["dispatch_gate"]["open"]

        # A continuation sent to another instance than the one holding its Gym state is refused,
        # naming the instance it lives on, and nothing is written.
        stray = next(r for r in cont if r["instance_id"] == "math/replica-0")
        wrong = await api.post(
            "/attempts/dispatch", {"dispatch_id": "d-wrong", "instance_id": "math/replica-1", "rollout_ids": [stray["rollout_id"]]}, 409
        )
        assert [(x["rollout_id"], x["code"]) for x in wrong["rows"]] == [(stray["rollout_id"], "wrong_instance")], wrong
        assert "math/replica-0" in wrong["rows"][0]["detail"]
        assert (await api.group(stray["group_id"]))["status"] == "generating"

        # The restarted trainer sends what the answer says: continuations to their own instance.
        trainer = Trainer(api, fresh, turns=TURNS)
        for iid in IDS:
            await trainer.dispatch([r for r in ans["rows"] if r["instance_id"] == iid], iid)
        others = [r for r in ans["rows"] if r["instance_id"] is None]
        if others:
            await trainer.dispatch(others, "math/replica-0")
        await trainer.wait_idle(60)
        for iid in IDS:
            sessions = (await _state(fresh[iid], "/resources/calendar_resources/sessions"))["sessions"]
            for r in cont:
                if r["instance_id"] != iid:
                    continue
                reply = trainer.replies[r["capture_key"]]
                k = reply["resumed_from_turn"]
                assert reply["turns_completed"] == TURNS and k is not None and 0 < k < TURNS, reply
                hist = sessions[r["capture_key"]]["history"]
                # No mutation applied twice: every turn once, the saved ones at attempt 0.
                assert [h["turn"] for h in hist] == list(range(TURNS))
                assert [h["attempt"] for h in hist] == [0] * k + [1] * (TURNS - k)
        counts = await api.get("/counts")
        assert set(counts["live_attempts"]) == {"sealed"}, counts
        # The restored rollouts are forgotten on their instance once sealed (docs/ledger.md#the-outbox).
        rows = await fetch(app.state.engine, "SELECT rollout_id, retirement FROM attempts WHERE rollout_id = ANY(:ids)", ids=[r["rollout_id"] for r in cont])
        assert len(rows) == len(cont) and {r["retirement"] for r in rows} <= {"forget_pending", "forgotten"}, rows
    finally:
        if trainer is not None:
            await trainer.aclose()
        await kill_all(*gyms.values(), *fresh.values())
