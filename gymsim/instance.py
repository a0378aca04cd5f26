"""One running Gym deployment instance: its servers, clock, faults and background lease checks."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from .clock import Clock, Notifier
from .config import InstanceConfig, ServerConfig, ServerKnobs
from .faults import FaultRegistry
from .kinds import make_participant
from .participant import Participant

log = logging.getLogger("gymsim")

LEASE_CHECK_SECONDS = 0.05


class Instance:
    def __init__(self, config: InstanceConfig, *, host: str, port: int) -> None:
        self._initial_config = config.model_copy(deep=True)
        self.host = host
        self.port = port
        self.notifier = Notifier()
        self.clock = Clock(self.notifier)
        self._build(config)
        self._http: httpx.AsyncClient | None = None
        self._lease_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def _build(self, config: InstanceConfig) -> None:
        self.config = config
        self.faults = FaultRegistry(config.faults)
        self.participants: dict[str, Participant] = {}
        self.non_participants: dict[str, ServerConfig] = {}
        for server in config.servers:
            if server.kind is None:
                self.non_participants[server.server_name] = server
            else:
                self.participants[server.server_name] = make_participant(self, server)

    # ------------------------------------------------------------------ addresses

    @property
    def base_url(self) -> str:
        # Internal calls always go over loopback, whatever interface the server listens on.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    def server_url(self, server_name: str) -> str:
        return f"{self.base_url}/s/{server_name}"

    def server_urls(self) -> dict[str, str]:
        return {s.server_name: self.server_url(s.server_name) for s in self.config.servers}

    def first_server_of_kind(self, kind: str) -> str | None:
        for server in self.config.servers:
            if server.kind == kind:
                return server.server_name
        return None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            # The data plane between servers: no timeout, since held calls wait for resume.
            self._http = httpx.AsyncClient(
                timeout=None, limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200)
            )
        return self._http

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._lease_task = asyncio.get_running_loop().create_task(self._check_leases())

    async def stop(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
        for participant in self.participants.values():
            participant.shutdown()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _check_leases(self) -> None:
        # Leases also expire while nobody calls: an idle deployment reopens on its own
        # (docs/gym-protocol.md#leases-and-renewals).
        while True:
            await asyncio.sleep(LEASE_CHECK_SECONDS)
            self.check_leases()

    def check_leases(self) -> None:
        for participant in self.participants.values():
            try:
                participant.check_lease()
            except Exception:  # one broken participant must not stop the others' expiry
                log.exception("gymsim: lease check of %s failed", participant.server_name)

    # ------------------------------------------------------------------ admin operations

    def reset(self) -> None:
        """Back to the state right after start: fresh participants, configured faults and knobs,
        clock offset 0. Lets a test harness reuse a running instance instead of starting one."""
        for participant in self.participants.values():
            participant.shutdown()
        self.clock.offset = 0.0
        self._build(self._initial_config.model_copy(deep=True))
        self.notifier.notify()

    def kill_server(self, server_name: str) -> None:
        """Replace a participant with a fresh one, as if its process had been restarted."""
        old = self.participants[server_name]
        old.shutdown()
        self.participants[server_name] = make_participant(self, old.config)
        self.notifier.notify()

    def set_knobs(self, server_name: str, changes: dict[str, Any]) -> ServerConfig:
        server = self.config.server(server_name)
        current = server.model_dump(include=set(ServerKnobs.model_fields))
        validated = ServerKnobs.model_validate({**current, **changes})  # unknown knobs are refused here
        updated = server.model_copy(update={name: getattr(validated, name) for name in changes})
        self.config.servers[self.config.servers.index(server)] = updated
        if server_name in self.participants:
            self.participants[server_name].config = updated
        self.notifier.notify()
        return updated

    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.check_leases()

    def admin_state(self) -> dict[str, Any]:
        servers: dict[str, Any] = {
            name: {"participant": True, **participant.admin_state()} for name, participant in self.participants.items()
        }
        for name, server in self.non_participants.items():
            servers[name] = {"participant": False, "kind": None}
        return {
            "instance_id": self.config.instance_id,
            "now": self.clock.now(),
            "clock_offset": self.clock.offset,
            "gym_profile": self.config.gym_profile,
            "wire_spelling": self.config.spelling_for(),
            "broken": list(self.config.broken),
            "faults": self.faults.describe(),
            "servers": servers,
        }
