"""The coordinator's Gym clients and the topology of a run, as stored at registration.

:func:`make_client` is the one way to build a Gym control client for a run: its budgets come
from the run's typed recovery config. :class:`GymClients` keeps one per run, since a client
remembers the checkpoint ids it issued. The topology comes from the ledger, not a fresh
discovery: discovery runs at registration and before a restore (docs/gym-protocol.md#discover),
not before every snapshot.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncConnection

from .domain.config import RecoveryConfig, load_recovery_config
from .gym.client import GymControlClient, Topology, tls_context
from .gym.clock import Clock
from .gym.egress import EgressPolicy
from .gym.models import InstanceSpec, InstanceTopology, Participant
from .ledger.gym_registry import instance_specs, participants_by_instance

__all__ = ["GymClients", "current_egress", "egress_policy", "instance_client_specs", "load_topology", "make_client", "set_egress"]


def egress_policy(allowed: str, *, database_url: str | None, own_port: int | None) -> EgressPolicy:
    """The Gym egress of this process: ``allowed`` (the setting), never the database's endpoint
    (its host resolved now) nor this coordinator's own port on this host's addresses."""
    endpoints: list[tuple[str, int]] = []
    if database_url:
        from sqlalchemy.engine import make_url

        u = make_url(database_url)
        if u.host and not u.host.startswith("/"):
            port = u.port or 5432
            try:
                endpoints = [(info[4][0].split("%", 1)[0], port) for info in socket.getaddrinfo(u.host, port, type=socket.SOCK_STREAM)]
            except OSError:
                endpoints = []  # not resolvable now: nothing to forbid that Gym could reach either
    local: list[str] = []
    try:
        import psutil

        local = [a.address.split("%", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    except Exception:  # an unusual host: the loopback rule still holds
        local = []
    return EgressPolicy.parse(allowed, endpoints=endpoints, local_ports=[own_port] if own_port else [], local_addresses=local)


# The process's Gym egress (``set_egress``, by the app at its creation): every client
# ``make_client`` builds connects only where it allows. None: anywhere (a library use).
_egress: EgressPolicy | None = None


def set_egress(policy: EgressPolicy | None) -> None:
    global _egress
    _egress = policy


def current_egress() -> EgressPolicy | None:
    return _egress


def make_client(
    cfg: RecoveryConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    issued: Iterable[str] | Callable[[str], bool] = (),
    clock: Clock | None = None,
    run_id: str | None = None,
) -> GymControlClient:
    """A control client with the run's budgets.

    ``issued`` names the Gym ids this coordinator issued before (from the ledger), or tells them
    by a predicate, so that the client recognises its own orphans after a restart. Discovery
    shares the control budget: the run's config has no budget of its own for it.
    """
    owns = issued if callable(issued) else frozenset(issued).__contains__
    return GymControlClient(
        control_timeout_s=cfg.control_timeout_s,
        prepare_timeout_s=cfg.prepare_timeout_s,
        discovery_timeout_s=cfg.control_timeout_s,
        transport=transport,
        owns_checkpoint_id=owns,
        clock=clock,
        egress=_egress,
        run_id=run_id,
    )


class GymClients:
    """One client per run, for the process's background work (snapshots, the outbox)."""

    def __init__(self, *, transport: httpx.AsyncBaseTransport | None = None, clock: Clock | None = None) -> None:
        self._clients: dict[str, GymControlClient] = {}
        self._transport = transport
        self._clock = clock
        tls_context()  # built at startup, not by the first snapshot (see tls_context)

    def for_run(self, run_id: str, config: RecoveryConfig | Mapping[str, Any]) -> GymControlClient:
        """``config`` is the run's recovery config, typed or as stored (validated when stored)."""
        client = self._clients.get(run_id)
        if client is None:
            cfg = config if isinstance(config, RecoveryConfig) else load_recovery_config(config)
            client = make_client(cfg, transport=self._transport, clock=self._clock, run_id=run_id)
            self._clients[run_id] = client
        return client

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()


async def instance_client_specs(conn: AsyncConnection, run_id: str) -> list[InstanceSpec]:
    """The run's registered instances, as the Gym client reaches them (tokens included)."""
    return [InstanceSpec(s.instance_id, s.control_token, s.servers) for s in await instance_specs(conn, run_id)]


async def load_topology(conn: AsyncConnection, run_id: str) -> Topology:
    """The run's registered instances with their discovered participants."""
    by_inst = await participants_by_instance(conn, run_id)
    topo: dict[str, InstanceTopology] = {}
    for spec in await instance_client_specs(conn, run_id):
        members = tuple(
            Participant(
                server_name=p.server_name,
                base_url=p.base_url,
                kind=p.kind,
                participant_name=p.participant_name,
                mode=p.mode,
                phase="idle",
                stage=p.stage,
            )
            for p in by_inst.get(spec.instance_id, ())
        )
        non = tuple(sorted(set(spec.servers) - {p.server_name for p in members}))
        topo[spec.instance_id] = InstanceTopology(spec=spec, participants=members, non_participants=non)
    return topo
