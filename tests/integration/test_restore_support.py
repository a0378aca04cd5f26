"""Helpers for the restore tests (no tests here): published snapshots made straight in the
database from the live ledger, gymsim instances, a tiny trainer that plays /run rows, and the Gym
save through the control client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from checkpoint_coordinator.gym.client import GymControlClient
from checkpoint_coordinator.gym.models import Episode, InstanceSpec
from checkpoint_coordinator.snapshots.store import cut_xid_basis, insert_cut_rows, set_cut_xid_basis
from gymsim.testing import GymsimInstance, default_instance_config

from .ledger_helpers import RunApi
from ..conformance.sequenced import SequencedGymSave


async def publish_snapshot(
    engine: Any,
    run_id: str,
    snapshot_id: str,
    anchor_step: int = 0,
    *,
    manifest: dict[str, Any] | None = None,
    snapshot_dir: str | None = None,
    data_plane_ref: dict[str, Any] | None = None,
) -> None:
    """A published snapshot whose cut is the run's live ledger now (live groups only, like the
    snapshot choreography's cut), copied with INSERT ... SELECT."""
    p = {"r": run_id, "s": snapshot_id}
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, outcome, reason, owner, gym_checkpoint_id, "
                "snapshot_dir, gym_manifest, data_plane_ref, cut_at, published_at, ended_at) VALUES (:r, :s, :step, 'published', "
                "'published', 'ok', 'test', :cid, :dir, CAST(:m AS jsonb), CAST(:dp AS jsonb), now(), now(), now())"
            ),
            {
                **p,
                "step": anchor_step,
                "cid": manifest["checkpoint_id"] if manifest else None,
                "dir": snapshot_dir,
                "m": json.dumps(manifest) if manifest is not None else None,
                "dp": json.dumps(data_plane_ref or {"path": f"/data/{snapshot_id}", "digest": "sha256:0"}),
            },
        )
        basis = await cut_xid_basis(conn)
        await insert_cut_rows(
            conn, run_id, snapshot_id,
            "SELECT * FROM prompt_groups WHERE run_id = :r AND status IN ('generating', 'ready')",
            "SELECT a.*, s.row_attempts_used FROM attempts a JOIN siblings s ON s.run_id = a.run_id AND s.group_id = a.group_id "
            "AND s.generation_index = a.generation_index WHERE a.run_id = :r AND a.is_current",
            {},
        )
        await set_cut_xid_basis(conn, run_id, snapshot_id, basis)


