"""An async harness for checking a Gym deployment against the participant (P) checklist
(docs/gym-protocol.md#conformance).

`Harness` drives one running `GymsimInstance` over real HTTP: control calls with the instance's
token, deadlines on the participant's clock (it tracks the admin clock offset), the data plane of
the default topology and the admin views. `tests/conformance/` uses it, and so can anyone who
needs to script a participant.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import time
from dataclasses import dataclass
from typing import Any

import httpx

from .config import PUBLISHED_PROFILES, InstanceConfig
from .testing import GymsimInstance, default_instance_config

MODEL = "policy_model"
AGENT = "workplace_agent"
RESOURCES = "calendar_resources"
JUDGE = "judge_model"
PARTICIPANTS = (MODEL, AGENT, RESOURCES)
STAGES = (MODEL, AGENT, RESOURCES)  # prepare order; resume goes the other way
OPS = ("prepare", "renew", "commit", "resume", "restore", "retire", "forget")

# The table of docs/gym-protocol.md#error-codes, restated here so that checks do not take their
# expectations from the implementation: legacy code -> (current spelling, HTTP status).
SPEC_CODES = {
    "unauthorized": ("checkpoint_unauthorized", 401),
    "stale_checkpoint": ("checkpoint_stale_checkpoint", 409),
    "checkpoint_conflict": ("checkpoint_conflict", 409),
    "invalid_phase": ("checkpoint_invalid_phase", 409),
    "deadline_exceeded": ("checkpoint_deadline_exceeded", 409),
    "restart_in_scope": ("checkpoint_restart_in_scope", 409),
    "invalid_checkpoint_state": ("checkpoint_invalid_checkpoint_state", 422),
    "checkpoint_error": ("checkpoint_error", 409),
    "checkpoint_coordinator_unavailable": ("checkpoint_coordinator_unavailable", 503),
    "admission_closed": ("checkpoint_parked", 409),
    "stale_attempt": ("checkpoint_stale_attempt", 409),
    "rollout_id_required": ("checkpoint_rollout_id_required", 400),
}


def ep(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt": attempt}


@dataclass
class Saved:
    checkpoint_id: str
    directory: Any
    runs: dict[str, asyncio.Task]
    saved_turns: dict[str, int]  # completed turns of each rollout at the cut
    turns: int
    replies: dict[str, dict[str, Any]]


class Harness:
    def __init__(self, gym: GymsimInstance, client: httpx.AsyncClient) -> None:
        self.gym = gym
        self.client = client
        self.token = gym.token
        self.servers = gym.servers
        self.profile = gym.config.gym_profile
        self.spelling = gym.config.spelling_for()
        # The status field listing restored state nobody claimed yet, in the instance's spelling.
        self.unclaimed_field = "restored_pending" if self.spelling == "legacy" else "unclaimed"
        self.offset = 0.0
        self._runs: list[asyncio.Task] = []

    # ---------------------------------------------------------------- clock

    def now(self) -> float:
        return time.time() + self.offset

    def deadline(self, seconds: float = 30.0) -> float:
        return self.now() + seconds

    def advance(self, seconds: float) -> None:
        self.offset = self.gym.admin("POST", "/clock", {"advance": seconds})["offset"]

    # ---------------------------------------------------------------- codes

    def code(self, legacy: str) -> str:
        return legacy if self.spelling == "legacy" else SPEC_CODES[legacy][0]

    def assert_error(self, response: httpx.Response, legacy: str, status: int | None = None) -> None:
        expected_status = status if status is not None else SPEC_CODES[legacy][1]
        assert response.status_code == expected_status, (response.status_code, response.text)
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "detail"}, body
        assert body["error"]["code"] == self.code(legacy), body
        assert isinstance(body["error"]["detail"], str)

    # ---------------------------------------------------------------- control calls

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token if token is None else token}"}

    async def call(
        self,
        server: str,
        op: str,
        body: Any = None,
        *,
        token: str | None = None,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        """One control call; `headers` replaces the auth header, `content` sends raw bytes."""
        url = f"{self.servers[server]}/ng-control/v1/checkpoint/{op}"
        headers = self.headers(token) if headers is None else headers
        if op == "status":
            return await self.client.get(url, headers=headers)
        if content is not None:
            return await self.client.post(url, content=content, headers={**headers, "content-type": "application/json"})
        return await self.client.post(url, json=body, headers=headers)

    async def ok(self, server: str, op: str, body: Any = None) -> dict[str, Any]:
        response = await self.call(server, op, body)
        assert response.status_code == 200, (server, op, response.status_code, response.text)
        return response.json()

    async def status(self, server: str) -> dict[str, Any]:
        return await self.ok(server, "status")

    def body(self, cid: str, seconds: float = 30.0, **extra: Any) -> dict[str, Any]:
        return {"checkpoint_id": cid, "deadline_ts": self.deadline(seconds), **extra}

    async def prepare(self, server: str, cid: str, seconds: float = 10.0) -> httpx.Response:
        return await self.call(server, "prepare", self.body(cid, seconds))

    async def prepare_all(self, cid: str, seconds: float = 10.0) -> dict[str, dict]:
        replies = {}
        for server in STAGES:
            replies[server] = await self.ok(server, "prepare", self.body(cid, seconds))
            assert replies[server]["phase"] == "prepared", replies[server]
        return replies

    async def commit(self, server: str, cid: str, directory, episodes, seconds: float = 30.0, **extra) -> httpx.Response:
        body = self.body(cid, seconds, checkpoint_dir=str(directory), episode_ids=list(episodes), **extra)
        return await self.call(server, "commit", body)

    async def commit_all(self, cid: str, directory, episodes) -> dict[str, dict]:
        replies = {}
        for server in STAGES:
            response = await self.commit(server, cid, directory, episodes)
            assert response.status_code == 200, (server, response.text)
            replies[server] = response.json()
        return replies

    async def resume_all(self, cid: str) -> None:
        for server in reversed(STAGES):
            await self.ok(server, "resume", self.body(cid))

    async def restore(self, server: str, cid: str, directory, episodes, seconds: float = 30.0) -> httpx.Response:
        body = self.body(cid, seconds, checkpoint_dir=str(directory), episode_ids=list(episodes))
        return await self.call(server, "restore", body)

    async def retire(self, server: str, cid: str, episodes, seconds: float = 30.0) -> httpx.Response:
        return await self.call(server, "retire", self.body(cid, seconds, episode_ids=list(episodes)))

    async def forget(self, server: str, cid: str, rollout_ids, seconds: float = 30.0) -> httpx.Response:
        return await self.call(server, "forget", self.body(cid, seconds, rollout_ids=list(rollout_ids)))

    # ---------------------------------------------------------------- data plane

    async def run(self, rollout_id: str, attempt: int = 0, *, task: Any = None, turns: int | None = None) -> httpx.Response:
        body: dict[str, Any] = {"_ng_rollout_id": rollout_id, "_ng_attempt_index": attempt, "task": task}
        if turns is not None:
            body["turns"] = turns
        return await self.client.post(f"{self.servers[AGENT]}/run", json=body, timeout=60)

    def start_run(self, rollout_id: str, attempt: int = 0, **kw) -> asyncio.Task:
        task = asyncio.ensure_future(self.run(rollout_id, attempt, **kw))
        self._runs.append(task)
        return task

    async def aclose(self) -> None:
        """Cancel /run calls a check left behind (for example on a killed instance)."""
        for task in self._runs:
            task.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)

    async def chat(self, key: str, turn: int | None = None) -> httpx.Response:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        if turn is not None:
            body["turn"] = turn
        return await self.client.post(f"{self.servers[MODEL]}/ng-rollout/{key}/v1/chat/completions", json=body, timeout=60)

    async def mutate(self, sid: str, turn: int | None = None, work_seconds: float = 0.0) -> httpx.Response:
        body = {"turn": turn, "entry": {"by": "test"}, "work_seconds": work_seconds}
        return await self.client.post(f"{self.servers[RESOURCES]}/sessions/{sid}/mutate", json=body, timeout=60)

    async def park_runs(self, rollouts, *, turns: int = 20, min_turns: int = 1) -> dict[str, asyncio.Task]:
        """Start one /run (attempt 0) per rollout and wait until each has finished `min_turns` turns."""
        runs = {r: self.start_run(r, 0, task={"rollout": r}, turns=turns) for r in rollouts}

        def progressed() -> bool:
            sessions = self.sessions()
            return all(sessions.get(r, {}).get("counter", 0) >= min_turns for r in rollouts)

        await self.wait_until(progressed)
        return runs

    async def save(self, cid: str, directory, rollouts, *, turns: int = 20) -> "Saved":
        """Run episodes, park them with a full prepare and commit them: a snapshot to restore from."""
        runs = await self.park_runs(rollouts, turns=turns)
        await self.prepare_all(cid)
        episodes = self.state(AGENT)["episodes"]
        saved_turns = {r: episodes[r]["turn"] for r in rollouts}
        replies = await self.commit_all(cid, directory, [ep(r) for r in sorted(rollouts)])
        return Saved(cid, directory, runs, saved_turns, turns, replies)

    async def restore_all(self, cid: str, saved: "Saved", rollouts=None) -> dict[str, dict]:
        """Restore every participant from a save, scoped to `rollouts` (default: all saved ones)."""
        episodes = [ep(r) for r in sorted(rollouts if rollouts is not None else saved.saved_turns)]
        replies = {}
        for server in STAGES:
            response = await self.restore(server, cid, saved.directory, episodes)
            assert response.status_code == 200, (server, response.text)
            replies[server] = response.json()
        return replies

    # ---------------------------------------------------------------- admin

    def state(self, server: str) -> dict[str, Any]:
        return self.gym.admin("GET", "/state")["servers"][server]

    @property
    def published(self) -> bool:
        return self.profile in PUBLISHED_PROFILES

    async def unclaimed(self, server: str) -> list[str]:
        """The restored episodes a participant's status lists as not yet claimed."""
        return (await self.status(server))[self.unclaimed_field]

    def sessions(self) -> dict[str, Any]:
        return self.gym.admin("GET", f"/resources/{RESOURCES}/sessions")["sessions"]

    def knobs(self, server: str, **changes: Any) -> None:
        self.gym.admin("POST", f"/servers/{server}/knobs", changes)

    def fingerprint(self, server: str) -> dict[str, Any]:
        """Everything observable about a participant that a refused call must leave unchanged."""
        state = copy.deepcopy(self.state(server))
        for volatile in ("prepare_calls", "commit_calls", "restore_calls", "install_count"):
            state.pop(volatile, None)
        return state

    async def wait_until(self, predicate, timeout: float = 10.0, interval: float = 0.02) -> None:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            assert time.monotonic() < deadline, "condition not reached in time"
            await asyncio.sleep(interval)

    async def wait_parked(self, count: int, timeout: float = 10.0) -> None:
        """Wait until `count` agent episodes sit at a boundary."""

        async def parked() -> bool:
            counts = (await self.status(AGENT))["report"]["counts"]
            return counts["at_boundary"] >= count and counts["working"] == 0

        await self.wait_until(parked, timeout)


