"""P5-P11: admission, readiness, prepare replays and waits, conflicts, the resumed memory, restarts."""

from __future__ import annotations

import asyncio
import time

import pytest

from gymsim.conformance import AGENT, MODEL, PARTICIPANTS, RESOURCES, STAGES
from gymsim.testing import default_instance_config, server_config


# ---------------------------------------------------------------------------------------------- P5


async def test_p5_prepare_closes_admission_and_resources_requests_wait(start, gym_profile):
    h = await start()
    await h.prepare_all("c1")
    h.assert_error(await h.run("late-run"), "admission_closed")
    if gym_profile == "published":
        # Published Gym's model (model.py b58bb4f) lets a new policy call wait for resume instead;
        # a waiting call is not admitted and does not block readiness.
        late_call = asyncio.ensure_future(h.chat("late-call"))
        await h.wait_until(lambda: h.state(MODEL)["waiting"] == 1)
        assert (await h.status(MODEL))["report"]["ready"] is True
    else:
        h.assert_error(await h.chat("late-call"), "admission_closed")

    waiting = asyncio.ensure_future(h.mutate("late-session", turn=0))
    await h.wait_until(lambda: h.state(RESOURCES)["report"]["counts"]["waiting"] == 1)
    await asyncio.sleep(0.2)
    assert not waiting.done()
    # A request waiting for resume does not block readiness.
    assert (await h.status(RESOURCES))["report"]["ready"] is True

    await h.resume_all("c1")
    response = await waiting
    assert response.status_code == 200 and response.json()["counter"] == 1
    assert (await h.run("late-run", turns=1)).status_code == 200
    if gym_profile == "published":
        assert (await late_call).status_code == 200
    assert (await h.chat("late-call")).status_code == 200


# ---------------------------------------------------------------------------------------------- P6


async def test_p6_prepare_replies_prepared_once_nothing_blocks(start):
    h = await start()
    for server in STAGES:
        reply = await h.ok(server, "prepare", h.body("c1"))
        assert reply["phase"] == "prepared"
        assert reply["report"]["ready"] is True
        assert reply["report"]["blockers"] == [] and reply["report"]["blocker_count"] == 0


async def test_p6_not_ready_by_the_deadline_caps_and_sorts_blockers(start):
    h = await start()
    sessions = [f"s{i:03d}" for i in range(105)]
    requests = [asyncio.ensure_future(h.mutate(s, work_seconds=60)) for s in reversed(sessions)]
    await h.wait_until(lambda: h.state(RESOURCES)["report"]["counts"]["in_flight"] == 105)

    started = time.monotonic()
    reply = await h.ok(RESOURCES, "prepare", h.body("c1", 0.3))
    assert time.monotonic() - started >= 0.25  # it waited for its deadline
    assert reply["phase"] == "preparing"
    report = reply["report"]
    assert report["ready"] is False
    assert report["blocker_count"] == 105
    assert report["blockers"] == sorted(sessions)[:100]

    # Admission stays closed: a new request waits instead of running.
    late = asyncio.ensure_future(h.mutate("late"))
    await h.wait_until(lambda: h.state(RESOURCES)["report"]["counts"]["waiting"] == 1)
    assert (await h.status(RESOURCES))["phase"] == "preparing"

    h.advance(61)  # the in-flight requests finish on the instance clock
    for response in await asyncio.gather(*requests):
        assert response.status_code == 200
    assert not late.done()
    await h.ok(RESOURCES, "resume", h.body("c1"))
    assert (await late).status_code == 200


