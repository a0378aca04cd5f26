"""P1-P4, P33, P34: authentication, discovery answers, status shape, body validation, spellings."""

from __future__ import annotations

import math

import pytest

from gymsim.conformance import AGENT, JUDGE, MODEL, OPS, PARTICIPANTS, RESOURCES, STAGES, ep
from gymsim.testing import default_instance_config, server_config

PHASES = {"idle", "preparing", "prepared", "committed", "restored"}
KINDS = {"environment", "model", "agent", "resources"}
MODES = {"exported", "stateless", "restart_only"}


def valid_body(h, op: str, directory: str = "/tmp/gymsim-never-written") -> dict:
    body = h.body("c-auth")
    if op in ("commit", "restore"):
        body.update(checkpoint_dir=directory, episode_ids=[ep("r1")])
    elif op == "retire":
        body.update(episode_ids=[ep("r1")])
    elif op == "forget":
        body.update(rollout_ids=["r1"])
    return body


# ---------------------------------------------------------------------------------------------- P1


async def test_p1_every_route_refuses_a_missing_or_wrong_token(start):
    h = await start()
    before = {s: h.fingerprint(s) for s in PARTICIPANTS}
    bad_headers = [
        {},
        {"Authorization": f"bearer {h.token}"},  # the scheme is exact
        {"Authorization": f"Bearer {h.token}x"},
        {"Authorization": f"Bearer {h.token[:-1]}"},
    ]
    for server in PARTICIPANTS:
        for op in ("status", *OPS):
            for headers in bad_headers:
                response = await h.call(server, op, valid_body(h, op), headers=headers)
                h.assert_error(response, "unauthorized")
    # The refused prepare did not close admission, the refused retire raised no mark, etc.
    assert {s: h.fingerprint(s) for s in PARTICIPANTS} == before
    assert (await h.run("after-auth", turns=1)).status_code == 200


async def test_p1_a_bad_token_is_refused_before_the_body_is_looked_at(start):
    h = await start()
    response = await h.call(MODEL, "prepare", content=b"{not json", headers={"Authorization": "Bearer nope"})
    h.assert_error(response, "unauthorized")


# ---------------------------------------------------------------------------------------------- P2


async def test_p2_a_non_participant_answers_404_to_status(start):
    h = await start()
    for headers in (None, {}):
        response = await h.call(JUDGE, "status", headers=headers)
        assert response.status_code == 404
    for op in OPS:
        assert (await h.call(JUDGE, op, valid_body(h, op))).status_code == 404
    # The judge keeps serving its own data plane.
    judged = await h.client.post(f"{h.servers[JUDGE]}/v1/chat/completions", json={"messages": []})
    assert judged.status_code == 200


async def test_p2_checkpointing_off_means_no_control_routes(start):
    config = server_config(default_instance_config(), RESOURCES, kind=None)
    h = await start(config=config)
    assert (await h.call(RESOURCES, "status")).status_code == 404
    assert (await h.call(MODEL, "status")).status_code == 200


# ---------------------------------------------------------------------------------------------- P3


def assert_status_shape(status: dict, *, with_mode: bool = True) -> None:
    """The fields of docs/gym-protocol.md#status; `with_mode=False` for published Gym, whose model
    and agent report none (rule P3, docs/gym-protocol.md#what-differs-rule-by-rule)."""
    fields = {
        "kind": str,
        "instance": str,
        "phase": str,
        "mode": str,
        "checkpoint_id": (str, type(None)),
        "lease_expires_at": (float, type(None)),
        "retired_rollouts": int,
        "report": dict,
    }
    if not with_mode:
        assert "mode" not in status, status
        del fields["mode"]
    for field, types in fields.items():
        assert field in status, field
        assert isinstance(status[field], types), (field, status[field])
    assert not isinstance(status["retired_rollouts"], bool)
    assert status["kind"] in KINDS
    assert status["phase"] in PHASES
    if with_mode:
        assert status["mode"] in MODES
    assert (status["checkpoint_id"] is None) == (status["phase"] == "idle")
    assert (status["lease_expires_at"] is None) == (status["phase"] == "idle")
    if status["lease_expires_at"] is not None:
        assert math.isfinite(status["lease_expires_at"])
    report = status["report"]
    assert isinstance(report["ready"], bool)
    assert isinstance(report["blockers"], list) and all(isinstance(b, str) for b in report["blockers"])
    assert len(report["blockers"]) <= 100 and report["blockers"] == sorted(report["blockers"])
    assert type(report["blocker_count"]) is int and report["blocker_count"] >= len(report["blockers"])
    assert isinstance(report["counts"], dict)
    assert all(isinstance(k, str) and type(v) is int for k, v in report["counts"].items())
    assert isinstance(report["restarts"], list) and report["restarts"] == sorted(report["restarts"])
    assert all(isinstance(r, str) for r in report["restarts"])


