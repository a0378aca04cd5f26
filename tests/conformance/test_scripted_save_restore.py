"""Scripted save and restore across 2 instances x 4 participants with 100 in-flight multi-turn
episodes; one instance is SIGKILLed between snapshot and restore. Every exported episode continues
at attempt N+1 on its own instance from its saved turn, and each mutation shows exactly once."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from checkpoint_coordinator.gym.client import GymControlClient
from checkpoint_coordinator.gym.models import Episode, InstanceSpec
import gymsim.testing
from gymsim.testing import GymsimInstance
from .sequenced import SequencedGymSave

pytestmark = pytest.mark.timeout(240)
TURNS = 6


def _config(iid: str, token: str) -> dict:  # type: ignore[type-arg]
    return {
        "instance_id": iid,
        "token": token,
        "gym_profile": gymsim.testing.DEFAULT_GYM_PROFILE,
        "lease_grace_seconds": 60,
        "turn_seconds": 0.25,
        "default_turns": TURNS,
        "servers": [
            {"server_name": "policy_model", "kind": "model", "mode": "exported"},
            {"server_name": "workplace_agent", "kind": "agent", "mode": "exported", "resources_server": "calendar_resources"},
            {"server_name": "calendar_resources", "kind": "resources", "mode": "exported"},
            {"server_name": "notes_resources", "kind": "resources", "mode": "exported"},
            {"server_name": "judge_model", "kind": None},
        ],
    }


async def test_save_kill_restore_continue(tmp_path: Path) -> None:
    ids = ["math/replica-0", "math/replica-1"]
    tokens = {ids[0]: "tok-a", ids[1]: "tok-b"}
    gyms = {iid: GymsimInstance.start(_config(iid, tokens[iid]), subprocess=True) for iid in ids}
    fresh: dict[str, GymsimInstance] = {}
    http = httpx.AsyncClient(timeout=120)
    try:
        async with GymControlClient(control_timeout_s=30, prepare_timeout_s=30) as gc:
            topo = await gc.discover_all([InstanceSpec(iid, tokens[iid], g.servers) for iid, g in gyms.items()])
            assert all(len(t.participants) == 4 for t in topo.values())
            episodes = {iid: [f"g{k}_g0_a{(i * 1000 + k):032x}" for k in range(50)] for i, iid in enumerate(ids)}

            async def run(iid: str, rid: str, attempt: int) -> httpx.Response:
                body = {"_ng_rollout_id": rid, "_ng_attempt_index": attempt, "task": {"rid": rid}, "turns": TURNS}
                return await http.post(gyms_now[iid].servers["workplace_agent"] + "/run", json=body)

            gyms_now = dict(gyms)
            runs = [asyncio.create_task(run(iid, rid, 0)) for iid in ids for rid in episodes[iid]]
            # wait until most episodes are a couple of turns in, however loaded the machine is
            async with asyncio.timeout(60):
                while True:
                    progressed = 0
                    for iid in ids:
                        got = await asyncio.to_thread(gyms[iid].admin, "GET", "/admin/resources/calendar_resources/sessions")
                        progressed += sum(len(h["history"]) >= 2 for h in got["sessions"].values())
                    if progressed >= 80:
                        break
                    await asyncio.sleep(0.1)

            async def drain(pending: dict[str, set[Episode]]) -> None:
                # replies on the wire when Gym parked: let them come back (the trainer seals them)
                while any(pending.values()):
                    done = {t.result().json()["rollout_id"] for t in runs if t.done() and t.result().status_code == 200}
                    for eps in pending.values():
                        eps.difference_update({e for e in eps if e.rollout_id in done})
                    await asyncio.sleep(0.05)

            saved_turns: dict[str, dict[str, int]] = {}

            async def capture(manifest: dict) -> None:  # type: ignore[type-arg]
                # Gym is still parked here: the sessions' histories are exactly what was exported.
                for iid in ids:
                    got = await asyncio.to_thread(gyms[iid].admin, "GET", "/admin/resources/calendar_resources/sessions")
                    saved_turns[iid] = {sid: len(h["history"]) for sid, h in got["sessions"].items()}

            snapshot_dir = str(tmp_path / "snap-1")
            save = SequencedGymSave(
                gc, topo, snapshot_dir=snapshot_dir,
                candidates={iid: [Episode(r, 0) for r in episodes[iid]] for iid in ids},
                drain_hook=drain, capture_hook=capture, drain_timeout_s=60, write_manifest_file=True,
            )
            result = await save.run()
            manifest = dict(result.manifest)
            exported = {iid: {e["rollout_id"]: e["attempt"] for e in manifest["instances"][iid]["episodes"]} for iid in ids}
            assert sum(len(v) for v in exported.values()) >= 60, exported  # most episodes were parked mid-way

            # kill one instance outright, stop the other: restore needs fresh servers everywhere
            gyms["math/replica-1"].kill()
            gyms["math/replica-0"].stop()
            for t in runs:
                t.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            fresh = {iid: GymsimInstance.start(_config(iid, tokens[iid]), subprocess=True) for iid in ids}
            gyms_now.update(fresh)
            topo2 = await gc.discover_all([InstanceSpec(iid, tokens[iid], g.servers) for iid, g in fresh.items()])
            restored = await gc.restore(manifest, topo2, snapshot_dir)
            assert restored.source_checkpoint_id == manifest["checkpoint_id"] and restored.restore_id != manifest["checkpoint_id"]
            for iid in ids:
                assert {e.rollout_id: e.attempt for e in restored.continued[iid]} == {r: a + 1 for r, a in exported[iid].items()}

            # A straggler of a saved attempt N is refused before its continuation claims the state:
            # by the mark the restore raised (strict), or by the restored binding (published).
            any_iid = ids[1]
            rid = next(iter(exported[any_iid]))
            early = await run(any_iid, rid, exported[any_iid][rid])
            assert early.status_code == 409 and "stale_attempt" in early.text, early.text

            conts = [asyncio.create_task(run(iid, rid, a + 1)) for iid in ids for rid, a in exported[iid].items()]
            replies = await asyncio.gather(*conts)
            for resp in replies:
                assert resp.status_code == 200, resp.text
                row = resp.json()
                assert row["attempt"] == 1 and row["turns_completed"] == TURNS
                assert row["resumed_from_turn"] is not None
                assert row["resumed_from_turn"] == saved_turns[next(i for i in ids if row["rollout_id"] in exported[i])].get(row["rollout_id"], 0)

            assert sum(r.json()["resumed_from_turn"] > 0 for r in replies) >= len(replies) // 2  # mid-episode saves
            for iid in ids:
                sessions = fresh[iid].admin("GET", "/admin/resources/calendar_resources/sessions")["sessions"]
                for rid in exported[iid]:
                    history = [h for sess in sessions.values() for h in sess["history"] if h["rollout_id"] == rid]
                    key = rid
                    turns = Counter(h["turn"] for h in history)
                    assert sorted(turns) == list(range(TURNS)), (key, history)
                    assert max(turns.values()) == 1, (key, turns)  # no mutation applied twice
                    # turns before the saved one came from the restored state, the rest from attempt 1
                    saved = saved_turns[iid].get(rid, 0)
                    assert [h["attempt"] for h in sorted(history, key=lambda h: h["turn"])] == [0] * saved + [1] * (TURNS - saved), (key, history)
            # After the continuation ended only a mark still refuses N: strict Gym keeps one, published
            # Gym none (P5, docs/gym-protocol.md#what-differs-rule-by-rule: the coordinator's ledger
            # refuses such a seal instead).
            if gymsim.testing.DEFAULT_GYM_PROFILE == "strict":
                stale = await run(any_iid, rid, exported[any_iid][rid])
                assert stale.status_code == 409 and "stale_attempt" in stale.text
    finally:
        await http.aclose()
        for g in list(gyms.values()) + list(fresh.values()):
            try:
                g.stop()
            except Exception:
                pass
