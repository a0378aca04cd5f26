"""Restore into another Gym topology (docs/ledger.md#another-gym-topology) end to end: three
gymsim instances with live multi-turn traffic, a snapshot, the allocation ends (trainer and every
Gym process die), and the next allocation brings two fresh instances named differently. The
trainer restores through the real client with an instance map; every plan row says why it does
what it does (docs/ledger.md#row-reasons)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckpt_client import AsyncCoordinatorClient, Conflict, InvalidRequest
from gymsim.testing import GymsimInstance, default_instance_config

from ..integration.ledger_helpers import group_body, new_run
from .harness import Trainer, kill_all, published_snapshot, wait_mid_way

pytestmark = pytest.mark.timeout(240)

TURNS = 12
SAVED = ("alloc1/replica-0", "alloc1/replica-1", "alloc1/replica-2")
LIVE = ("alloc2/node-a", "alloc2/node-b")
MAP = {SAVED[0]: LIVE[0], SAVED[1]: LIVE[1]}  # SAVED[2] has nowhere to go


def _start(iid: str, **overrides: Any) -> GymsimInstance:
    config = default_instance_config(iid, token=f"tok-{iid.replace('/', '-')}", turn_seconds=0.1, lease_grace_seconds=10, **overrides)
    return GymsimInstance.start(config, subprocess=True)


def _registration(*gyms: GymsimInstance) -> dict[str, Any]:
    return {"instances": [{"instance_id": g.instance_id, "control_token": g.token, "servers": g.servers} for g in gyms]}


async def _sessions(g: GymsimInstance, prefix: str = "/admin") -> dict[str, Any]:
    return (await asyncio.to_thread(g.admin, "GET", f"{prefix}/resources/calendar_resources/sessions"))["sessions"]


def _client(app: Any, api: Any) -> AsyncCoordinatorClient:
    token = api.h["Authorization"].removeprefix("Bearer ")
    return AsyncCoordinatorClient("http://coordinator", token, run_id=api.run_id, transport=httpx.ASGITransport(app=app), retries=1)


async def _snapshot_of_three(client: Any, admin: Any, tmp_path: Path) -> tuple[Any, dict[str, GymsimInstance], Trainer, dict[str, set[str]], dict[str, list[dict[str, Any]]]]:
    """A turn-level run on the three saved instances, long episodes mid-way, a sibling-level group
    and a group never sent; snapshot ``s1`` published. Answers the run, the instances, the
    trainer, the saved episodes per instance and the never-sent rows."""
    gyms = {iid: _start(iid) for iid in SAVED}
    api = await new_run(
        client, admin, target_level="turn", control_timeout_s=10, drain_timeout_s=20, data_plane_timeout_s=20,
        agent_target_level_overrides={"sib_agent": "sibling"},
    )
    await api.post("/gym-instances", _registration(*gyms.values()))
    trainer = Trainer(api, gyms, turns=TURNS)
    for k, iid in enumerate(SAVED):
        await trainer.admit_and_dispatch([group_body(f"t{k}{j}", 2) for j in range(2)], iid)
        await trainer.admit_and_dispatch([group_body(f"s{k}", 2, agent_name="sib_agent")], iid)
    unsent = await api.admit(group_body("u0", 3), group_body("u1", 3))
    await wait_mid_way(gyms, TURNS)
    saved = await published_snapshot(api, tmp_path / "dp")
    return api, gyms, trainer, saved, {g["group_id"]: g["rows"] for g in unsent["groups"]}


async def _end_allocation(api: Any, gyms: dict[str, GymsimInstance], trainer: Trainer) -> None:
    """The allocation ends: the trainer's calls drop, every Gym process dies, and the next
    allocation's trainer unregisters the instances that are gone."""
    for t in list(trainer.tasks):
        t.cancel()
    await asyncio.gather(*list(trainer.tasks), return_exceptions=True)
    await trainer.http.aclose()
    for g in gyms.values():
        await asyncio.to_thread(g.kill)
    for iid in SAVED:
        r = await api.c.delete(f"/v1/runs/{api.run_id}/gym-instances/{iid}", headers=api.h)
        assert r.status_code == 204, r.text


