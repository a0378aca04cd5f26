"""Coordinator conformance, restore, retire and forget (checklist items 55-61;
docs/gym-protocol.md#restore, docs/gym-protocol.md#retire, docs/gym-protocol.md#forget,
docs/gym-protocol.md#marks-retire-and-forget).

The Gym control client runs against in-process gymsim instances over real HTTP. Snapshots are
taken with the client's own save against one set of instances, which are then killed; restores
go into freshly started instances with the same ids, as after a crash.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from checkpoint_coordinator.gym import (
    Episode,
    FailureClass,
    GymControlClient,
    GymControlError,
    InstanceSpec,
)
from gymsim.testing import GymsimInstance, corrupt_records_file, default_instance_config, server_config

from .helpers import PARTICIPANTS, Rows, StartGym, calls_to, nothing, server_of, spec, state, topology, wait_running
from .recording import RecordingTransport
from .sequenced import SequencedGymSave

CLIENT_TIMEOUTS = {"control_timeout_s": 2, "prepare_timeout_s": 3, "discovery_timeout_s": 2}
# Short episodes: the continuations a restore starts finish quickly.
ROW_TURNS = 5


# --- fixtures and helpers ------------------------------------------------------------------------


@dataclass
class Snapshot:
    manifest: dict[str, Any]
    snapshot_dir: str
    configs: dict[str, dict[str, Any]]

    def copy(self, tmp_path: Any) -> Snapshot:
        """A private copy of the snapshot files, for a test that tampers with them."""
        target = tmp_path / "snap-copy"
        shutil.copytree(self.snapshot_dir, target)
        return Snapshot(self.manifest, str(target), self.configs)


def cfg(instance_id: str, **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("turn_seconds", 0.3)
    return default_instance_config(instance_id, **kwargs)


def snapshot_plan() -> dict[str, tuple[dict[str, Any], list[str]]]:
    """replica-0 and replica-1 export their episodes; replica-2's restart-only resources server
    turns its in-flight episode into a restart. Built under the Gym profile in force."""
    return {
        "math/replica-0": (cfg("math/replica-0"), ["r2", "r1"]),
        "math/replica-1": (cfg("math/replica-1"), ["b1"]),
        "math/replica-2": (cfg("math/replica-2", resources_mode="restart_only"), ["c1"]),
    }


async def _take_snapshot(directory: str, plan: dict[str, tuple[dict[str, Any], list[str]]]) -> Snapshot:
    """Run the rows of each instance, save once, then kill the instances (a crash)."""
    insts = {iid: GymsimInstance.start(config) for iid, (config, _) in plan.items()}
    rows = Rows(turns=ROW_TURNS)
    try:
        for iid, (_, keys) in plan.items():
            for key in keys:
                rows.start(insts[iid], key)
        for iid, (_, keys) in plan.items():
            await wait_running(insts[iid], keys)
        async with GymControlClient(control_timeout_s=2, prepare_timeout_s=3) as saver:
            topo = await topology(saver, *insts.values())
            result = await SequencedGymSave(
                saver, topo, snapshot_dir=directory,
                candidates={iid: [Episode(k, 0) for k in keys] for iid, (_, keys) in plan.items()},
                drain_hook=nothing, capture_hook=nothing, drain_timeout_s=5,
            ).run()
    finally:
        await rows.aclose()
        for inst in insts.values():
            inst.kill()
    return Snapshot(json.loads(json.dumps(result.manifest)), directory, {iid: c for iid, (c, _) in plan.items()})


_SNAPSHOTS: dict[str, Snapshot] = {}


@pytest.fixture
def snap(gym_profile: str, tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    """One snapshot per Gym profile for the whole module: restores only read it (tamperers take
    a copy)."""
    if gym_profile not in _SNAPSHOTS:
        _SNAPSHOTS[gym_profile] = _snapshot(tmp_path_factory)
    return _SNAPSHOTS[gym_profile]


def _snapshot(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    # Episodes last 5 turns of 0.3 s so that the continuations the tests run finish quickly; on a
    # loaded machine one can end before the save reaches it and is then missing from the manifest.
    # Every test here relies on the saved set below, so a save that missed an episode is taken
    # again (fresh instances, fresh directory) rather than handing the tests another snapshot.
    plan = snapshot_plan()
    wanted = {iid: sorted(keys) for iid, (_, keys) in plan.items() if iid != "math/replica-2"}
    saved: dict[str, list[str]] = {}
    for _ in range(3):
        directory = str(tmp_path_factory.mktemp("restore") / "snap")
        # A fresh loop in a worker thread: a module-scoped fixture must not borrow a test's loop.
        with ThreadPoolExecutor(1) as pool:
            taken = pool.submit(asyncio.run, _take_snapshot(directory, plan)).result(60)
        saved = {iid: sorted(e["rollout_id"] for e in taken.manifest["instances"][iid]["episodes"]) for iid in wanted}
        if saved == wanted:
            return taken
    raise AssertionError(f"three saves in a row missed episodes: saved {saved}, wanted {wanted}")


def fresh_instances(
    start_gym: StartGym, snapshot: Snapshot, overrides: dict[str, dict[str, Any]] | None = None
) -> dict[str, GymsimInstance]:
    """Freshly started instances for every instance of the snapshot (configs may be replaced)."""
    overrides = overrides or {}
    return {iid: start_gym(overrides.get(iid, config)) for iid, config in snapshot.configs.items()}


def specs(insts: dict[str, GymsimInstance]) -> dict[str, InstanceSpec]:
    return {iid: spec(i) for iid, i in insts.items()}


# --- 55 ------------------------------------------------------------------------------------------


async def test_c55_instance_set_must_match_naming_missing_and_unknown(
    start_gym: StartGym, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport
) -> None:
    live = fresh_instances(start_gym, snap)
    live.pop("math/replica-2")
    live["math/replica-9"] = start_gym(cfg("math/replica-9"))
    with pytest.raises(GymControlError) as info:
        await client.restore(snap.manifest, specs(live), snap.snapshot_dir)
    err = info.value
    assert err.failure_class is FailureClass.TOPOLOGY_MISMATCH and not err.transient
    assert err.extra["missing_instances"] == ["math/replica-2"]
    assert err.extra["unknown_instances"] == ["math/replica-9"]
    assert "math/replica-2" in str(err) and "math/replica-9" in str(err)
    assert recorder.ops("restore") == [] and recorder.ops("retire") == []


async def test_c55_missing_participant_named_before_any_restore_call(
    start_gym: StartGym, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport
) -> None:
    # The resources server of replica-1 no longer takes part (checkpointing switched off).
    lacking = server_config(snap.configs["math/replica-1"], "calendar_resources", kind=None)
    live = fresh_instances(start_gym, snap, {"math/replica-1": lacking})
    with pytest.raises(GymControlError) as info:
        await client.restore(snap.manifest, specs(live), snap.snapshot_dir)
    err = info.value
    assert err.failure_class is FailureClass.TOPOLOGY_MISMATCH
    assert err.extra["missing_participants"] == {"math/replica-1": ["calendar_resources"]}
    assert "math/replica-1/calendar_resources" in str(err)
    # No restore call to any instance.
    assert recorder.ops("restore") == []


async def test_c55_extra_live_participant_gets_no_restore_only_resume(
    start_gym: StartGym, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport
) -> None:
    config = snap.configs["math/replica-0"]
    extra = {**config, "servers": [*config["servers"], {"server_name": "notes_resources", "kind": "resources", "mode": "exported"}]}
    live = fresh_instances(start_gym, snap, {"math/replica-0": extra})
    result = await client.restore(snap.manifest, specs(live), snap.snapshot_dir)
    extra_calls = [c for c in recorder.calls if "/s/notes_resources/" in c.url]
    assert [c.op for c in extra_calls] == ["status", "resume"]
    assert result.resume is not None and result.resume.ok


# --- 56 ------------------------------------------------------------------------------------------


async def test_c56_restore_sends_saved_episodes_at_n_and_validates_replies(
    start_gym: StartGym, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport
) -> None:
    saved = snap.manifest["instances"]["math/replica-0"]["episodes"]
    assert saved == [{"rollout_id": "r1", "attempt": 0}, {"rollout_id": "r2", "attempt": 0}]
    live = fresh_instances(start_gym, snap)
    result = await client.restore(snap.manifest, specs(live), snap.snapshot_dir)
    for iid, inst in live.items():
        restores = calls_to(recorder, inst, "restore")
        assert {server_of(c) for c in restores} == set(PARTICIPANTS)
        for call in restores:
            # Every instance gets its own saved episodes, even when the list is empty.
            assert call.body["episode_ids"] == snap.manifest["instances"][iid]["episodes"]
            assert call.body["checkpoint_id"] == result.restore_id
            assert call.body["checkpoint_dir"] == f"{snap.snapshot_dir}/gym-instances/{iid}"
    assert result.source_checkpoint_id == snap.manifest["checkpoint_id"]
    assert result.continued["math/replica-0"] == (Episode("r1", 1), Episode("r2", 1))


def _wrong_source(status: int, body: Any) -> tuple[int, Any]:
    return status, {**body, "source_checkpoint_id": "snap-someone-else"}


def _not_n_plus_1(status: int, body: Any) -> tuple[int, Any]:
    return status, {**body, "restored": ["r1-a2"]}


def _nothing_restored(status: int, body: Any) -> tuple[int, Any]:
    return status, {**body, "restored": []}


@pytest.mark.parametrize(
    "servers,rewrite,words",
    [
        (["policy_model"], _wrong_source, "wrong checkpoint"),
        (["workplace_agent"], _not_n_plus_1, "not the N+1"),
        (list(PARTICIPANTS), _nothing_restored, "restored by no participant"),
    ],
    ids=["source-id", "not-n-plus-1", "missing"],
)
async def test_c56_invalid_restore_replies_fail_and_clean_up(
    start_gym: StartGym, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport,
    servers: list[str], rewrite: Callable[[int, Any], tuple[int, Any]], words: str,
) -> None:
    live = fresh_instances(start_gym, snap)
    for server in servers:
        recorder.rewrite(f"{live['math/replica-0'].base_url}/s/{server}/", "restore", rewrite)
    with pytest.raises(GymControlError) as info:
        await client.restore(snap.manifest, specs(live), snap.snapshot_dir)
    err = info.value
    assert err.failure_class is FailureClass.PROTOCOL_ERROR and words in str(err)
    assert set(err.instances) == {"math/replica-0"}
    assert err.extra["rollouts_to_restart"] == {"math/replica-0": ["r1", "r2"], "math/replica-1": ["b1"], "math/replica-2": []}
    assert {server_of(c) for c in calls_to(recorder, live["math/replica-0"], "retire")} == set(PARTICIPANTS)


# --- 57 ------------------------------------------------------------------------------------------


async def test_c57_any_restore_failure_retires_n_plus_1_everywhere_callers_first_then_resumes(
    start_gym: StartGym, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    tampered = snap.copy(tmp_path)
    # Replica-1's resources records were tampered with: its restore is refused with 422.
    corrupt_records_file(f"{tampered.snapshot_dir}/gym-instances/math/replica-1", "resources", "calendar_resources")
    live = fresh_instances(start_gym, tampered)
    started = time.time()
    with pytest.raises(GymControlError) as info:
        await client.restore(tampered.manifest, specs(live), tampered.snapshot_dir)
    err = info.value
    assert err.failure_class is FailureClass.CHECKPOINT_STATE and not err.transient
    assert err.server_names() == {"math/replica-1": ["calendar_resources"]}
    assert err.extra["rollouts_to_restart"] == {"math/replica-0": ["r1", "r2"], "math/replica-1": ["b1"], "math/replica-2": []}
    restore_id = err.extra["restore_id"]
    expected = {
        "math/replica-0": [{"rollout_id": "r1", "attempt": 1}, {"rollout_id": "r2", "attempt": 1}],
        "math/replica-1": [{"rollout_id": "b1", "attempt": 1}],
    }
    for iid, inst in live.items():
        retires = {server_of(c): c for c in calls_to(recorder, inst, "retire")}
        if iid not in expected:
            assert retires == {}  # no saved episode there, nothing to retire
        else:
            assert set(retires) == set(PARTICIPANTS)
            for call in retires.values():
                assert call.body["episode_ids"] == expected[iid]
                assert call.body["checkpoint_id"] == restore_id
                assert call.body["deadline_ts"] >= started + 30
            # Callers first: the agent before the model and the resources server.
            agent_done = retires["workplace_agent"].answered_at
            assert agent_done <= retires["policy_model"].sent_at and agent_done <= retires["calendar_resources"].sent_at
        resumes = calls_to(recorder, inst, "resume")
        assert {server_of(c) for c in resumes} == set(PARTICIPANTS)
        if retires:
            assert min(c.sent_at for c in resumes) >= max(c.answered_at for c in retires.values())
        servers = (await state(inst))["servers"]
        assert all(servers[n]["phase"] == "idle" and servers[n]["admission_open"] for n in PARTICIPANTS)
    # The abandoned continuation can never run: its attempt N+1 is marked.
    async with httpx.AsyncClient(timeout=10) as http:
        reply = await http.post(live["math/replica-0"].servers["workplace_agent"] + "/run",
                                json={"_ng_rollout_id": "r1", "_ng_attempt_index": 1, "task": {"q": "r1"}, "turns": 5})
    assert reply.status_code == 409 and reply.json()["error"]["code"] in ("checkpoint_stale_attempt", "stale_attempt")


async def test_c57_caller_discard_of_a_successful_restore_runs_the_cleanup(
    start_gym: StartGym, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport
) -> None:
    live = fresh_instances(start_gym, snap)
    result = await client.restore(snap.manifest, specs(live), snap.snapshot_dir, resume=False)
    assert recorder.ops("resume") == []
    fresh = live["math/replica-0"]
    assert (await state(fresh, "workplace_agent"))["phase"] == "restored"
    cleanup = await client.discard_restore(result)
    assert cleanup.failure is None and cleanup.unretired() == {}
    assert cleanup.rollouts_to_restart == {"math/replica-0": ("r1", "r2"), "math/replica-1": ("b1",), "math/replica-2": ()}
    assert {(server_of(c), c.body["checkpoint_id"]) for c in calls_to(recorder, fresh, "retire")} == {
        (n, result.restore_id) for n in PARTICIPANTS
    }
    for name in PARTICIPANTS:
        server = await state(fresh, name)
        assert server["marks"] == {"r1": 1, "r2": 1} and server["phase"] == "idle"


# --- 58 ------------------------------------------------------------------------------------------


async def test_c58_successful_restore_resumes_with_restore_id_and_reports_continuations(
    start_gym: StartGym, rows: Rows, snap: Snapshot, client: GymControlClient, recorder: RecordingTransport
) -> None:
    assert snap.manifest["instances"]["math/replica-2"]["restarts"] == [{"rollout_id": "c1", "attempt": 0}]
    live = fresh_instances(start_gym, snap)
    result = await client.restore(snap.manifest, specs(live), snap.snapshot_dir)
    assert result.restore_id.startswith("restore-") and len(result.restore_id) == len("restore-") + 32
    assert result.restore_id != snap.manifest["checkpoint_id"]
    assert result.continued == {
        "math/replica-0": (Episode("r1", 1), Episode("r2", 1)),
        "math/replica-1": (Episode("b1", 1),),
        "math/replica-2": (),
    }
    assert result.restarts == {"math/replica-0": (), "math/replica-1": (), "math/replica-2": (Episode("c1", 0),)}
    assert result.resume is not None and result.resume.ok
    for inst in live.values():
        resumes = {server_of(c): c for c in calls_to(recorder, inst, "resume")}
        assert {c.body["checkpoint_id"] for c in resumes.values()} == {result.restore_id}
        assert resumes["calendar_resources"].answered_at <= resumes["workplace_agent"].sent_at
        assert resumes["workplace_agent"].answered_at <= resumes["policy_model"].sent_at
    # The continuation runs as N+1 on the same instance and picks up where the snapshot was.
    reply = await asyncio.wait_for(rows.start(live["math/replica-1"], "b1", attempt=1), 15)
    assert reply.status_code == 200 and reply.json()["resumed_from_turn"] >= 1


async def test_c52_restore_ids_are_fresh_and_differ_from_the_source(client: GymControlClient) -> None:
    ids = {client.new_restore_id("snap-1-00000000") for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("restore-") and len(i) == 40 for i in ids)


# --- 59 ------------------------------------------------------------------------------------------


async def test_c59_retire_and_forget_callers_first_in_batches_while_idle(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport
) -> None:
    inst = start_gym()
    topo = (await topology(client, inst))[inst.instance_id]
    episodes = [Episode(f"r{i:04d}", 1) for i in range(1030)]
    batches = await client.retire(topo, episodes)
    assert [len(b.episodes) for b in batches] == [1024, 6] and all(b.ok for b in batches)
    retires = recorder.ops("retire")
    assert len(retires) == 6 and {c.body["checkpoint_id"] for c in retires} == {"retire"}
    for first in (0, 3):
        batch = {server_of(c): c for c in retires[first:first + 3]}
        assert batch["workplace_agent"].answered_at <= min(batch["policy_model"].sent_at, batch["calendar_resources"].sent_at)
        assert len(batch["policy_model"].body["episode_ids"]) == (1024 if first == 0 else 6)
    status = inst.control("calendar_resources", "status").json()
    assert status["retired_rollouts"] == 1030
    forgets = await client.forget(topo, [e.rollout_id for e in episodes])
    assert [len(b.rollout_ids) for b in forgets] == [1024, 6] and all(b.ok for b in forgets)
    assert {c.body["checkpoint_id"] for c in recorder.ops("forget")} == {"forget"}
    assert inst.control("calendar_resources", "status").json()["retired_rollouts"] == 0


async def test_c59_retire_deferred_while_a_checkpoint_is_open(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport
) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    prepared = await client.prepare(client.new_checkpoint_id("59"), topo)
    batches = await client.retire(topo[inst.instance_id], [Episode("r1", 0)])
    assert len(batches) == 1 and not batches[0].ok and batches[0].failure is not None
    assert batches[0].failure.transient
    assert recorder.ops("retire") == []  # nothing was sent: Gym would refuse it
    await client.resume(prepared.checkpoint_id, topo)
    assert all(b.ok for b in await client.retire(topo[inst.instance_id], [Episode("r1", 0)]))


async def test_c59_queued_retires_go_out_before_the_next_prepare(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym()
    topo = await topology(client, inst)

    async def deliver_outbox() -> None:
        results = await client.retire(topo[inst.instance_id], [Episode("old", 2)])
        assert all(b.ok for b in results)

    # The pending snapshot delivers the outbox as its retire phase, before the save's prepare step.
    await deliver_outbox()
    await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing, capture_hook=nothing,
                  drain_timeout_s=5).run()
    assert max(c.answered_at for c in recorder.ops("retire")) <= min(c.sent_at for c in recorder.ops("prepare"))


# --- 60 ------------------------------------------------------------------------------------------


async def test_c60_failed_retire_batch_is_reported_for_requeue_and_resent(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport
) -> None:
    inst = start_gym(faults=[{"server_name": "policy_model", "op": "retire", "type": "error", "status": 503,
                              "code": "checkpoint_coordinator_unavailable", "times": 1}])
    topo = (await topology(client, inst))[inst.instance_id]
    first = await client.retire(topo, [Episode("r1", 0)])
    assert not first[0].ok and first[0].failure is not None and first[0].failure.transient
    # The other participants still retired the batch (no stage stops the rest).
    assert first[0].servers_ok == ("calendar_resources", "workplace_agent")
    again = await client.retire(topo, first[0].episodes)
    assert again[0].ok
    assert (await state(inst, "policy_model"))["marks"] == {"r1": 0}


async def test_c60_refused_forget_retires_again_then_forgets(start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport) -> None:
    inst = start_gym(faults=[{"server_name": "workplace_agent", "op": "forget", "type": "refuse", "code": "checkpoint_error",
                              "status": 409, "times": 1}])
    topo = (await topology(client, inst))[inst.instance_id]
    assert all(b.ok for b in await client.retire(topo, [Episode("r1", 2)]))
    recorder.clear()
    settled = await client.forget_settling_refusals(topo, {"r1": Episode("r1", 2)})
    assert settled.forgotten == ("r1",) and settled.owed_forgets == () and settled.owed_retires == ()
    assert [c.op for c in recorder.calls if server_of(c) == "workplace_agent" and c.op != "status"] == ["forget", "retire", "forget"]
    assert inst.control("workplace_agent", "status").json()["retired_rollouts"] == 0


async def test_c60_second_forget_refusal_keeps_both_queued(start_gym: StartGym, client: GymControlClient) -> None:
    inst = start_gym(faults=[{"server_name": "workplace_agent", "op": "forget", "type": "refuse", "code": "checkpoint_error",
                              "status": 409, "times": 2}])
    topo = (await topology(client, inst))[inst.instance_id]
    await client.retire(topo, [Episode("r1", 2)])
    settled = await client.forget_settling_refusals(topo, {"r1": Episode("r1", 2)})
    assert settled.forgotten == ()
    assert settled.owed_forgets == ("r1",) and settled.owed_retires == (Episode("r1", 2),)


# --- 61 ------------------------------------------------------------------------------------------


async def test_c61_retired_rollout_never_dispatched_again_is_forgotten_right_after(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport
) -> None:
    inst = start_gym()
    topo = (await topology(client, inst))[inst.instance_id]
    retired, forgotten = await client.retire_then_forget(topo, [Episode("r1", 0), Episode("r2", 3)])
    assert all(b.ok for b in retired) and all(b.ok for b in forgotten)
    assert [c.op for c in recorder.calls if server_of(c) == "calendar_resources" and c.op != "status"] == ["retire", "forget"]
    for name in PARTICIPANTS:
        assert inst.control(name, "status").json()["retired_rollouts"] == 0


async def test_c61_restored_rollout_forgotten_after_its_continuation_seals(
    start_gym: StartGym, rows: Rows, snap: Snapshot, client: GymControlClient, gym_profile: str
) -> None:
    live = fresh_instances(start_gym, snap)
    result = await client.restore(snap.manifest, specs(live), snap.snapshot_dir)
    fresh = live["math/replica-0"]
    topo = result.topology[fresh.instance_id]
    # Strict Gym marks N on every participant at the restore; published Gym marks nothing (P5,
    # docs/gym-protocol.md#what-differs-rule-by-rule), and its restored binding alone refuses N: the forget is then harmless, never early.
    marked = 2 if gym_profile == "strict" else 0
    assert inst_marks(fresh) == marked
    sealed = await asyncio.wait_for(rows.start(fresh, "r1", attempt=1), 15)
    assert sealed.status_code == 200
    assert all(b.ok for b in await client.forget(topo, ["r1"]))
    assert inst_marks(fresh) == max(0, marked - 1)
    # At shutdown every rollout still marked is forgotten.
    assert all(b.ok for b in await client.forget(topo, ["r2"]))
    assert inst_marks(fresh) == 0


def inst_marks(inst: GymsimInstance) -> int:
    counts = {inst.control(n, "status").json()["retired_rollouts"] for n in PARTICIPANTS}
    assert len(counts) == 1, counts
    return counts.pop()
