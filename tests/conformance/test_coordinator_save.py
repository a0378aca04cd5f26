"""Coordinator conformance, the save side (checklist items 39-53;
docs/gym-protocol.md#the-save-choreography, docs/gym-protocol.md#leases-and-renewals).

The Gym control client runs against in-process gymsim instances over real HTTP. A
RecordingTransport around the real one observes what was sent and when; where a reply no valid
participant produces is needed (item 45), it rewrites gymsim's real reply. P1 to P8 are the
rules of docs/gym-protocol.md#what-differs-rule-by-rule.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest

from checkpoint_coordinator.gym import (
    Episode,
    FailureClass,
    GymControlClient,
    GymControlError,
    GymSaveAborted,
    LeaseRenewer,
    ManualClock,
    instance_checkpoint_dir,
)
from checkpoint_coordinator.gym.errors import BLOCKED_EPISODES
from gymsim.testing import default_instance_config, server_config

from .helpers import PARTICIPANTS, Rows, StartGym, assert_all_idle, calls_to, server_of, state, topology, wait_running
from .helpers import nothing as nothing_hook
from .recording import RecordingTransport
from .sequenced import SequencedGymSave

CLIENT_TIMEOUTS = {"control_timeout_s": 1.0, "prepare_timeout_s": 3.0, "discovery_timeout_s": 2.0}


# --- 39 ------------------------------------------------------------------------------------------


async def test_c39_prepare_stage_order(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport) -> None:
    inst = start_gym(
        faults=[{"server_name": "policy_model", "op": "prepare", "type": "delay", "seconds": 0.3}]
    )
    topo = await topology(client, inst)
    result = await client.prepare(client.new_checkpoint_id("39"), topo)
    prepares = {server_of(c): c for c in recorder.ops("prepare")}
    assert set(prepares) == set(PARTICIPANTS)
    # Each stage is sent only once the previous one has answered prepared.
    assert prepares["policy_model"].answered_at <= prepares["workplace_agent"].sent_at
    assert prepares["workplace_agent"].answered_at <= prepares["calendar_resources"].sent_at
    assert result.restarts == {inst.instance_id: frozenset()}
    await client.resume(result.checkpoint_id, topo)


async def test_c39_model_not_ready_agents_and_resources_never_receive_prepare(
    start_gym: StartGym, recorder: RecordingTransport
) -> None:
    # A multi-worker model with one worker that never reports stays unready.
    inst = start_gym(server_config(default_instance_config(), "policy_model", workers=2, unreported_workers=1))
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=0.3, transport=recorder) as client:
        topo = await topology(client, inst)
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("39b"), topo)
    assert info.value.failure_class is FailureClass.NOT_READY
    assert {server_of(c) for c in recorder.ops("prepare")} == {"policy_model"}
    # Resume still reaches everyone, including the servers that never got prepare.
    assert {server_of(c) for c in recorder.ops("resume")} == set(PARTICIPANTS)
    assert_all_idle(inst)


# --- 40 ------------------------------------------------------------------------------------------


async def test_c40_not_ready_resumes_every_instance_and_reports_counts_and_samples(
    start_gym: StartGym, rows: Rows, recorder: RecordingTransport
) -> None:
    ready = start_gym(instance_id="math/replica-0")
    # Model responses that stream for a long time block the model's readiness: 12 blockers.
    blocked = start_gym(server_config(default_instance_config("math/replica-1", turn_seconds=0.3), "policy_model", stream_seconds=30))
    keys = [f"r{i:02d}" for i in range(12)]
    for key in keys:
        rows.start(blocked, key)
    deadline = time.monotonic() + 5
    while len((await state(blocked, "policy_model"))["calls"]) < 12 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=0.5, transport=recorder) as client:
        topo = await topology(client, ready, blocked)
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("40"), topo)
    err = info.value
    assert err.failure_class is FailureClass.NOT_READY and err.transient
    part = err.instances["math/replica-1"]["policy_model"]
    assert part["blocker_count"] == 12
    assert len(part["blockers"]) == 10 and set(part["blockers"]) <= set(keys)
    assert "math/replica-0" not in err.instances
    # Every blocker named, not only the sample: the snapshot records them (docs/ledger.md#stragglers).
    assert err.extra[BLOCKED_EPISODES] == {"math/replica-1": keys}
    # Every participant of every instance was resumed.
    for inst in (ready, blocked):
        assert {server_of(c) for c in calls_to(recorder, inst, "resume")} == set(PARTICIPANTS)
    assert err.to_dict()["instances"]["math/replica-1"]["policy_model"]["blocker_count"] == 12


# --- 41 ------------------------------------------------------------------------------------------


async def test_c41_every_call_carries_send_time_plus_its_timeout(start_gym: StartGym, recorder: RecordingTransport, tmp_path: Any) -> None:
    inst = start_gym()
    clock = ManualClock()
    t0 = clock.time()
    async with GymControlClient(control_timeout_s=7, prepare_timeout_s=11, clock=clock, transport=recorder) as client:
        topo = await topology(client, inst)
        cid = client.new_checkpoint_id("41")
        await client.prepare(cid, topo)
        clock.advance(1.0)
        await client.renew(cid, topo)
        clock.advance(1.0)
        await client.commit(cid, topo, {inst.instance_id: instance_checkpoint_dir(str(tmp_path), inst.instance_id)}, {})
        clock.advance(1.0)
        await client.resume(cid, topo)
    assert {c.body["deadline_ts"] for c in recorder.ops("prepare")} == {t0 + 11}
    assert {c.body["deadline_ts"] for c in recorder.ops("renew")} == {t0 + 1 + 7}
    assert {c.body["deadline_ts"] for c in recorder.ops("commit")} == {t0 + 2 + 7}
    assert {c.body["deadline_ts"] for c in recorder.ops("resume")} == {t0 + 3 + 7}


async def test_c41_client_gives_up_at_deadline_plus_reply_grace(start_gym: StartGym, recorder: RecordingTransport) -> None:
    inst = start_gym(faults=[{"server_name": "policy_model", "op": "prepare", "type": "delay", "seconds": 5, "times": 1}])
    # Grace = min(control_timeout_s, 5) = 0.3; prepare deadline 0.4 s: give up at about 0.7 s.
    async with GymControlClient(control_timeout_s=0.3, prepare_timeout_s=0.4, transport=recorder) as client:
        topo = await topology(client, inst)
        started = time.monotonic()
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("41b"), topo)
        elapsed = time.monotonic() - started
    assert info.value.failure_class is FailureClass.UNAVAILABLE
    assert info.value.server_names() == {inst.instance_id: ["policy_model"]}
    # Waited out the deadline and the grace, not the 5 s the participant took, and never
    # re-sent after the timeout.
    assert 0.6 < elapsed < 2.5
    assert len([c for c in recorder.ops("prepare") if server_of(c) == "policy_model"]) == 1


async def test_c41_lost_reply_is_resent_and_replayed(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport) -> None:
    inst = start_gym(faults=[{"server_name": "workplace_agent", "op": "prepare", "type": "lost_reply", "times": 1}])
    topo = await topology(client, inst)
    result = await client.prepare(client.new_checkpoint_id("41c"), topo)
    agent = [c for c in recorder.ops("prepare") if server_of(c) == "workplace_agent"]
    assert [c.status for c in agent] == [None, 200]
    assert (await state(inst, "workplace_agent"))["phase"] == "prepared"
    await client.resume(result.checkpoint_id, topo)


# --- 42 ------------------------------------------------------------------------------------------


def test_c42_renew_interval_formula() -> None:
    for timeout, expected in ((60, 10.0), (30, 10.0), (15, 5.0), (0.3, 0.1), (0.01, 0.01), (0.001, 0.01)):
        assert GymControlClient(control_timeout_s=timeout).lease_renew_interval_s == pytest.approx(expected)


@pytest.mark.parametrize("grace,warned", [(20.0, "below"), (60.0, None), (300.0, "above")])
async def test_c42_renews_after_prepare_then_on_cadence_and_checks_grace(
    start_gym: StartGym, recorder: RecordingTransport, grace: float, warned: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    inst = start_gym(lease_grace_seconds=grace)
    clock = ManualClock()
    async with GymControlClient(control_timeout_s=60, prepare_timeout_s=300, clock=clock, transport=recorder) as client:
        topo = await topology(client, inst)
        prepared = await client.prepare(client.new_checkpoint_id("42"), topo)
        prepared_at = clock.time()
        renewer = LeaseRenewer(client, prepared.checkpoint_id, topo, prepare=prepared)
        await renewer.start()
        while renewer.renewals < 4:
            await asyncio.sleep(0.01)
        await renewer.stop()
        await client.resume(prepared.checkpoint_id, topo)
    assert renewer.failure is None
    assert clock.sleeps[:3] == [10.0, 10.0, 10.0]
    renews = recorder.ops("renew")
    # The first round goes out right after prepare, before any wait (the virtual clock moves
    # only when the renewer sleeps), the next ones a cadence apart.
    assert sorted({c.body["deadline_ts"] for c in renews})[:3] == [prepared_at + 60, prepared_at + 70, prepared_at + 80]
    assert len(renews) >= 4 * 3
    resume_sent = min(c.sent_at for c in recorder.ops("resume"))
    # Renewing stops before resume: no renew answered after it (one in flight may be cancelled).
    assert all(c.answered_at <= resume_sent for c in renews if c.answered_at is not None)
    said = [r.getMessage() for r in caplog.records if "lease grace" in r.getMessage()]
    if warned is None:
        assert renewer.warnings == [] and said == []
    else:
        # One warning for the instance, naming every participant, and one log line.
        assert len(renewer.warnings) == 1 and renewer.warnings[0].count(warned) == 3
        assert all(p in renewer.warnings[0] for p in PARTICIPANTS)
        assert len(said) == 1 and all(p in said[0] for p in PARTICIPANTS)


async def test_c42_the_first_renew_round_follows_the_commit_and_nothing_waits_for_it(
    start_gym: StartGym, recorder: RecordingTransport, tmp_path: Any
) -> None:
    # The commit right after prepare sets every lease as a renew does; the first round goes out
    # once the commit is answered. One participant answers it late: the save does not wait.
    inst = start_gym(faults=[{"server_name": "policy_model", "op": "renew", "type": "delay", "seconds": 1.5, "times": 1}])
    async with GymControlClient(control_timeout_s=10, transport=recorder) as client:
        topo = await topology(client, inst)
        result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                               capture_hook=nothing_hook, drain_timeout_s=5).run()
    assert set(result.commit.instances) == {inst.instance_id}
    renews = recorder.ops("renew")
    assert {server_of(c) for c in renews} == set(PARTICIPANTS)  # one round, every participant
    last_commit_answer = max(c.answered_at for c in recorder.ops("commit"))
    assert min(c.sent_at for c in renews) >= last_commit_answer - 0.05
    late = next(c for c in renews if server_of(c) == "policy_model")
    resume_sent = min(c.sent_at for c in recorder.ops("resume"))
    assert resume_sent < late.sent_at + 1.5  # resumed while that renew was still held
    assert_all_idle(inst)


# --- 43 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["current", "legacy"])
async def test_c43_stale_checkpoint_on_renew_before_the_commit_is_lease_lost_and_resumes(
    start_gym: StartGym, recorder: RecordingTransport, tmp_path: Any, spelling: str
) -> None:
    """replica-0 commits at once; replica-1's commit is slow, and the renew round that follows
    replica-0's commit finds replica-1's lease gone: work there moved past a state nothing saved
    (docs/gym-protocol.md#leases-and-renewals), so the save fails ``lease_lost`` and every
    participant is resumed."""
    fast = start_gym(wire_spelling=spelling)
    slow = start_gym(wire_spelling=spelling, instance_id="math/replica-1", faults=[
        {"server_name": "policy_model", "op": "commit", "type": "delay", "seconds": 2.0, "times": 1},
        {"server_name": "policy_model", "op": "renew", "type": "refuse", "code": "stale_checkpoint"},
    ])
    async with GymControlClient(control_timeout_s=5, prepare_timeout_s=5, transport=recorder) as client:
        topo = await topology(client, fast, slow)
        save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                       capture_hook=nothing_hook, drain_timeout_s=5)
        with pytest.raises(GymControlError) as info:
            await asyncio.wait_for(save.run(), 20)
    assert info.value.failure_class is FailureClass.LEASE_LOST and info.value.transient
    assert info.value.server_names() == {slow.instance_id: ["policy_model"]}
    stale = [c for c in recorder.ops("renew") if c.status == 409]
    assert stale and all(c.url.startswith(slow.base_url) for c in stale)
    # The renew was answered before replica-1's model committed (its commit was cancelled).
    assert not [c for c in recorder.ops("commit") if c.url.startswith(slow.base_url) and server_of(c) == "policy_model" and c.status == 200]
    resumes = recorder.ops("resume")
    assert {(server_of(c), c.url.startswith(slow.base_url)) for c in resumes} == {(p, s) for p in PARTICIPANTS for s in (True, False)}
    assert min(c.sent_at for c in resumes) >= min(c.answered_at for c in stale)
    assert_all_idle(fast)
    assert_all_idle(slow)


@pytest.mark.parametrize("stop", [False, True], ids=["resume", "stop"])
async def test_c43_a_lease_that_lapses_after_the_commit_is_a_warning_naming_the_participant(
    start_gym: StartGym, recorder: RecordingTransport, tmp_path: Any, stop: bool
) -> None:
    """The instance committed, then Gym's lease ran out while the caller took its capture: Gym
    resumed on its own, its records of the checkpoint are written. The save is kept, and says
    which participants lapsed; a stopping save says the stop was not honoured there."""
    config = _stop_config(True) if stop else default_instance_config(turn_seconds=0.3)
    inst = start_gym({**config, "lease_grace_seconds": 1})

    async def capture(_: dict[str, Any]) -> None:
        # The participants' clock jumps past their leases; they reopen on their own.
        await asyncio.to_thread(inst.admin, "POST", "/admin/clock", {"advance": 3600})
        deadline = time.monotonic() + 10
        while any(s["phase"] != "idle" for n, s in (await state(inst))["servers"].items() if n in PARTICIPANTS):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=3, transport=recorder) as client:
        topo = await topology(client, inst)
        result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                               capture_hook=capture, drain_timeout_s=5, stop=stop).run()
    assert result.lapsed == {inst.instance_id: tuple(sorted(PARTICIPANTS))}
    for server in PARTICIPANTS:
        assert any(f"{inst.instance_id}/{server}: lease lapsed" in w for w in result.warnings), (server, result.warnings)
    if stop:
        assert result.stop_honoured == {inst.instance_id: False}
        assert any("stop not honoured" in w and "lease lapsed" in w for w in result.warnings)
    assert_all_idle(inst)


async def test_c42_a_renew_answered_after_a_short_save_still_counts(
    start_gym: StartGym, recorder: RecordingTransport, tmp_path: Any
) -> None:
    """A save shorter than a renew round: the round's answers (Gym's lease grace of 600 s
    against control_timeout_s = 1 s, and a lapse) are in its result, and the warning of the
    grace is given once for the run's client."""
    inst = start_gym(lease_grace_seconds=600, faults=[
        {"server_name": "workplace_agent", "op": "renew", "type": "slow_reply", "seconds": 0.5, "times": 1},
    ])
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=3, transport=recorder) as client:
        topo = await topology(client, inst)
        results = []
        for n in range(2):
            results.append(await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path / str(n)), candidates={}, drain_hook=nothing_hook,
                                         capture_hook=nothing_hook, drain_timeout_s=5).run())
    first, second = results
    (grace,) = [w for w in first.warnings if "lease grace" in w]
    assert inst.instance_id in grace and all(p in grace for p in PARTICIPANTS) and "above 4x" in grace
    late = next(c for c in recorder.ops("renew") if server_of(c) == "workplace_agent")
    assert late.answered_at is not None and late.status == 200  # awaited, not cancelled
    # The resume was not held back by it.
    assert min(c.sent_at for c in recorder.ops("resume")) < late.answered_at
    assert first.lapsed == {} and second.lapsed == {}
    assert not [w for w in second.warnings if "lease grace" in w]  # once per run and instance