class InstanceCache:
    """Running instances kept across checks, keyed by their exact config.

    Starting and stopping uvicorn costs more than most checks; a released instance is reset
    (fresh participants, configured faults and knobs, clock offset 0) and handed to the next check
    that asks for the same config.
    """

    def __init__(self) -> None:
        self._idle: dict[str, list[GymsimInstance]] = {}
        self._all: list[GymsimInstance] = []

    @staticmethod
    def key(config: "dict[str, Any] | InstanceConfig") -> str:
        return InstanceConfig.coerce(config).model_dump_json()

    def acquire(self, config: "dict[str, Any] | InstanceConfig") -> GymsimInstance:
        idle = self._idle.get(self.key(config))
        if idle:
            return idle.pop()
        gym = GymsimInstance.start(config)
        self._all.append(gym)
        return gym

    def release(self, gym: GymsimInstance) -> None:
        try:
            gym.reset()
        except (httpx.HTTPError, RuntimeError):
            return  # a broken or stopped instance is not reused
        self._idle.setdefault(self.key(gym.config), []).append(gym)

    def close(self) -> None:
        # Side by side: each stop waits for its server's shutdown, and a session's worth of
        # them one after another adds up to a long wait.
        if self._all:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(self._all))) as pool:
                list(pool.map(GymsimInstance.stop, self._all))
        self._all.clear()
        self._idle.clear()