@pytest.mark.parametrize("mode", ["exported", "stateless", "restart_only"])
async def test_p3_status_has_every_field_with_its_type(start, mode):
    config = default_instance_config(resources_mode=mode)
    config = server_config(config, AGENT, mode=mode)
    h = await start(config=config)
    # Published Gym: only resources report their mode; model and agent never do, even if configured.
    with_mode = {s: not h.published or s == RESOURCES for s in PARTICIPANTS}
    for server in PARTICIPANTS:
        status = await h.status(server)
        assert_status_shape(status, with_mode=with_mode[server])
        assert status["instance"] == server
    assert (await h.status(AGENT)).get("mode") == (None if h.published else mode)
    assert (await h.status(RESOURCES))["mode"] == mode
    await h.prepare_all("c-shape")
    for server in PARTICIPANTS:
        status = await h.status(server)
        assert_status_shape(status, with_mode=with_mode[server])
        assert status["phase"] == "prepared" and status["checkpoint_id"] == "c-shape"


async def test_p3_status_changes_neither_phase_nor_lease(start):
    h = await start()
    await h.prepare_all("c-status", seconds=20)
    before = {s: h.fingerprint(s) for s in PARTICIPANTS}
    for _ in range(3):
        for server in PARTICIPANTS:
            status = await h.status(server)
            assert status["phase"] == "prepared"
            assert status["lease_expires_at"] == before[server]["lease_expires_at"]
    assert {s: h.fingerprint(s) for s in PARTICIPANTS} == before


async def test_p3_an_older_gym_reports_no_mode(start):
    config = server_config(default_instance_config(), RESOURCES, mode=None)
    h = await start(config=config)
    status = await h.status(RESOURCES)
    assert status["kind"] == "resources"
    if h.published:
        # Published resources always report a mode, falling back to Gym's default restart_only;
        # the model's status is the one without a mode there.
        assert status["mode"] == "restart_only"
        assert "mode" not in await h.status(MODEL)
    else:
        assert "mode" not in status


# ---------------------------------------------------------------------------------------------- P4


def _invalid_bodies(h) -> list[tuple[str, object]]:
    d = h.deadline()
    cases: list[tuple[str, object]] = [
        ("prepare", {"checkpoint_id": "c1", "deadline_ts": d, "extra": 1}),
        ("prepare", {"checkpoint_id": "bad id", "deadline_ts": d}),
        ("prepare", {"checkpoint_id": "-leading-dash", "deadline_ts": d}),
        ("prepare", {"checkpoint_id": "", "deadline_ts": d}),
        ("prepare", {"checkpoint_id": "x" * 129, "deadline_ts": d}),
        ("prepare", {"checkpoint_id": 7, "deadline_ts": d}),
        ("prepare", {"checkpoint_id": "c1", "deadline_ts": "soon"}),
        ("prepare", {"checkpoint_id": "c1", "deadline_ts": True}),
        ("prepare", {"checkpoint_id": "c1"}),
        ("prepare", [1, 2]),
        ("renew", {"checkpoint_id": "c1", "deadline_ts": d, "stop": True}),
        ("resume", {"checkpoint_id": "c/1", "deadline_ts": d}),
        ("commit", {"checkpoint_id": "c1", "deadline_ts": d, "episode_ids": []}),
        ("commit", {"checkpoint_id": "c1", "deadline_ts": d, "checkpoint_dir": "/x", "episode_ids": [], "stop": "yes"}),
        ("retire", {"checkpoint_id": "retire", "deadline_ts": d, "episode_ids": []}),
        ("retire", {"checkpoint_id": "retire", "deadline_ts": d, "episode_ids": [ep(f"r{i}") for i in range(1025)]}),
        ("retire", {"checkpoint_id": "retire", "deadline_ts": d, "episode_ids": [{"rollout_id": "r", "attempt": -1}]}),
        ("retire", {"checkpoint_id": "retire", "deadline_ts": d, "episode_ids": [{"rollout_id": "r", "attempt": "1"}]}),
        ("retire", {"checkpoint_id": "retire", "deadline_ts": d, "episode_ids": [{"rollout_id": "r", "attempt": True}]}),
        ("retire", {"checkpoint_id": "retire", "deadline_ts": d, "episode_ids": [{"rollout_id": "r-a3", "attempt": 0}]}),
        ("retire", {"checkpoint_id": "retire", "deadline_ts": d, "episode_ids": [{"rollout_id": "r", "attempt": 0, "x": 1}]}),
        ("forget", {"checkpoint_id": "forget", "deadline_ts": d, "rollout_ids": []}),
        ("forget", {"checkpoint_id": "forget", "deadline_ts": d, "rollout_ids": [f"r{i}" for i in range(1025)]}),
        ("forget", {"checkpoint_id": "forget", "deadline_ts": d, "rollout_ids": ["r1-a2"]}),
        ("forget", {"checkpoint_id": "forget", "deadline_ts": d, "rollout_ids": ["has space"]}),
    ]
    return cases