async def test_c43_stale_checkpoint_on_commit_is_lease_lost(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    for code in ("stale_checkpoint", "checkpoint_stale_checkpoint", "checkpoint_stale"):
        await asyncio.to_thread(inst.admin, "POST", "/admin/faults", {
            "server_name": "calendar_resources", "op": "commit", "type": "error", "status": 409, "code": code, "times": 1})
        recorder.clear()
        save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path / code), candidates={}, drain_hook=nothing_hook,
                       capture_hook=nothing_hook, drain_timeout_s=5)
        with pytest.raises(GymControlError) as info:
            await save.run()
        assert info.value.failure_class is FailureClass.LEASE_LOST, code
        assert info.value.server_names() == {inst.instance_id: ["calendar_resources"]}
        assert {server_of(c) for c in recorder.ops("resume")} == set(PARTICIPANTS)
        assert_all_idle(inst)


async def test_c43_clock_past_known_lease_expiry_is_lease_lost(start_gym: StartGym) -> None:
    inst = start_gym(lease_grace_seconds=5)
    clock = ManualClock()
    async with GymControlClient(control_timeout_s=60, prepare_timeout_s=60, clock=clock) as client:
        topo = await topology(client, inst)
        prepared = await client.prepare(client.new_checkpoint_id("43c"), topo)
        renewer = LeaseRenewer(client, prepared.checkpoint_id, topo, prepare=prepared)
        await renewer.renew_once()
        assert renewer.earliest_expiry is not None
        clock.advance(renewer.earliest_expiry - clock.time() + 1)
        with pytest.raises(GymControlError) as info:
            renewer.check()
        assert info.value.failure_class is FailureClass.LEASE_LOST
        assert renewer.lost.is_set()
        await client.resume(prepared.checkpoint_id, topo)


