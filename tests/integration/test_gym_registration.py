"""Gym registration at setup against gymsim (docs/ledger.md#recovery-configuration,
docs/gym-protocol.md#discover)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gymsim.testing import GymsimInstance, default_instance_config, server_config

from .ledger_helpers import group_body, new_run
from .test_restore_support import fetch, register, registration, start_gym

INSTANCE = "math/replica-0"


@pytest.fixture
def gym() -> Iterator[GymsimInstance]:
    g = start_gym(INSTANCE)
    yield g
    g.stop()


# Published Gym reports a mode for resources only (P3,
# docs/gym-protocol.md#what-differs-rule-by-rule): each of its model and agent servers earns this
# warning, once, at registration.
NO_MODE = "reports no checkpoint mode"


def _policy_warnings(answer: dict[str, Any]) -> list[str]:
    return [w for w in answer["warnings"] if NO_MODE not in w]


def _restart_only(server: str, mode: str = "restart_only") -> GymsimInstance:
    # Strict Gym: a published agent reports no mode, so only its restarts would tell.
    config = server_config(default_instance_config(INSTANCE, token="tok-ro", gym_profile="strict"), server, mode=mode)
    return GymsimInstance.start(config)


async def test_registration_discovers_participants_and_never_returns_the_token(client, admin, app, gym, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    api = await new_run(client, admin, target_level="turn", control_timeout_s=20)
    ans = await register(api, gym)
    assert gym.token not in str(ans)
    (inst,) = ans["instances"]
    assert inst["instance_id"] == INSTANCE and inst["non_participants"] == ["judge_model"]
    parts = {p["server_name"]: p for p in inst["participants"]}
    assert [p["server_name"] for p in inst["participants"]] == ["policy_model", "workplace_agent", "calendar_resources"]
    assert parts["policy_model"]["kind"] == "model" and parts["policy_model"]["stage"] == 1
    assert parts["calendar_resources"] == {
        "server_name": "calendar_resources", "base_url": gym.servers["calendar_resources"], "kind": "resources",
        "participant_name": "calendar_resources", "mode": "exported", "stage": 3, "phase": "idle", "restart_only": False,
    }
    assert ans["restart_only_servers"] == []
    silent = [] if gym.config.gym_profile == "strict" else ["policy_model", "workplace_agent"]
    assert sorted(w.split()[0] for w in ans["warnings"]) == sorted(f"{INSTANCE}/{s}" for s in silent)
    assert all(NO_MODE in w for w in ans["warnings"])
    assert ans["gym_settings"]["checkpoint"] == {"lease_grace_seconds": 20.0}
    assert "control_auth_token" in ans["gym_settings"]["excluded"]
    listed = await api.get("/gym-instances")
    assert gym.token not in str(listed)
    assert [p["server_name"] for p in listed["instances"][0]["participants"]] == ["policy_model", "workplace_agent", "calendar_resources"]
    assert listed["instances"][0]["servers"] == dict(sorted(gym.servers.items()))
    settings = await api.get("/gym-settings")
    assert settings["checkpoint"] == {"lease_grace_seconds": 20.0} and gym.token not in str(settings)
    # Re-registering identical instances answers the same; nothing duplicates.
    again = await register(api, gym)
    assert again == ans
    assert len(await fetch(app.state.engine, "SELECT * FROM gym_participants WHERE run_id = :r", r=api.run_id)) == 3
    # The token is stored (it authenticates control calls) but appears in no log line.
    assert all(gym.token not in rec.getMessage() for rec in caplog.records)
    stored = await fetch(app.state.engine, "SELECT control_token FROM gym_instances WHERE run_id = :r", r=api.run_id)
    assert stored == [{"control_token": gym.token}]


async def test_reregistering_a_restarted_instance_replaces_its_servers(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    first = start_gym(INSTANCE)
    try:
        await register(api, first)
    finally:
        first.kill()
    second = start_gym(INSTANCE)
    try:
        await register(api, second)
        listed = await api.get("/gym-instances")
        assert listed["instances"][0]["servers"] == dict(sorted(second.servers.items()))
        assert {p["base_url"] for p in listed["instances"][0]["participants"]} <= set(second.servers.values())
    finally:
        second.stop()


async def test_a_fresh_replacement_process_is_not_sent_what_its_predecessor_was_owed(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """Retires queued for attempts of a Gym process that died are not delivered to the fresh
    process registered in its place: it never ran them, and the marks would make it refuse a
    restore (docs/ledger.md#the-outbox)."""
    api = await new_run(client, admin, run_id="run-moot")
    first = start_gym(INSTANCE)
    try:
        await register(api, first)
        rows = (await api.admit(group_body("G", 2)))["groups"][0]["rows"]
        await api.dispatch([r["rollout_id"] for r in rows], INSTANCE, placeholder=False)
    finally:
        first.kill()
    await api.fail(rows, "transport")  # the answers never came: retires owed to the dead process
    assert len((await api.get("/outbox"))["items"]) == 2
    second = start_gym(INSTANCE)
    try:
        again = await register(api, second)
        assert any("2 retire/forget item(s) owed to the process(es) replaced by math/replica-0 were dropped" in w for w in again["warnings"]), again
        assert (await api.get("/outbox"))["items"] == []
        # Re-registering the same process (its servers did not change) drops nothing it is owed,
        # fresh as it looks.
        nxt = [a for s in (await api.group("G"))["siblings"] for a in s["attempts"] if a["is_current"]]
        await api.dispatch([a["rollout_id"] for a in nxt], INSTANCE, placeholder=False)
        await api.fail(nxt, "transport")
        owed = (await api.get("/outbox"))["items"]
        assert len(owed) == 2
        same = await register(api, second)
        assert not any("were dropped" in w for w in same["warnings"]) and len((await api.get("/outbox"))["items"]) == 2
    finally:
        second.stop()


@pytest.mark.parametrize("server", ["calendar_resources", "workplace_agent"])
async def test_restart_only_server_refused_under_turn_naming_it(client, admin, app, server: str) -> None:  # type: ignore[no-untyped-def]
    gym = _restart_only(server)
    try:
        api = await new_run(client, admin, target_level="turn")
        body = await register(api, gym, expect=422)
        assert body["code"] == "restart_only_gym_servers"
        assert body["servers"] == [f"{INSTANCE}:{server}"] and server in body["detail"]
        assert body["errors"] == [{"field": f"instances.{INSTANCE}.servers.{server}", "message": "restart_only participant under target_level 'turn'"}]
        # Nothing was stored.
        assert (await api.get("/gym-instances"))["instances"] == []
        # Allowed: accepted with a warning naming it.
        allowed = await new_run(client, admin, "run-allowed", target_level="turn", allow_restart_only_gym_servers=True)
        ok = await register(allowed, gym)
        assert ok["restart_only_servers"] == [f"{INSTANCE}:{server}"]
        assert len(ok["warnings"]) == 1 and f"{INSTANCE}:{server}" in ok["warnings"][0]
        assert {p["server_name"]: p["restart_only"] for p in ok["instances"][0]["participants"]}[server] is True
        # Coarser than turn: restart-only servers lose nothing, so no refusal and no warning.
        coarse = await new_run(client, admin, "run-sibling", target_level="sibling")
        fine = await register(coarse, gym)
        assert fine["warnings"] == [] and fine["restart_only_servers"] == [f"{INSTANCE}:{server}"]
    finally:
        gym.stop()


async def test_flag_without_restart_only_servers_warns_it_has_no_effect(client, admin, gym) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="turn", allow_restart_only_gym_servers=True)
    ans = await register(api, gym)
    assert len(_policy_warnings(ans)) == 1 and "no effect" in _policy_warnings(ans)[0]
    # The flag below turn is refused by the config rules already.
    r = await client.post(
        "/v1/runs", json={"run_id": "r2", "checkpoint_root": "/tmp/x", "recovery": {"target_level": "sibling", "allow_restart_only_gym_servers": True}}, headers=admin
    )
    assert r.status_code == 422 and "allow_restart_only_gym_servers" in r.text


