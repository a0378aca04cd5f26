"""Coordinator conformance, codes and wire forms (checklist items 62-64;
docs/gym-protocol.md#transport, docs/gym-protocol.md#failure-classes,
docs/gym-protocol.md#error-codes).

The Gym control client runs against in-process gymsim instances over real HTTP, in both wire
spellings. Oversized and embellished replies are made by rewriting gymsim's real replies in a
RecordingTransport.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from checkpoint_coordinator.gym import (
    Episode,
    FailureClass,
    GymControlClient,
    GymControlError,
    InstanceSpec,
    InstanceTopology,
    instance_checkpoint_dir,
    normalize_code,
)
from gymsim.testing import default_instance_config, server_config

from .helpers import PARTICIPANTS, StartGym, nothing, server_of, topology
from .recording import RecordingTransport
from .sequenced import SequencedGymSave

SPELLINGS = ["current", "legacy"]
CLIENT_TIMEOUTS = {"control_timeout_s": 1, "prepare_timeout_s": 2, "discovery_timeout_s": 2}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=None) as h:
        yield h


def only_part(err: GymControlError) -> dict[str, Any]:
    parts = [p for servers in err.instances.values() for p in servers.values()]
    assert parts
    return parts[0]


# --- 62 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_c62_codes_recognised_in_both_spellings(
    start_gym: StartGym, client: GymControlClient, tmp_path: Any, spelling: str
) -> None:
    inst = start_gym(wire_spelling=spelling)
    topo = await topology(client, inst)
    iid = inst.instance_id
    dirs = {iid: instance_checkpoint_dir(str(tmp_path), iid)}
    seen: dict[str, tuple[FailureClass, str | None]] = {}

    async def expect(name: str, call: Any, server: str | None = None) -> GymControlError:
        with pytest.raises(GymControlError) as info:
            await call
        part = info.value.instances[iid][server] if server else only_part(info.value)
        seen[name] = (FailureClass(part["class"]) if server else info.value.failure_class, part["code"])
        return info.value

    # invalid_phase: commit while idle.
    await expect("invalid_phase", client.commit("snap-x-00000001", topo, dirs, {}))
    # stale_checkpoint on renew of an ended checkpoint: the lease is lost.
    cid = client.new_checkpoint_id("62")
    await client.prepare(cid, topo)
    await client.resume(cid, topo)
    await expect("stale_checkpoint", client.renew(cid, topo))
    # checkpoint_conflict: another controller holds the instance.
    async with GymControlClient(control_timeout_s=2) as other:
        foreign = other.new_checkpoint_id("other")
        await other.prepare(foreign, await topology(other, inst))
        await expect("checkpoint_conflict", client.prepare(client.new_checkpoint_id("62b"), topo))
        await other.resume(foreign, await topology(other, inst))
    # invalid_checkpoint_state: restore from a directory that holds no checkpoint.
    manifest = {"schema_version": 2, "checkpoint_id": "snap-none-00000000", "instances": {
        iid: {"episodes": [], "restarts": [], "staging_keys": [], "participants": sorted(PARTICIPANTS)}}}
    err = await expect("invalid_checkpoint_state", client.restore(manifest, topo, str(tmp_path / "empty")))
    assert err.extra["rollouts_to_restart"] == {iid: []}
    # checkpoint_error (409): restore into a participant that is not fresh, from a valid
    # directory (published Gym reads the directory before it checks freshness).
    saved = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path / "valid"), candidates={},
                          drain_hook=nothing, capture_hook=nothing, drain_timeout_s=5).run()
    async with httpx.AsyncClient(timeout=10) as h:
        await h.post(inst.servers["policy_model"] + "/ng-rollout/warm/v1/chat/completions", json={"model": "p", "messages": [], "turn": 0})
    await expect("checkpoint_error", client.restore(dict(saved.manifest), topo, str(tmp_path / "valid")), "policy_model")
    # unauthorized: a wrong token on a control call.
    bad = {iid: InstanceTopology(InstanceSpec(iid, "wrong", inst.servers), topo[iid].participants)}
    await expect("unauthorized", client.resume("snap-y-00000001", bad))

    assert seen == {
        "invalid_phase": (FailureClass.UNAVAILABLE, "invalid_phase"),
        "stale_checkpoint": (FailureClass.LEASE_LOST, "stale_checkpoint"),
        "checkpoint_conflict": (FailureClass.CONFLICT, "checkpoint_conflict"),
        "invalid_checkpoint_state": (FailureClass.CHECKPOINT_STATE, "invalid_checkpoint_state"),
        "checkpoint_error": (FailureClass.PROTOCOL_ERROR, "checkpoint_error"),
        "unauthorized": (FailureClass.CONFIG_ERROR, "unauthorized"),
    }


@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_c62_restart_in_scope_and_deadline_exceeded(start_gym: StartGym, tmp_path: Any, spelling: str) -> None:
    inst = start_gym(server_config(default_instance_config(wire_spelling=spelling, turn_seconds=0.3, resources_mode="restart_only"),
                                   "workplace_agent", export_seconds=4.0))
    async with httpx.AsyncClient(timeout=None) as h:
        row = asyncio.ensure_future(h.post(inst.servers["workplace_agent"] + "/run",
                                           json={"_ng_rollout_id": "r1", "_ng_attempt_index": 0, "task": {}, "turns": 50}))
        try:
            while not (await asyncio.to_thread(inst.state, "workplace_agent"))["episodes"].get("r1", {}).get("turn"):
                await asyncio.sleep(0.05)
            # Deadlines with room for a loaded machine: the other participants answer well within
            # 1.5 s, the agent's export (4 s) cannot.
            client = GymControlClient(control_timeout_s=1.5, prepare_timeout_s=6)
            topo = await topology(client, inst)
            cid = client.new_checkpoint_id("62d")
            prepared = await client.prepare(cid, topo)
            assert Episode("r1", 0) in prepared.restarts[inst.instance_id]
            with pytest.raises(GymControlError) as info:
                await client.commit(cid, topo, {inst.instance_id: instance_checkpoint_dir(str(tmp_path), inst.instance_id)},
                                    {inst.instance_id: [Episode("r1", 0)]})
            parts = info.value.instances[inst.instance_id]
            assert parts["calendar_resources"]["code"] == "restart_in_scope"
            assert parts["calendar_resources"]["class"] == "protocol_error"
            # The slow agent export (4 s) overran its 1.5 s deadline.
            assert parts["workplace_agent"]["code"] == "deadline_exceeded"
            assert parts["workplace_agent"]["class"] == "unavailable"
            assert info.value.failure_class is FailureClass.PROTOCOL_ERROR and not info.value.transient
            await client.resume(cid, topo)
            await client.aclose()
        finally:
            row.cancel()
            await asyncio.gather(row, return_exceptions=True)


async def test_c62_unknown_codes_classified_by_status(start_gym: StartGym, client: GymControlClient) -> None:
    inst = start_gym()
    topo = await topology(client, inst)
    cases = [
        (418, "mystery_code", FailureClass.PROTOCOL_ERROR),
        (400, "checkpoint_mystery", FailureClass.PROTOCOL_ERROR),
        (502, "bad_gateway", FailureClass.UNAVAILABLE),
        (429, "slow_down", FailureClass.UNAVAILABLE),
        (503, "checkpoint_coordinator_unavailable", FailureClass.UNAVAILABLE),
        (500, "checkpoint_error", FailureClass.UNAVAILABLE),
    ]
    for status, code, expected in cases:
        await asyncio.to_thread(inst.admin, "POST", "/admin/faults", {
            "server_name": "workplace_agent", "op": "prepare", "type": "error", "status": status, "code": code, "times": 1})
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("62e"), topo)
        assert info.value.failure_class is expected, (status, code)
        assert info.value.instances[inst.instance_id]["workplace_agent"]["http_status"] == status


@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_c62_admission_refusal_on_run_is_retry_same_attempt_after_resume(
    start_gym: StartGym, client: GymControlClient, http: httpx.AsyncClient, spelling: str
) -> None:
    inst = start_gym(wire_spelling=spelling)
    topo = await topology(client, inst)
    cid = client.new_checkpoint_id("62f")
    await client.prepare(cid, topo)
    row = {"_ng_rollout_id": "late", "_ng_attempt_index": 0, "task": {}, "turns": 1}
    refused = await http.post(inst.servers["workplace_agent"] + "/run", json=row)
    # Either spelling is recognised as the admission refusal: the row never started, so the
    # caller re-sends the same attempt rather than spending one.
    assert refused.status_code == 409
    assert normalize_code(refused.json()["error"]["code"]) == "admission_closed"
    await client.resume(cid, topo)
    # The very same row, same rollout id and attempt, is admitted after resume: no mark was raised.
    again = await http.post(inst.servers["workplace_agent"] + "/run", json=row)
    assert again.status_code == 200


# --- 63 ------------------------------------------------------------------------------------------


async def test_c63_requests_use_objects_replies_parse_capture_keys_and_lists_are_sets(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, http: httpx.AsyncClient, tmp_path: Any
) -> None:
    inst = start_gym()
    rows = [
        asyncio.ensure_future(http.post(inst.servers["workplace_agent"] + "/run",
                                        json={"_ng_rollout_id": rid, "_ng_attempt_index": att, "task": {}, "turns": 50}))
        for rid, att in (("r-b", 2), ("r-a", 0), ("r-c", 11))
    ]
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            episodes = (await asyncio.to_thread(inst.state, "workplace_agent"))["episodes"]
            if all(episodes.get(k, {}).get("turn", 0) >= 1 for k in ("r-b-a2", "r-a", "r-c-a11")):
                break
            await asyncio.sleep(0.05)

        def shuffle(status: int, body: Any) -> tuple[int, Any]:
            # Reply lists in another order, with a repeat: still the same sets.
            for key in ("episode_ids", "run_episode_ids", "staging_keys"):
                if key in body:
                    items = list(body[key]) + list(body[key][:1])
                    random.Random(7).shuffle(items)
                    body[key] = items
            return status, body

        recorder.rewrite("/s/", "commit", shuffle)
        topo = await topology(client, inst)
        candidates = {inst.instance_id: [Episode("r-c", 11), Episode("r-b", 2), Episode("r-a", 0)]}
        result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates=candidates, drain_hook=nothing,
                               capture_hook=nothing, drain_timeout_s=5).run()
    finally:
        for row in rows:
            row.cancel()
        await asyncio.gather(*rows, return_exceptions=True)
    for call in recorder.ops("commit"):
        assert call.body["episode_ids"] == [
            {"rollout_id": "r-a", "attempt": 0}, {"rollout_id": "r-b", "attempt": 2}, {"rollout_id": "r-c", "attempt": 11}
        ]
        assert "stop" not in call.body
    assert result.commit.instances[inst.instance_id].episodes == (Episode("r-a", 0), Episode("r-b", 2), Episode("r-c", 11))
    assert result.manifest["instances"][inst.instance_id]["episodes"][2] == {"rollout_id": "r-c", "attempt": 11}
    keys = result.manifest["instances"][inst.instance_id]["staging_keys"]
    assert keys == sorted(set(keys)) and any(k.startswith("tq/r-c-a11/") for k in keys)


# --- 64 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("second,transient", [(503, True), (409, False)])
async def test_c64_multi_instance_failure_transient_only_if_all_parts_are(
    start_gym: StartGym, recorder: RecordingTransport, second: int, transient: bool
) -> None:
    not_ready = start_gym(server_config(default_instance_config("math/replica-0"), "policy_model", workers=2, unreported_workers=1))
    failing = start_gym(instance_id="math/replica-1", faults=[
        {"server_name": "policy_model", "op": "prepare", "type": "error", "status": second, "code": "checkpoint_error"}
    ])
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=0.3, transport=recorder) as client:
        topo = await topology(client, not_ready, failing)
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("64"), topo)
    err = info.value
    assert err.transient is transient
    assert err.failure_class is (FailureClass.NOT_READY if transient else FailureClass.PROTOCOL_ERROR)
    assert set(err.instances) == {"math/replica-0", "math/replica-1"}
    data = err.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["instances"]["math/replica-0"]["policy_model"]["class"] == "not_ready"
    assert data["instances"]["math/replica-1"]["policy_model"]["http_status"] == second
    assert pickle.loads(pickle.dumps(err)).to_dict() == data


async def test_c64_unknown_reply_fields_are_ignored(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, tmp_path: Any
) -> None:
    inst = start_gym()

    def embellish(status: int, body: Any) -> tuple[int, Any]:
        if isinstance(body, dict):
            body = {**body, "x_future_field": {"nested": [1, 2]}, "workers": 4}
            if isinstance(body.get("manifest"), dict):
                body["manifest"] = {**body["manifest"], "session_owners": {"a": "b"}}
            if isinstance(body.get("report"), dict):
                body["report"] = {**body["report"], "x_hint": True}
        return status, body

    for op in ("status", "prepare", "renew", "commit", "resume"):
        recorder.rewrite("/s/", op, embellish)
    topo = await topology(client, inst)
    result = await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing,
                           capture_hook=nothing, drain_timeout_s=5).run()
    assert result.resume is not None and result.resume.ok


@pytest.mark.parametrize("chunked", [False, True])
async def test_c64_reply_over_max_control_reply_bytes_is_a_protocol_error(
    start_gym: StartGym, recorder: RecordingTransport, tmp_path: Any, chunked: bool
) -> None:
    inst = start_gym()

    def inflate(status: int, body: Any) -> tuple[int, Any] | list[bytes]:
        body["staging_keys"] = body["staging_keys"] + [f"tq/padding/{i}" for i in range(100)]
        raw = json.dumps(body).encode()
        return [raw[i:i + 256] for i in range(0, len(raw), 256)] if chunked else (status, body)

    recorder.rewrite("/s/policy_model/", "commit", inflate)
    async with GymControlClient(control_timeout_s=1, prepare_timeout_s=2, max_control_reply_bytes=2048, transport=recorder) as client:
        topo = await topology(client, inst)
        with pytest.raises(GymControlError) as info:
            await SequencedGymSave(client, topo, snapshot_dir=str(tmp_path), candidates={}, drain_hook=nothing,
                          capture_hook=nothing, drain_timeout_s=5).run()
    err = info.value
    assert err.failure_class is FailureClass.PROTOCOL_ERROR and not err.transient
    part = err.instances[inst.instance_id]["policy_model"]
    assert part["code"] == "response_too_large"
    # Not re-sent: a reply arrived, it was only too large.
    assert len([c for c in recorder.ops("commit") if server_of(c) == "policy_model"]) == 1


async def test_token_never_appears_in_logs_or_failures(
    start_gym: StartGym, client: GymControlClient, caplog: pytest.LogCaptureFixture
) -> None:
    inst = start_gym(token="very-secret-token-123", faults=[
        {"server_name": "workplace_agent", "op": "prepare", "type": "error", "status": 500, "code": "checkpoint_error"}
    ])
    with caplog.at_level(logging.DEBUG):
        topo = await topology(client, inst)
        with pytest.raises(GymControlError) as info:
            await client.prepare(client.new_checkpoint_id("tok"), topo)
    assert "very-secret-token-123" not in caplog.text
    assert "very-secret-token-123" not in json.dumps(info.value.to_dict())
    assert "very-secret-token-123" not in repr(topo) + str(info.value)