# --- 44 ------------------------------------------------------------------------------------------


async def test_c44_scope_excludes_restarts_sorted_objects_and_dir_created_first(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    # A restart-only resources server reports every in-flight episode with a session as a restart.
    inst = start_gym(resources_mode="restart_only")
    for key in ("r-b", "r-a"):
        rows.start(inst, key)
    await wait_running(inst, ["r-a", "r-b"])
    topo = await topology(client, inst)
    ghosts = [Episode("ghost-2", 1), Episode("ghost-1", 0)]
    candidates = {inst.instance_id: [Episode("r-b", 0), Episode("r-a", 0), *ghosts]}
    drained: list[dict[str, set[Episode]]] = []

    async def drain(pending: dict[str, set[Episode]]) -> None:
        drained.append({k: set(v) for k, v in pending.items()})

    snapshot = tmp_path / "snap"
    save = SequencedGymSave(client, topo, snapshot_dir=str(snapshot), candidates=candidates, drain_hook=drain,
                   capture_hook=nothing_hook, drain_timeout_s=5)
    result = await save.run()
    directory = instance_checkpoint_dir(str(snapshot), inst.instance_id)
    commits = recorder.ops("commit")
    assert {server_of(c) for c in commits} == set(PARTICIPANTS)
    for call in commits:
        assert call.body["episode_ids"] == [{"rollout_id": "ghost-1", "attempt": 0}, {"rollout_id": "ghost-2", "attempt": 1}]
        assert call.body["checkpoint_dir"] == directory
        assert "stop" not in call.body
    assert os.path.isdir(directory)
    assert result.manifest["instances"][inst.instance_id]["restarts"] == [
        {"rollout_id": "r-a", "attempt": 0}, {"rollout_id": "r-b", "attempt": 0}
    ]
    # The drain never waits on restarts.
    assert drained == [{inst.instance_id: set(ghosts)}]
    assert result.gym_restarted_episodes == 2


async def test_c44_candidates_given_to_the_commit_step_give_the_scope(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    # The coordinator's candidates query runs while the prepare calls are in flight: the candidates
    # handed to the commit step (not the constructor's) make the scope.
    inst = start_gym()
    topo = await topology(client, inst)
    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_timeout_s=5)
    await save.prepare()
    await save.commit({inst.instance_id: [Episode("ghost-2", 0), Episode("ghost-1", 3)]})
    await save.resume_before_cut()
    for call in recorder.ops("commit"):
        assert call.body["episode_ids"] == [{"rollout_id": "ghost-1", "attempt": 3}, {"rollout_id": "ghost-2", "attempt": 0}]
    assert len(recorder.ops("resume")) == len(PARTICIPANTS)


async def test_c44_candidates_naming_an_unknown_instance_are_refused_before_the_commit(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_timeout_s=5)
    await save.prepare()
    with pytest.raises(ValueError, match="outside the topology"):
        await save.commit({"math/replica-9": [Episode("x", 0)]})
    await save.resume_before_cut()
    assert recorder.ops("commit") == []
    assert len(recorder.ops("resume")) == len(PARTICIPANTS)


async def test_c44_empty_scope_is_sent_as_empty_list(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                   capture_hook=nothing_hook, drain_timeout_s=5)
    result = await save.run()
    assert [c.body["episode_ids"] for c in recorder.ops("commit")] == [[], [], []]
    assert result.manifest["instances"][inst.instance_id] == {
        "episodes": [], "participants": sorted(PARTICIPANTS), "restarts": [], "staging_keys": []
    }


# --- 45 ------------------------------------------------------------------------------------------


def _tamper(kind: str) -> tuple[str, Callable[[int, Any], tuple[int, Any]]]:
    def manifest_field(field: str, value: Any) -> Callable[[int, Any], tuple[int, Any]]:
        def fn(status: int, body: Any) -> tuple[int, Any]:
            body["manifest"][field] = value
            return status, body
        return fn

    def outside(status: int, body: Any) -> tuple[int, Any]:
        body["episode_ids"] = [*body["episode_ids"], "not-in-scope"]
        return status, body

    def staging(status: int, body: Any) -> tuple[int, Any]:
        body["staging_keys"] = [*body["staging_keys"], "tq/orphan/0"]
        return status, body

    def run_outside(status: int, body: Any) -> tuple[int, Any]:
        body["run_episode_ids"] = []
        return status, body

    def run_not_exported(status: int, body: Any) -> tuple[int, Any]:
        # A /run session the agent names but did not export (P8 keeps this a protocol error).
        body["run_episode_ids"] = sorted({*body.get("run_episode_ids", body["episode_ids"]), "not-exported"})
        return status, body

    return {
        "kind": ("policy_model", manifest_field("kind", "agent")),
        "participant": ("workplace_agent", manifest_field("instance", "someone_else")),
        "checkpoint": ("calendar_resources", manifest_field("checkpoint_id", "snap-other-00000000")),
        # P2: only the model's exports must stay inside the scope.
        "outside-scope": ("policy_model", outside),
        "staging-mismatch": ("policy_model", staging),
        "stranded": ("workplace_agent", run_outside),
        "run-not-exported": ("workplace_agent", run_not_exported),
    }[kind]


@pytest.mark.pinned_too
async def test_c45_invalid_commit_replies_fail_as_protocol_error(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym()
    rows.start(inst, "r1")
    await wait_running(inst, ["r1"])
    topo = await topology(client, inst)
    # One tampered reply per save; the episode keeps running across them (each save resumes).
    for kind in ("kind", "participant", "checkpoint", "outside-scope", "staging-mismatch", "stranded", "run-not-exported"):
        server, fn = _tamper(kind)
        recorder.rewrites.clear()
        recorder.rewrite(f"/s/{server}/", "commit", fn)
        recorder.clear()
        save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path / kind), candidates={inst.instance_id: [Episode("r1", 0)]},
                       drain_hook=nothing_hook, capture_hook=nothing_hook, drain_timeout_s=5)
        with pytest.raises(GymControlError) as info:
            await save.run()
        err = info.value
        assert err.failure_class is FailureClass.PROTOCOL_ERROR and not err.transient, (kind, err)
        assert server in err.server_names()[inst.instance_id], kind
        assert {server_of(c) for c in recorder.ops("resume")} == set(PARTICIPANTS), kind
        if kind == "stranded":
            assert "stranded sessions: 1" in str(err)
        if kind == "run-not-exported":
            assert "1 run_episode_ids not among its episode_ids" in str(err)
            assert err.instances[inst.instance_id][server]["samples"] == ["not-exported"]


