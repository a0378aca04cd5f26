"""Reaching a run's Gym instances: the control client built from the run's config, the
registered instances as client specs, and the freshness probe a restore runs before it touches
Gym."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncConnection

from ..domain.config import RecoveryConfig
from ..gym.client import GymControlClient
from ..gym.models import InstanceSpec, InstanceTopology
from ..ledger.gym_registry import StoredSpec, instance_specs, issued_gym_ids

CONTROL_PREFIX = "/ng-control/v1/checkpoint/"
# Informational readiness counters (protocol 5) that, when positive, show live data-plane work.
_LIVE_COUNTS = frozenset(
    {"episodes", "sessions", "in_flight", "working", "at_boundary", "on_wire", "computing", "held", "streaming", "waiting", "unclaimed", "native"}
)


def make_client(
    cfg: RecoveryConfig, *, transport: httpx.AsyncBaseTransport | None = None, issued: Iterable[str] = ()
) -> GymControlClient:
    owned = frozenset(issued)
    return GymControlClient(
        control_timeout_s=cfg.control_timeout_s,
        prepare_timeout_s=cfg.prepare_timeout_s,
        discovery_timeout_s=cfg.control_timeout_s,
        transport=transport,
        owns_checkpoint_id=owned.__contains__,
    )


def to_spec(s: StoredSpec) -> InstanceSpec:
    return InstanceSpec(s.instance_id, s.control_token, s.servers)


async def registered_specs(conn: AsyncConnection, run_id: str) -> tuple[list[InstanceSpec], frozenset[str]]:
    """The run's registered instances as client specs, and the Gym ids the coordinator issued."""
    specs = [to_spec(s) for s in await instance_specs(conn, run_id)]
    return specs, await issued_gym_ids(conn, run_id)


async def probe_freshness(
    topology: Mapping[str, InstanceTopology],
    *,
    timeout_s: float,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, dict[str, list[str]]]:
    """Per instance and participant, why it has evidently served work since it started.

    Gym refuses to restore into a participant that is not fresh, but the protocol's status
    reply carries no freshness flag. These signs are in the status every participant answers:
    a phase other than ``idle``, marks it holds (``retired_rollouts``: a participant with marks
    would refuse the very continuations a restore installs), restored state nobody claimed
    (``unclaimed``/``restored_pending``), blockers, restarts or live-work counters in its
    readiness report. Gym's own refusal (409 ``checkpoint_error``) remains the last word.
    A status that cannot be read is not judged here: the restore's own discovery reports it.
    """
    async with httpx.AsyncClient(transport=transport, trust_env=False, timeout=timeout_s) as http:

        async def one(inst: InstanceTopology, server: str, url: str) -> tuple[str, str, list[str]]:
            token = inst.spec.token.get_secret_value()
            try:
                resp = await http.get(url.rstrip("/") + CONTROL_PREFIX + "status", headers={"Authorization": f"Bearer {token}"})
                body = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                body = None
            return inst.instance_id, server, _signs(body) if isinstance(body, dict) else []

        calls = [one(inst, p.server_name, p.base_url) for inst in topology.values() for p in inst.participants]
        results = await asyncio.gather(*calls)
    out: dict[str, dict[str, list[str]]] = {}
    for iid, server, signs in results:
        if signs:
            out.setdefault(iid, {})[server] = signs
    return out


def _signs(status: dict[str, Any]) -> list[str]:
    signs = []
    phase = status.get("phase")
    if phase not in (None, "idle"):
        signs.append(f"phase {phase!r} (checkpoint {status.get('checkpoint_id')!r})")
    retired = status.get("retired_rollouts")
    if type(retired) is int and retired > 0:
        signs.append(f"holds marks of {retired} retired rollout(s)")
    for key in ("unclaimed", "restored_pending"):
        val = status.get(key)
        if isinstance(val, list) and val:
            signs.append(f"{len(val)} restored episode(s) unclaimed")
    report = status.get("report")
    if isinstance(report, dict):
        counts = report.get("counts")
        if isinstance(counts, dict):
            live = sorted(k for k, v in counts.items() if k in _LIVE_COUNTS and type(v) is int and v > 0)
            if live:
                signs.append("live work: " + ", ".join(f"{k}={counts[k]}" for k in live))
        count = report.get("blocker_count")
        if type(count) is int and count > 0:
            signs.append(f"{count} episode(s) in flight")
        restarts = report.get("restarts")
        if isinstance(restarts, list) and restarts:
            signs.append(f"{len(restarts)} live episode(s) it would restart")
    return signs