async def fetch(engine: Any, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return [dict(r._mapping) for r in (await conn.execute(text(sql), params)).all()]


def manifest_doc(instances: dict[str, dict[str, Any]], checkpoint_id: str = "snap-s1-0badc0de") -> dict[str, Any]:
    """A Gym manifest v2 from {instance: {episodes: [(rid, n)], restarts: [(rid, n)], participants: [...]}}."""
    out: dict[str, Any] = {}
    for iid, body in instances.items():
        out[iid] = {
            "episodes": [{"rollout_id": r, "attempt": n} for r, n in body.get("episodes", [])],
            "restarts": [{"rollout_id": r, "attempt": n} for r, n in body.get("restarts", [])],
            "staging_keys": list(body.get("staging_keys", [])),
            "participants": list(body.get("participants", ["calendar_resources", "policy_model", "workplace_agent"])),
        }
    return {"schema_version": 2, "checkpoint_id": checkpoint_id, "instances": out}


def start_gym(instance_id: str = "math/replica-0", *, subprocess: bool = False, **overrides: Any) -> GymsimInstance:
    config = default_instance_config(instance_id, token=f"tok-{instance_id.replace('/', '-')}", **overrides)
    return GymsimInstance.start(config, subprocess=subprocess)


def registration(*gyms: GymsimInstance) -> dict[str, Any]:
    return {"instances": [{"instance_id": g.instance_id, "control_token": g.token, "servers": g.servers} for g in gyms]}


async def register(api: RunApi, *gyms: GymsimInstance, expect: int = 200) -> dict[str, Any]:
    return await api.post("/gym-instances", registration(*gyms), expect)


class Player:
    """Plays dispatched rows on gymsim agents and reports each outcome to the coordinator."""

    def __init__(self, api: RunApi, gyms: dict[str, GymsimInstance], *, turns: int = 20) -> None:
        self.api = api
        self.gyms = gyms
        self.turns = turns
        self.http = httpx.AsyncClient(timeout=120)
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.replies: dict[str, dict[str, Any]] = {}

    def play(self, rows: Iterable[dict[str, Any]], instance_id: str, *, turns: int | None = None) -> None:
        for row in rows:
            key = row["capture_key"]
            self.tasks[key] = asyncio.create_task(self._run(row, instance_id, self.turns if turns is None else turns))

    async def _run(self, row: dict[str, Any], instance_id: str, turns: int) -> None:
        agent = self.gyms[instance_id].servers["workplace_agent"]
        body = {
            "_ng_rollout_id": row["rollout_id"],
            "_ng_attempt_index": row["gym_attempt"],
            # The same task on every attempt: Gym checks a continuation's task digest.
            "task": {"group": row["group_id"], "index": row["generation_index"]},
            "turns": turns,
        }
        resp = await self.http.post(f"{agent}/run", json=body)
        if resp.status_code != 200:
            return
        reply = resp.json()
        self.replies[row["capture_key"]] = reply
        await self.api.post(
            "/attempts/sealed",
            {
                "rows": [
                    {
                        "rollout_id": row["rollout_id"],
                        "receipt": {"rollout_id": reply["capture_key"]},
                        "staging_keys": reply["staging_keys"],
                        "reward": reply["reward"],
                    }
                ]
            },
        )

    async def drain(self, pending: dict[str, set[Episode]]) -> None:
        keys = [ep.capture_key for eps in pending.values() for ep in eps]
        await asyncio.gather(*(self.tasks[k] for k in keys if k in self.tasks), return_exceptions=True)
        for eps in pending.values():
            eps.clear()

    async def stop(self) -> None:
        """The trainer dies: every /run it had in flight is dropped."""
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.http.aclose()


async def gym_save(
    engine: Any,
    run_id: str,
    snapshot_id: str,
    gyms: Iterable[GymsimInstance],
    snapshot_dir: Path,
    player: Player,
    *,
    anchor_step: int = 0,
) -> dict[str, Any]:
    """A Gym save through the control client whose capture publishes the snapshot (cut = the live
    ledger while Gym is parked). Candidates are the run's live turn-level attempts per instance."""
    gyms = list(gyms)
    rows = await fetch(
        engine,
        "SELECT a.gym_instance_id, a.rollout_id, a.gym_attempt FROM attempts a JOIN prompt_groups g ON g.run_id = a.run_id "
        "AND g.group_id = a.group_id WHERE a.run_id = :r AND a.is_current AND g.restore_level = 'turn' "
        "AND (a.status = 'dispatched' OR (a.status = 'reserved' AND a.gym_attempt > 0)) AND a.gym_instance_id IS NOT NULL",
        r=run_id,
    )
    candidates: dict[str, list[Episode]] = {g.instance_id: [] for g in gyms}
    for r in rows:
        candidates[r["gym_instance_id"]].append(Episode(r["rollout_id"], r["gym_attempt"]))
    published: dict[str, Any] = {}

    async def capture(manifest: dict[str, Any]) -> None:
        await publish_snapshot(engine, run_id, snapshot_id, anchor_step, manifest=manifest, snapshot_dir=str(snapshot_dir))
        published["manifest"] = manifest

    async with GymControlClient(control_timeout_s=10, prepare_timeout_s=20) as gc:
        topo = await gc.discover_all([InstanceSpec(g.instance_id, g.token, g.servers) for g in gyms])
        save = SequencedGymSave(
            gc,
            topo,
            snapshot_dir=str(snapshot_dir),
            candidates=candidates,
            drain_hook=player.drain,
            capture_hook=capture,
            drain_timeout_s=60,
            snapshot_id=snapshot_id,
        )
        await save.run()
    return published["manifest"]


async def wait_dispatched_at_boundary(gyms: Iterable[GymsimInstance], min_turn: int = 1, timeout: float = 20) -> None:
    """Wait until every episode running on these instances has completed ``min_turn`` turns."""
    async with asyncio.timeout(timeout):
        while True:
            ok = True
            for g in gyms:
                eps = (await asyncio.to_thread(g.state, "workplace_agent"))["episodes"]
                if not eps or any(e["turn"] < min_turn for e in eps.values()):
                    ok = False
            if ok:
                return
            await asyncio.sleep(0.02)