@pytest.mark.pinned_too
async def test_c45_agent_and_resources_exports_outside_the_scope_are_counted_not_saved(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    """P2: published agents and resources export every live session. Those outside
    the scope are accepted, left out of E and of the staging keys, and counted per kind."""
    inst = start_gym()
    rows.start(inst, "r1")
    rows.start(inst, "r2")
    await wait_running(inst, ["r1", "r2"])
    topo = await topology(client, inst)

    def add_r2(status: int, body: Any) -> tuple[int, Any]:
        if "r2" not in body["episode_ids"]:
            body["episode_ids"] = sorted([*body["episode_ids"], "r2"])
        body.pop("run_episode_ids", None)  # a published agent sends none (P1)
        return status, body

    recorder.rewrite("/s/workplace_agent/", "commit", add_r2)
    recorder.rewrite("/s/calendar_resources/", "commit", add_r2)
    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: [Episode("r1", 0)]},
                   drain_hook=nothing_hook, capture_hook=nothing_hook, drain_timeout_s=5)
    result = await save.run()
    ic = result.commit.instances[inst.instance_id]
    assert ic.episodes == (Episode("r1", 0),)
    assert ic.outside_scope == {"agent": 1, "resources": 1} and ic.exported_outside_scope == 2
    assert ic.figures()["exported_outside_scope"] == 2
    assert result.manifest["instances"][inst.instance_id]["episodes"] == [{"rollout_id": "r1", "attempt": 0}]
    assert all("/r2/" not in k for k in result.manifest["instances"][inst.instance_id]["staging_keys"])


