"""P12-P20: commit phases, restarts in scope, manifests, replays, overruns, model and agent replies."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import pytest

from gymsim.conformance import AGENT, MODEL, PARTICIPANTS, RESOURCES, STAGES, ep
from gymsim.storage import participant_dir
from gymsim.testing import default_instance_config, server_config

KINDS = {MODEL: "model", AGENT: "agent", RESOURCES: "resources"}


def files_of(directory) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


async def saved_and_restored(start, ckdir, rollouts=("r1", "r2"), turns=8):
    """A save on instance A and a fresh instance B restored from it (phase restored)."""
    a = await start()
    saved = await a.save("snap-1", ckdir(), list(rollouts), turns=turns)
    b = await start()
    await b.restore_all("restore-1", saved)
    return a, b, saved


# ---------------------------------------------------------------------------------------------- P12


async def test_p12_commit_outside_prepared_is_invalid_phase(start, ckdir):
    h = await start(turn_seconds=30)
    for server in PARTICIPANTS:
        h.assert_error(await h.commit(server, "c1", ckdir(), []), "invalid_phase")  # idle
    run = h.start_run("busy", turns=1)
    await h.wait_until(lambda: h.state(AGENT)["report"]["counts"]["working"] == 1)
    assert (await h.ok(AGENT, "prepare", h.body("c1", 0.1)))["phase"] == "preparing"
    h.assert_error(await h.commit(AGENT, "c1", ckdir(), [ep("busy")]), "invalid_phase")  # preparing
    await h.ok(AGENT, "resume", h.body("c1"))
    run.cancel()


async def test_p12_commit_in_restored_is_invalid_phase(start, ckdir):
    _, b, saved = await saved_and_restored(start, ckdir)
    for server in PARTICIPANTS:
        h_dir = ckdir()
        b.assert_error(await b.commit(server, "restore-1", h_dir, [ep("r1", 1)]), "invalid_phase")
        assert not any(h_dir.iterdir())


async def test_p12_commit_after_readiness_regressed_is_invalid_phase(start, ckdir):
    config = server_config(default_instance_config(), MODEL, model_latency_seconds=0.3)
    h = await start(config=config)
    call = asyncio.ensure_future(h.chat("held-episode", turn=0))
    await h.wait_until(lambda: h.state(MODEL)["report"]["counts"]["computing"] == 1)
    # An admitted call whose response is not delivered yet does not block readiness.
    assert (await h.ok(MODEL, "prepare", h.body("c1")))["phase"] == "prepared"
    await h.wait_until(lambda: h.state(MODEL)["report"]["counts"]["held"] == 1)
    assert not call.done()

    h.gym.admin("POST", f"/model/{MODEL}/release_held", {"stream_seconds": 30})
    await h.wait_until(lambda: h.state(MODEL)["report"]["counts"]["streaming"] == 1)
    directory = ckdir()
    h.assert_error(await h.commit(MODEL, "c1", directory, [ep("held-episode")]), "invalid_phase")
    assert not any(directory.iterdir())
    await h.ok(MODEL, "resume", h.body("c1"))
    h.advance(31)
    assert (await call).status_code == 200


# ---------------------------------------------------------------------------------------------- P13


async def test_p13_a_scope_naming_a_reported_restart_is_refused_and_writes_nothing(start, ckdir):
    config = server_config(default_instance_config(), AGENT, mode="restart_only")
    h = await start(config=config)
    await h.park_runs(["r1", "r2"], turns=8)
    replies = await h.prepare_all("c1")
    assert replies[AGENT]["report"]["restarts"] == ["r1", "r2"]
    directory = ckdir()
    h.assert_error(await h.commit(AGENT, "c1", directory, [ep("r1")]), "restart_in_scope")
    h.assert_error(await h.commit(AGENT, "c1", directory, [ep("r0"), ep("r2")]), "restart_in_scope")
    assert list(directory.rglob("*")) == []
    assert (await h.status(AGENT))["phase"] == "prepared"
    # Without the restarts the same commit goes through.
    assert (await h.commit(AGENT, "c1", directory, [])).status_code == 200


async def check_p13_restart_in_scope(h, ckdir) -> None:
    await h.park_runs(["r1"], turns=8)
    await h.prepare_all("c1")
    directory = ckdir()
    h.assert_error(await h.commit(AGENT, "c1", directory, [ep("r1")]), "restart_in_scope")
    assert list(directory.rglob("*")) == []


async def test_p13_broken_commit_names_restart_is_caught(start, ckdir):
    config = server_config(default_instance_config(broken=["commit_names_restart"]), AGENT, mode="restart_only")
    h = await start(config=config)
    with pytest.raises(AssertionError):
        await check_p13_restart_in_scope(h, ckdir)


# ---------------------------------------------------------------------------------------------- P14


def assert_manifest_matches_files(reply: dict, directory, kind: str, name: str, checkpoint_id: str) -> list[dict]:
    manifest = reply["manifest"]
    pdir = participant_dir(directory, kind, name)
    on_disk = json.loads((pdir / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["schema_version"] == 1
    assert manifest["kind"] == kind and manifest["instance"] == name
    assert manifest["checkpoint_id"] == checkpoint_id
    data = (pdir / manifest["records_file"]).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert manifest["records_sha256"] == digest
    assert manifest["records_file"] == f"records-{digest}.jsonl"
    assert manifest["record_count"] == data.count(b"\n") == len(data.splitlines())
    assert sorted(os.listdir(pdir)) == sorted(["manifest.json", manifest["records_file"]])  # no temp files
    records = [json.loads(line) for line in data.splitlines()]
    for record in records:
        assert set(record) == {"episode_id", "kind", "state"} and record["kind"] == kind
        assert set(record["episode_id"]) == {"rollout_id", "attempt"}
    return records


async def test_p14_manifest_written_last_with_digest_and_count(start, ckdir):
    h = await start()
    saved = await h.save("c1", ckdir(), ["r1", "r2", "r3"])
    for server in STAGES:
        records = assert_manifest_matches_files(saved.replies[server], saved.directory, KINDS[server], server, "c1")
        assert [r["episode_id"]["rollout_id"] for r in records] == ["r1", "r2", "r3"]
        assert saved.replies[server]["episode_ids"] == ["r1", "r2", "r3"]


async def test_p14_a_participant_without_episodes_still_writes_a_manifest(start, ckdir):
    h = await start()
    await h.prepare_all("c-empty")
    directory = ckdir()
    replies = await h.commit_all("c-empty", directory, [])
    for server in STAGES:
        records = assert_manifest_matches_files(replies[server], directory, KINDS[server], server, "c-empty")
        assert records == [] and replies[server]["manifest"]["record_count"] == 0
        assert replies[server]["manifest"]["records_sha256"] == hashlib.sha256(b"").hexdigest()
        assert replies[server]["episode_ids"] == []


# ---------------------------------------------------------------------------------------------- P15


async def check_p15_commit_replay(h, ckdir) -> None:
    await h.park_runs(["r1", "r2"])
    await h.prepare_all("c1")
    directory = ckdir()
    scope = [ep("r2"), ep("r1"), ep("ghost")]
    first = await h.commit(AGENT, "c1", directory, scope)
    assert first.status_code == 200, first.text
    reply = first.json()
    assert reply["episode_ids"] == sorted(reply["episode_ids"]) == ["r1", "r2"]
    assert set(reply["episode_ids"]) <= {"r1", "r2", "ghost"}
    # Same dir, same scope (as a set, in any order), same stop: a replay, whatever the deadline.
    again = await h.commit(AGENT, "c1", directory, list(reversed(scope)), seconds=99)
    assert again.status_code == 200 and again.json() == reply
    assert h.state(AGENT)["export_count"] == 1
    h.assert_error(await h.commit(AGENT, "c1", ckdir(), scope), "checkpoint_conflict")
    h.assert_error(await h.commit(AGENT, "c1", directory, scope[:2]), "checkpoint_conflict")
    with_stop = await h.commit(AGENT, "c1", directory, scope, stop=True)
    if h.published:
        # Published Gym has no `stop` (rule P4, docs/gym-protocol.md#what-differs-rule-by-rule).
        assert with_stop.status_code == 422  # an unknown field
    else:
        h.assert_error(with_stop, "checkpoint_conflict")
    assert h.state(AGENT)["export_count"] == 1


async def test_p15_commit_replays_without_exporting_again_and_conflicts_on_other_arguments(start, ckdir):
    await check_p15_commit_replay(await start(), ckdir)


async def test_p15_broken_replay_with_a_different_scope_is_caught(start, ckdir):
    h = await start(broken=["replay_different_scope"])
    with pytest.raises(AssertionError):
        await check_p15_commit_replay(h, ckdir)


# ---------------------------------------------------------------------------------------------- P16


async def test_p16_an_overrun_commit_is_awaited_by_its_retry_and_exports_once(start, ckdir):
    config = server_config(default_instance_config(), AGENT, export_seconds=5.0)
    h = await start(config=config)
    await h.park_runs(["r1"])
    await h.prepare_all("c1")
    directory = ckdir()
    h.assert_error(await h.commit(AGENT, "c1", directory, [ep("r1")], seconds=0.2), "deadline_exceeded")
    assert not (participant_dir(directory, "agent", AGENT) / "manifest.json").exists()
    assert (await h.status(AGENT))["phase"] == "prepared"

    retries = [asyncio.ensure_future(h.commit(AGENT, "c1", directory, [ep("r1")], seconds=60)) for _ in range(2)]
    await asyncio.sleep(0.2)
    assert not any(r.done() for r in retries)
    h.advance(5)  # the one running export finishes
    first, second = [r.json() for r in await asyncio.gather(*retries)]
    assert first == second and first["episode_ids"] == ["r1"]
    state = h.state(AGENT)
    assert state["export_count"] == 1 and state["write_count"] == 1
    assert state["phase"] == "committed"


# ---------------------------------------------------------------------------------------------- P17


async def test_p17_a_model_commit_needs_episode_ids(start, ckdir):
    h = await start()
    await h.prepare_all("c1")
    body = h.body("c1", checkpoint_dir=str(ckdir()))
    response = await h.call(MODEL, "commit", body)
    assert response.status_code in (409, 422)
    if response.status_code == 409:
        h.assert_error(response, "checkpoint_error")
    assert (await h.status(MODEL))["phase"] == "prepared"
    assert h.state(MODEL)["export_count"] == 0


async def test_p17_staging_keys_by_episode_cover_exactly_the_staging_keys(start, ckdir):
    h = await start()
    saved = await h.save("c1", ckdir(), ["r1", "r2"], turns=20)
    reply = saved.replies[MODEL]
    by_episode = reply["staging_keys_by_episode"]
    assert set(by_episode) <= {"r1", "r2"}
    union = sorted({k for keys in by_episode.values() for k in keys})
    assert union == reply["staging_keys"]
    for rollout, turn in saved.saved_turns.items():
        keys = set(by_episode[rollout])
        assert {f"tq/{rollout}/{t}" for t in range(turn)} <= keys <= {f"tq/{rollout}/{t}" for t in range(turn + 1)}


# ---------------------------------------------------------------------------------------------- P18


@pytest.mark.pinned_too
async def test_p18_agent_run_episode_ids_are_a_subset_of_its_exports(start, ckdir, gym_profile):
    h = await start()
    h.gym.admin("POST", f"/agent/{AGENT}/native_sessions", {"rollout_id": "native", "attempt": 0})
    await h.park_runs(["r1", "outside"])
    await h.prepare_all("c1")
    reply = (await h.commit(AGENT, "c1", ckdir(), [ep("native"), ep("r1")])).json()
    if gym_profile == "published":
        # No run_episode_ids (rule P1), and every live session is exported whatever the scope (rule P2).
        assert "run_episode_ids" not in reply
        assert reply["episode_ids"] == ["native", "outside", "r1"]
        return
    if gym_profile == "pinned":
        # Every live session exported (rule P2), and the /run sessions among them named, the one
        # outside the scope too (rule P8).
        assert reply["episode_ids"] == ["native", "outside", "r1"]
        assert reply["run_episode_ids"] == ["outside", "r1"]
    else:
        assert reply["episode_ids"] == ["native", "r1"]
        assert reply["run_episode_ids"] == ["r1"]
    assert set(reply["run_episode_ids"]) <= set(reply["episode_ids"])


async def test_p18_a_restart_only_agent_reports_restarts_and_exports_nothing(start, ckdir):
    config = server_config(default_instance_config(), AGENT, mode="restart_only")
    h = await start(config=config)
    await h.park_runs(["r1", "r2"], turns=8)
    replies = await h.prepare_all("c1")
    assert replies[AGENT]["report"]["restarts"] == ["r1", "r2"]
    directory = ckdir()
    reply = (await h.commit(AGENT, "c1", directory, [ep("other")])).json()
    assert reply["episode_ids"] == [] and reply.get("run_episode_ids", []) == []
    assert ("run_episode_ids" in reply) == (not h.published)
    records = assert_manifest_matches_files(reply, directory, "agent", AGENT, "c1")
    assert records == []


# ---------------------------------------------------------------------------------------------- P19


async def test_p19_a_directory_with_another_checkpoints_manifest_is_refused_unchanged(start, ckdir):
    h = await start()
    directory = ckdir()
    await h.prepare_all("c1")
    await h.commit_all("c1", directory, [])
    await h.resume_all("c1")
    before = files_of(directory)
    await h.prepare_all("c2")
    for server in STAGES:
        h.assert_error(await h.commit(server, "c2", directory, []), "invalid_checkpoint_state")
        assert (await h.status(server))["phase"] == "prepared"
    assert files_of(directory) == before
    # Another, empty directory is fine.
    await h.commit_all("c2", ckdir(), [])


# ---------------------------------------------------------------------------------------------- P20


async def test_p20_commit_deletes_unclaimed_restored_state_outside_scope_without_a_mark(start, ckdir):
    _, b, saved = await saved_and_restored(start, ckdir)
    await b.resume_all("restore-1")
    assert await b.unclaimed(AGENT) == ["r1-a1", "r2-a1"]
    marks_before = {s: b.state(s)["marks"] for s in PARTICIPANTS}

    await b.prepare_all("c2")
    replies = await b.commit_all("c2", ckdir(), [ep("r2", 1)])  # r1-a1 is left out
    assert replies[AGENT]["episode_ids"] == ["r2-a1"]  # an unclaimed continuation in scope is exported again
    await b.resume_all("c2")
    for server in PARTICIPANTS:
        assert await b.unclaimed(server) == ["r2-a1"]
        assert b.state(server)["marks"] == marks_before[server]  # no mark was raised

    # The deleted continuation's attempt is admitted, and starts over since nothing was kept.
    response = await b.run("r1", 1, task={"rollout": "r1"}, turns=2)
    assert response.status_code == 200, response.text
    assert response.json()["resumed_from_turn"] is None
    # The one kept in scope still continues from its saved turn.
    kept = await b.run("r2", 1, task={"rollout": "r2"}, turns=saved.turns)
    assert kept.json()["resumed_from_turn"] == saved.saved_turns["r2"]
