"""Coordinator conformance, discovery and setup (docs/gym-protocol.md#discover; checklist items
35-38).

The Gym control client runs against in-process gymsim instances over real HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import pytest

from checkpoint_coordinator.domain.config import RestartOnlyVerdict, check_restart_only_servers, load_recovery_config
from checkpoint_coordinator.gym import (
    FailureClass,
    GymControlClient,
    GymControlError,
    InstanceSpec,
    InstanceTopology,
)
from checkpoint_coordinator.restore.registration import participant_record, restart_only_servers
from gymsim.testing import GymsimInstance, default_instance_config, server_config

from .helpers import StartGym
from .recording import RecordingTransport

CLIENT_TIMEOUTS = {"control_timeout_s": 2, "prepare_timeout_s": 2, "discovery_timeout_s": 2}


def spec_of(inst: GymsimInstance, **extra_servers: str) -> InstanceSpec:
    return InstanceSpec(inst.instance_id, inst.token, {**inst.servers, **extra_servers})


def restart_only_policy(live: dict[str, InstanceTopology], allow: bool) -> RestartOnlyVerdict:
    """The rule registration applies to what discovery found, at target level turn."""
    cfg = load_recovery_config({"target_level": "turn", "allow_restart_only_gym_servers": allow})
    found = restart_only_servers({iid: map(participant_record, t.participants) for iid, t in live.items()})
    return check_restart_only_servers(cfg, found)


def dead_url() -> str:
    """A loopback URL where nothing listens: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/s/gone"


# --- 35 ------------------------------------------------------------------------------------------


async def test_c35_discovery_probes_every_server_with_bearer_and_skips_404(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport, gym_profile: str
) -> None:
    inst = start_gym()
    topo = await client.discover_instance(spec_of(inst))
    probed = recorder.ops("status")
    assert sorted(c.url for c in probed) == sorted(f"{u}/ng-control/v1/checkpoint/status" for u in inst.servers.values())
    assert all(c.bearer for c in probed)
    # The judge answers 404: recorded as a non-participant and skipped.
    assert topo.non_participants == ("judge_model",)
    # Sorted by (stage, server_name): model, agent, resources.
    assert [(p.server_name, p.kind, p.stage) for p in topo.participants] == [
        ("policy_model", "model", 1),
        ("workplace_agent", "agent", 2),
        ("calendar_resources", "resources", 3),
    ]
    # Published Gym reports a mode for resources only (P3, docs/gym-protocol.md#what-differs-rule-by-rule).
    modes = {p.server_name: p.mode for p in topo.participants}
    if gym_profile == "published":
        assert modes == {"policy_model": None, "workplace_agent": None, "calendar_resources": "exported"}
    else:
        assert set(modes.values()) == {"exported"}
    assert all(p.phase == "idle" for p in topo.participants)
    assert await client.discover(spec_of(inst)) == list(topo.participants)


async def test_c35_wrong_token_is_a_non_transient_config_error(start_gym: StartGym, client: GymControlClient) -> None:
    inst = start_gym()
    with pytest.raises(GymControlError) as info:
        await client.discover_instance(InstanceSpec(inst.instance_id, "not-the-token", inst.servers))
    err = info.value
    assert err.failure_class is FailureClass.CONFIG_ERROR and not err.transient
    # Every participant refused; the judge's 404 without a token is not a failure.
    assert err.server_names() == {inst.instance_id: ["calendar_resources", "policy_model", "workplace_agent"]}
    assert all(p["http_status"] == 401 for p in err.instances[inst.instance_id].values())
    assert "not-the-token" not in str(err.to_dict()) and "not-the-token" not in repr(err)


# --- 36 ------------------------------------------------------------------------------------------


async def test_c36_refused_connection_tried_exactly_three_times_and_no_partial_set(
    start_gym: StartGym, client: GymControlClient, recorder: RecordingTransport
) -> None:
    inst = start_gym()
    gone = dead_url()
    with pytest.raises(GymControlError) as info:
        await client.discover_instance(spec_of(inst, extra_resources=gone))
    err = info.value
    assert err.failure_class is FailureClass.UNAVAILABLE and err.transient
    assert err.server_names() == {inst.instance_id: ["extra_resources"]}
    tries = [c for c in recorder.ops("status") if c.url.startswith(gone)]
    assert len(tries) == 3
    assert all(c.status is None for c in tries)