async def test_p6_a_deadline_already_past_still_gets_a_200_reply(start):
    h = await start(turn_seconds=30)
    run = h.start_run("slow", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    response = await h.call(AGENT, "prepare", {"checkpoint_id": "c1", "deadline_ts": h.now() - 10})
    assert response.status_code == 200
    assert response.json()["phase"] == "preparing"
    assert response.json()["report"]["blockers"] == ["slow"]
    h.assert_error(await h.run("other"), "admission_closed")
    await h.ok(AGENT, "resume", h.body("c1"))
    run.cancel()


# ---------------------------------------------------------------------------------------------- P7


async def test_p7_a_repeated_prepare_after_not_ready_waits_again(start):
    h = await start(turn_seconds=20)
    run = h.start_run("r1", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)

    first = await h.ok(AGENT, "prepare", h.body("c1", 0.2))
    assert first["phase"] == "preparing" and first["report"]["blockers"] == ["r1"]
    started = time.monotonic()
    second = await h.ok(AGENT, "prepare", h.body("c1", 0.4))
    assert time.monotonic() - started >= 0.35  # waited again instead of replaying "not ready"
    assert second["phase"] == "preparing"

    # Once the turn ends, the episode parks at its boundary and the waiting prepare succeeds.
    waiting = asyncio.ensure_future(h.ok(AGENT, "prepare", h.body("c1", 60)))
    await asyncio.sleep(0.1)
    h.advance(20)
    third = await waiting
    assert third["phase"] == "prepared" and third["report"]["ready"] is True
    await h.ok(AGENT, "resume", h.body("c1"))
    assert (await run).status_code == 200


async def test_p7_once_prepared_a_repeat_replays_the_stored_reply_exactly(start):
    h = await start()
    first = await h.ok(RESOURCES, "prepare", h.body("c1"))
    # Change what a fresh report would say: a request now waits for resume.
    waiting = asyncio.ensure_future(h.mutate("s1"))
    await h.wait_until(lambda: h.state(RESOURCES)["report"]["counts"]["waiting"] == 1)
    assert (await h.status(RESOURCES))["report"]["counts"] != first["report"]["counts"]
    for _ in range(3):
        assert await h.ok(RESOURCES, "prepare", h.body("c1", 0.5)) == first
    await h.ok(RESOURCES, "resume", h.body("c1"))
    await waiting


# ---------------------------------------------------------------------------------------------- P8


async def test_p8_a_resume_ends_a_waiting_prepare_with_phase_idle(start):
    h = await start(turn_seconds=30)
    run = h.start_run("r1", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    waiting = asyncio.ensure_future(h.ok(AGENT, "prepare", h.body("c1", 20)))
    await h.wait_until(lambda: h.state(AGENT)["phase"] == "preparing")
    await asyncio.sleep(0.1)
    assert not waiting.done()

    resumed = await h.ok(AGENT, "resume", h.body("c1"))
    assert resumed == {"phase": "idle", "idempotent": False}
    reply = await asyncio.wait_for(waiting, 5)
    assert reply["phase"] == "idle"
    status = await h.status(AGENT)
    assert status["phase"] == "idle" and status["checkpoint_id"] is None
    assert status["accepting"] is True
    run.cancel()


# ---------------------------------------------------------------------------------------------- P9


async def test_p9_another_id_while_active_is_a_conflict_and_renew_in_idle_is_invalid_phase(start, ckdir):
    h = await start()
    for server in PARTICIPANTS:
        h.assert_error(await h.call(server, "renew", h.body("c1")), "invalid_phase")
    await h.prepare_all("c1")
    before = {s: h.fingerprint(s) for s in PARTICIPANTS}
    for server in PARTICIPANTS:
        h.assert_error(await h.prepare(server, "c2"), "checkpoint_conflict")
        h.assert_error(await h.call(server, "renew", h.body("c2")), "checkpoint_conflict")
        h.assert_error(await h.commit(server, "c2", ckdir(), []), "checkpoint_conflict")
        h.assert_error(await h.call(server, "resume", h.body("c2")), "checkpoint_conflict")
    assert {s: h.fingerprint(s) for s in PARTICIPANTS} == before


# ---------------------------------------------------------------------------------------------- P10


async def test_p10_the_last_64_resumed_ids_are_stale_and_the_65th_oldest_is_forgotten(start, ckdir):
    h = await start()
    ids = [f"c{i:02d}" for i in range(65)]
    # The oldest and the newest end real checkpoints; the others are resumes while idle, which the
    # participant remembers the same way (docs/gym-protocol.md#participant-phases).
    for index, cid in enumerate(ids):
        if index in (0, 64):
            assert (await h.ok(MODEL, "prepare", h.body(cid)))["phase"] == "prepared"
            assert (await h.ok(MODEL, "resume", h.body(cid)))["idempotent"] is False
        else:
            assert (await h.ok(MODEL, "resume", h.body(cid)))["idempotent"] is True
    directory = str(ckdir())
    for cid in ids[1:]:
        h.assert_error(await h.prepare(MODEL, cid), "stale_checkpoint")
    for cid in (ids[1], ids[32], ids[64]):
        h.assert_error(await h.call(MODEL, "renew", h.body(cid)), "stale_checkpoint")
        h.assert_error(await h.commit(MODEL, cid, directory, []), "stale_checkpoint")
        h.assert_error(await h.restore(MODEL, cid, directory, []), "stale_checkpoint")
    assert len(h.state(MODEL)["resumed"]) == 64
    # The oldest id fell out of the memory of 64: it can open a checkpoint again.
    assert (await h.ok(MODEL, "prepare", h.body(ids[0])))["phase"] == "prepared"
    # Stale is checked before conflict.
    h.assert_error(await h.prepare(MODEL, ids[1]), "stale_checkpoint")


# ---------------------------------------------------------------------------------------------- P11


async def test_p11_restarts_are_fixed_uncapped_and_never_block(start, gym_profile):
    h = await start(resources_mode="restart_only")
    sessions = [f"sess{i:03d}" for i in range(105)]
    await asyncio.gather(*(h.mutate(s) for s in sessions))
    # One request is still in flight: a restart_only resources server is ready all the same.
    busy = asyncio.ensure_future(h.mutate("sess-busy", work_seconds=60))
    await h.wait_until(lambda: h.state(RESOURCES)["report"]["counts"]["in_flight"] == 1)

    expected = sorted([*sessions, "sess-busy"])
    replies = await h.prepare_all("c1")
    report = replies[RESOURCES]["report"]
    assert report["ready"] is True and report["restarts"] == expected  # 106 > 100: never truncated
    assert replies[MODEL]["report"]["restarts"] == [] and replies[AGENT]["report"]["restarts"] == []
    assert (await h.status(RESOURCES))["report"]["restarts"] == expected
    again = await h.ok(RESOURCES, "prepare", h.body("c1"))
    assert again["report"]["restarts"] == expected
    h.advance(61)
    assert (await busy).status_code == 200
    # The busy session's request finished, yet the restarts of this checkpoint do not change.
    assert (await h.status(RESOURCES))["report"]["restarts"] == expected
    if gym_profile == "published":
        # Published restart_only resources never park a request and work their restarts out again
        # on every status, so a session started now shows up there; the stored prepare reply, which
        # is what the coordinator acts on, keeps the restarts it had.
        assert (await h.mutate("sess-new")).status_code == 200
        assert (await h.status(RESOURCES))["report"]["restarts"] == sorted([*expected, "sess-new"])
        assert (await h.ok(RESOURCES, "prepare", h.body("c1")))["report"]["restarts"] == expected


async def test_p11_a_restart_only_agent_reports_its_in_flight_runs_identically(start):
    config = server_config(default_instance_config(), AGENT, mode="restart_only")
    h = await start(config=config)
    await h.park_runs(["r1", "r2"], turns=8)
    replies = await h.prepare_all("c1")
    restarts = replies[AGENT]["report"]["restarts"]
    assert restarts == ["r1", "r2"] and replies[AGENT]["report"]["ready"] is True
    for _ in range(2):
        assert (await h.status(AGENT))["report"]["restarts"] == restarts
        assert (await h.ok(AGENT, "prepare", h.body("c1")))["report"]["restarts"] == restarts


@pytest.mark.parametrize("server", [MODEL, AGENT, RESOURCES])
async def test_p6_multi_worker_blockers(start, server, gym_profile):
    config = server_config(default_instance_config(), server, workers=3, unreported_workers=2)
    h = await start(config=config)
    kind = (await h.status(server))["kind"]
    if kind == "model" and gym_profile == "published":
        kind = "policy"  # published model_workers.py names its tokens after the policy
    reply = await h.ok(server, "prepare", h.body("c1", 0.2))
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == [f"{kind}-workers-unreported:2"]
    status = await h.status(server)
    assert status["expected_workers"] == 3 and status["workers"] == 1
    h.knobs(server, unreported_workers=0, worker_lost=True)
    reply = await h.ok(server, "prepare", h.body("c1", 0.2))
    assert reply["report"]["blockers"] == [f"{kind}-worker-lost"]
    h.knobs(server, worker_lost=False)
    assert (await h.ok(server, "prepare", h.body("c1", 2)))["phase"] == "prepared"
