"""The data plane and the topology knobs: clear 4xx errors, modes, kinds and participant names."""

from __future__ import annotations

import asyncio
import json

from gymsim.conformance import AGENT, JUDGE, MODEL, RESOURCES, STAGES, ep
from gymsim.storage import participant_dir
from gymsim.testing import default_instance_config, server_config


async def test_bad_data_plane_input_gets_clear_4xx_never_500(start):
    h = await start()
    agent, model, resources = (h.servers[s] for s in (AGENT, MODEL, RESOURCES))
    cases = [
        ("POST", f"{agent}/run", {"task": 1}, 400),
        ("POST", f"{agent}/run", {"_ng_rollout_id": "", "task": 1}, 400),
        ("POST", f"{agent}/run", {"_ng_rollout_id": "r-a2"}, 422),
        ("POST", f"{agent}/run", {"_ng_rollout_id": "r", "_ng_attempt_index": "1"}, 422),
        ("POST", f"{agent}/run", {"_ng_rollout_id": "r", "_ng_attempt_index": -1}, 422),
        ("POST", f"{agent}/run", {"_ng_rollout_id": "r", "turns": 1.5}, 422),
        ("POST", f"{agent}/run", {"_ng_rollout_id": "r", "surprise": 1}, 422),
        ("POST", f"{agent}/run", [1, 2], 422),
        ("POST", f"{model}/v1/chat/completions", {"messages": []}, 400),
        ("POST", f"{model}/ng-rollout/bad key!/v1/chat/completions", {}, 400),
        ("POST", f"{resources}/sessions/s1/mutate", {"turn": "one"}, 422),
        ("POST", f"{resources}/sessions/s1/mutate", {"work_seconds": -1}, 422),
        ("POST", f"{resources}/sessions/-bad/mutate", {}, 400),
        ("POST", f"{h.gym.base_url}/s/nobody/run", {"_ng_rollout_id": "r"}, 404),
        ("POST", f"{model}/run", {"_ng_rollout_id": "r"}, 404),
    ]
    for method, url, body, status in cases:
        response = await h.client.request(method, url, json=body)
        assert response.status_code == status, (url, body, response.status_code, response.text)
    raw = await h.client.post(f"{agent}/run", content=b"{oops", headers={"content-type": "application/json"})
    assert raw.status_code == 422
    h.assert_error(await h.client.post(f"{agent}/run", json={"task": 1}), "rollout_id_required")