async def test_c36_server_that_never_answers_fails_unavailable_after_discovery_timeout(
    start_gym: StartGym, recorder: RecordingTransport
) -> None:
    config = default_instance_config(
        faults=[{"server_name": "calendar_resources", "op": "status", "type": "delay", "seconds": 5}]
    )
    inst = start_gym(config)
    async with GymControlClient(discovery_timeout_s=0.3, transport=recorder) as client:
        started = time.monotonic()
        with pytest.raises(GymControlError) as info:
            await client.discover_instance(spec_of(inst))
        elapsed = time.monotonic() - started
    err = info.value
    assert err.failure_class is FailureClass.UNAVAILABLE and err.transient
    assert err.server_names() == {inst.instance_id: ["calendar_resources"]}
    # Gave up at the discovery budget, well before the 5 s delay; no retry after a timeout.
    assert elapsed < 3
    assert len([c for c in recorder.ops("status") if "calendar_resources" in c.url]) == 1


async def test_c36_discovery_of_several_instances_fails_as_a_whole(start_gym: StartGym, client: GymControlClient) -> None:
    good = start_gym(instance_id="math/replica-0")
    bad = start_gym(instance_id="math/replica-1")
    with pytest.raises(GymControlError) as info:
        await client.discover_all([spec_of(good), spec_of(bad, broken=dead_url())])
    assert set(info.value.instances) == {"math/replica-1"}


async def test_c36_5xx_408_429_at_discovery_are_transient(start_gym: StartGym, client: GymControlClient) -> None:
    inst = start_gym()
    for status in (500, 503, 429, 408):
        await asyncio.to_thread(inst.admin, "POST", "/admin/faults", {
            "server_name": "policy_model", "op": "status", "type": "error", "status": status, "code": "whatever", "times": 1})
        with pytest.raises(GymControlError) as info:
            await client.discover_instance(spec_of(inst))
        assert info.value.failure_class is FailureClass.UNAVAILABLE and info.value.transient, status


async def test_c36_other_status_at_discovery_is_a_protocol_error(start_gym: StartGym, client: GymControlClient) -> None:
    config = default_instance_config(
        faults=[{"server_name": "policy_model", "op": "status", "type": "error", "status": 409, "code": "checkpoint_conflict"}]
    )
    inst = start_gym(config)
    with pytest.raises(GymControlError) as info:
        await client.discover_instance(spec_of(inst))
    assert info.value.failure_class is FailureClass.PROTOCOL_ERROR and not info.value.transient


# --- 37 ------------------------------------------------------------------------------------------


