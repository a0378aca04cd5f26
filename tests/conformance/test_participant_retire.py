"""P29-P32: retire and forget phases, marks, overrunning retires and forgetting marks."""

from __future__ import annotations

import asyncio

import pytest

from gymsim.conformance import AGENT, MODEL, PARTICIPANTS, RESOURCES, ep
from gymsim.testing import default_instance_config, server_config


async def _refused_while_open(h, server: str, cid: str) -> None:
    for checkpoint_id in (cid, "retire"):
        h.assert_error(await h.retire(server, checkpoint_id, [ep("victim")]), "invalid_phase")
    for checkpoint_id in (cid, "forget"):
        h.assert_error(await h.forget(server, checkpoint_id, ["victim"]), "invalid_phase")
    assert "victim" not in h.state(server)["marks"]


# ---------------------------------------------------------------------------------------------- P29


async def check_p29_retire_and_forget_while_open(h, ckdir) -> None:
    # preparing: the agent has an episode between boundaries.
    run = h.start_run("busy", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    assert (await h.ok(AGENT, "prepare", h.body("c1", 0.1)))["phase"] == "preparing"
    await _refused_while_open(h, AGENT, "c1")
    await h.ok(AGENT, "resume", h.body("c1"))
    run.cancel()
    # prepared, then committed.
    for server in (MODEL, RESOURCES):
        assert (await h.ok(server, "prepare", h.body("c2")))["phase"] == "prepared"
        await _refused_while_open(h, server, "c2")
        assert (await h.commit(server, "c2", ckdir(), [])).status_code == 200
        await _refused_while_open(h, server, "c2")


async def test_p29_retire_and_forget_are_invalid_phase_while_a_checkpoint_is_open(start, ckdir):
    await check_p29_retire_and_forget_while_open(await start(turn_seconds=30), ckdir)


async def test_p29_broken_retire_while_open_is_caught(start, ckdir):
    h = await start(turn_seconds=30, broken=["retire_while_open"])
    with pytest.raises(AssertionError):
        await check_p29_retire_and_forget_while_open(h, ckdir)


async def test_p29_in_restored_only_the_restore_id_may_retire_or_forget(start, ckdir):
    a = await start()
    saved = await a.save("snap-1", ckdir(), ["r1"], turns=8)
    b = await start()
    await b.restore_all("restore-1", saved)
    # Published Gym raises none at restore (rule P5, docs/gym-protocol.md#what-differs-rule-by-rule).
    restore_marks = {} if b.published else {"r1": 0}
    for server in PARTICIPANTS:
        b.assert_error(await b.retire(server, "retire", [ep("r1", 1)]), "checkpoint_conflict")
        b.assert_error(await b.forget(server, "forget", ["r1"]), "checkpoint_conflict")
        assert b.state(server)["marks"] == restore_marks
    # The restore cleanup: retire N+1 with the restore id, callers first.
    for server in (AGENT, MODEL, RESOURCES):
        assert (await b.retire(server, "restore-1", [ep("r1", 1)])).json() == {"retired": ["r1-a1"]}
        assert b.state(server)["marks"] == {"r1": 1}
        assert await b.unclaimed(server) == []
    await b.resume_all("restore-1")
    b.assert_error(await b.run("r1", 1, task={"rollout": "r1"}), "stale_attempt")
    assert (await b.run("r1", 2, task={"rollout": "r1"}, turns=1)).status_code == 200


# ---------------------------------------------------------------------------------------------- P30


async def check_p30_marks_refuse_stale_attempts(h) -> None:
    for server in PARTICIPANTS:
        assert (await h.retire(server, "retire", [ep("r", 1)])).json() == {"retired": ["r-a1"]}
    h.assert_error(await h.run("r", 1), "stale_attempt")
    h.assert_error(await h.run("r", 0), "stale_attempt")
    h.assert_error(await h.chat("r-a1"), "stale_attempt")
    h.assert_error(await h.chat("r"), "stale_attempt")
    h.assert_error(await h.mutate("r-a1"), "stale_attempt")
    h.assert_error(await h.mutate("r"), "stale_attempt")
    admitted = await h.run("r", 2, turns=1)
    assert admitted.status_code == 200 and admitted.json()["capture_key"] == "r-a2"
    # A later retire of a lower attempt never lowers the mark.
    for server in PARTICIPANTS:
        await h.retire(server, "retire", [ep("r", 0)])
        assert h.state(server)["marks"] == {"r": 1}
    h.assert_error(await h.run("r", 1), "stale_attempt")


async def test_p30_a_retire_marks_the_rollout_and_refuses_attempts_up_to_n(start):
    await check_p30_marks_refuse_stale_attempts(await start())


async def test_p30_broken_ignore_stale_attempt_is_caught(start):
    h = await start(broken=["ignore_stale_attempt"])
    with pytest.raises(AssertionError):
        await check_p30_marks_refuse_stale_attempts(h)


async def test_p30_a_retire_stops_running_work(start):
    h = await start(turn_seconds=30)
    run = h.start_run("r1", turns=3)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    assert (await h.retire(AGENT, "retire", [ep("r1")])).status_code == 200
    h.assert_error(await asyncio.wait_for(run, 5), "stale_attempt")
    assert h.state(AGENT)["episodes"] == {}


# ---------------------------------------------------------------------------------------------- P31


async def test_p31_an_overrun_retire_keeps_the_mark_and_a_retry_finishes_the_stop(start):
    config = server_config(default_instance_config(turn_seconds=30), AGENT, stop_seconds=5)
    h = await start(config=config)
    run = h.start_run("r1", turns=2)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)

    h.assert_error(await h.retire(AGENT, "retire", [ep("r1")], seconds=0.2), "deadline_exceeded")
    state = h.state(AGENT)
    assert state["marks"] == {"r1": 0}
    assert state["episodes"]["r1"]["cancel_requested"] is True  # still tracked, still stopping
    h.assert_error(await h.run("r1", 0), "stale_attempt")
    # Forget refuses while the retired work is still tracked, and forgets nothing.
    h.assert_error(await h.forget(AGENT, "forget", ["r1"]), "checkpoint_error")
    assert h.state(AGENT)["marks"] == {"r1": 0}

    retry = asyncio.ensure_future(h.retire(AGENT, "retire", [ep("r1")], seconds=60))
    await asyncio.sleep(0.2)
    assert not retry.done()
    h.advance(5)  # the episode's cleanup ends
    assert (await retry).json() == {"retired": ["r1"]}
    assert h.state(AGENT)["episodes"] == {}
    h.assert_error(await asyncio.wait_for(run, 5), "stale_attempt")
    # Repeating a retire is harmless.
    assert (await h.retire(AGENT, "retire", [ep("r1")])).json() == {"retired": ["r1"]}
    assert h.state(AGENT)["marks"] == {"r1": 0}
    assert (await h.forget(AGENT, "forget", ["r1"])).json() == {"forgotten": ["r1"]}


# ---------------------------------------------------------------------------------------------- P32


async def test_p32_forget_drops_marks_returns_sorted_ids_and_readmits(start):
    h = await start()
    for server in PARTICIPANTS:
        await h.retire(server, "retire", [ep("zeta", 0), ep("alpha", 1)])
        assert (await h.status(server))["retired_rollouts"] == 2
    assert (await h.status(RESOURCES))["retired_sessions"] >= 2
    h.assert_error(await h.run("alpha", 1), "stale_attempt")
    for server in (AGENT, MODEL, RESOURCES):
        reply = await h.forget(server, "forget", ["zeta", "alpha", "never-marked"])
        assert reply.json() == {"forgotten": ["alpha", "never-marked", "zeta"]}
        assert (await h.status(server))["retired_rollouts"] == 0
    assert (await h.status(RESOURCES))["retired_sessions"] == 0
    assert (await h.run("alpha", 1, turns=1)).status_code == 200
    assert (await h.run("zeta", 0, turns=1)).status_code == 200
    assert h.state(AGENT)["forget_calls"] == [["alpha", "never-marked", "zeta"]]
    assert h.state(AGENT)["retire_calls"] == [["zeta", "alpha-a1"]]