@pytest.mark.pinned_too
async def test_c45_native_sessions_of_an_agent_are_stranded(start_gym: StartGym, client: GymControlClient, tmp_path: Any, gym_profile: str) -> None:
    inst = start_gym()
    await asyncio.to_thread(inst.admin, "POST", "/admin/agent/workplace_agent/native_sessions", {"rollout_id": "native-1", "attempt": 0})
    await asyncio.to_thread(inst.admin, "POST", "/admin/agent/workplace_agent/native_sessions", {"rollout_id": "native-2", "attempt": 0})
    topo = await topology(client, inst)
    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: [Episode("native-1", 0)]},
                   drain_hook=nothing_hook, capture_hook=nothing_hook, drain_timeout_s=5)
    if gym_profile == "published":
        # Without run_episode_ids every agent session counts as a /run session (environment
        # participants are refused at discovery): one in the scope is saved, one outside it is
        # no candidate at all, so it is left out and counted (P1, P2).
        result = await save.run()
        ic = result.commit.instances[inst.instance_id]
        assert ic.episodes == (Episode("native-1", 0),)
        assert ic.outside_scope == {"agent": 1} and ic.stranded == 1
        return
    with pytest.raises(GymControlError) as info:
        await save.run()
    assert info.value.failure_class is FailureClass.PROTOCOL_ERROR
    part = info.value.instances[inst.instance_id]["workplace_agent"]
    assert "stranded" in part["detail"] and part["samples"] == ["native-1"]


@pytest.mark.pinned_too
@pytest.mark.parametrize("in_scope", [True, False], ids=["in-scope", "outside-scope"])
async def test_c45_episode_claimed_by_two_agents(
    start_gym: StartGym, rows: Rows, recorder: RecordingTransport, tmp_path: Any, in_scope: bool
) -> None:
    """Both agents name r1 as a /run session of theirs: a protocol error, whether the scope holds
    r1 (it would be saved twice) or not (P8: a session has one driver)."""
    config = default_instance_config(turn_seconds=0.3)
    config["servers"].append({"server_name": "second_agent", "kind": "agent", "mode": "exported"})
    inst = start_gym(config)
    rows.start(inst, "r1")
    await wait_running(inst, ["r1"])

    def claim(status: int, body: Any) -> tuple[int, Any]:
        body["episode_ids"] = ["r1"]
        body["run_episode_ids"] = ["r1"]
        return status, body

    recorder.rewrite("/s/workplace_agent/", "commit", claim)
    recorder.rewrite("/s/second_agent/", "commit", claim)
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=3, transport=recorder) as client:
        topo = await topology(client, inst)
        with pytest.raises(GymControlError) as info:
            await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: [Episode("r1", 0)] if in_scope else []},
                          drain_hook=nothing_hook, capture_hook=nothing_hook, drain_timeout_s=5).run()
    err = info.value
    assert err.failure_class is FailureClass.PROTOCOL_ERROR
    named = err.server_names()[inst.instance_id]
    assert "second_agent" in named and "workplace_agent" in named
    assert "claimed by more than one agent" in str(err)


@pytest.mark.pinned_too
async def test_p8_run_episode_ids_outside_the_scope_are_counted_not_saved(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any, gym_profile: str
) -> None:
    """P8: an agent that names its /run sessions among every export (`pinned`) names
    r2, which the scope does not hold. The commit is accepted: r2 is counted outside the scope,
    not saved, and none of its staging keys is kept. Published and strict Gym reach the same
    snapshot by P1/P2 and by exporting the scope only."""
    inst = start_gym()
    rows.start(inst, "r1")
    rows.start(inst, "r2")
    await wait_running(inst, ["r1", "r2"])
    topo = await topology(client, inst)
    agent_replies: list[Any] = []

    def keep(status: int, body: Any) -> tuple[int, Any]:
        agent_replies.append(body)
        return status, body

    recorder.rewrite("/s/workplace_agent/", "commit", keep)
    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: [Episode("r1", 0)]},
                   drain_hook=nothing_hook, capture_hook=nothing_hook, drain_timeout_s=5)
    result = await save.run()
    ic = result.commit.instances[inst.instance_id]
    assert ic.episodes == (Episode("r1", 0),)
    assert ic.staging_keys and all(k.startswith("tq/r1/") for k in ic.staging_keys)
    (agent_reply,) = agent_replies
    if gym_profile == "strict":
        assert agent_reply["run_episode_ids"] == ["r1"] and ic.outside_scope == {}
        return
    assert ic.outside_scope == {"agent": 1, "resources": 1}
    if gym_profile == "pinned":
        assert agent_reply["run_episode_ids"] == ["r1", "r2"]  # the case P8 is about
    else:
        assert "run_episode_ids" not in agent_reply


# --- 46 and 47 -----------------------------------------------------------------------------------


@pytest.mark.pinned_too
async def test_c46_c47_saved_episodes_are_run_episode_ids_and_drain_waits_for_the_rest(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    # The reply of a finished episode sits on the wire for 2 s: Gym exports no agent state for
    # it, but the model still holds its staging keys.
    inst = start_gym(faults=[{"server_name": "workplace_agent", "op": "run_reply", "type": "delay", "seconds": 2.0, "times": 1}])
    running = rows.start(inst, "r-live", turns=100)
    wired = rows.start(inst, "r-wire", turns=1)
    await wait_running(inst, ["r-live"])
    deadline = time.monotonic() + 5
    while (await state(inst, "workplace_agent"))["episodes"].get("r-wire", {}).get("state") != "wire":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    topo = await topology(client, inst)
    drained: list[set[Episode]] = []
    renews_during_drain: list[int] = []

    async def drain(pending: dict[str, set[Episode]]) -> None:
        drained.append(set(pending[inst.instance_id]))
        before = len(recorder.ops("renew"))
        reply = await wired  # the caller resolves the pending /run: it has its reply now
        assert reply.status_code == 200
        renews_during_drain.append(len(recorder.ops("renew")) - before)

    cands = {inst.instance_id: [Episode("r-live", 0), Episode("r-wire", 0)]}
    result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates=cands, drain_hook=drain,
                           capture_hook=nothing_hook, drain_timeout_s=10).run()
    ic = result.commit.instances[inst.instance_id]
    assert ic.episodes == (Episode("r-live", 0),)
    assert drained == [{Episode("r-wire", 0)}]
    # Staging keys only of the saved episode, though the model exported r-wire's too.
    model_keys = (await state(inst, "policy_model"))["staging_keys_by_episode"]
    assert ic.staging_keys and all(k.startswith("tq/r-live/") for k in ic.staging_keys)
    assert any(k.startswith("tq/r-wire/") for keys in model_keys.values() for k in keys)
    assert result.manifest["instances"][inst.instance_id]["episodes"] == [{"rollout_id": "r-live", "attempt": 0}]
    assert result.manifest["instances"][inst.instance_id]["staging_keys"] == list(ic.staging_keys)
    # Leases were renewed while the drain waited (interval T/3 = 0.33 s, drain about 1 s).
    assert renews_during_drain[0] >= 3 * 2
    assert not running.done()


