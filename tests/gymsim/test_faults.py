"""Fault injection: each fault type does what a test of the coordinator will rely on."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gymsim.conformance import AGENT, MODEL, PARTICIPANTS, RESOURCES, ep
from gymsim.testing import default_instance_config


async def test_delay_fault_delays_before_handling(start):
    h = await start()
    h.gym.admin("POST", "/faults", {"server_name": MODEL, "op": "status", "type": "delay", "seconds": 0.4, "times": 1})
    started = time.monotonic()
    assert (await h.call(MODEL, "status")).status_code == 200
    assert time.monotonic() - started >= 0.35
    started = time.monotonic()
    await h.call(MODEL, "status")
    assert time.monotonic() - started < 0.35  # `times` ran out


async def test_error_fault_replies_with_the_given_status_and_code(start):
    h = await start()
    fault = {"server_name": AGENT, "op": "prepare", "type": "error", "status": 503, "code": "checkpoint_coordinator_unavailable"}
    h.gym.admin("POST", "/faults", fault)
    response = await h.prepare(AGENT, "c1")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "checkpoint_coordinator_unavailable"
    assert (await h.status(AGENT))["phase"] == "idle"  # nothing ran
    h.gym.admin("DELETE", "/faults")
    assert (await h.prepare(AGENT, "c1")).json()["phase"] == "prepared"


@pytest.mark.parametrize("spelling", ["current", "legacy"])
async def test_refuse_fault_uses_the_protocol_code_in_the_instance_spelling(start, spelling):
    h = await start(wire_spelling=spelling)
    h.gym.admin("POST", "/faults", {"server_name": MODEL, "op": "renew", "type": "refuse", "code": "stale_checkpoint"})
    h.assert_error(await h.call(MODEL, "renew", h.body("c1")), "stale_checkpoint")
    h.gym.admin("POST", "/faults", {"server_name": AGENT, "op": "run", "type": "refuse", "code": "admission_closed"})
    h.assert_error(await h.run("r1"), "admission_closed")


async def test_reset_drops_the_connection_without_running_the_operation(start):
    h = await start()
    h.gym.admin("POST", "/faults", {"server_name": MODEL, "op": "prepare", "type": "reset", "times": 1})
    with pytest.raises(httpx.TransportError):
        await h.prepare(MODEL, "c1")
    assert (await h.status(MODEL))["phase"] == "idle"
    assert (await h.prepare(MODEL, "c1")).json()["phase"] == "prepared"


async def test_lost_reply_runs_the_operation_then_drops_the_reply(start, ckdir):
    h = await start()
    await h.prepare_all("c1")
    h.gym.admin("POST", "/faults", {"server_name": AGENT, "op": "commit", "type": "lost_reply", "times": 1})
    directory = ckdir()
    with pytest.raises(httpx.TransportError):
        await h.commit(AGENT, "c1", directory, [])
    assert (await h.status(AGENT))["phase"] == "committed"  # the work was applied
    replay = await h.commit(AGENT, "c1", directory, [])
    assert replay.status_code == 200 and h.state(AGENT)["export_count"] == 1


async def test_lost_reply_on_run_leaves_the_episode_running_in_gym(start):
    h = await start()
    h.gym.admin("POST", "/faults", {"server_name": AGENT, "op": "run", "type": "lost_reply", "times": 1})
    with pytest.raises(httpx.TransportError):
        await h.run("r1", turns=2)
    assert h.sessions()["r1"]["counter"] == 2  # it ran to the end; only the row never arrived


async def test_a_reply_on_the_wire_is_neither_a_blocker_nor_exported(start, ckdir):
    h = await start()
    h.gym.admin("POST", "/faults", {"server_name": AGENT, "op": "run_reply", "type": "delay", "seconds": 30})
    run = h.start_run("r1", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["on_wire"] == 1)
    replies = await h.prepare_all("c1")
    assert replies[AGENT]["report"]["ready"] is True
    committed = await h.commit_all("c1", ckdir(), [ep("r1")])
    # Gym exported nothing for it: the coordinator drains it (scope minus exported).
    assert committed[AGENT]["episode_ids"] == [] and committed[AGENT].get("run_episode_ids", []) == []
    await h.resume_all("c1")
    h.advance(30)
    assert (await run).json()["turns_completed"] == 1


async def test_a_hung_tool_keeps_one_episode_between_boundaries_until_it_is_retired(start):
    # The resources' mutate of one rollout never answers: its episode stays working (no turn
    # boundary) and blocks every prepare; the other episode finishes. A retire cancels it.
    h = await start()
    h.gym.admin("POST", "/faults", {"server_name": RESOURCES, "op": "mutate", "type": "hang", "rollout_id": "r1"})
    stuck = h.start_run("r1", turns=2)
    assert (await h.run("r2", turns=2)).status_code == 200
    await h.wait_until(lambda: h.state(AGENT)["episodes"].get("r1", {}).get("state") == "working")
    reply = (await h.prepare(AGENT, "c1", seconds=0.3)).json()
    assert reply["phase"] == "preparing" and reply["report"]["blockers"] == ["r1"], reply
    await h.ok(AGENT, "resume", h.body("c1"))
    assert not stuck.done()
    assert (await h.retire(AGENT, "retire", [ep("r1")])).status_code == 200
    h.assert_error(await stuck, "stale_attempt")
    assert (await h.prepare(AGENT, "c2")).json()["report"]["ready"] is True
    await h.ok(AGENT, "resume", h.body("c2"))
    assert "r1" not in h.sessions() and h.sessions()["r2"]["counter"] == 2


async def test_faults_are_listed_and_cleared(start):
    h = await start(faults=[{"server_name": RESOURCES, "op": "mutate", "type": "error", "status": 500}])
    listed = h.gym.admin("GET", "/faults")["faults"]
    assert listed == [{"server_name": RESOURCES, "op": "mutate", "type": "error", "status": 500, "remaining": None}]
    assert (await h.mutate("s1")).status_code == 500
    assert h.gym.admin("DELETE", "/faults") == {"faults": []}
    assert (await h.mutate("s1")).status_code == 200


async def test_bad_fault_specs_are_refused_with_422(start):
    h = await start()
    for bad in (
        {"server_name": MODEL, "op": "status", "type": "explode"},
        {"server_name": MODEL, "op": "status", "type": "delay"},
        {"server_name": MODEL, "op": "status", "type": "refuse"},
        {"server_name": MODEL, "op": "status", "type": "reset", "times": 0},
    ):
        with pytest.raises(httpx.HTTPStatusError) as info:
            h.gym.admin("POST", "/faults", bad)
        assert info.value.response.status_code == 422
    with pytest.raises(httpx.HTTPStatusError) as info:
        h.gym.admin("POST", "/faults", {"server_name": "nobody", "op": "status", "type": "reset"})
    assert info.value.response.status_code == 404


async def test_slow_install_overruns_and_a_retry_awaits_it(start, ckdir):
    a = await start()
    await a.prepare_all("c1")
    directory = ckdir()
    await a.commit_all("c1", directory, [])
    b = await start()
    b.knobs(MODEL, install_seconds=5)
    b.assert_error(await b.restore(MODEL, "restore-1", directory, [], seconds=0.2), "deadline_exceeded")
    assert b.state(MODEL)["admission_open"] is False  # closed while the install runs
    retry = asyncio.ensure_future(b.restore(MODEL, "restore-1", directory, [], seconds=60))
    await asyncio.sleep(0.1)
    b.advance(5)
    assert (await retry).json()["phase"] == "restored"
    assert b.state(MODEL)["install_count"] == 1


async def test_admin_kill_gives_a_fresh_participant_and_drops_its_connections(start):
    h = await start(turn_seconds=30)
    await h.retire(AGENT, "retire", [ep("old")])
    run = h.start_run("r1", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    h.gym.admin("POST", "/kill", {"server_name": AGENT})
    with pytest.raises(httpx.TransportError):
        await run
    state = h.state(AGENT)
    assert state["marks"] == {} and state["episodes"] == {} and state["fresh"] is True
    for server in PARTICIPANTS:
        assert (await h.status(server))["phase"] == "idle"


async def test_admin_requires_the_token(start):
    h = await start()
    response = await h.client.get(f"{h.gym.base_url}/admin/state")
    h.assert_error(response, "unauthorized")


async def test_knobs_are_validated(start):
    h = await start()
    for bad in ({"no_such_knob": 1}, {"export_seconds": -1}, {"workers": 0}):
        with pytest.raises(httpx.HTTPStatusError) as info:
            h.knobs(MODEL, **bad)
        assert info.value.response.status_code == 422


def test_default_config_has_a_judge_that_is_no_participant():
    config = default_instance_config(resources_mode="restart_only")
    kinds = {s["server_name"]: s["kind"] for s in config["servers"]}
    assert kinds == {"policy_model": "model", "workplace_agent": "agent", "calendar_resources": "resources", "judge_model": None}
    assert config["servers"][2]["mode"] == "restart_only"


async def test_a_commit_with_other_arguments_during_an_overrun_export_is_a_conflict(start, ckdir):
    h = await start()
    h.knobs(AGENT, export_seconds=5)
    await h.prepare_all("c1")
    first, other = ckdir(), ckdir()
    h.assert_error(await h.commit(AGENT, "c1", first, [], seconds=0.1), "deadline_exceeded")
    h.assert_error(await h.commit(AGENT, "c1", other, []), "checkpoint_conflict")
    h.advance(5)
    assert (await h.commit(AGENT, "c1", first, [])).status_code == 200
    assert not any(other.rglob("manifest.json"))
    assert h.state(AGENT)["write_count"] == 1
