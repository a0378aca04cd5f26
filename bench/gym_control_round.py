"""Benchmark: the Gym control client's own CPU time per control round.

One round is prepare + commit + resume against 8 in-process gymsim participants (2 instances
of policy model, agent and two resources servers each), with zero-latency servers.

gymsim runs in its own threads, so the client's cost is the CPU time of the thread running
the client's event loop (``time.thread_time``), which excludes the participants' work. The
reference, measured in the same run the same way, is a bare httpx exchange doing the same 24
calls (the same bodies, fan-out and stage order) with no validation, no error classification
and no bookkeeping. Two settings:

* ``loopback``: real HTTP to gymsim. Includes the socket, httpcore and anyio costs, which in a
  sandboxed kernel (expensive syscalls) dominate both figures.
* ``replay``: the replies gymsim gave in one real round, replayed from memory by an httpx
  transport (checkpoint ids substituted), so only the client's own work and httpx's request
  and response objects remain. ``client - bare`` there is the client's own logic.

Each Gym profile of gymsim is measured (``published``, NeMo Gym as published: no mode for model
and agent, no ``run_episode_ids``, legacy error spelling; ``strict``, the protocol to the
letter: docs/gym-protocol.md#the-strict-profile).

Target: under 20 ms of the client's own CPU per round for 8 participants, under both profiles.

    python bench/gym_control_round.py [--rounds 40] [--profiles published,strict]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from typing import Any

import httpx

from checkpoint_coordinator.gym import GymControlClient, InstanceSpec, InstanceTopology, instance_checkpoint_dir
from gymsim.testing import GymsimInstance, default_instance_config

TARGET_MS = 20.0


def start_instances(profile: str) -> list[GymsimInstance]:
    insts = []
    for i in range(2):
        config = default_instance_config(f"bench/replica-{i}", gym_profile=profile)
        config["servers"].append({"server_name": "notes_resources", "kind": "resources", "mode": "exported"})
        insts.append(GymsimInstance.start(config))
    return insts


async def client_round(client: GymControlClient, topo: dict[str, InstanceTopology], snapshot_dir: str) -> float:
    started = time.thread_time()
    cid = client.new_checkpoint_id("bench")
    await client.prepare(cid, topo)
    await client.commit(cid, topo, {iid: instance_checkpoint_dir(snapshot_dir + "/" + cid, iid) for iid in topo}, {})
    await client.resume(cid, topo)
    return time.thread_time() - started


async def bare_round(http: httpx.AsyncClient, topo: dict[str, InstanceTopology], snapshot_dir: str, n: int) -> float:
    """The same calls with plain httpx: stage by stage per instance, JSON in and out."""
    started = time.thread_time()
    cid = f"bare-{n}"

    async def post(inst: InstanceTopology, base_url: str, op: str, body: dict[str, Any]) -> Any:
        headers = {"authorization": "Bearer " + inst.spec.token.get_secret_value()}
        response = await http.post(f"{base_url}/ng-control/v1/checkpoint/{op}", json=body, headers=headers)
        response.raise_for_status()
        return response.json()

    async def per_instance(inst: InstanceTopology, op: str, body: dict[str, Any], reverse: bool = False) -> None:
        for stage in inst.stages(reverse=reverse):
            await asyncio.gather(*(post(inst, p.base_url, op, body) for p in stage))

    deadline = time.time() + 60
    await asyncio.gather(*(per_instance(i, "prepare", {"checkpoint_id": cid, "deadline_ts": deadline}) for i in topo.values()))
    bodies = {
        iid: {"checkpoint_id": cid, "deadline_ts": deadline, "checkpoint_dir": instance_checkpoint_dir(snapshot_dir + "/" + cid, iid), "episode_ids": []}
        for iid in topo
    }
    await asyncio.to_thread(lambda: [__import__("os").makedirs(b["checkpoint_dir"], exist_ok=True) for b in bodies.values()])
    await asyncio.gather(*(post(inst, p.base_url, "commit", bodies[iid]) for iid, inst in topo.items() for p in inst.participants))
    await asyncio.gather(*(per_instance(i, "resume", {"checkpoint_id": cid, "deadline_ts": deadline}, True) for i in topo.values()))
    return time.thread_time() - started


class Capture(httpx.AsyncBaseTransport):
    """Keeps the last reply body per URL, with the request's checkpoint id made a placeholder."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.replies: dict[str, tuple[int, bytes]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        if request.method == "POST":
            cid = json.loads(request.content)["checkpoint_id"]
            self.replies[str(request.url)] = (response.status_code, content.replace(cid.encode(), PLACEHOLDER))
        return httpx.Response(response.status_code, content=content, headers=response.headers)


