"""P21-P24: resume semantics, reopening admission, lease arithmetic and lease expiry."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gymsim.conformance import AGENT, MODEL, PARTICIPANTS, RESOURCES, STAGES, ep
from gymsim.storage import participant_dir
from gymsim.testing import default_instance_config, server_config


# ---------------------------------------------------------------------------------------------- P21


async def test_p21_resume_is_idempotent_false_only_when_it_ends_a_checkpoint(start):
    h = await start()
    await h.prepare_all("c1")
    for server in reversed(STAGES):
        assert await h.ok(server, "resume", h.body("c1")) == {"phase": "idle", "idempotent": False}
    for server in PARTICIPANTS:
        assert await h.ok(server, "resume", h.body("c1")) == {"phase": "idle", "idempotent": True}
        # Resume is never refused for a deadline that passed when there is nothing to wait for.
        late = await h.call(server, "resume", {"checkpoint_id": "c1", "deadline_ts": h.now() - 100})
        assert late.json() == {"phase": "idle", "idempotent": True}


async def test_p21_resume_of_an_unseen_id_while_idle_makes_it_stale(start):
    h = await start()
    for server in PARTICIPANTS:
        assert await h.ok(server, "resume", h.body("c-aborted")) == {"phase": "idle", "idempotent": True}
    for server in PARTICIPANTS:
        # A late prepare of the aborted checkpoint can never close admission.
        h.assert_error(await h.prepare(server, "c-aborted"), "stale_checkpoint")
        assert (await h.status(server))["phase"] == "idle"
    assert (await h.run("after", turns=1)).status_code == 200


# ---------------------------------------------------------------------------------------------- P22


async def test_p22_resume_reopens_admission_and_delivers_held_responses(start):
    config = server_config(default_instance_config(), MODEL, model_latency_seconds=0.2)
    h = await start(config=config)
    call = asyncio.ensure_future(h.chat("held", turn=0))
    await h.wait_until(lambda: h.state(MODEL)["report"]["counts"]["computing"] == 1)
    await h.prepare_all("c1")
    await h.wait_until(lambda: h.state(MODEL)["report"]["counts"]["held"] == 1)
    await asyncio.sleep(0.2)
    assert not call.done()
    h.assert_error(await h.run("new"), "admission_closed")

    await h.resume_all("c1")
    response = await asyncio.wait_for(call, 5)
    assert response.status_code == 200
    assert response.json()["staging_key"] == "tq/held/0"
    assert (await h.run("new", turns=1)).status_code == 200


async def test_p22_parked_episodes_continue_after_resume(start):
    h = await start()
    runs = await h.park_runs(["r1", "r2"], turns=6)
    await h.prepare_all("c1")
    await asyncio.sleep(0.2)
    assert not any(run.done() for run in runs.values())
    await h.resume_all("c1")
    for rollout, run in runs.items():
        body = (await asyncio.wait_for(run, 10)).json()
        assert body["turns_completed"] == 6 and body["reward"] == 1.0


# ---------------------------------------------------------------------------------------------- P23


async def test_p23_the_lease_is_the_max_of_old_and_deadline_plus_grace(start, ckdir):
    grace = 100.0
    h = await start(lease_grace_seconds=grace)
    d1 = h.deadline(10)
    await h.ok(MODEL, "prepare", {"checkpoint_id": "c1", "deadline_ts": d1})
    assert (await h.status(MODEL))["lease_expires_at"] == d1 + grace
    # An earlier deadline never moves the lease back.
    reply = await h.ok(MODEL, "renew", {"checkpoint_id": "c1", "deadline_ts": d1 - 5})
    assert reply == {"lease_expires_at": d1 + grace}
    d2 = d1 + 7
    assert (await h.ok(MODEL, "renew", {"checkpoint_id": "c1", "deadline_ts": d2}))["lease_expires_at"] == d2 + grace
    await h.ok(MODEL, "prepare", {"checkpoint_id": "c1", "deadline_ts": d1})  # a replay
    assert (await h.status(MODEL))["lease_expires_at"] == d2 + grace
    d3 = d2 + 3
    body = {"checkpoint_id": "c1", "deadline_ts": d3, "checkpoint_dir": str(ckdir()), "episode_ids": []}
    await h.ok(MODEL, "commit", body)
    assert (await h.status(MODEL))["lease_expires_at"] == d3 + grace
    await h.ok(MODEL, "renew", {"checkpoint_id": "c1", "deadline_ts": d1})
    assert (await h.status(MODEL))["lease_expires_at"] == d3 + grace


async def test_p23_restore_and_retire_while_restored_set_the_lease(start, ckdir):
    grace = 50.0
    a = await start()
    await a.prepare_all("c1")
    directory = ckdir()
    await a.commit_all("c1", directory, [])
    b = await start(lease_grace_seconds=grace)
    d1 = b.deadline(20)
    body = {"checkpoint_id": "restore-1", "deadline_ts": d1, "checkpoint_dir": str(directory), "episode_ids": []}
    await b.ok(RESOURCES, "restore", body)
    assert (await b.status(RESOURCES))["lease_expires_at"] == d1 + grace
    d2 = d1 + 4
    retire = {"checkpoint_id": "restore-1", "deadline_ts": d2, "episode_ids": [ep("x", 1)]}
    await b.ok(RESOURCES, "retire", retire)
    assert (await b.status(RESOURCES))["lease_expires_at"] == d2 + grace
    forget = {"checkpoint_id": "restore-1", "deadline_ts": d1, "rollout_ids": ["x"]}
    await b.ok(RESOURCES, "forget", forget)
    assert (await b.status(RESOURCES))["lease_expires_at"] == d2 + grace


# ---------------------------------------------------------------------------------------------- P24


async def check_p24_lease_expiry(h, ckdir, caplog) -> None:
    await h.park_runs(["r1"], turns=8)
    await h.prepare_all("c1", seconds=2)
    directory = ckdir()
    # A slow export is running when the lease runs out: it must never publish a manifest.
    h.assert_error(await h.commit(AGENT, "c1", directory, [ep("r1")], seconds=0.1), "deadline_exceeded")
    with caplog.at_level(logging.WARNING, logger="gymsim"):
        h.advance(30)
        for server in PARTICIPANTS:
            status = await h.status(server)
            assert status["phase"] == "idle" and status["checkpoint_id"] is None
            assert status["lease_expires_at"] is None
            assert h.state(server)["lease_expired"] == 1
    assert any("lease" in r.getMessage() and "c1" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert (await h.run("after-expiry", turns=1)).status_code == 200  # admission reopened
    for server in PARTICIPANTS:
        h.assert_error(await h.call(server, "renew", h.body("c1")), "stale_checkpoint")
        h.assert_error(await h.prepare(server, "c1"), "stale_checkpoint")
        h.assert_error(await h.commit(server, "c1", directory, [ep("r1")]), "stale_checkpoint")
    await asyncio.sleep(0.3)
    h.advance(30)
    await asyncio.sleep(0.1)
    assert not (participant_dir(directory, "agent", AGENT) / "manifest.json").exists()


def _expiry_config(**extra):
    config = default_instance_config(lease_grace_seconds=5, **extra)
    return server_config(config, AGENT, export_seconds=3)


async def test_p24_an_expired_lease_reopens_the_participant(start, ckdir, caplog):
    await check_p24_lease_expiry(await start(config=_expiry_config()), ckdir, caplog)


async def test_p24_broken_lease_never_expires_is_caught(start, ckdir, caplog):
    h = await start(config=_expiry_config(broken=["lease_never_expires"]))
    with pytest.raises(AssertionError):
        await check_p24_lease_expiry(h, ckdir, caplog)


async def test_p24_an_idle_deployment_reopens_on_its_own(start):
    h = await start(lease_grace_seconds=0.3)
    await h.prepare_all("c1", seconds=0.1)
    await asyncio.sleep(1.0)
    # The admin view never expires leases itself: only the participant's own timer can have done it.
    for server in PARTICIPANTS:
        state = h.state(server)
        assert state["phase"] == "idle" and state["lease_expired"] == 1 and state["admission_open"] is True