def _with_servers(*changes: tuple[str, dict[str, Any]], extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    config = default_instance_config()
    for name, change in changes:
        config = server_config(config, name, **change)
    config["servers"].extend(extra or [])
    return config


@pytest.mark.parametrize(
    "config,offenders,words",
    [
        (_with_servers(("policy_model", {"kind": None})), ["*"], "no policy model"),
        (_with_servers(extra=[{"server_name": "typed_env", "kind": "environment", "mode": "exported"}]), ["typed_env"], "environment"),
        (_with_servers(extra=[{"server_name": "odd", "kind": "verifier", "mode": "exported"}]), ["odd"], "unknown kind"),
        (_with_servers(("calendar_resources", {"mode": "snapshot_everything"})), ["calendar_resources"], "unknown mode"),
        (
            _with_servers(extra=[{"server_name": "calendar_resources_2", "kind": "resources", "mode": "exported", "participant_name": "calendar_resources"}]),
            ["calendar_resources", "calendar_resources_2"],
            "collide",
        ),
        (_with_servers(("workplace_agent", {"participant_name": "bad name!"})), ["workplace_agent"], "NAME"),
    ],
    ids=["no-model", "environment", "unknown-kind", "unknown-mode", "duplicate", "bad-name"],
)
async def test_c37_discovery_refuses_naming_the_server(
    start_gym: StartGym, client: GymControlClient, config: dict[str, Any], offenders: list[str], words: str
) -> None:
    inst = start_gym(config)
    with pytest.raises(GymControlError) as info:
        await client.discover_instance(spec_of(inst))
    err = info.value
    assert err.failure_class is FailureClass.CONFIG_ERROR and not err.transient
    assert err.server_names() == {inst.instance_id: offenders}
    assert words in str(err)
    for name in offenders:
        if name != "*":
            assert name in str(err)


async def test_c37_export_restore_is_an_alias_of_exported(start_gym: StartGym, client: GymControlClient) -> None:
    inst = start_gym(server_config(default_instance_config(), "calendar_resources", mode="export_restore"))
    topo = await client.discover_instance(spec_of(inst))
    assert topo.by_name()["calendar_resources"].mode == "exported"


# --- 38 ------------------------------------------------------------------------------------------


async def test_c38_restart_only_policy_after_discovery(start_gym: StartGym, client: GymControlClient, gym_profile: str) -> None:
    a = start_gym(instance_id="math/replica-0", resources_mode="restart_only")
    b = start_gym(server_config(default_instance_config("math/replica-1"), "workplace_agent", mode="restart_only"))
    live = await client.discover_all([spec_of(a), spec_of(b)])
    refused = restart_only_policy(live, allow=False)
    # A published agent reports no mode (P3), so only its restarts at each prepare
    # tell that it cannot continue; discovery can flag the resources server alone.
    flagged = ["math/replica-0:calendar_resources"]
    if gym_profile == "strict":
        flagged.append("math/replica-1:workplace_agent")
    assert refused.error is not None and list(refused.restart_only_servers) == flagged
    for name in flagged:
        assert name in refused.error
    accepted = restart_only_policy(live, allow=True)
    assert accepted.accepted and len(accepted.warnings) == 1
    assert "math/replica-0:calendar_resources" in accepted.warnings[0]
    assert ("math/replica-1:workplace_agent" in accepted.warnings[0]) == (gym_profile == "strict")


async def test_c38_flag_without_restart_only_warns_no_effect(start_gym: StartGym, client: GymControlClient) -> None:
    inst = start_gym()
    topo = await client.discover_instance(spec_of(inst))
    verdict = restart_only_policy({inst.instance_id: topo}, allow=True)
    assert verdict.accepted and len(verdict.warnings) == 1 and "no effect" in verdict.warnings[0]


async def test_c38_status_without_mode_is_not_flagged_and_warns(
    start_gym: StartGym, client: GymControlClient, caplog: pytest.LogCaptureFixture, gym_profile: str
) -> None:
    # Strict: a resources server of an older Gym reports no mode. Published: resources always report
    # one (restart_only by default), and the policy model never does (P3).
    silent = "calendar_resources" if gym_profile == "strict" else "policy_model"
    inst = start_gym(resources_mode=None if gym_profile == "strict" else "exported")
    with caplog.at_level(logging.WARNING, logger="checkpoint_coordinator.gym"):
        topo = await client.discover_instance(spec_of(inst))
    assert topo.by_name()[silent].mode is None
    assert any(silent in w and "no checkpoint mode" in w for w in topo.warnings)
    assert any("no checkpoint mode" in r.getMessage() for r in caplog.records)
    # Not restart-only: the strict policy accepts it.
    assert restart_only_policy({inst.instance_id: topo}, allow=False).accepted


async def test_c35_participant_name_differing_from_server_name_warns(start_gym: StartGym, client: GymControlClient) -> None:
    inst = start_gym(server_config(default_instance_config(), "workplace_agent", participant_name="agent_a"))
    topo = await client.discover_instance(spec_of(inst))
    assert topo.by_name()["workplace_agent"].participant_name == "agent_a"
    assert any("agent_a" in w for w in topo.warnings)


async def test_discovery_runs_probes_concurrently(start_gym: StartGym) -> None:
    # Each status is delayed 0.4 s; probing one after the other would take 1.6 s.
    faults = [
        {"server_name": name, "op": "status", "type": "delay", "seconds": 0.4}
        for name in ("policy_model", "workplace_agent", "calendar_resources", "judge_model")
    ]
    inst = start_gym(default_instance_config(faults=faults))
    async with GymControlClient(discovery_timeout_s=5) as client:
        started = time.monotonic()
        await asyncio.wait_for(client.discover_instance(spec_of(inst)), 5)
        assert time.monotonic() - started < 1.4