async def test_restart_only_on_another_instance_counts(client, admin, app, gym) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="turn")
    await register(api, gym)
    config = server_config(default_instance_config("math/replica-1", token="tok-r1"), "calendar_resources", mode="restart_only")
    other = GymsimInstance.start(config)
    try:
        body = await register(api, other, expect=422)
        assert body["servers"] == ["math/replica-1:calendar_resources"]
        assert [i["instance_id"] for i in (await api.get("/gym-instances"))["instances"]] == [INSTANCE]
    finally:
        other.stop()


async def test_mode_missing_is_not_restart_only_and_warns(client, admin, caplog) -> None:  # type: ignore[no-untyped-def]
    # A strict Gym from before modes were reported (published Gym gives resources a default).
    gym = GymsimInstance.start(server_config(default_instance_config(INSTANCE, token="tok-old", gym_profile="strict"), "calendar_resources", mode=None))
    try:
        api = await new_run(client, admin, target_level="turn")
        ans = await register(api, gym)
        assert ans["restart_only_servers"] == []
        assert any("no checkpoint mode" in w for w in ans["warnings"])
        parts = {p["server_name"]: p for p in ans["instances"][0]["participants"]}
        assert parts["calendar_resources"]["mode"] is None
        # Logged once, by the registration; not by every discovery.
        logged = [r for r in caplog.records if NO_MODE in r.getMessage()]
        assert len(logged) == 1, [r.getMessage() for r in logged]
    finally:
        gym.stop()