async def test_p4_invalid_bodies_get_422_and_change_nothing(start):
    h = await start()
    await h.ok(MODEL, "retire", h.body("retire", episode_ids=[ep("marked", 1)]))
    before = {s: h.fingerprint(s) for s in PARTICIPANTS}
    for op, body in _invalid_bodies(h):
        for server in PARTICIPANTS:
            response = await h.call(server, op, body)
            assert response.status_code == 422, (op, body if len(str(body)) < 200 else "...", response.text)
            assert isinstance(response.json()["detail"], list)
    assert {s: h.fingerprint(s) for s in PARTICIPANTS} == before


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
async def test_p4_a_non_finite_deadline_gets_422(start, literal):
    h = await start()
    before = h.fingerprint(MODEL)
    raw = b'{"checkpoint_id": "c1", "deadline_ts": ' + literal + b"}"
    for op in ("prepare", "renew", "resume"):
        response = await h.call(MODEL, op, content=raw)
        assert response.status_code == 422, (op, literal, response.text)
    assert h.fingerprint(MODEL) == before
    assert (await h.status(MODEL))["phase"] == "idle"


async def test_p4_boundary_sizes_are_accepted(start):
    h = await start()
    ok_id = "c" * 128
    assert (await h.prepare(RESOURCES, ok_id)).status_code == 200
    await h.ok(RESOURCES, "resume", h.body(ok_id))
    many = [ep(f"r{i:04d}") for i in range(1024)]
    reply = await h.ok(RESOURCES, "retire", h.body("retire", episode_ids=many))
    assert len(reply["retired"]) == 1024
    forgotten = await h.ok(RESOURCES, "forget", h.body("forget", rollout_ids=[e["rollout_id"] for e in many]))
    assert len(forgotten["forgotten"]) == 1024


# ---------------------------------------------------------------------------------------------- P33


@pytest.mark.parametrize("spelling", ["current", "legacy"])
async def test_p33_every_code_is_emitted_in_the_configured_spelling(start, ckdir, spelling):
    config = default_instance_config(wire_spelling=spelling)
    h = await start(config=config)
    fresh = await start(config=config)

    # unauthorized
    h.assert_error(await h.call(MODEL, "status", token="wrong"), "unauthorized")
    # stale_checkpoint
    await h.ok(MODEL, "resume", h.body("c-gone"))
    h.assert_error(await h.prepare(MODEL, "c-gone"), "stale_checkpoint")
    # invalid_phase
    h.assert_error(await h.call(MODEL, "renew", h.body("c-none")), "invalid_phase")
    # rollout_id_required (data plane)
    response = await h.client.post(f"{h.servers[AGENT]}/run", json={"task": {}})
    h.assert_error(response, "rollout_id_required")
    # stale_attempt (data plane)
    await h.ok(AGENT, "retire", h.body("retire", episode_ids=[ep("old", 0)]))
    h.assert_error(await h.run("old", 0), "stale_attempt")
    # checkpoint_error: a restore on a participant that served work (published Gym reads the
    # directory first, and this one holds no checkpoint).
    assert (await h.run("served", turns=1)).status_code == 200
    not_fresh = "invalid_checkpoint_state" if h.published else "checkpoint_error"
    h.assert_error(await h.restore(MODEL, "restore-x", ckdir(), []), not_fresh)

    # With a checkpoint open: conflict, admission_closed, restart_in_scope, invalid_checkpoint_state,
    # deadline_exceeded, checkpoint_error (model commit without scope).
    h.knobs(AGENT, export_seconds=1.0)
    await h.prepare_all("c-open")
    h.assert_error(await h.prepare(MODEL, "c-other"), "checkpoint_conflict")
    h.assert_error(await h.run("new-work"), "admission_closed")
    if not h.published:  # the published model lets a new call wait instead
        h.assert_error(await h.chat("new-work"), "admission_closed")
    response = await h.call(MODEL, "commit", h.body("c-open", checkpoint_dir=str(ckdir())))
    assert response.status_code in (409, 422)
    if response.status_code == 409:
        h.assert_error(response, "checkpoint_error")
    h.assert_error(await h.commit(RESOURCES, "c-open", "relative/dir", []), "invalid_checkpoint_state")
    h.assert_error(await h.commit(AGENT, "c-open", ckdir(), [], seconds=0.2), "deadline_exceeded")
    await h.resume_all("c-open")

    # restart_in_scope needs a restart: a restart_only participant with a live episode.
    restart_only = server_config(config, RESOURCES, mode="restart_only")
    r = await start(config=restart_only)
    assert (await r.mutate("live-session")).status_code == 200
    await r.prepare_all("c-restart")
    r.assert_error(await r.commit(RESOURCES, "c-restart", ckdir(), [ep("live-session")]), "restart_in_scope")

    # unclaimed vs restored_pending
    status = await fresh.status(AGENT)
    assert ("restored_pending" in status) == (spelling == "legacy")
    assert ("unclaimed" in status) == (spelling == "current")


