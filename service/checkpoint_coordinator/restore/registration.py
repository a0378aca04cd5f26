"""Gym registration at setup (docs/ledger.md#recovery-configuration, docs/gym-protocol.md#discover).

Discovery probes every server of every instance being registered; it fails as a whole, so the
run never holds a partial participant set. The restart-only rule is then applied to every
participant the run will have (the instances registered before plus these), and only if it
passes is anything stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.config import (
    RecoveryConfig,
    check_restart_only_servers,
    gym_checkpoint_settings,
    load_recovery_config,
)
from ..domain.errors import DomainError
from ..domain.levels import RestoreLevel
from ..gym.egress import parse_gym_url
from ..gym.errors import GymControlError
from ..gym.models import InstanceSpec, InstanceTopology, Participant
from ..gym_runtime import current_egress, make_client
from ..ledger.gym_registry import (
    InstanceRecord,
    ParticipantRecord,
    list_instances,
    participant_json,
    participants_by_instance,
    store_instances,
)
from ..ledger.runs import get_run
from ..recovery_config import domain_problem
from .errors import EgressRefusedProblem, GymFailure, RestartOnlyRefused
from .gym_access import probe_freshness

log = logging.getLogger("checkpoint_coordinator.restore")


@dataclass(frozen=True)
class Registration:
    instance_id: str
    control_token: str
    servers: dict[str, str]


def run_config(raw: dict[str, Any]) -> RecoveryConfig:
    try:
        return load_recovery_config(raw)
    except DomainError as e:  # a stored config always validated once; say so if it no longer does
        raise domain_problem(e, prefix="recovery") from e


def is_restart_only(p: ParticipantRecord) -> bool:
    """A participant that cannot continue a session after a crash reports ``restart_only``; one
    without a mode (an older Gym) is not restart-only."""
    return p.mode == "restart_only"


def restart_only_servers(participants: Mapping[str, Iterable[ParticipantRecord]]) -> dict[str, list[str]]:
    """Per instance, the sorted names of its restart-only participants (instances without any
    left out): what ``allow_restart_only_gym_servers`` is applied to."""
    found = {iid: sorted(p.server_name for p in ps if is_restart_only(p)) for iid, ps in participants.items()}
    return {iid: names for iid, names in found.items() if names}


def participant_record(p: Participant) -> ParticipantRecord:
    return ParticipantRecord(p.server_name, p.base_url, p.kind, p.participant_name, p.mode, p.stage)


def gym_settings(cfg: RecoveryConfig) -> dict[str, Any]:
    return {
        "checkpoint": gym_checkpoint_settings(cfg),
        "excluded": ["control_auth_token"],
        "note": "configure every Gym server of the run with these checkpoint settings; the control "
        "token is per instance and never published",
    }


async def register_instances(
    engine: AsyncEngine,
    run_id: str,
    registrations: Sequence[Registration],
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    async with engine.connect() as conn:
        run = await get_run(conn, run_id)
        stored = await participants_by_instance(conn, run_id)
        servers_before = {i["instance_id"]: dict(i["servers"]) for i in await list_instances(conn, run_id)}
    cfg = run_config(run.config)
    await check_egress(registrations)
    specs = [InstanceSpec(r.instance_id, r.control_token, r.servers) for r in registrations]
    client = make_client(cfg, transport=transport, run_id=run_id)
    try:
        topology = await client.discover_all(specs, log_warnings=False)
        replaced = await _fresh_replacements(client, registrations, topology, servers_before, cfg)
    except GymControlError as exc:
        raise GymFailure.of(exc, "Gym discovery", {r.instance_id: r.servers for r in registrations}) from None
    finally:
        await client.aclose()

    records: list[InstanceRecord] = []
    answer_instances: list[dict[str, Any]] = []
    warnings: list[str] = []
    for reg in registrations:
        topo = topology[reg.instance_id]
        record = InstanceRecord(reg.instance_id, reg.control_token, dict(reg.servers), tuple(map(participant_record, topo.participants)))
        records.append(record)
        warnings.extend(topo.warnings)
        busy = {p.server_name: p.checkpoint_id for p in topo.participants if p.phase != "idle"}
        if busy:
            warnings.append(
                f"{reg.instance_id}: participants not idle: "
                + ", ".join(f"{s} ({c})" for s, c in sorted(busy.items()))
                + "; a snapshot or restore resumes or refuses them"
            )
        answer_instances.append(_answer_instance(reg, topo, record))

    # The rule applies to every participant the run will have after this registration.
    merged = {iid: list(ps) for iid, ps in stored.items()}
    merged.update({r.instance_id: list(r.participants) for r in records})
    restart_only = restart_only_servers(merged)
    verdict = check_restart_only_servers(cfg, restart_only)
    if verdict.error is not None:
        raise RestartOnlyRefused(
            verdict.error,
            servers=list(verdict.restart_only_servers),
            errors=[
                {"field": f"instances.{iid}.servers.{name}", "message": f"restart_only participant under target_level '{RestoreLevel.turn}'"}
                for iid, names in sorted(restart_only.items())
                for name in names
            ],
        )
    warnings.extend(verdict.warnings)
    moot = await store_instances(engine, run_id, records, replaced=replaced)
    if moot:
        warnings.append(
            f"{moot} retire/forget item(s) owed to the process(es) replaced by {', '.join(replaced)} were dropped: "
            "that process is gone, and the fresh one never ran those rollouts"
        )
    for w in warnings:
        log.warning("run %s: %s", run_id, w)
    return {
        "run_id": run_id,
        "instances": answer_instances,
        "restart_only_servers": list(verdict.restart_only_servers),
        "warnings": warnings,
        "gym_settings": gym_settings(cfg),
    }


async def _fresh_replacements(
    client: Any, registrations: Sequence[Registration], topology: Mapping[str, InstanceTopology],
    servers_before: Mapping[str, dict[str, str]], cfg: RecoveryConfig,
) -> list[str]:
    """The instances re-registered on other servers whose participants show no sign of having
    served work: a restarted Gym process. What the run owed the process it replaces is moot."""
    moved = [r.instance_id for r in registrations if r.instance_id in servers_before and servers_before[r.instance_id] != dict(r.servers)]
    if not moved:
        return []
    stale = await probe_freshness({i: topology[i] for i in moved}, timeout_s=cfg.control_timeout_s, client=client)
    return [i for i in moved if i not in stale]


async def check_egress(registrations: Sequence[Registration]) -> None:
    """Every server's address allowed (``gym.egress``), before any connection is made: a host
    name is resolved, and every address it resolves to checked. Refused as a whole, naming each
    server."""
    policy = current_egress()
    if policy is None:
        return
    targets = [(k, name, url) for k, r in enumerate(registrations) for name, url in sorted(r.servers.items())]

    async def one(url: str) -> str | None:
        try:
            host, port = parse_gym_url(url)
            await policy.resolve(host, port)
        except ValueError as e:
            return str(e)
        return None

    verdicts = await asyncio.gather(*(one(url) for _, _, url in targets))
    errors = [
        {"field": f"instances.{k}.servers.{name}", "message": f"{url}: {why}"}
        for (k, name, url), why in zip(targets, verdicts)
        if why is not None
    ]
    if errors:
        raise EgressRefusedProblem(
            f"{len(errors)} Gym server address(es) not allowed: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5]),
            errors=errors,
        )


def _answer_instance(reg: Registration, topo: InstanceTopology, record: InstanceRecord) -> dict[str, Any]:
    return {
        "instance_id": reg.instance_id,
        "servers": dict(sorted(reg.servers.items())),
        "participants": [
            {**participant_json(r), "phase": p.phase, "restart_only": is_restart_only(r)}
            for p, r in zip(topo.participants, record.participants)
        ],
        "non_participants": list(topo.non_participants),
    }


async def registered(engine: AsyncEngine, run_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        await get_run(conn, run_id)
        instances = await list_instances(conn, run_id)
    return {"run_id": run_id, "instances": instances}