async def test_a_running_episode_cannot_be_started_twice(start):
    h = await start(turn_seconds=30)
    run = h.start_run("r1", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    duplicate = await h.run("r1")
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "episode_running"
    run.cancel()


async def test_a_continuation_with_another_task_is_refused(start, ckdir):
    a = await start()
    saved = await a.save("snap-1", ckdir(), ["r1"], turns=8)
    b = await start()
    await b.restore_all("restore-1", saved)
    await b.resume_all("restore-1")
    refused = await b.run("r1", 1, task={"rollout": "someone else"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "task_mismatch"
    assert await b.unclaimed(AGENT) == ["r1-a1"]  # still there for the right task
    assert (await b.run("r1", 1, task={"rollout": "r1"}, turns=8)).json()["resumed_from_turn"] is not None


async def test_the_judge_keeps_serving_while_the_instance_is_parked(start):
    h = await start()
    await h.prepare_all("c1")
    response = await h.client.post(f"{h.servers[JUDGE]}/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"


async def test_policy_completions_are_deterministic_and_record_staging_keys(start):
    h = await start()
    first = (await h.chat("k1", turn=0)).json()
    h2 = await start()
    again = (await h2.chat("k1", turn=0)).json()
    assert first["choices"] == again["choices"] and first["staging_key"] == "tq/k1/0"
    assert (await h.chat("k1")).json()["staging_key"] == "tq/k1/1"  # without a turn: the next number
    assert h.state(MODEL)["staging_keys_by_episode"] == {"k1": ["tq/k1/0", "tq/k1/1"]}


async def test_stateless_participants_commit_one_empty_record_per_session(start, ckdir):
    config = server_config(default_instance_config(resources_mode="stateless"), MODEL, mode="stateless")
    h = await start(config=config)
    saved = await h.save("c1", ckdir(), ["r1"], turns=8)
    model = saved.replies[MODEL]
    assert model["episode_ids"] == ["r1"]
    assert model["staging_keys"] == [] and model["staging_keys_by_episode"] == {"r1": []}
    for kind, name in (("model", MODEL), ("resources", RESOURCES)):
        pdir = participant_dir(saved.directory, kind, name)
        manifest = json.loads((pdir / "manifest.json").read_text())
        lines = (pdir / manifest["records_file"]).read_text().splitlines()
        assert [json.loads(line)["state"] for line in lines] == [{}]
    b = await start(config=config)
    replies = await b.restore_all("restore-1", saved)
    assert all(r["restored"] == ["r1-a1"] for r in replies.values())


async def test_restart_only_resources_write_an_empty_records_file(start, ckdir):
    h = await start(resources_mode="restart_only")
    saved = await h.save("c1", ckdir(), [], turns=8)
    assert saved.replies[RESOURCES]["manifest"]["record_count"] == 0


async def test_environment_and_unknown_kinds_take_part_in_the_protocol(start, ckdir):
    config = default_instance_config()
    config["servers"] += [
        {"server_name": "blackjack_env", "kind": "environment", "mode": "exported"},
        {"server_name": "mystery", "kind": "oracle", "mode": "export_restore"},
    ]
    h = await start(config=config)
    h.servers = h.gym.servers
    for server, kind, mode in (("blackjack_env", "environment", "exported"), ("mystery", "oracle", "export_restore")):
        status = await h.status(server)
        assert status["kind"] == kind and status["mode"] == mode
        assert (await h.prepare(server, "c1")).json()["phase"] == "prepared"
        reply = (await h.commit(server, "c1", ckdir(), [])).json()
        assert reply["manifest"]["kind"] == kind


async def test_the_participant_name_names_the_directory(start, ckdir):
    config = server_config(default_instance_config(), RESOURCES, participant_name="calendar")
    h = await start(config=config)
    assert (await h.status(RESOURCES))["instance"] == "calendar"
    await h.prepare_all("c1")
    directory = ckdir()
    reply = (await h.commit(RESOURCES, "c1", directory, [])).json()
    assert reply["manifest"]["instance"] == "calendar"
    assert (participant_dir(directory, "resources", "calendar") / "manifest.json").exists()


async def test_colliding_participant_names_are_reported_as_configured(start):
    config = server_config(default_instance_config(), AGENT, participant_name="shared", kind="agent")
    config["servers"].append({"server_name": "second_agent", "kind": "agent", "participant_name": "shared"})
    h = await start(config=config)
    h.servers = h.gym.servers
    names = [(await h.status(s))["instance"] for s in (AGENT, "second_agent")]
    assert names == ["shared", "shared"]
    assert "mode" not in await h.status("second_agent")


async def test_many_concurrent_runs_complete_with_exact_sessions(start):
    h = await start()
    rollouts = [f"g1_g{i}_a{i:032x}" for i in range(12)]
    rows = await asyncio.gather(*(h.run(r, 0, task={"i": r}, turns=3) for r in rollouts))
    assert all(row.json()["reward"] == 1.0 for row in rows)
    sessions = h.sessions()
    for rollout in rollouts:
        assert [(e["rollout_id"], e["turn"]) for e in sessions[rollout]["history"]] == [(rollout, t) for t in range(3)]
    for server in STAGES:
        assert (await h.status(server))["report"]["ready"] is True
    assert (await h.retire(AGENT, "retire", [ep(rollouts[0])])).status_code == 200


async def test_an_oversized_body_gets_413(start, monkeypatch):
    import gymsim.app

    h = await start()
    monkeypatch.setattr(gymsim.app, "MAX_BODY_BYTES", 1024)
    body = h.body("c1", checkpoint_dir="/x", episode_ids=[ep(f"r{i}") for i in range(100)])
    response = await h.call(MODEL, "commit", body)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


async def test_a_large_commit_scope_is_accepted(start, ckdir):
    h = await start()
    await h.prepare_all("c1")
    scope = [ep(f"g{i // 8}_g{i % 8}_a{i:032x}") for i in range(20_000)]  # about 1.4 MB of JSON
    response = await h.commit(RESOURCES, "c1", ckdir(), scope)
    assert response.status_code == 200 and response.json()["episode_ids"] == []