async def test_discovery_failures_name_the_server_and_store_nothing(client, admin, app, gym) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    wrong = registration(gym)
    wrong["instances"][0]["control_token"] = "not-the-token"
    body = await api.post("/gym-instances", wrong, 422)
    assert body["code"] == "gym_config_error" and f"{INSTANCE}/policy_model" in body["servers"]
    assert "not-the-token" not in str(body) and gym.token not in str(body)
    # The refusal says Gym answered 401, where, and which token to send.
    assert f"{INSTANCE}/policy_model at {gym.servers['policy_model']}: HTTP 401" in body["detail"]
    assert "control_token is not the instance's checkpoint.control_auth_token" in body["detail"]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    unreachable = registration(gym)
    unreachable["instances"][0]["servers"] = {**gym.servers, "calendar_resources": dead}
    body = await api.post("/gym-instances", unreachable, 502)
    assert body["code"] == "gym_unavailable" and body["servers"] == [f"{INSTANCE}/calendar_resources"]
    assert body["failure"]["transient"] is True
    assert f"{INSTANCE}/calendar_resources at {dead}: no answer" in body["detail"]  # the URL it could not reach

    no_model = registration(gym)
    no_model["instances"][0]["servers"] = {k: v for k, v in gym.servers.items() if k != "policy_model"}
    body = await api.post("/gym-instances", no_model, 422)
    assert body["code"] == "gym_config_error" and "no policy model" in body["detail"]
    assert (await api.get("/gym-instances"))["instances"] == []


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["instances"][0].update(servers={"policy_model": "ftp://x"}), "instances.0.servers"),
        (lambda b: b["instances"][0].update(servers={"bad name": "http://127.0.0.1:1"}), "instances.0.servers"),
        (lambda b: b["instances"][0].update(servers={}), "instances.0.servers"),
        (lambda b: b["instances"][0].update(control_token=""), "instances.0.control_token"),
        (lambda b: b["instances"][0].update(instance_id="math//x"), "instances.0.instance_id"),
        (lambda b: b["instances"][0].update(extra=1), "instances.0.extra"),
        (lambda b: b["instances"].append(dict(b["instances"][0])), "body"),
        (lambda b: b.update(instances=[]), "instances"),
    ],
)
async def test_bad_registration_bodies_name_the_field(client, admin, mutate: Any, field: str) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    body = {"instances": [{"instance_id": INSTANCE, "control_token": "secret-tok", "servers": {"policy_model": "http://127.0.0.1:1"}}]}
    mutate(body)
    r = await client.post(f"/v1/runs/{api.run_id}/gym-instances", json=body, headers=api.h)
    assert r.status_code == 422, r.text
    assert field in {e["field"] for e in r.json()["errors"]}, r.json()
    assert "secret-tok" not in r.text


async def test_delete_instance_and_auth(client, admin, gym) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    await register(api, gym)
    other = await new_run(client, admin, "run-other")
    r = await client.post(f"/v1/runs/{api.run_id}/gym-instances", json=registration(gym), headers=other.h)
    assert r.status_code == 403
    r = await client.get(f"/v1/runs/{api.run_id}/gym-instances", headers=admin)
    assert r.status_code == 200 and len(r.json()["instances"]) == 1
    r = await client.delete(f"/v1/runs/{api.run_id}/gym-instances/{INSTANCE}", headers=api.h)
    assert r.status_code == 204
    r = await client.delete(f"/v1/runs/{api.run_id}/gym-instances/{INSTANCE}", headers=api.h)
    assert r.status_code == 404 and r.json()["code"] == "gym_instance_not_found"
    r = await client.delete(f"/v1/runs/{api.run_id}/gym-instances/bad%20id", headers=api.h)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "instance_id"
