"""Real answers against the served OpenAPI document: the schemas describe what the routes send.

Most answers are documented by a model that is not run on them (the batch reports, the ledger's
views, restores: ``api/common.py``, ``as_built``), so nothing but a check like this one ties the
document to the JSON. Two scenarios drive nearly every operation with the app wrapped in
``Conformance``: every answer, success or problem, must validate against the schema declared for
its operation and status (``additionalProperties: false``: no undocumented member either), and
each scenario must have reached the operations it names with a success.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ckpt_client import (
    AsyncCoordinatorClient,
    Conflict,
    GroupSpec,
    GymInstance,
    SealedRow,
)

from tests.conftest import ADMIN_TOKEN
from tests.gym_placeholders import register_placeholders
from tests.integration.test_ledger_import import doc_v4

from .openapi_check import Conformance, operations, served_openapi

pytestmark = pytest.mark.timeout(180)

ALL_OPERATIONS = set(operations(served_openapi()))
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
INSTANCE = "math/replica-0"


class Run:
    """Requests of one run through a checked client, each expected to answer ``expect``."""

    def __init__(self, client: httpx.AsyncClient, run_id: str, token: str) -> None:
        self.c, self.run_id, self.h = client, run_id, {"Authorization": f"Bearer {token}"}

    async def call(self, method: str, path: str, body: Any = None, expect: int = 200) -> Any:
        r = await self.c.request(method, f"/v1/runs/{self.run_id}{path}", json=body, headers=self.h)
        assert r.status_code == expect, (method, path, r.status_code, r.text[:2000])
        return r.json() if r.content else None

    async def get(self, path: str, expect: int = 200) -> Any:
        return await self.call("GET", path, expect=expect)

    async def post(self, path: str, body: Any = None, expect: int = 200) -> Any:
        return await self.call("POST", path, body if body is not None else {}, expect)


def _group(gid: str, n: int) -> dict[str, Any]:
    return {"group_id": gid, "prompt_ref": {"sample_id": gid, "task_name": "math"}, "task_digest": f"sha256:{gid}",
            "expected_generations": n, "target_step": 3, "weight_version": "w3"}


def _seal(row: dict[str, Any]) -> dict[str, Any]:
    return {"rollout_id": row["rollout_id"], "receipt": {"rollout_id": row["capture_key"]}, "staging_keys": [f"tq/{row['capture_key']}/0"], "reward": 1.0}


# ---------------------------------------------------------------------------- the ledger alone

LEDGER_OPERATIONS = ALL_OPERATIONS - {
    # With a Gym deployment: the second scenario.
    "register_gym_instances", "request_snapshot", "snapshot_barrier_held", "snapshot_data_plane_captured", "abort_snapshot",
    "get_snapshot_gym_manifest",
}


@pytest.fixture
async def checked(app: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Conformance]]:
    conformance = Conformance(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=conformance), base_url="http://coordinator") as c:
        yield c, conformance


async def _open_run(c: httpx.AsyncClient, run_id: str, root: Path) -> Run:
    assert (await c.get("/healthz")).status_code == 200
    assert (await c.get("/readyz")).status_code == 200
    body = {"run_id": run_id, "checkpoint_root": str(root), "recovery": {"target_level": "sibling"}}
    created = await c.post("/v1/runs", json=body, headers=ADMIN)
    assert created.status_code == 201, created.text
    assert (await c.get("/v1/runs?limit=1", headers=ADMIN)).status_code == 200
    rotated = await c.post(f"/v1/runs/{run_id}/token", headers=ADMIN)
    assert rotated.status_code == 200, rotated.text
    run = Run(c, run_id, rotated.json()["run_token"])
    await run.get("")
    await run.get("/gym-settings")
    await run.get("/does-not-exist", expect=404)
    return run


async def _rollouts(run: Run, app: Any) -> None:
    await register_placeholders(app.state.engine, run.run_id, INSTANCE, "math/replica-1")
    await run.get("/gym-instances")
    await run.call("DELETE", "/gym-instances/math/replica-1", expect=204)
    admitted = await run.post("/groups/admit", {"groups": [_group("g1", 2), _group("g2", 2), _group("g3", 1)]})
    rows = {g["group_id"]: g["rows"] for g in admitted["groups"]}
    await run.post("/attempts/dispatch", {"dispatch_id": "d0", "instance_id": "nowhere/0", "rollout_ids": [rows["g1"][0]["rollout_id"]]}, 404)
    first = [r["rollout_id"] for r in rows["g1"] + rows["g2"]]
    await run.post("/attempts/dispatch", {"dispatch_id": "d1", "instance_id": INSTANCE, "rollout_ids": first})
    await run.post("/attempts/dispatch", {"dispatch_id": "d2", "instance_id": INSTANCE, "rollout_ids": [rows["g3"][0]["rollout_id"]]})
    await _effects(run, rows["g1"][0]["rollout_id"])
    sealed = await run.post("/attempts/sealed", {"rows": [_seal(r) for r in rows["g1"]]})
    assert sealed["ready_groups"] == ["g1"]
    await run.post("/attempts/sealed", {"rows": [_seal(rows["g3"][0]) | {"receipt": {"rollout_id": "other"}}]}, 409)
    await run.post("/groups/finalize", {"group_ids": ["g1"]})
    await run.post("/groups/finalize", {"group_ids": ["nope"]}, 409)
    await run.post("/attempts/failed", {"rows": [{"rollout_id": rows["g2"][0]["rollout_id"], "failure_class": "transport"}]})
    await run.post("/attempts/refused", {"rollout_ids": [rows["g3"][0]["rollout_id"]]})
    ended = await run.post("/dispatches/d1/ended", {"returned": [r["rollout_id"] for r in rows["g1"]]})
    assert ended["missing"] == [rows["g2"][1]["rollout_id"]]
    await run.post("/groups/abandon", {"group_ids": ["g2"]})
    await run.get("/counts")
    await run.get("/groups/g2")
    await run.get("/groups/nope", 404)
    await run.post("/attempts/pending", {"rollout_ids": first})
    outbox = await run.get("/outbox?limit=1")
    assert outbox["items"], "the abandoned group's attempts owe Gym retires"
    await run.post("/train-steps", {"step": 1, "checkpoint_ref": "ckpt/1"})
    await run.get("/train-steps?include_retired=true")


async def _effects(run: Run, rollout_id: str) -> None:
    """Every answer of the effect journal (docs/effects.md)."""
    call = {"rollout_id": rollout_id, "gym_attempt": 0, "seq": 0, "effect": "send_mail", "digest": "sha256:a"}
    first = await run.post("/effects/begin", call)
    assert first["answer"] == "proceed"
    assert (await run.post("/effects/begin", call))["answer"] == "unknown"
    await run.post(f"/effects/{first['effect_id']}/complete", {"result": {"message_id": "m1"}})
    assert (await run.post("/effects/begin", call))["answer"] == "done"
    other = await run.post("/effects/begin", call | {"digest": "sha256:b"})
    assert other["answer"] == "diverged" and other["orphaned"]["effect_id"] == first["effect_id"]
    await run.post(f"/effects/{other['effect_id']}/abandon", {})
    await run.post("/effects/begin", call | {"gym_attempt": 3}, 409)
    await run.post("/effects/999999/complete", {"result": None}, 404)
    page = await run.get("/effects?orphaned=true&limit=1")
    assert page["orphans_total"] == 1 and [e["orphan_reason"] for e in page["effects"]] == ["diverged"]
    await run.get("/effects")


async def _imported(run: Run) -> None:
    await run.get("/snapshots")
    await run.post("/ledger-import", {"snapshot_id": "imp1", "document": doc_v4()}, 201)
    await run.get("/snapshots/imp1")
    await run.get("/snapshots/imp1?manifest=true")
    await run.get("/snapshots?limit=1")
    await run.get("/snapshots/imp1/staging-keys")
    await run.get("/snapshots/imp1/ledger-export")
    await run.get("/snapshots/imp1/gym-manifest", 404)
    await run.get("/restore-plan?snapshot_id=imp1&include_reused=true")
    await run.get("/restore-plan?snapshot_id=imp1&with_gym_state=false&limit=1")
    answer = await run.post("/restores", {"restore_id": "r1", "snapshot_id": "imp1", "with_gym_state": False})
    assert answer["state"] == "applied"
    assert (await run.post("/restores", {"restore_id": "r1", "snapshot_id": "imp1", "with_gym_state": False})) == answer
    await run.get("/restores/r1")
    await run.get("/restores/r1/rows?limit=1")
    await run.get("/restores/r9", 404)
    accounting = await run.get("/accounting")
    assert accounting["prompts"]["conserved"] and [r["restore_id"] for r in accounting["restores"]] == ["r1"]
    await run.post("/reopen")
    await run.post("/close")


async def test_the_ledgers_answers_match_their_schemas(checked: tuple[httpx.AsyncClient, Conformance], app: Any, tmp_path: Path) -> None:
    client, conformance = checked
    run = await _open_run(client, "run-schemas", tmp_path / "root")
    await _rollouts(run, app)
    await _imported(run)
    assert not conformance.violations, "\n".join(conformance.violations)
    answered = {op for op, status in conformance.seen if status < 300}
    assert answered >= LEDGER_OPERATIONS, sorted(LEDGER_OPERATIONS - answered)


# ------------------------------------------------------------------------- with Gym: snapshots


@pytest.fixture
def gym() -> Iterator[Any]:
    from gymsim.testing import GymsimInstance, default_instance_config

    g = GymsimInstance.start(default_instance_config(INSTANCE, token="tok-gym", turn_seconds=0.05))
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture
def live(settings: Any, database_url: str, tmp_path: Path) -> Iterator[tuple[str, Conformance]]:
    from checkpoint_coordinator.app import create_app

    from ..client.conftest import LiveServer

    wrapped: list[Conformance] = []

    def wrap(app: Any) -> Conformance:
        wrapped.append(Conformance(app))
        return wrapped[-1]

    server = LiveServer(lambda: create_app(settings, database_url=database_url), tmp_path / "checkpoints", database_url=database_url, settings=settings)
    server.start(wrap)
    try:
        yield server.url, wrapped[0]
    finally:
        server.stop()


def _capture(directory: Path) -> Any:
    def capture(staging_keys: list[str]) -> dict[str, str]:
        directory.mkdir(parents=True, exist_ok=True)
        payload = json.dumps(sorted(staging_keys)).encode()
        (directory / "data_plane.json").write_bytes(payload)
        return {"path": str(directory / "data_plane.json"), "digest": "sha256:" + hashlib.sha256(payload).hexdigest()}

    return capture


async def _until_ended(run: AsyncCoordinatorClient, snapshot_id: str) -> None:
    for _ in range(600):
        if (await run.get_snapshot(snapshot_id)).terminal:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"snapshot {snapshot_id} did not end")


async def _snapshots(url: str, run: AsyncCoordinatorClient, token: str, gym: Any, tmp_path: Path) -> None:
    await run.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
    admitted = await run.admit_groups([GroupSpec(g, sample_id=g, task_name="math", task_digest=f"sha256:{g}", expected_generations=2) for g in ("g0", "g1")])
    await run.dispatch([r.rollout_id for r in admitted.rows], dispatch_id="d-1", instance_id=INSTANCE)
    await run.report_sealed([SealedRow(r.rollout_id, {"rollout_id": r.capture_key}, [f"tq/{r.capture_key}/0"], 1.0) for r in admitted.groups[0].rows])
    await run.snapshot(0, _capture(tmp_path / "s1"), snapshot_id="s1", poll_interval=0.05, timeout=60)
    await run.request_snapshot(0, snapshot_id="s1")  # a repeat: 200, as stored
    with pytest.raises(Conflict):
        await run.snapshot_barrier("s1", delta=True)  # published: not awaiting the barrier
    await run.snapshot_staging_keys("s1")
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        for path in ("/snapshots/s1?manifest=true", "/snapshots/s1/gym-manifest", "/snapshots/s1/ledger-export"):
            assert (await c.get(f"/v1/runs/{run.run_id}{path}")).status_code == 200, path
    await run.request_snapshot(0, snapshot_id="s2")
    await run.abort_snapshot("s2", "cancelled", wait=False)
    await _until_ended(run, "s2")
    await run.stop_snapshot(0, _capture(tmp_path / "s3"), snapshot_id="s3", deadline_s=60)
    await run.reopen()
    await run.restore("r-1", snapshot_id="s1", with_gym_state=False, timeout=60)


async def test_the_snapshot_answers_match_their_schemas(live: tuple[str, Conformance], gym: Any, tmp_path: Path) -> None:
    url, conformance = live
    async with AsyncCoordinatorClient(url, ADMIN_TOKEN) as admin:
        created = await admin.create_run("run-snap", str(tmp_path / "root"), {"target_level": "sibling"})
    token = created.run_token or ""
    async with AsyncCoordinatorClient(url, token, run_id="run-snap") as run:
        await _snapshots(url, run, token, gym, tmp_path)
    assert not conformance.violations, "\n".join(conformance.violations)
    answered = {op for op, status in conformance.seen if status < 300}
    wanted = (ALL_OPERATIONS - LEDGER_OPERATIONS) | {"get_snapshot", "snapshot_staging_keys", "reopen_run", "create_restore"}
    assert answered >= wanted, sorted(wanted - answered)
    assert ("request_snapshot", 200) in conformance.seen and ("request_snapshot", 202) in conformance.seen
