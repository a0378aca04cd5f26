"""`gym_profile`: each published-Gym behaviour of the audit table in gymsim/README.md, checked
against the strict one (rules P1 to P8: docs/gym-protocol.md#what-differs-rule-by-rule).

Every test here fails if its published behaviour is taken away (or leaks into the strict profile).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

import gymsim.testing
from gymsim.cli import load_config, main
from gymsim.conformance import AGENT, MODEL, PARTICIPANTS, RESOURCES, STAGES, ep
from gymsim.config import InstanceConfig
from gymsim.testing import corrupt_records_file, default_instance_config, server_config

PROFILES = ["published", "strict"]


def config_of(profile: str, server: str | None = None, **changes) -> dict:
    config = default_instance_config(gym_profile=profile)
    return server_config(config, server, **changes) if server else config


async def saved_and_restored(start, ckdir, profile: str, rollouts=("r1", "r2"), turns=8, **overrides):
    a = await start(gym_profile=profile, **overrides)
    saved = await a.save("snap-1", ckdir(), list(rollouts), turns=turns)
    b = await start(gym_profile=profile, **overrides)
    await b.restore_all("restore-1", saved)
    return b, saved


# ---------------------------------------------------------------------------------------------- config


def test_the_profile_defaults_to_published_and_servers_inherit_it():
    raw = default_instance_config()
    del raw["gym_profile"]  # the config's own default, whatever the test module default is
    config = InstanceConfig.model_validate(raw)
    assert config.gym_profile == "published" and config.wire_spelling is None
    assert all(s.gym_profile is None for s in config.servers)
    assert config.profile_of("policy_model") == "published" and config.spelling_for() == "legacy"
    strict = InstanceConfig.model_validate(server_config(raw, MODEL, gym_profile="strict"))
    assert strict.profile_of(MODEL) == "strict" and strict.spelling_for(MODEL) == "current"
    assert strict.profile_of(AGENT) == "published" and strict.spelling_for(AGENT) == "legacy"
    # An explicit spelling wins over every profile.
    explicit = InstanceConfig.model_validate(default_instance_config(gym_profile="strict", wire_spelling="legacy"))
    assert explicit.spelling_for() == explicit.spelling_for(MODEL) == "legacy"
    with pytest.raises(ValueError):
        InstanceConfig.model_validate(default_instance_config(gym_profile="lenient"))


def test_default_instance_config_reads_the_module_default_at_call_time(monkeypatch):
    monkeypatch.setattr(gymsim.testing, "DEFAULT_GYM_PROFILE", "published")
    assert default_instance_config()["gym_profile"] == "published"
    monkeypatch.setattr(gymsim.testing, "DEFAULT_GYM_PROFILE", "strict")
    assert default_instance_config()["gym_profile"] == "strict"
    assert default_instance_config(gym_profile="published")["gym_profile"] == "published"
    assert "wire_spelling" not in default_instance_config()


def test_cli_gym_profile_for_default_config_and_serve(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gymsim.testing, "DEFAULT_GYM_PROFILE", "published")
    assert main(["default-config", "--gym-profile", "strict"]) == 0
    assert json.loads(capsys.readouterr().out)["gym_profile"] == "strict"
    assert main(["default-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    # The lease grace the coordinator asks for with its default control_timeout_s (60 s), not Gym's 600.
    assert printed["gym_profile"] == "published" and printed["lease_grace_seconds"] == 60
    assert main(["default-config", "--gym-profile", "pinned", "--lease-grace-seconds", "30"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["gym_profile"], printed["lease_grace_seconds"]) == ("pinned", 30)
    path = tmp_path / "instance.json"
    path.write_text(json.dumps(default_instance_config(gym_profile="published")))
    assert load_config(str(path)).gym_profile == "published"
    assert load_config(str(path), "strict").gym_profile == "strict"
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(path), "--gym-profile", "lenient"])


async def test_a_server_can_follow_another_profile_than_its_instance(start):
    h = await start(config=server_config(default_instance_config(gym_profile="published"), RESOURCES, gym_profile="strict"))
    assert h.state(RESOURCES)["gym_profile"] == "strict" and h.state(MODEL)["gym_profile"] == "published"
    await h.prepare_all("c1")
    # Each server speaks its own profile's spelling.
    assert (await h.prepare(RESOURCES, "c2")).json()["error"]["code"] == "checkpoint_conflict"
    assert (await h.call(RESOURCES, "renew", h.body("c2"))).json()["error"]["code"] == "checkpoint_conflict"
    assert (await h.call(MODEL, "commit", h.body("c1", checkpoint_dir="relative"))).json()["error"]["code"] == (
        "checkpoint_error"
    )
    assert (await h.call(RESOURCES, "commit", h.body("c1", checkpoint_dir="relative", episode_ids=[]))).json()[
        "error"
    ]["code"] == "checkpoint_invalid_checkpoint_state"
    assert (await h.call(AGENT, "commit", h.body("c1", checkpoint_dir="relative", episode_ids=[]))).json()["error"][
        "code"
    ] == "invalid_checkpoint_state"


# ---------------------------------------------------------------------------------------------- P1


@pytest.mark.parametrize("profile", PROFILES)
async def test_p1_only_the_strict_agent_reply_carries_run_episode_ids(start, ckdir, profile):
    h = await start(gym_profile=profile)
    saved = await h.save("c1", ckdir(), ["r1"])
    reply = saved.replies[AGENT]
    assert reply["episode_ids"] == ["r1"]
    if profile == "published":
        assert "run_episode_ids" not in reply
    else:
        assert reply["run_episode_ids"] == ["r1"]


# ---------------------------------------------------------------------------------------------- P2


@pytest.mark.parametrize("profile", PROFILES)
async def test_p2_agent_and_resources_export_live_sessions_outside_the_scope(start, ckdir, profile):
    h = await start(gym_profile=profile)
    h.gym.admin("POST", f"/agent/{AGENT}/native_sessions", {"rollout_id": "native", "attempt": 0})
    h.gym.admin("POST", "/faults", {"server_name": AGENT, "op": "run_reply", "type": "delay", "seconds": 30})
    wire = h.start_run("on-wire", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["on_wire"] == 1)
    await h.park_runs(["in-scope", "outside"], turns=20)
    await h.prepare_all("c1")
    replies = await h.commit_all("c1", ckdir(), [ep("in-scope")])
    assert replies[MODEL]["episode_ids"] == ["in-scope"]  # the model keeps to the scope in both
    if profile == "published":
        # Every live session, whatever the scope; never one whose reply is already on the wire.
        assert replies[AGENT]["episode_ids"] == ["in-scope", "native", "outside"]
        assert replies[RESOURCES]["episode_ids"] == ["in-scope", "on-wire", "outside"]
    else:
        assert replies[AGENT]["episode_ids"] == replies[RESOURCES]["episode_ids"] == ["in-scope"]
    await h.resume_all("c1")
    h.advance(30)
    await wire


@pytest.mark.parametrize("profile", PROFILES)
async def test_p2_unclaimed_restored_state_outside_the_scope_is_never_exported(start, ckdir, profile):
    b, _ = await saved_and_restored(start, ckdir, profile)
    await b.resume_all("restore-1")
    await b.prepare_all("c2")
    replies = await b.commit_all("c2", ckdir(), [ep("r2", 1)])
    for server in STAGES:
        assert replies[server]["episode_ids"] == ["r2-a1"], server
        assert await b.unclaimed(server) == ["r2-a1"]


# ---------------------------------------------------------------------------------------------- P3


@pytest.mark.parametrize("profile", PROFILES)
async def test_p3_only_resources_report_a_mode_under_published(start, profile):
    h = await start(gym_profile=profile)
    modes = {s: (await h.status(s)).get("mode") for s in PARTICIPANTS}
    if profile == "published":
        assert modes == {MODEL: None, AGENT: None, RESOURCES: "exported"}
    else:
        assert modes == {MODEL: "exported", AGENT: "exported", RESOURCES: "exported"}


@pytest.mark.parametrize("profile", PROFILES)
async def test_p3_resources_without_a_mode_are_restart_only_under_published(start, ckdir, profile):
    h = await start(config=config_of(profile, RESOURCES, mode=None))
    assert (await h.mutate("live")).status_code == 200
    status = await h.status(RESOURCES)
    replies = await h.prepare_all("c1")
    reply = (await h.commit(RESOURCES, "c1", ckdir(), [])).json()
    if profile == "published":
        assert status["mode"] == "restart_only" and h.state(RESOURCES)["behaviour_mode"] == "restart_only"
        assert replies[RESOURCES]["report"]["restarts"] == ["live"]
        assert reply["episode_ids"] == []
    else:
        assert "mode" not in status and h.state(RESOURCES)["behaviour_mode"] == "exported"
        assert replies[RESOURCES]["report"]["restarts"] == []
        assert reply["episode_ids"] == []  # exported, but "live" is not in the scope


# ---------------------------------------------------------------------------------------------- P4


@pytest.mark.parametrize("profile", PROFILES)
async def test_p4_stop_is_refused_as_an_unknown_field_under_published(start, ckdir, profile):
    h = await start(gym_profile=profile)
    await h.prepare_all("c1")
    directory = ckdir()
    before = {s: h.fingerprint(s) for s in STAGES}
    for server in STAGES:
        response = await h.commit(server, "c1", directory, [], stop=True)
        if profile == "published":
            assert response.status_code == 422, response.text
            detail = response.json()["detail"]
            assert [(d["type"], d["loc"]) for d in detail] == [("extra_forbidden", ["body", "stop"])]
        else:
            assert response.status_code == 200 and response.json()["phase"] == "committed"
    if profile == "published":
        assert {s: h.fingerprint(s) for s in STAGES} == before
        assert not any(directory.iterdir())
        # Without stop, the same commit goes through.
        await h.commit_all("c1", directory, [])


@pytest.mark.parametrize(("profile", "accepts"), [("published", True), ("strict", False)])
async def test_p4_the_accepts_stop_knob_overrides_the_profile(start, ckdir, profile, accepts):
    h = await start(config=config_of(profile, AGENT, accepts_stop=accepts))
    await h.prepare_all("c1")
    directory = ckdir()
    response = await h.commit(AGENT, "c1", directory, [], stop=True)
    if accepts:
        assert response.status_code == 200
        # Accepted, stop behaves as in the strict profile: a commit without it is another commit.
        h.assert_error(await h.commit(AGENT, "c1", directory, []), "checkpoint_conflict")
    else:
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "stop"]
    h.knobs(AGENT, accepts_stop=None)  # back to the profile's own answer, at runtime
    other = await h.commit(AGENT, "c1", ckdir(), [], stop=True)
    assert other.status_code == (422 if profile == "published" else 200)


# ---------------------------------------------------------------------------------------------- P5 / N10


@pytest.mark.parametrize("profile", PROFILES)
async def test_p5_a_restore_raises_no_mark_under_published_and_the_agent_binding_refuses(start, ckdir, profile):
    b, saved = await saved_and_restored(start, ckdir, profile)
    await b.resume_all("restore-1")
    marks = {s: b.state(s)["marks"] for s in PARTICIPANTS}
    b.assert_error(await b.run("r1", 0, task={"rollout": "r1"}), "stale_attempt")
    if profile == "published":
        assert marks == {s: {} for s in PARTICIPANTS}
        assert [(await b.status(s))["retired_rollouts"] for s in PARTICIPANTS] == [0, 0, 0]
        # The binding also refuses a later attempt; the model and resources admit attempt N.
        b.assert_error(await b.run("r1", 2, task={"rollout": "r1"}), "stale_attempt")
        assert (await b.chat("r1")).status_code == 200
        assert (await b.mutate("r1")).status_code == 200
    else:
        assert marks == {s: {"r1": 0, "r2": 0} for s in PARTICIPANTS}
        b.assert_error(await b.chat("r1"), "stale_attempt")
        b.assert_error(await b.mutate("r1"), "stale_attempt")
    row = await b.run("r1", 1, task={"rollout": "r1"}, turns=saved.turns)
    assert row.status_code == 200 and row.json()["resumed_from_turn"] == saved.saved_turns["r1"]


@pytest.mark.parametrize("profile", PROFILES)
async def test_n10_a_live_episode_binds_its_rollout_under_published(start, profile):
    h = await start(gym_profile=profile, turn_seconds=30)
    run = h.start_run("r1", 0, turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    other = h.start_run("r1", 1, turns=1)
    if profile == "published":
        h.assert_error(await other, "stale_attempt")
    else:
        await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 2)
    duplicate = await h.run("r1", 0)
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "episode_running"
    h.advance(30)
    assert (await run).status_code == 200
    if profile == "strict":
        assert (await other).json()["capture_key"] == "r1-a1"
    # Once the episode is over, another attempt of the rollout is admitted again.
    assert (await h.run("r1", 2, turns=0)).status_code == 200


@pytest.mark.parametrize("profile", PROFILES)
async def test_p5_retire_raises_marks_in_both_profiles(start, profile):
    h = await start(gym_profile=profile)
    for server in PARTICIPANTS:
        await h.ok(server, "retire", h.body("retire", episode_ids=[ep("r", 1)]))
        assert h.state(server)["marks"] == {"r": 1}
    h.assert_error(await h.run("r", 1), "stale_attempt")
    h.assert_error(await h.chat("r-a1"), "stale_attempt")


# ---------------------------------------------------------------------------------------------- P6


@pytest.mark.parametrize(("profile", "code", "pending"), [("published", "invalid_phase", "restored_pending"), ("strict", "checkpoint_invalid_phase", "unclaimed")])
async def test_p6_the_profile_picks_the_default_spelling(start, profile, code, pending):
    h = await start(gym_profile=profile)
    assert (await h.call(MODEL, "renew", h.body("c1"))).json()["error"]["code"] == code
    assert pending in await h.status(AGENT)
    h.gym.admin("POST", "/faults", {"server_name": MODEL, "op": "renew", "type": "refuse", "code": "invalid_phase"})
    assert (await h.call(MODEL, "renew", h.body("c1"))).json()["error"]["code"] == code
    assert h.gym.admin("GET", "/state")["wire_spelling"] == ("legacy" if profile == "published" else "current")


# ---------------------------------------------------------------------------------------------- model waits


@pytest.mark.parametrize("profile", PROFILES)
async def test_a_new_policy_call_waits_for_resume_under_published(start, profile):
    h = await start(gym_profile=profile)
    await h.prepare_all("c1")
    if profile == "strict":
        h.assert_error(await h.chat("late"), "admission_closed")
        return
    call = asyncio.ensure_future(h.chat("late", turn=0))
    await h.wait_until(lambda: h.state(MODEL)["waiting"] == 1)
    await asyncio.sleep(0.1)
    assert not call.done()
    status = await h.status(MODEL)
    # Not admitted: no call is tracked, nothing blocks, and the prepare replay is unchanged.
    assert status["report"]["ready"] is True and h.state(MODEL)["calls"] == []
    assert h.state(MODEL)["served"] is False
    await h.resume_all("c1")
    response = await asyncio.wait_for(call, 5)
    assert response.status_code == 200 and response.json()["staging_key"] == "tq/late/0"
    assert h.state(MODEL)["waiting"] == 0


async def test_a_retire_wakes_a_waiting_policy_call_which_is_then_stale(start, ckdir):
    b, _ = await saved_and_restored(start, ckdir, "published")
    call = asyncio.ensure_future(b.chat("r1-a1"))  # admission stays closed until resume
    other = asyncio.ensure_future(b.chat("r2-a1"))
    await b.wait_until(lambda: b.state(MODEL)["waiting"] == 2)
    assert (await b.retire(MODEL, "restore-1", [ep("r1", 1)])).status_code == 200
    b.assert_error(await asyncio.wait_for(call, 5), "stale_attempt")
    assert not other.done() and b.state(MODEL)["waiting"] == 1
    await b.resume_all("restore-1")
    assert (await asyncio.wait_for(other, 5)).status_code == 200


# ---------------------------------------------------------------------------------------------- restart_only resources


@pytest.mark.parametrize("profile", PROFILES)
async def test_restart_only_resources_never_park_requests_under_published(start, ckdir, profile):
    h = await start(gym_profile=profile, resources_mode="restart_only")
    assert (await h.mutate("s1")).status_code == 200
    first = await h.ok(RESOURCES, "prepare", h.body("c1"))
    assert first["report"]["restarts"] == ["s1"]
    request = asyncio.ensure_future(h.mutate("s2"))
    if profile == "published":
        assert (await asyncio.wait_for(request, 5)).status_code == 200
        # Restarts are worked out again on every status; the stored prepare reply stays as it was.
        assert (await h.status(RESOURCES))["report"]["restarts"] == ["s1", "s2"]
    else:
        await h.wait_until(lambda: h.state(RESOURCES)["report"]["counts"]["waiting"] == 1)
        assert not request.done()
        assert (await h.status(RESOURCES))["report"]["restarts"] == ["s1"]
    assert await h.ok(RESOURCES, "prepare", h.body("c1")) == first
    # A commit checks the scope against the restarts it reports now (published) or at prepare.
    late = ep("s2") if profile == "published" else ep("s1")
    h.assert_error(await h.commit(RESOURCES, "c1", ckdir(), [late]), "restart_in_scope")
    await h.ok(RESOURCES, "resume", h.body("c1"))
    assert (await request).status_code == 200


# ---------------------------------------------------------------------------------------------- restart_only agent


@pytest.mark.parametrize("profile", PROFILES)
async def test_a_restart_only_agent_never_parks_under_published(start, ckdir, profile):
    h = await start(config=server_config(default_instance_config(gym_profile=profile, turn_seconds=30), AGENT, mode="restart_only"))
    first_run = h.start_run("r1", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    prepared = await h.ok(AGENT, "prepare", h.body("c1", 0.3))
    if profile == "strict":
        # It parks like any agent: the working episode blocks, and new work is refused.
        assert prepared["phase"] == "preparing" and prepared["report"]["blockers"] == ["r1"]
        h.assert_error(await h.run("r2", turns=1), "admission_closed")
        await h.ok(AGENT, "resume", h.body("c1"))
        h.advance(30)
        assert (await first_run).status_code == 200
        return
    assert prepared["phase"] == "prepared" and prepared["report"]["ready"] is True
    assert prepared["report"]["restarts"] == ["r1"]
    second_run = h.start_run("r2", turns=1)  # admitted while the checkpoint is open
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 2)
    status = await h.status(AGENT)
    assert status["report"]["restarts"] == ["r1", "r2"] and status["report"]["ready"] is True
    assert status["accepting"] is True
    assert await h.ok(AGENT, "prepare", h.body("c1")) == prepared  # the stored reply is unchanged
    # restart_in_scope is checked against the restarts at commit time.
    directory = ckdir()
    h.assert_error(await h.commit(AGENT, "c1", directory, [ep("r2")]), "restart_in_scope")
    h.advance(30)  # both episodes finish while the checkpoint is still open
    assert (await first_run).status_code == 200 and (await second_run).status_code == 200
    assert (await h.status(AGENT))["report"]["restarts"] == []
    reply = await h.commit(AGENT, "c1", directory, [ep("r2")])
    assert reply.status_code == 200 and reply.json()["episode_ids"] == []


# ---------------------------------------------------------------------------------------------- workers


@pytest.mark.parametrize("profile", PROFILES)
async def test_worker_tokens_are_policy_first_and_unsorted_under_published(start, profile):
    config = config_of(profile, MODEL, workers=3, unreported_workers=2, worker_lost=True, stream_seconds=30)
    h = await start(config=config)
    call = asyncio.ensure_future(h.chat("aaa-streaming", turn=0))
    await h.wait_until(lambda: h.state(MODEL)["report"]["counts"]["streaming"] == 1)
    blockers = (await h.ok(MODEL, "prepare", h.body("c1", 0.2)))["report"]["blockers"]
    if profile == "published":
        assert blockers == ["policy-workers-unreported:2", "policy-worker-lost", "aaa-streaming"]
    else:
        assert blockers == ["aaa-streaming", "model-worker-lost", "model-workers-unreported:2"]
    resources = await start(config=config_of(profile, RESOURCES, workers=2, unreported_workers=1))
    assert (await resources.ok(RESOURCES, "prepare", resources.body("c1", 0.1)))["report"]["blockers"] == [
        "resources-workers-unreported:1"
    ]
    await h.ok(MODEL, "resume", h.body("c1"))
    h.advance(30)
    await call


# ---------------------------------------------------------------------------------------------- unexpected faults


@pytest.mark.parametrize("profile", PROFILES)
async def test_an_unexpected_fault_is_a_plain_500_under_published(start, ckdir, profile):
    h = await start(gym_profile=profile)

    def boom(*args, **kwargs):
        raise RuntimeError("a participant hook broke")

    async def alone(op: str, body=None) -> httpx.Response:
        # uvicorn closes a connection after an unhandled exception: each call gets its own.
        async with httpx.AsyncClient(timeout=30) as client:
            url = f"{h.servers[MODEL]}/ng-control/v1/checkpoint/{op}"
            return await client.request("GET" if op == "status" else "POST", url, json=body, headers=h.headers())

    await h.prepare_all("c1")
    model = h.gym._instance.participants[MODEL]
    model.status = boom
    model.capture_state = boom
    response = await alone("status")
    commit = await alone("commit", h.body("c1", checkpoint_dir=str(ckdir()), episode_ids=[]))
    for reply, what in ((response, "unexpected participant fault"), (commit, "export failed")):
        assert reply.status_code == 500
        if profile == "published":
            assert reply.text == "Internal Server Error" and "json" not in reply.headers["content-type"]
        else:
            h.assert_error(reply, "checkpoint_error", 500)
            assert what in reply.json()["error"]["detail"]


# ---------------------------------------------------------------------------------------------- restore order


@pytest.mark.parametrize("profile", PROFILES)
async def test_a_non_fresh_restore_from_a_corrupt_directory(start, ckdir, profile):
    a = await start(gym_profile=profile)
    saved = await a.save("snap-1", ckdir(), ["r1"])
    corrupt_records_file(saved.directory, "model", MODEL, "flip")
    b = await start(gym_profile=profile)
    assert (await b.chat("earlier")).status_code == 200
    before = b.fingerprint(MODEL)
    response = await b.restore(MODEL, "restore-1", saved.directory, [ep("r1")])
    # Published Gym reads and checks the directory first; strict refuses a non-fresh server first.
    b.assert_error(response, "invalid_checkpoint_state" if profile == "published" else "checkpoint_error")
    assert b.fingerprint(MODEL) == before
    # With an intact directory both refuse the non-fresh server, and nothing is installed.
    intact = await start(gym_profile=profile)
    saved_ok = await intact.save("snap-2", ckdir(), ["r1"])
    b.assert_error(await b.restore(MODEL, "restore-2", saved_ok.directory, [ep("r1")]), "checkpoint_error")
    state = b.state(MODEL)
    assert state["phase"] == "idle" and state["unclaimed"] == [] and state["admission_open"] is True


# ---------------------------------------------------------------------------------------------- status


@pytest.mark.parametrize("profile", PROFILES)
async def test_lease_expired_is_in_status_only_under_strict(start, profile):
    h = await start(gym_profile=profile, lease_grace_seconds=5)
    await h.prepare_all("c1", seconds=1)
    h.advance(10)
    status = await h.status(MODEL)
    assert status["phase"] == "idle" and h.state(MODEL)["lease_expired"] == 1
    if profile == "published":
        assert "lease_expired" not in status
    else:
        assert status["lease_expired"] == 1


# ---------------------------------------------------------------------------------------------- staging map


@pytest.mark.parametrize("staging_map", [True, False])
async def test_the_staging_map_knob_models_the_older_published_model(start, ckdir, staging_map):
    h = await start(config=server_config(default_instance_config(), MODEL, staging_map=staging_map))
    saved = await h.save("c1", ckdir(), ["r1"], turns=8)
    reply = saved.replies[MODEL]
    assert reply["staging_keys"] and all(k.startswith("tq/r1/") for k in reply["staging_keys"])
    if staging_map:
        assert reply["staging_keys_by_episode"] == {"r1": reply["staging_keys"]}
    else:
        assert "staging_keys_by_episode" not in reply


def test_serve_gym_profile_overrides_the_config_file(tmp_path):
    path = tmp_path / "instance.json"
    path.write_text(json.dumps(default_instance_config(gym_profile="published")))
    command = [sys.executable, "-m", "gymsim", "serve", "--config", str(path), "--gym-profile", "strict"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(process.stdout.readline())
        url = f"{ready['servers'][MODEL]}/ng-control/v1/checkpoint/renew"
        body = {"checkpoint_id": "c1", "deadline_ts": 1e12}
        response = httpx.post(url, json=body, headers={"Authorization": "Bearer tok-gymsim"}, timeout=10)
        assert response.json()["error"]["code"] == "checkpoint_invalid_phase"  # strict's spelling
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


# ---------------------------------------------------------------------------------------------- one control lock


@pytest.mark.parametrize("profile", PROFILES)
async def test_a_renew_waits_for_a_commit_under_way_under_published(start, ckdir, profile):
    h = await start(gym_profile=profile)
    h.knobs(AGENT, export_seconds=5)
    await h.prepare_all("c1")
    commit = asyncio.create_task(h.commit(AGENT, "c1", ckdir(), []))
    await asyncio.sleep(0.3)  # the commit is exporting: the instance clock stands still
    renew = asyncio.create_task(h.call(AGENT, "renew", h.body("c1")))
    done, _ = await asyncio.wait({renew}, timeout=1.0)
    assert bool(done) == (profile == "strict")
    assert not commit.done()
    h.advance(5)
    assert (await commit).status_code == 200
    assert (await renew).status_code == 200
