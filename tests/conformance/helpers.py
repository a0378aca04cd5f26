"""Helpers the coordinator conformance checks share: rows on gymsim's data plane, views of what a
RecordingTransport saw, and waits on gymsim's state. The fixtures built on them are in conftest.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from checkpoint_coordinator.gym import GymControlClient, InstanceSpec, InstanceTopology
from gymsim.testing import GymsimInstance

from .recording import RecordedCall, RecordingTransport

StartGym = Callable[..., GymsimInstance]
PARTICIPANTS = ("policy_model", "workplace_agent", "calendar_resources")


class Rows:
    """Data-plane /run rows, sent the way a caller would (its own connection pool)."""

    def __init__(self, turns: int = 100) -> None:
        self.turns = turns
        self.http = httpx.AsyncClient(timeout=None)
        self.tasks: dict[str, asyncio.Task[httpx.Response]] = {}

    def start(self, inst: GymsimInstance, rollout_id: str, attempt: int = 0, turns: int | None = None) -> asyncio.Task[httpx.Response]:
        body = {"_ng_rollout_id": rollout_id, "_ng_attempt_index": attempt, "task": {"q": rollout_id},
                "turns": self.turns if turns is None else turns}
        task = asyncio.ensure_future(self.http.post(inst.servers["workplace_agent"] + "/run", json=body))
        self.tasks[f"{inst.instance_id}:{rollout_id}:{attempt}"] = task
        return task

    async def aclose(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.http.aclose()


def spec(inst: GymsimInstance) -> InstanceSpec:
    return InstanceSpec(inst.instance_id, inst.token, inst.servers)


async def topology(client: GymControlClient, *insts: GymsimInstance) -> dict[str, InstanceTopology]:
    return await client.discover_all(spec(i) for i in insts)


def server_of(call: RecordedCall) -> str:
    return call.url.split("/s/", 1)[1].split("/", 1)[0]


def calls_to(recorder: RecordingTransport, inst: GymsimInstance, op: str) -> list[RecordedCall]:
    return [c for c in recorder.ops(op) if c.url.startswith(inst.base_url)]


async def state(inst: GymsimInstance, server: str | None = None) -> dict[str, Any]:
    return await asyncio.to_thread(inst.state, server)


async def wait_running(inst: GymsimInstance, keys: list[str], timeout: float = 5.0) -> None:
    """Until the agent runs every episode (past its first turn, so it has model and resources state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        episodes = (await state(inst, "workplace_agent"))["episodes"]
        if all(k in episodes and episodes[k]["turn"] >= 1 for k in keys):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"episodes {keys} did not start")


async def nothing(_: Any) -> None:
    """A drain or capture hook with nothing to do."""
    return None


def assert_all_idle(*insts: GymsimInstance) -> None:
    for inst in insts:
        servers = inst.state()["servers"]
        for name in PARTICIPANTS:
            if name in servers and servers[name]["participant"]:
                assert servers[name]["phase"] == "idle", (inst.instance_id, name, servers[name]["phase"])
                assert servers[name]["admission_open"], (inst.instance_id, name)
