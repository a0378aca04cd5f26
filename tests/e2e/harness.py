"""A small simulated trainer for end-to-end tests: drives the coordinator's API and gymsim's /run."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import httpx

from checkpoint_coordinator.gym.client import GymControlClient
from checkpoint_coordinator.gym.models import InstanceSpec

_ids = itertools.count(1)


async def register_by_discovery(engine: Any, run_id: str, instances: list[Any]) -> None:
    """Register gymsim instances for a run straight in the ledger (discovery through the Gym client)."""
    from sqlalchemy import text

    async with GymControlClient(control_timeout_s=10) as gc:
        topo = await gc.discover_all([InstanceSpec(i.instance_id, i.token, i.servers) for i in instances])
    async with engine.begin() as conn:
        for inst in instances:
            # Replaces a placeholder of the same id (tests/gym_placeholders.py), as a registration does.
            await conn.execute(text("DELETE FROM gym_instances WHERE run_id = :r AND instance_id = :i"), {"r": run_id, "i": inst.instance_id})
            await conn.execute(
                text("INSERT INTO gym_instances (run_id, instance_id, servers, control_token, discovered_at) VALUES (:r, :i, CAST(:s AS jsonb), :t, now())"),
                {"r": run_id, "i": inst.instance_id, "s": json.dumps(inst.servers), "t": inst.token},
            )
            for p in topo[inst.instance_id].participants:
                await conn.execute(
                    text(
                        "INSERT INTO gym_participants (run_id, instance_id, server_name, base_url, kind, participant_name, mode, stage) "
                        "VALUES (:r, :i, :n, :u, :k, :pn, :m, :st)"
                    ),
                    {"r": run_id, "i": inst.instance_id, "n": p.server_name, "u": p.base_url, "k": p.kind, "pn": p.participant_name, "m": p.mode, "st": p.stage},
                )


class Trainer:
    """Dispatches rows to gymsim agents and reports every outcome, like a NeMo RL trainer would."""

    def __init__(self, api: Any, instances: dict[str, Any], *, turns: int = 4) -> None:
        self.api = api
        self.instances = instances
        self.turns = turns
        self.http = httpx.AsyncClient(timeout=60)
        self.tasks: set[asyncio.Task[None]] = set()
        self.replies: dict[str, dict[str, Any]] = {}
        self.refusals = 0
        self.stragglers: list[str] = []  # rows Gym retired under their /run as stragglers

    async def aclose(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.http.aclose()

    async def admit_and_dispatch(self, groups: list[dict[str, Any]], instance_id: str) -> list[dict[str, Any]]:
        admitted = await self.api.admit(*groups)
        rows = [r for g in admitted["groups"] for r in g["rows"]]
        await self.dispatch(rows, instance_id)
        return rows

    async def dispatch(self, rows: list[dict[str, Any]], instance_id: str) -> None:
        while True:
            r = await self.api.c.post(
                f"/v1/runs/{self.api.run_id}/attempts/dispatch",
                json={"dispatch_id": f"d{next(_ids)}", "instance_id": instance_id, "rollout_ids": [x["rollout_id"] for x in rows]},
                headers=self.api.h,
            )
            if r.status_code == 409 and r.json()["code"] == "gate_closed":
                await asyncio.sleep(0.05)
                continue
            assert r.status_code == 200, r.text
            break
        for row in r.json()["rows"]:
            t = asyncio.create_task(self._run(row, instance_id))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def _run(self, row: dict[str, Any], instance_id: str) -> None:
        agent = self.instances[instance_id].servers["workplace_agent"]
        body = {"_ng_rollout_id": row["rollout_id"], "_ng_attempt_index": row["gym_attempt"], "task": {"group": row["group_id"]}, "turns": self.turns}
        resp = await self.http.post(f"{agent}/run", json=body)
        if resp.status_code == 200:
            reply = resp.json()
            self.replies[row["capture_key"]] = reply
            await self.api.post(
                "/attempts/sealed",
                {"rows": [{"rollout_id": row["rollout_id"], "receipt": {"rollout_id": reply["capture_key"]}, "staging_keys": reply["staging_keys"], "reward": reply["reward"]}]},
            )
        elif resp.status_code == 409 and resp.json()["error"]["code"] in ("checkpoint_parked", "admission_closed"):
            self.refusals += 1
            await self.api.post("/attempts/refused", {"rollout_ids": [row["rollout_id"]]})
            await asyncio.sleep(0.05)
            await self.dispatch([row], instance_id)
        elif resp.status_code == 409 and resp.json()["error"]["code"] == "stale_attempt" and await self._replaced(row, instance_id):
            pass
        else:
            await self.api.post("/attempts/failed", {"rows": [{"rollout_id": row["rollout_id"], "failure_class": "data"}]})

    async def _replaced(self, row: dict[str, Any], instance_id: str) -> bool:
        """Gym retired the row under its /run: the pending read says whether the coordinator gave
        it up as a straggler, and what to send instead (docs/ledger.md#stragglers)."""
        read = await self.api.post("/attempts/pending", {"rollout_ids": [row["rollout_id"]]})
        rows = [r for s in read.get("stragglers", []) for r in s["group"]["rows_to_send"]]
        if not read.get("stragglers"):
            return False
        self.stragglers.append(row["rollout_id"])
        if rows:
            await self.dispatch(rows, instance_id)
        return True

    async def wait_idle(self, timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while self.tasks:
                await asyncio.gather(*list(self.tasks), return_exceptions=True)


class ReportingTrainer(Trainer):
    """A trainer that reports a /run call whose connection dropped as a transport failure, as
    NeMo RL's does when a Gym replica dies under it."""

    async def _run(self, row: dict[str, Any], instance_id: str) -> None:
        try:
            await super()._run(row, instance_id)
        except httpx.TransportError:
            await self.api.post("/attempts/failed", {"rows": [{"rollout_id": row["rollout_id"], "failure_class": "transport"}]})


async def drive_snapshot(api: Any, snapshot_id: str, step: int, capture_dir: Path, *, timeout: float = 30) -> dict[str, Any]:
    """The trainer side of a snapshot (docs/ledger.md#phases): request, barrier, capture,
    captured; returns the final record."""
    r = await api.c.post(f"/v1/runs/{api.run_id}/snapshots", json={"snapshot_id": snapshot_id, "anchor_step": step}, headers=api.h)
    assert r.status_code in (200, 202), r.text
    async with asyncio.timeout(timeout):
        while True:
            s = await api.get(f"/snapshots/{snapshot_id}")
            if s["outcome"] is not None:
                return s
            if s["awaiting"] == "barrier":
                b = await api.c.post(f"/v1/runs/{api.run_id}/snapshots/{snapshot_id}/barrier", headers=api.h)
                if b.status_code == 200:
                    keys = b.json()["staging_keys"]
                    capture_dir.mkdir(parents=True, exist_ok=True)
                    f = capture_dir / f"{snapshot_id}.json"
                    f.write_text(json.dumps(keys))
                    digest = hashlib.sha256(f.read_bytes()).hexdigest()
                    await api.post(f"/snapshots/{snapshot_id}/captured", {"reference": {"path": str(f), "digest": digest}})
            await asyncio.sleep(0.02)


async def turns_done(g: Any) -> dict[str, int]:
    """Completed turns of every episode of an instance, from its resources server's sessions."""
    sessions = (await asyncio.to_thread(g.admin, "GET", "/admin/resources/calendar_resources/sessions"))["sessions"]
    return {k: len(x["history"]) for k, x in sessions.items()}


async def until_every_episode_has(g: Any, keys: list[str], turns: int, timeout: float = 60) -> None:
    """Until every episode of ``keys`` has done ``turns`` turns, however loaded the machine."""
    async with asyncio.timeout(timeout):
        while True:
            done = await turns_done(g)
            if all(done.get(k, 0) >= turns for k in keys):
                return
            await asyncio.sleep(0.02)


async def wait_mid_way(gyms: dict[str, Any], turns: int, *, timeout: float = 30) -> None:
    """Until every instance has at least two long (``t``-prefixed) episodes a few turns in,
    however loaded the machine."""
    async with asyncio.timeout(timeout):
        while True:
            mid = []
            for g in gyms.values():
                sessions = (await asyncio.to_thread(g.admin, "GET", "/admin/resources/calendar_resources/sessions"))["sessions"]
                mid.append(sum(2 <= len(x["history"]) < turns - 2 for k, x in sessions.items() if k.startswith("t")))
            if all(n >= 2 for n in mid):
                return
            await asyncio.sleep(0.02)


async def published_snapshot(api: Any, capture_dir: Path) -> dict[str, set[str]]:
    """Snapshot ``s1`` at step 0 through the trainer side, published; the saved (exported)
    episodes of each instance."""
    snap = await drive_snapshot(api, "s1", 0, capture_dir)
    assert snap["outcome"] == "published", snap
    manifest = (await api.get("/snapshots/s1?manifest=true"))["gym_manifest"]
    saved = {iid: {e["rollout_id"] for e in body["episodes"]} for iid, body in manifest["instances"].items()}
    assert all(saved.values()), manifest
    return saved


async def kill_all(*gyms: Any) -> None:
    for g in gyms:
        try:
            await asyncio.to_thread(g.kill)
        except Exception:
            pass
