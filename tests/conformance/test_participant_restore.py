"""P25-P28: restore freshness, installing N+1, refusing bad state, and claiming the continuation."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from gymsim.conformance import AGENT, MODEL, PARTICIPANTS, RESOURCES, STAGES, ep
from gymsim.testing import corrupt_records_file, default_instance_config, edit_manifest, server_config

KINDS = {MODEL: "model", AGENT: "agent", RESOURCES: "resources"}


async def empty_checkpoint(start, ckdir):
    a = await start()
    await a.prepare_all("c1")
    directory = ckdir()
    await a.commit_all("c1", directory, [])
    return directory


# ---------------------------------------------------------------------------------------------- P25


@pytest.mark.parametrize("server", [MODEL, AGENT, RESOURCES])
async def test_p25_restore_on_a_participant_that_served_work_is_refused(start, ckdir, server):
    directory = await empty_checkpoint(start, ckdir)
    b = await start(turn_seconds=30)
    if server == MODEL:
        assert (await b.chat("earlier")).status_code == 200
    elif server == RESOURCES:
        assert (await b.mutate("earlier")).status_code == 200
    else:
        b.start_run("earlier", turns=1)
        await b.wait_until(lambda: b.state(AGENT)["report"]["counts"]["working"] == 1)
    before = b.fingerprint(server)
    b.assert_error(await b.restore(server, "restore-1", directory, []), "checkpoint_error")
    assert b.fingerprint(server) == before
    state = b.state(server)
    assert state["phase"] == "idle" and state["admission_open"] is True and state["checkpoint_id"] is None


async def test_p25_a_non_fresh_process_is_refused(start, ckdir):
    directory = await empty_checkpoint(start, ckdir)
    config = server_config(default_instance_config(), MODEL, non_fresh=True)
    b = await start(config=config)
    b.assert_error(await b.restore(MODEL, "restore-1", directory, []), "checkpoint_error")
    assert (await b.status(MODEL))["phase"] == "idle"
    # The other participants of the instance are fresh and restore fine.
    assert (await b.restore(AGENT, "restore-1", directory, [])).status_code == 200


# ---------------------------------------------------------------------------------------------- P26


async def test_p26_restore_installs_exactly_the_scoped_episodes_as_n_plus_1(start, ckdir):
    a = await start()
    saved = await a.save("snap-1", ckdir(), ["r1", "r2"], turns=8)
    b = await start()
    replies = await b.restore_all("restore-1", saved, rollouts=["r1"])
    for server in STAGES:
        reply = replies[server]
        assert reply == {"phase": "restored", "source_checkpoint_id": "snap-1", "restored": ["r1-a1"]}
        status = await b.status(server)
        assert status["phase"] == "restored" and status["checkpoint_id"] == "restore-1"
        assert status[b.unclaimed_field] == ["r1-a1"]
    # Admission stays closed until resume.
    b.assert_error(await b.run("r1", 1, task={"rollout": "r1"}), "admission_closed")
    b.assert_error(await b.run("fresh-work"), "admission_closed")
    if b.published:
        # The published model lets a new call wait for resume instead of refusing it.
        late_call = asyncio.ensure_future(b.chat("fresh-work"))
        await b.wait_until(lambda: b.state(MODEL)["waiting"] == 1)
    else:
        b.assert_error(await b.chat("fresh-work"), "admission_closed")
    # A replay of the same restore returns the same reply.
    again = await b.restore(AGENT, "restore-1", saved.directory, [ep("r1")])
    assert again.json() == replies[AGENT]
    await b.resume_all("restore-1")
    response = await b.run("r1", 1, task={"rollout": "r1"}, turns=saved.turns)
    assert response.status_code == 200
    if b.published:
        assert (await late_call).status_code == 200


# ---------------------------------------------------------------------------------------------- P27


def _tamper(directory, case: str, kind: str, name: str) -> None:
    if case == "flipped byte":
        corrupt_records_file(directory, kind, name, "flip")
    elif case == "extra line":
        corrupt_records_file(directory, kind, name, "append")
    elif case == "wrong record_count":
        edit_manifest(directory, kind, name, record_count=99)
    elif case == "another kind":
        edit_manifest(directory, kind, name, kind="model" if kind != "model" else "agent")
    elif case == "another participant":
        edit_manifest(directory, kind, name, instance="someone_else")
    elif case == "schema version":
        edit_manifest(directory, kind, name, schema_version=2)
    elif case == "missing":
        shutil.rmtree(directory / "gym" / kind / name)


BAD_STATE = ["flipped byte", "extra line", "wrong record_count", "another kind", "another participant", "schema version", "missing"]


@pytest.mark.parametrize("server", [AGENT, RESOURCES, MODEL])
async def test_p27_restore_from_bad_state_gets_422_and_stays_idle_and_open(start, ckdir, tmp_path, server):
    a = await start()
    saved = await a.save("snap-1", ckdir(), ["r1"], turns=8)
    b = await start()
    before = b.fingerprint(server)
    for case in BAD_STATE:
        bad = tmp_path / case.replace(" ", "-")
        shutil.copytree(saved.directory, bad)
        _tamper(bad, case, KINDS[server], server)
        response = await b.restore(server, "restore-1", bad, [ep("r1")])
        b.assert_error(response, "invalid_checkpoint_state")
        assert b.fingerprint(server) == before, case
        state = b.state(server)
        assert state["phase"] == "idle" and state["admission_open"] is True and state["unclaimed"] == []
    # A failed restore can be retried with the same id.
    retried = await b.restore(server, "restore-1", saved.directory, [ep("r1")])
    assert retried.status_code == 200 and retried.json()["restored"] == ["r1-a1"]


# ---------------------------------------------------------------------------------------------- P28


@pytest.mark.parametrize("spelling", ["current", "legacy"])
async def test_p28_the_n_plus_1_run_claims_the_restored_state_and_n_is_stale(start, ckdir, spelling):
    a = await start(wire_spelling=spelling)
    saved = await a.save("snap-1", ckdir(), ["r1", "r2"], turns=8)
    b = await start(wire_spelling=spelling)
    await b.restore_all("restore-1", saved)
    await b.resume_all("restore-1")
    pending = "restored_pending" if spelling == "legacy" else "unclaimed"
    for server in PARTICIPANTS:
        assert (await b.status(server))[pending] == ["r1-a1", "r2-a1"]

    b.assert_error(await b.run("r1", 0, task={"rollout": "r1"}), "stale_attempt")
    if b.published:
        # Published Gym raises no mark at restore (rule P5,
        # docs/gym-protocol.md#what-differs-rule-by-rule): the agent's restored binding of r1 is what
        # refuses attempt N, and any other attempt but N+1 too. Model and resources hold no mark, so
        # the coordinator's own ledger has to refuse a late seal of N.
        b.assert_error(await b.run("r1", 2, task={"rollout": "r1"}), "stale_attempt")
        assert [(await b.status(s))["retired_rollouts"] for s in PARTICIPANTS] == [0, 0, 0]
    else:
        b.assert_error(await b.chat("r1"), "stale_attempt")
        b.assert_error(await b.mutate("r1"), "stale_attempt")

    response = await b.run("r1", 1, task={"rollout": "r1"}, turns=saved.turns)
    assert response.status_code == 200, response.text
    row = response.json()
    turn = saved.saved_turns["r1"]
    assert row["capture_key"] == "r1-a1" and row["resumed_from_turn"] == turn
    assert row["turns_completed"] == saved.turns and row["reward"] == 1.0
    assert {f"tq/r1/{t}" for t in range(turn)} <= set(row["staging_keys"])
    assert {f"tq/r1-a1/{t}" for t in range(turn, saved.turns)} <= set(row["staging_keys"])
    for server in PARTICIPANTS:
        assert (await b.status(server))[pending] == ["r2-a1"]

    # Every (rollout, turn) mutation was applied exactly once across the save and the continuation.
    history = b.sessions()["r1-a1"]["history"]
    assert sorted((h["rollout_id"], h["turn"]) for h in history) == [("r1", t) for t in range(saved.turns)]
    assert [h["attempt"] for h in history] == [0] * turn + [1] * (saved.turns - turn)