async def test_restore_into_two_fresh_instances_named_otherwise(client, admin, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api, gyms, trainer, saved, _unsent = await _snapshot_of_three(client, admin, tmp_path)
    fresh: dict[str, GymsimInstance] = {}
    again: Trainer | None = None
    ckpt = _client(app, api)
    try:
        await _end_allocation(api, gyms, trainer)
        fresh = {iid: _start(iid) for iid in LIVE}
        await api.post("/gym-instances", _registration(*fresh.values()))

        # Without a map the live instances must equal the saved ones.
        with pytest.raises(Conflict) as differs:
            await ckpt.restore("r-nomap", step=0, timeout=60)
        assert differs.value.code == "gym_topology_mismatch"

        plan = await ckpt.restore_plan(step=0, instance_map=MAP, include_reused=True)
        assert plan.raw["instance_map"] == MAP
        # Every row says why; the summary counts them per disposition and reason.
        assert all(r.reason for r in plan.rows)
        assert plan.reasons == {
            d: dict(Counter(r.reason for r in plan.rows if r.disposition == d)) for d in {r.disposition for r in plan.rows}
        }
        assert sum(n for per in plan.reasons.values() for n in per.values()) == plan.raw["total"]
        by_reason = {(r.disposition, r.reason) for r in plan.rows}
        assert by_reason >= {("continued", "exported_by_gym"), ("restarted", "instance_not_mapped"), ("dispatch", "never_sent")}

        ans = await ckpt.restore("r-map", step=0, instance_map=MAP, timeout=120)
        assert ans.state == "applied" and ans.raw["gym"]["installed"] is True and ans.raw["instance_map"] == MAP
        rows = ans.rows
        assert {r.rollout_id for r in rows} == {r.rollout_id for r in plan.rows_to_send}  # the restore applies the preview
        cont = [r for r in rows if r.disposition == "continued"]
        # Each mapped instance continues its saved instance's exported episodes, at N+1.
        for saved_iid, live_iid in MAP.items():
            mine = {r.rollout_id for r in cont if r.instance_id == live_iid}
            assert mine == saved[saved_iid]
        assert all(r.gym_attempt == 1 and r.capture_key == f"{r.rollout_id}-a1" and r.reason == "exported_by_gym" for r in cont)
        # The unmapped instance's exported episodes restart under new ids, and say why.
        unmapped = {r.replaces_rollout_id: r for r in rows if r.reason == "instance_not_mapped"}
        assert set(unmapped) == saved[SAVED[2]]
        assert all(r.disposition == "restarted" and r.rollout_id not in saved[SAVED[2]] for r in unmapped.values())
        # Every other row to send names a live instance, in even shares.
        others = [r for r in rows if r.disposition != "continued"]
        share = Counter(r.instance_id for r in others)
        assert set(share) == set(LIVE) and max(share.values()) - min(share.values()) <= 1, share
        # No retire waits for an instance of the old allocation (they are gone).
        outbox = await api.get("/outbox")
        assert all(item["instance_id"] in LIVE for item in outbox["items"]), outbox
        # In the ledger the continuations now live on their mapped instance.
        g = await api.group(cont[0].group_id)
        [current] = [a for s in g["siblings"] for a in s["attempts"] if a["rollout_id"] == cont[0].rollout_id]
        assert current["gym_instance_id"] == cont[0].instance_id and current["gym_owned"]

        # The new allocation's trainer sends what the answer says, where it says.
        again = Trainer(api, fresh, turns=TURNS)
        for iid in LIVE:
            await again.dispatch([r.raw for r in rows if r.instance_id == iid], iid)
        await again.wait_idle(90)
        for live_iid in LIVE:
            sessions = await _sessions(fresh[live_iid], prefix="")
            for r in cont:
                if r.instance_id != live_iid:
                    continue
                reply = again.replies[r.capture_key]
                k = reply["resumed_from_turn"]
                assert reply["turns_completed"] == TURNS and k is not None and 0 < k < TURNS, reply
                hist = sessions[r.capture_key]["history"]
                # No mutation applied twice: every turn once, the saved ones at attempt 0.
                assert [h["turn"] for h in hist] == list(range(TURNS))
                assert [h["attempt"] for h in hist] == [0] * k + [1] * (TURNS - k)
        for r in unmapped.values():
            assert again.replies[r.capture_key]["resumed_from_turn"] is None  # from its task, turn 0
        # Nothing lost: every live row ended sealed.
        counts = await api.get("/counts")
        assert set(counts["live_attempts"]) == {"sealed"}, counts
    finally:
        await ckpt.close()
        if again is not None:
            await again.aclose()
        await kill_all(*gyms.values(), *fresh.values())


async def test_instance_map_refusals_leave_gym_untouched(client, admin, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api, gyms, trainer, _saved, _unsent = await _snapshot_of_three(client, admin, tmp_path)
    fresh: dict[str, GymsimInstance] = {}
    ckpt = _client(app, api)
    try:
        await _end_allocation(api, gyms, trainer)
        # node-b's deployment lacks the resources server that committed the saved instances.
        fresh = {
            LIVE[0]: _start(LIVE[0]),
            LIVE[1]: _start(LIVE[1], servers=[
                {"server_name": "policy_model", "kind": "model", "mode": "exported"},
                {"server_name": "workplace_agent", "kind": "agent", "mode": "exported"},
                {"server_name": "judge_model", "kind": None},
            ]),
        }
        await api.post("/gym-instances", _registration(*fresh.values()))

        async def refused(instance_map: dict[str, str] | list[str], status: int) -> dict[str, Any]:
            if isinstance(instance_map, list):  # the query form, which can name a saved instance twice
                r = await api.c.get(f"/v1/runs/{api.run_id}/restore-plan", params={"step": 0, "instance_map": instance_map}, headers=api.h)
            else:
                r = await api.c.post(f"/v1/runs/{api.run_id}/restores", json={"restore_id": "r-bad", "step": 0, "instance_map": instance_map}, headers=api.h)
            assert r.status_code == status and r.headers["content-type"].startswith("application/problem+json"), r.text
            return r.json()

        twice = await refused([f"{SAVED[0]}={LIVE[0]}", f"{SAVED[0]}={LIVE[1]}"], 422)
        assert twice["code"] == "instance_map_invalid" and SAVED[0] in twice["detail"] and "mapped twice" in twice["detail"]
        same = await refused({SAVED[0]: LIVE[0], SAVED[1]: LIVE[0]}, 422)
        assert same["code"] == "instance_map_invalid" and same["errors"][0]["instances"] == [SAVED[0], SAVED[1]]
        assert LIVE[0] in same["detail"]
        malformed = await refused([f"{SAVED[0]}:{LIVE[0]}"], 422)
        assert malformed["code"] == "instance_map_invalid"
        unknown_saved = await refused({"alloc1/replica-9": LIVE[0]}, 409)
        assert unknown_saved["code"] == "instance_map_unknown_instance" and unknown_saved["unknown_saved_instances"] == ["alloc1/replica-9"]
        unknown_live = await refused({SAVED[0]: "alloc2/node-z"}, 409)
        assert unknown_live["code"] == "instance_map_unknown_instance" and unknown_live["unknown_live_instances"] == ["alloc2/node-z"]
        missing = await refused({SAVED[0]: LIVE[0], SAVED[1]: LIVE[1]}, 409)
        assert missing["code"] == "gym_participants_missing"
        assert missing["missing_participants"] == {LIVE[1]: ["calendar_resources"]} and missing["saved_instances"] == {LIVE[1]: SAVED[1]}
        assert SAVED[1] in missing["detail"] and LIVE[1] in missing["detail"]
        # The client raises the same refusals, typed.
        with pytest.raises(InvalidRequest) as typed:
            await ckpt.restore_plan(step=0, instance_map={SAVED[0]: LIVE[0], SAVED[2]: LIVE[0]})
        assert typed.value.code == "instance_map_invalid"

        # Nothing was touched: no Gym restore call, no restore record, the run as it was.
        for g in fresh.values():
            state = await asyncio.to_thread(g.state)
            assert all(s.get("restore_calls", 0) == 0 for s in state["servers"].values()), state
        r = await api.c.get(f"/v1/runs/{api.run_id}/restores/r-bad", headers=api.h)
        assert r.status_code == 404
        run = await api.get("")
        assert run["restored_from_rollout_snapshot"] is None
    finally:
        await ckpt.close()
        await kill_all(*gyms.values(), *fresh.values())