async def test_c47_drain_timeout_reports_count_and_samples(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    ghosts = [Episode(f"ghost-{i:02d}", 0) for i in range(12)]

    async def never(pending: dict[str, set[Episode]]) -> None:
        # Two replies arrive; the other ten never do.
        pending[inst.instance_id].discard(ghosts[0])
        pending[inst.instance_id].discard(ghosts[1])
        await asyncio.sleep(60)

    with pytest.raises(GymControlError) as info:
        await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: ghosts},
                      drain_hook=never, capture_hook=nothing_hook, drain_timeout_s=0.3).run()
    err = info.value
    assert err.failure_class is FailureClass.DRAIN_TIMEOUT and err.transient
    assert err.extra["pending_count"] == 10
    assert err.extra["pending_samples"] == [e.capture_key for e in ghosts[2:12]]
    assert sorted(err.extra[BLOCKED_EPISODES][inst.instance_id]) == [e.capture_key for e in ghosts[2:12]]
    assert {server_of(c) for c in recorder.ops("resume")} == set(PARTICIPANTS)
    assert_all_idle(inst)


# --- 48 ------------------------------------------------------------------------------------------


async def test_c48_manifest_complete_before_capture_and_resume_between_capture_and_publish(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym()
    rows.start(inst, "r1")
    await wait_running(inst, ["r1"])
    topo = await topology(client, inst)
    seen: dict[str, Any] = {}

    async def capture(manifest: dict[str, Any]) -> None:
        seen["manifest"] = json.loads(json.dumps(manifest))
        seen["resumes_before_capture"] = len(recorder.ops("resume"))
        seen["file"] = json.loads((tmp_path / "gym_checkpoint.json").read_text())
        seen["at"] = time.time()

    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: [Episode("r1", 0)]},
                   drain_hook=nothing_hook, capture_hook=capture, drain_timeout_s=5, write_manifest_file=True)
    result = await save.run()
    published_at = time.time()  # what the caller does next
    manifest = seen["manifest"]
    assert manifest == result.manifest == seen["file"]
    assert manifest["schema_version"] == 2 and manifest["checkpoint_id"] == result.checkpoint_id
    assert manifest["instances"][inst.instance_id]["episodes"] == [{"rollout_id": "r1", "attempt": 0}]
    assert manifest["instances"][inst.instance_id]["participants"] == sorted(PARTICIPANTS)
    assert manifest["instances"][inst.instance_id]["staging_keys"]
    assert seen["resumes_before_capture"] == 0
    resumes = {server_of(c): c for c in recorder.ops("resume")}
    assert all(seen["at"] <= c.sent_at and c.answered_at <= published_at for c in resumes.values())
    # Reverse stage order: resources, then agent, then model.
    assert resumes["calendar_resources"].answered_at <= resumes["workplace_agent"].sent_at
    assert resumes["workplace_agent"].answered_at <= resumes["policy_model"].sent_at
    assert result.resume is not None and result.resume.ok
    assert result.gym_parked_seconds is not None and result.gym_parked_seconds > 0
    assert {"prepare", "commit", "drain", "manifest", "capture", "resume", "total"} <= set(result.timings)
    assert_all_idle(inst)


# --- 49 ------------------------------------------------------------------------------------------


async def test_c49_transient_resume_failure_retried_on_the_failed_instance_only(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    flaky = start_gym(instance_id="math/replica-0",
                      faults=[{"server_name": "workplace_agent", "op": "resume", "type": "error", "status": 503, "code": "checkpoint_coordinator_unavailable", "times": 1}])
    fine = start_gym(instance_id="math/replica-1")
    topo = await topology(client, flaky, fine)
    result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                           capture_hook=nothing_hook, drain_timeout_s=5).run()
    assert result.resume is not None and result.resume.ok and result.resume.rounds == 2
    assert len(calls_to(recorder, fine, "resume")) == 3
    flaky_resumes = calls_to(recorder, flaky, "resume")
    assert len(flaky_resumes) == 6
    # The failing agent did not stop the model's resume in the first round.
    assert [server_of(c) for c in flaky_resumes[:3]] == ["calendar_resources", "workplace_agent", "policy_model"]
    assert_all_idle(flaky, fine)


async def test_c49_resume_failure_after_the_cut_is_reported_and_snapshot_kept(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    broken = start_gym(instance_id="math/replica-0",
                       faults=[{"server_name": "workplace_agent", "op": "resume", "type": "error", "status": 503, "code": "checkpoint_coordinator_unavailable"}])
    fine = start_gym(instance_id="math/replica-1")
    topo = await topology(client, broken, fine)
    result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                           capture_hook=nothing_hook, drain_timeout_s=5).run()
    assert result.manifest["instances"].keys() == {"math/replica-0", "math/replica-1"}
    assert result.resume is not None and not result.resume.ok
    failure = result.resume.failure
    assert failure is not None and failure.server_names() == {"math/replica-0": ["workplace_agent"]}
    assert result.resume.rounds == 3
    assert_all_idle(fine)
    # Everything but the failing agent of the broken instance was resumed.
    state0 = (await state(broken))["servers"]
    assert state0["policy_model"]["phase"] == "idle" and state0["calendar_resources"]["phase"] == "idle"


# --- 50 ------------------------------------------------------------------------------------------


async def test_c50_failure_before_cut_resumes_everyone_and_attaches_resume_failure(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym(faults=[
        {"server_name": "policy_model", "op": "commit", "type": "refuse", "code": "checkpoint_error", "status": 409},
        {"server_name": "calendar_resources", "op": "resume", "type": "error", "status": 500, "code": "checkpoint_error"},
    ])
    topo = await topology(client, inst)
    with pytest.raises(GymControlError) as info:
        await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                      capture_hook=nothing_hook, drain_timeout_s=5).run()
    err = info.value
    assert err.failure_class is FailureClass.PROTOCOL_ERROR and err.server_names() == {inst.instance_id: ["policy_model"]}
    assert err.resume_failure is not None
    assert err.resume_failure.server_names() == {inst.instance_id: ["calendar_resources"]}
    assert {server_of(c) for c in recorder.ops("resume")} == set(PARTICIPANTS)
    data = pickle.loads(pickle.dumps(err)).to_dict()
    assert data["resume_failure"]["instances"][inst.instance_id]["calendar_resources"]["http_status"] == 500


