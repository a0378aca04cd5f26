"""Reaching a run's Gym instances from the restore side: the registered instances as client
specs, and the freshness probe a restore runs before it touches Gym. Clients come from the one
factory, :func:`checkpoint_coordinator.gym_runtime.make_client`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncConnection

from ..gym.channel import CallFailed
from ..gym.client import GymControlClient
from ..gym_runtime import current_egress
from ..gym.models import InstanceSpec, InstanceTopology, Participant
from ..gym_runtime import instance_client_specs, make_client
from ..ledger.gym_registry import issued_gym_ids, registered_instance_ids

__all__ = ["make_client", "probe_freshness", "registered_instance_ids", "registered_specs"]

# Informational readiness counters that, when positive, show live data-plane work.
_LIVE_COUNTS = frozenset(
    {"episodes", "sessions", "in_flight", "working", "at_boundary", "on_wire", "computing", "held", "streaming", "waiting", "unclaimed", "native"}
)


async def registered_specs(conn: AsyncConnection, run_id: str) -> tuple[list[InstanceSpec], frozenset[str]]:
    """The run's registered instances as client specs, and the Gym ids the coordinator issued."""
    return await instance_client_specs(conn, run_id), await issued_gym_ids(conn, run_id)


async def probe_freshness(
    topology: Mapping[str, InstanceTopology],
    *,
    timeout_s: float,
    transport: httpx.AsyncBaseTransport | None = None,
    client: GymControlClient | None = None,
) -> dict[str, dict[str, list[str]]]:
    """Per instance and participant, why it has evidently served work since it started.

    Gym refuses to restore into a participant that is not fresh, but the protocol's status
    reply carries no freshness flag. These signs are in the status every participant answers:
    a phase other than ``idle``, marks it holds (``retired_rollouts``: a participant with marks
    would refuse the very continuations a restore installs), restored state nobody claimed
    (``unclaimed``/``restored_pending``), blockers, restarts or live-work counters in its
    readiness report. Gym's own refusal (409 ``checkpoint_error``) remains the last word.
    A status that cannot be read is not judged here: the restore's own discovery reports it.

    The statuses are read through ``client`` (the restore's own), or without one through a
    short-lived client on ``transport`` whose budgets are ``timeout_s``.
    """
    if client is None:
        async with GymControlClient(control_timeout_s=timeout_s, discovery_timeout_s=timeout_s, transport=transport, egress=current_egress()) as own:
            return await probe_freshness(topology, timeout_s=timeout_s, client=own)

    async def one(inst: InstanceTopology, p: Participant) -> tuple[str, str, list[str]]:
        try:
            body = await client.status_document(inst, p)
        except CallFailed:
            body = None
        return inst.instance_id, p.server_name, _signs(body) if body is not None else []

    results = await asyncio.gather(*(one(inst, p) for inst in topology.values() for p in inst.participants))
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