class Replay(httpx.AsyncBaseTransport):
    def __init__(self, replies: dict[str, tuple[int, bytes]]) -> None:
        self.replies = replies

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        status, template = self.replies[str(request.url)]
        cid = json.loads(request.content)["checkpoint_id"].encode()
        content = template.replace(PLACEHOLDER, cid)
        return httpx.Response(status, content=content, headers={"content-type": "application/json", "content-length": str(len(content))})


PLACEHOLDER = b"@@CHECKPOINT_ID@@"


async def measure(
    client: GymControlClient, http: httpx.AsyncClient, topo: dict[str, InstanceTopology], snapshot_dir: str, rounds: int
) -> tuple[list[float], list[float]]:
    # Warm both paths (connections, imports, caches) before measuring.
    for n in range(3):
        await client_round(client, topo, snapshot_dir)
        await bare_round(http, topo, snapshot_dir, -n - 1)
    client_s: list[float] = []
    bare_s: list[float] = []
    # Interleaved, so both see the same machine load.
    for n in range(rounds):
        client_s.append(await client_round(client, topo, snapshot_dir))
        bare_s.append(await bare_round(http, topo, snapshot_dir, n))
    return client_s, bare_s


def summary(client_s: list[float], bare_s: list[float]) -> dict[str, float]:
    client_ms = statistics.median(client_s) * 1000
    bare_ms = statistics.median(bare_s) * 1000
    return {
        "client_cpu_ms_per_round_median": round(client_ms, 2),
        "client_cpu_ms_per_round_p90": round(sorted(client_s)[int(0.9 * (len(client_s) - 1))] * 1000, 2),
        "bare_httpx_cpu_ms_per_round_median": round(bare_ms, 2),
        "ratio_client_to_bare_httpx": round(client_ms / bare_ms, 2) if bare_ms else float("nan"),
        "client_own_cpu_ms_per_round": round(client_ms - bare_ms, 2),
    }


async def main(rounds: int, profiles: list[str]) -> dict[str, Any]:
    results = {profile: await measure_profile(rounds, profile) for profile in profiles}
    return {
        "rounds": rounds,
        "target_ms": TARGET_MS,
        "profiles": results,
        "client_own_cpu_within_target": all(r["client_own_cpu_within_target"] for r in results.values()),
    }


async def measure_profile(rounds: int, profile: str) -> dict[str, Any]:
    insts = start_instances(profile)
    capture = Capture()
    try:
        specs = [InstanceSpec(i.instance_id, i.token, i.servers) for i in insts]
        with tempfile.TemporaryDirectory() as snapshot_dir:
            async with GymControlClient(control_timeout_s=30, prepare_timeout_s=30) as client, httpx.AsyncClient() as http:
                topo = await client.discover_all(specs)
                participants = sum(len(t.participants) for t in topo.values())
                loopback = summary(*await measure(client, http, topo, snapshot_dir, rounds))
            async with GymControlClient(control_timeout_s=30, prepare_timeout_s=30, transport=capture) as recorder:
                await client_round(recorder, topo, snapshot_dir)
            replay_transport = Replay(capture.replies)
            async with GymControlClient(control_timeout_s=30, prepare_timeout_s=30, transport=replay_transport) as client, \
                    httpx.AsyncClient(transport=replay_transport) as http:
                replay = summary(*await measure(client, http, topo, snapshot_dir, rounds))
    finally:
        for inst in insts:
            inst.kill()
    return {
        "participants": participants,
        "calls_per_round": 3 * participants,
        "loopback": loopback,
        "replay": replay,
        "client_own_cpu_within_target": replay["client_own_cpu_ms_per_round"] < TARGET_MS,
        "replay_total_within_target": replay["client_cpu_ms_per_round_median"] < TARGET_MS,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--profiles", default="published,strict", help="gymsim profiles to measure, comma-separated")
    args = parser.parse_args()
    profiles = [p for p in args.profiles.split(",") if p]
    unknown = set(profiles) - {"published", "strict"}
    if unknown or not profiles:
        parser.error(f"--profiles takes published and/or strict, not {sorted(unknown) or args.profiles!r}")
    logging.disable(logging.WARNING)
    print(json.dumps(asyncio.run(main(args.rounds, profiles)), indent=2))
