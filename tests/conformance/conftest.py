"""Fixtures of the participant (P) conformance checks: gymsim instances over real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gymsim.conformance import Harness
from gymsim.testing import GymsimInstance, default_instance_config


@pytest.fixture
async def start(tmp_path):
    """Factory: `await start(**config_overrides)` or `await start(config=dict)` gives a Harness."""
    gyms: list[GymsimInstance] = []
    clients: list[httpx.AsyncClient] = []
    harnesses: list[Harness] = []

    async def _start(config: dict[str, Any] | None = None, **overrides: Any) -> Harness:
        # Short turns keep the suite quick; checks that need slow turns ask for them.
        overrides.setdefault("turn_seconds", 0.02)
        cfg = config if config is not None else default_instance_config(**overrides)
        gym = await asyncio.to_thread(GymsimInstance.start, cfg)
        gyms.append(gym)
        client = httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_connections=500))
        clients.append(client)
        harness = Harness(gym, client)
        harnesses.append(harness)
        return harness

    yield _start
    for harness in harnesses:
        await harness.aclose()
    for client in clients:
        await client.aclose()
    await asyncio.gather(*(asyncio.to_thread(gym.stop) for gym in gyms))


@pytest.fixture
def ckdir(tmp_path):
    """A fresh checkpoint directory, as the coordinator creates it before commit."""
    counter = iter(range(10_000))

    def _make(name: str | None = None):
        path = tmp_path / "snap" / (name or f"d{next(counter)}") / "gym-instances" / "math" / "replica-0"
        path.mkdir(parents=True)
        return path

    return _make