async def test_c50_capture_failure_resumes_and_reraises(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any) -> None:
    inst = start_gym()
    topo = await topology(client, inst)

    class CaptureFailed(Exception):
        pass

    async def capture(_: dict[str, Any]) -> None:
        raise CaptureFailed("data plane barrier timed out")

    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                   capture_hook=capture, drain_timeout_s=5)
    with pytest.raises(CaptureFailed):
        await save.run()
    assert not save.cut_done
    assert {server_of(c) for c in recorder.ops("resume")} == set(PARTICIPANTS)
    assert_all_idle(inst)


async def test_c50_abort_by_caller_resumes_at_once(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    drain_started = asyncio.Event()

    async def drain(_: dict[str, set[Episode]]) -> None:
        drain_started.set()
        await asyncio.sleep(60)

    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: [Episode("ghost", 0)]},
                   drain_hook=drain, capture_hook=nothing_hook, drain_timeout_s=30)
    running = asyncio.ensure_future(save.run())
    await asyncio.wait_for(drain_started.wait(), 5)
    aborted_at = time.time()
    assert save.abort("train_step_committed")
    with pytest.raises(GymSaveAborted) as info:
        await asyncio.wait_for(running, 5)
    assert info.value.reason == "train_step_committed" and info.value.resume_failure is None
    resumes = recorder.ops("resume")
    assert {server_of(c) for c in resumes} == set(PARTICIPANTS)
    assert max(c.answered_at for c in resumes) - aborted_at < 2
    assert save.gym_parked_seconds is not None
    assert_all_idle(inst)
    # After the cut an abort is refused.
    done = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path / "b"), candidates={}, drain_hook=nothing_hook,
                   capture_hook=nothing_hook, drain_timeout_s=5)
    await done.run()
    assert not done.abort()


# --- 51 ------------------------------------------------------------------------------------------


def _stop_config(accepts: bool, instance_id: str = "math/replica-0") -> dict[str, Any]:
    config = default_instance_config(instance_id, turn_seconds=0.3)
    for server in PARTICIPANTS:
        config = server_config(config, server, accepts_stop=accepts)
    return config


async def test_c51_stop_commit_carries_stop_and_sends_no_resume(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    """Item 51, for participants that accept ``stop`` (one published branch does:
    docs/gym-protocol.md#stop-and-park)."""
    inst = start_gym(_stop_config(True))
    topo = await topology(client, inst)
    result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing_hook,
                           capture_hook=nothing_hook, drain_timeout_s=5, stop=True).run()
    assert [c.body["stop"] for c in recorder.ops("commit")] == [True, True, True]
    assert recorder.ops("resume") == []
    assert result.resume is None
    assert result.stop_honoured == {inst.instance_id: True}
    assert result.commit.instances[inst.instance_id].figures()["stop_supported"] is True
    assert {s["phase"] for n, s in (await state(inst))["servers"].items() if n in PARTICIPANTS} == {"committed"}
    # The coordinator no longer drives it (the leases reopen Gym): a new prepare finds an orphan
    # of its own, resumes it and says try again, never a conflict with itself.
    with pytest.raises(GymControlError) as info:
        await client.prepare(client.new_checkpoint_id("51b"), topo)
    assert info.value.failure_class is FailureClass.UNAVAILABLE
    assert_all_idle(inst)


async def test_p4_a_participant_refusing_stop_gets_the_commit_again_without_it(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    """P4: a Gym that predates ``stop`` answers 422 naming it. The same commit goes
    again without it, once, to that participant; the snapshot is kept, the instance resumed, and
    the result says the stop was not honoured."""
    refusing = start_gym(_stop_config(False))
    accepting = start_gym(_stop_config(True, "math/replica-1"))
    rows.start(refusing, "r1")
    await wait_running(refusing, ["r1"])
    topo = await topology(client, refusing, accepting)
    result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={refusing.instance_id: [Episode("r1", 0)]},
                           drain_hook=nothing_hook, capture_hook=nothing_hook, drain_timeout_s=5, stop=True).run()
    commits = [c for c in recorder.ops("commit") if c.url.startswith(refusing.base_url)]
    for server in PARTICIPANTS:
        mine = [c for c in commits if server_of(c) == server]
        # First with stop (refused 422), then the same commit without it.
        assert [("stop" in c.body, c.status) for c in mine] == [(True, 422), (False, 200)], (server, mine)
        assert mine[0].body["episode_ids"] == mine[1].body["episode_ids"]
    assert all(c.body.get("stop") is True for c in recorder.ops("commit") if c.url.startswith(accepting.base_url))
    ic = result.commit.instances[refusing.instance_id]
    assert ic.stop_supported is False and ic.episodes == (Episode("r1", 0),)
    assert result.commit.instances[accepting.instance_id].stop_supported is True
    assert result.stop_honoured == {refusing.instance_id: False, accepting.instance_id: True}
    assert any("stop not honoured" in w for w in result.warnings)
    # The refusing instance is resumed as usual, the accepting one stays parked.
    assert {server_of(c) for c in recorder.ops("resume") if c.url.startswith(refusing.base_url)} == set(PARTICIPANTS)
    assert not [c for c in recorder.ops("resume") if c.url.startswith(accepting.base_url)]
    assert_all_idle(refusing)


# --- 52 ------------------------------------------------------------------------------------------


async def test_c52_checkpoint_ids_are_never_reused(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    ids = set()
    for i in range(3):
        result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path / str(i)), candidates={}, drain_hook=nothing_hook,
                               capture_hook=nothing_hook, drain_timeout_s=5, snapshot_id=7).run()
        ids.add(result.checkpoint_id)
        assert result.checkpoint_id.startswith("snap-7-")
    assert len(ids) == 3
    assert len({c.body["checkpoint_id"] for c in recorder.ops("prepare")}) == 3
    used = next(iter(ids))
    with pytest.raises(ValueError):
        await client.prepare(used, topo)
    assert len(recorder.ops("prepare")) == 9


# --- 53 ------------------------------------------------------------------------------------------


async def test_c53_orphan_of_our_own_is_resumed_and_reported_unavailable(start_gym: StartGym, recorder: RecordingTransport) -> None:
    inst = start_gym()
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=2) as crashed:
        topo = await topology(crashed, inst)
        orphan = crashed.new_checkpoint_id("53")
        await crashed.prepare(orphan, topo)
    # A restarted coordinator recognises the id (its ledger knows it) but has no operation open.
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=2, transport=recorder,
                                owns_checkpoint_id=lambda cid: cid == orphan) as client:
        topo = await topology(client, inst)
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("53b"), topo)
        err = info.value
        assert err.failure_class is FailureClass.UNAVAILABLE and err.transient
        assert err.instances[inst.instance_id]["policy_model"]["held_checkpoint_id"] == orphan
        assert {server_of(c) for c in recorder.ops("resume") if c.body["checkpoint_id"] == orphan} == set(PARTICIPANTS)
        assert_all_idle(inst)
        # The next attempt goes through.
        again = await client.prepare(client.new_checkpoint_id("53c"), topo)
        await client.resume(again.checkpoint_id, topo)


