"""The coordinator's Gym clients and the topology of a run, as stored at registration.

One GymControlClient per run (its timeouts are the run's recovery config, and it remembers the
checkpoint ids it issued). The topology comes from the ledger, not a fresh discovery: discovery
runs at registration and before a restore (protocol section 3), not before every snapshot.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from .gym.client import GymControlClient, Topology
from .gym.models import InstanceSpec, InstanceTopology, Participant


class GymClients:
    def __init__(self, **client_kwargs: Any) -> None:
        self._clients: dict[str, GymControlClient] = {}
        self._kwargs = client_kwargs

    def for_run(self, run_id: str, config: dict[str, Any]) -> GymControlClient:
        client = self._clients.get(run_id)
        if client is None:
            client = GymControlClient(
                control_timeout_s=float(config.get("control_timeout_s", 60)),
                prepare_timeout_s=float(config.get("prepare_timeout_s", 300)),
                **self._kwargs,
            )
            self._clients[run_id] = client
        return client

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()


async def load_topology(conn: AsyncConnection, run_id: str) -> Topology:
    """The run's registered instances with their discovered participants."""
    insts = (
        await conn.execute(
            text("SELECT instance_id, control_token, servers FROM gym_instances WHERE run_id = :r ORDER BY instance_id"), {"r": run_id}
        )
    ).all()
    parts = (
        await conn.execute(
            text(
                "SELECT instance_id, server_name, base_url, kind, participant_name, mode, stage FROM gym_participants "
                "WHERE run_id = :r ORDER BY instance_id, stage, server_name"
            ),
            {"r": run_id},
        )
    ).all()
    by_inst: dict[str, list[Participant]] = {}
    for p in parts:
        by_inst.setdefault(p.instance_id, []).append(
            Participant(
                server_name=p.server_name, base_url=p.base_url, kind=p.kind, participant_name=p.participant_name,
                mode=p.mode, phase="idle", stage=p.stage,
            )
        )
    topo: dict[str, InstanceTopology] = {}
    for i in insts:
        spec = InstanceSpec(i.instance_id, i.control_token, dict(i.servers))
        members = tuple(by_inst.get(i.instance_id, ()))
        non = tuple(sorted(set(spec.servers) - {p.server_name for p in members}))
        topo[i.instance_id] = InstanceTopology(spec=spec, participants=members, non_participants=non)
    return topo