async def test_p33_legacy_and_current_codes_differ_where_section_10_says(start):
    legacy = await start(wire_spelling="legacy")
    current = await start(wire_spelling="current")
    for h, expected in ((legacy, "invalid_phase"), (current, "checkpoint_invalid_phase")):
        response = await h.call(MODEL, "renew", h.body("c1"))
        assert response.json()["error"]["code"] == expected
    for h, expected in ((legacy, "admission_closed"), (current, "checkpoint_parked")):
        await h.prepare_all("c1")
        assert (await h.run("x")).json()["error"]["code"] == expected


# ---------------------------------------------------------------------------------------------- P34


async def test_p34_capture_key_strings_instead_of_episode_objects_get_422(start, ckdir):
    h = await start()
    runs = await h.park_runs(["r1"], turns=5)
    await h.prepare_all("c1")
    directory = ckdir()
    before = {s: h.fingerprint(s) for s in PARTICIPANTS}
    for server in PARTICIPANTS:
        response = await h.call(server, "commit", h.body("c1", checkpoint_dir=str(directory), episode_ids=["r1"]))
        assert response.status_code == 422, response.text
        response = await h.call(server, "retire", h.body("c1", episode_ids=["r1-a1"]))
        assert response.status_code == 422
        response = await h.call(server, "restore", h.body("c1", checkpoint_dir=str(directory), episode_ids=["r1"]))
        assert response.status_code == 422
    assert {s: h.fingerprint(s) for s in PARTICIPANTS} == before
    assert not any(directory.iterdir())
    await h.resume_all("c1")
    assert (await runs["r1"]).status_code == 200


async def test_p34_commit_with_stop_true_is_accepted(start, ckdir):
    """Strict: accepted. Published (rule P4): refused 422 by a Gym that predates `stop`."""
    h = await start()
    await h.prepare_all("c-stop")
    directory = ckdir()
    if h.published:
        # Published Gym predates `stop`: an unknown field, refused 422 naming it, changing nothing.
        before = {s: h.fingerprint(s) for s in STAGES}
        for server in STAGES:
            response = await h.commit(server, "c-stop", directory, [], stop=True)
            assert response.status_code == 422, response.text
            assert [(e["type"], e["loc"]) for e in response.json()["detail"]] == [("extra_forbidden", ["body", "stop"])]
        assert {s: h.fingerprint(s) for s in STAGES} == before and not any(directory.iterdir())
        # The coordinator's retry without stop goes through.
        await h.commit_all("c-stop", directory, [])
        return
    for server in STAGES:
        response = await h.commit(server, "c-stop", directory, [], stop=True)
        assert response.status_code == 200, response.text
        assert response.json()["phase"] == "committed"
        # The replay compares stop: omitting it now is another commit.
        h.assert_error(await h.commit(server, "c-stop", directory, []), "checkpoint_conflict")
    for server in PARTICIPANTS:
        assert (await h.status(server))["phase"] == "committed"


async def test_p34_wrong_json_types_never_give_500(start):
    h = await start()
    garbage = [b"", b"null", b"[]", b"\"text\"", b"{\"checkpoint_id\": null}", b"\xff\xfe", b"{" * 50]
    for op in OPS:
        for raw in garbage:
            response = await h.call(MODEL, op, content=raw)
            assert response.status_code == 422, (op, raw, response.status_code)