async def test_c53_foreign_checkpoint_is_a_conflict_and_left_alone(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport) -> None:
    inst = start_gym()
    async with GymControlClient(control_timeout_s=5, prepare_timeout_s=5) as other:
        other_topo = await topology(other, inst)
        foreign = other.new_checkpoint_id("other")
        await other.prepare(foreign, other_topo)
        topo = await topology(client, inst)
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("53d"), topo)
        err = info.value
        assert err.failure_class is FailureClass.CONFLICT and not err.transient
        assert [c.body["checkpoint_id"] for c in recorder.ops("resume")] and all(
            c.body["checkpoint_id"] != foreign for c in recorder.ops("resume")
        )
        # The other controller's checkpoint is untouched.
        assert (await state(inst, "policy_model"))["checkpoint_id"] == foreign
        await other.resume(foreign, other_topo)


async def test_c53_recover_orphans_at_discovery(start_gym: StartGym) -> None:
    inst = start_gym()
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=2) as crashed:
        orphan = crashed.new_checkpoint_id("53e")
        await crashed.prepare(orphan, await topology(crashed, inst))
    async with GymControlClient(control_timeout_s=1, owns_checkpoint_id=lambda cid: cid == orphan) as client:
        topo = await topology(client, inst)
        assert set(topo[inst.instance_id].active_ids.values()) == {orphan}
        assert await client.recover_orphans(topo) == [orphan]
    assert_all_idle(inst)
    async with GymControlClient(control_timeout_s=1) as stranger:
        held = stranger.new_checkpoint_id("53f")
        await stranger.prepare(held, await topology(stranger, inst))
    async with GymControlClient(control_timeout_s=1) as client:
        with pytest.raises(GymControlError) as info:
            await client.recover_orphans(await topology(client, inst))
        assert info.value.failure_class is FailureClass.CONFLICT


async def test_p7_a_second_prepare_never_resumes_this_clients_own_open_checkpoint(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport
) -> None:
    """P7: the first checkpoint is this client's own and still open, so it is no
    orphan: the second prepare fails as ``conflict`` without a call, and the first stays open."""
    inst = start_gym()
    topo = await topology(client, inst)
    first = client.new_checkpoint_id("p7a")
    await client.prepare(first, topo)
    recorder.clear()
    with pytest.raises(GymControlError) as info:
        await client.prepare(client.new_checkpoint_id("p7b"), topo)
    assert info.value.failure_class is FailureClass.CONFLICT and not info.value.transient
    assert first in str(info.value)
    assert recorder.ops("prepare") == [] and recorder.ops("resume") == []
    assert {s["checkpoint_id"] for n, s in (await state(inst))["servers"].items() if n in PARTICIPANTS} == {first}
    # The first checkpoint goes on as if nothing happened, and afterwards a new one is fine.
    await client.renew(first, topo)
    await client.resume(first, topo)
    second = await client.prepare(client.new_checkpoint_id("p7c"), topo)
    await client.resume(second.checkpoint_id, topo)
    assert_all_idle(inst)


async def test_c46_a_model_without_staging_keys_by_episode_keeps_all_of_its_keys(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    """An older published model replies `staging_keys` only. The snapshot then keeps every key
    it lists (a superset of E's keys, so nothing the restore needs is dropped)."""
    inst = start_gym()
    rows.start(inst, "r1")
    await wait_running(inst, ["r1"])
    topo = await topology(client, inst)
    seen: dict[str, Any] = {}

    def drop_map(status: int, body: Any) -> tuple[int, Any]:
        seen["keys"] = list(body["staging_keys"])
        body.pop("staging_keys_by_episode")
        return status, body

    recorder.rewrite("/s/policy_model/", "commit", drop_map)
    save = SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={inst.instance_id: [Episode("r1", 0)]},
                   drain_hook=nothing_hook, capture_hook=nothing_hook, drain_timeout_s=5)
    result = await save.run()
    assert seen["keys"], "the model held staging keys for r1"
    assert result.manifest["instances"][inst.instance_id]["staging_keys"] == sorted(seen["keys"])


async def test_c44_a_candidate_that_became_a_restart_after_prepare_is_moved_out_of_the_scope(
    start_gym: StartGym, rows: Rows, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any, gym_profile: str
) -> None:
    """Published restart-only agents never park and recompute their restarts at commit: a /run
    that reached the agent after prepare is a restart the prepare replies did not name. The
    agent refuses the commit (`restart_in_scope`); the coordinator re-reads its restarts, moves
    that episode out of the scope and commits the agent again, once."""
    if gym_profile == "strict":
        pytest.skip("strict Gym decides restarts at prepare, and its parked agents admit no new /run")
    inst = start_gym(server_config(default_instance_config(turn_seconds=0.3), "workplace_agent", mode="restart_only"))
    rows.start(inst, "r1")
    await wait_running(inst, ["r1"])
    topo = await topology(client, inst)
    cid = client.new_checkpoint_id("44g")
    prepared = await client.prepare(cid, topo)
    assert prepared.restarts[inst.instance_id] == frozenset({Episode("r1", 0)})
    rows.start(inst, "r2")  # dispatched before the gate closed, arrived after prepare
    async with asyncio.timeout(5):  # admitted; its model call waits for the resume
        while "r2" not in (await state(inst, "workplace_agent"))["episodes"]:
            await asyncio.sleep(0.02)
    directory = instance_checkpoint_dir(str(tmp_path), inst.instance_id)
    result = await client.commit(cid, topo, {inst.instance_id: directory}, {inst.instance_id: [Episode("r2", 0)]},
                                 restarts={inst.instance_id: [Episode("r1", 0)]})
    ic = result.instances[inst.instance_id]
    assert ic.scope == () and set(ic.restarts) == {Episode("r1", 0), Episode("r2", 0)} and ic.pending == ()
    agent_commits = [c for c in recorder.ops("commit") if server_of(c) == "workplace_agent"]
    assert [(len(c.body["episode_ids"]), c.status) for c in agent_commits] == [(1, 409), (0, 200)]
    await client.resume(cid, topo)
    assert_all_idle(inst)