class HarnessPool:
    """Starts instances with harnesses and tears all of them down at the end (a fixture's body)."""

    def __init__(self, cache: InstanceCache | None = None, default_turn_seconds: float = 0.02) -> None:
        self.cache = cache
        self.default_turn_seconds = default_turn_seconds
        self._gyms: list[GymsimInstance] = []
        self._harnesses: list[Harness] = []

    async def start(self, config: dict[str, Any] | None = None, **overrides: Any) -> Harness:
        """`start(**overrides)` of `default_instance_config`, or `start(config=...)` verbatim."""
        # Short turns keep checks quick; a check that needs slow turns asks for them.
        overrides.setdefault("turn_seconds", self.default_turn_seconds)
        cfg = config if config is not None else default_instance_config(**overrides)
        if self.cache is not None:
            gym = await asyncio.to_thread(self.cache.acquire, cfg)
        else:
            gym = await asyncio.to_thread(GymsimInstance.start, cfg)
        self._gyms.append(gym)
        client = httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_connections=500))
        harness = Harness(gym, client)
        self._harnesses.append(harness)
        return harness

    async def close(self) -> None:
        for harness in self._harnesses:
            await harness.aclose()
            await harness.client.aclose()
        release = self.cache.release if self.cache is not None else GymsimInstance.stop
        await asyncio.gather(*(asyncio.to_thread(release, gym) for gym in self._gyms))


def checkpoint_dirs(base):
    """A factory of fresh `<snapshot>/gym-instances/<instance_id>` directories under `base`, as the
    coordinator creates them before commit."""
    counter = iter(range(1_000_000))

    def make(name: str | None = None):
        path = base / "snap" / (name or f"d{next(counter)}") / "gym-instances" / "math" / "replica-0"
        path.mkdir(parents=True)
        return path

    return make
