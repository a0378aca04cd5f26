"""Runs API: admin creates, the run token reaches only its own run, bad input is a 4xx problem."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import create_engine, text

from checkpoint_coordinator.ledger import db

ROOT = "/tmp/ckptc-runs"


def _body(run_id: str = "run-1", **recovery: Any) -> dict[str, Any]:
    return {"run_id": run_id, "checkpoint_root": ROOT, "recovery": {"target_level": "sibling", **recovery}}


async def _create(client, admin, run_id="run-1", **recovery):  # type: ignore[no-untyped-def]
    r = await client.post("/v1/runs", json=_body(run_id, **recovery), headers=admin)
    assert r.status_code == 201, r.text
    return r.json()


async def test_create_returns_token_once_and_stores_only_its_hash(client, admin, database_url) -> None:  # type: ignore[no-untyped-def]
    run = await _create(client, admin)
    token = run["run_token"]
    assert token.startswith("ckptc_run_") and run["state"] == "open"
    assert run["recovery"]["target_level"] == "sibling" and run["recovery"]["max_row_attempts"] == 3
    got = await client.get("/v1/runs/run-1", headers={"Authorization": f"Bearer {token}"})
    assert got.status_code == 200 and "run_token" not in got.json()
    eng = create_engine(db.sqlalchemy_url(database_url))
    with eng.connect() as c:
        stored = c.execute(text("SELECT token_hash FROM runs")).scalar()
        dump = c.execute(text("SELECT row_to_json(runs)::text FROM runs")).scalar()
    eng.dispose()
    assert token not in dump and stored != token and len(stored) == 64
    again = await client.post("/v1/runs", json=_body(), headers=admin)
    assert again.status_code == 409 and again.json()["code"] == "run_exists"
    assert token not in again.text


async def test_run_token_reaches_only_its_run(client, admin) -> None:  # type: ignore[no-untyped-def]
    a = await _create(client, admin, "run-a")
    await _create(client, admin, "run-b")
    ha = {"Authorization": f"Bearer {a['run_token']}"}
    assert (await client.get("/v1/runs/run-a", headers=ha)).status_code == 200
    other = await client.get("/v1/runs/run-b", headers=ha)
    missing = await client.get("/v1/runs/run-zzz", headers=ha)
    # Same answer for another run and a run that does not exist: no existence leak.
    assert other.status_code == missing.status_code == 403
    assert other.json()["detail"] == missing.json()["detail"]
    assert (await client.get("/v1/runs", headers=ha)).status_code == 403  # listing is admin-only
    assert (await client.post("/v1/runs", json=_body("run-c"), headers=ha)).status_code == 403


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer wrong"}])
async def test_missing_or_wrong_token(client, admin, headers) -> None:  # type: ignore[no-untyped-def]
    await _create(client, admin)
    r = await client.get("/v1/runs/run-1", headers=headers)
    assert r.status_code in (401, 403)
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] in ("unauthorized", "forbidden")


async def test_list_and_close(client, admin) -> None:  # type: ignore[no-untyped-def]
    for i in range(3):
        await _create(client, admin, f"run-{i}")
    page = (await client.get("/v1/runs?limit=2", headers=admin)).json()
    assert [r["run_id"] for r in page["runs"]] == ["run-0", "run-1"] and page["next_after"] == "run-1"
    rest = (await client.get("/v1/runs?limit=2&after=run-1", headers=admin)).json()
    assert [r["run_id"] for r in rest["runs"]] == ["run-2"] and rest["next_after"] is None
    closed = await client.post("/v1/runs/run-1/close", headers=admin)
    assert closed.status_code == 200 and closed.json()["state"] == "closed"
    assert (await client.post("/v1/runs/run-1/close", headers=admin)).json()["state"] == "closed"  # idempotent
    open_only = (await client.get("/v1/runs?state=open", headers=admin)).json()
    assert [r["run_id"] for r in open_only["runs"]] == ["run-0", "run-2"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"run_id": "bad id!", "checkpoint_root": ROOT}, "run_id"),
        ({"run_id": "-starts-with-dash", "checkpoint_root": ROOT}, "run_id"),
        ({"run_id": "x" * 200, "checkpoint_root": ROOT}, "run_id"),
        ({"run_id": 12, "checkpoint_root": ROOT}, "run_id"),
        ({"run_id": "r", "checkpoint_root": "relative/path"}, "checkpoint_root"),
        ({"run_id": "r", "checkpoint_root": ROOT, "surprise": 1}, "surprise"),
        ({"run_id": "r", "checkpoint_root": ROOT, "recovery": {"target_level": "bogus"}}, "recovery.target_level"),
        ({"run_id": "r", "checkpoint_root": ROOT, "recovery": {"target_level": "prefix"}}, "recovery.target_level"),
        ({"run_id": "r", "checkpoint_root": ROOT, "recovery": {"default_granularity": "sibling"}}, "recovery.default_granularity"),
        ({"run_id": "r", "checkpoint_root": ROOT, "recovery": {"contol_timeout_s": 5}}, "recovery.contol_timeout_s"),
        ({"run_id": "r", "checkpoint_root": ROOT, "recovery": {"control_timeout_s": "soon"}}, "recovery.control_timeout_s"),
        ({"run_id": "r", "checkpoint_root": ROOT, "recovery": {"max_row_attempts": 0}}, "recovery.max_row_attempts"),
        (
            {"run_id": "r", "checkpoint_root": ROOT, "recovery": {"target_level": "sibling", "agent_target_level_overrides": {"a": "turn"}}},
            "recovery.agent_target_level_overrides",
        ),
        ({"run_id": "r", "checkpoint_root": ROOT, "recovery": {"stall_timeout_s": 10}}, "recovery.stall_timeout_s"),
        (
            {"run_id": "r", "checkpoint_root": ROOT, "recovery": {"target_level": "sibling", "allow_restart_only_gym_servers": True}},
            "recovery.allow_restart_only_gym_servers",
        ),
    ],
)
async def test_bad_input_is_a_4xx_problem_naming_the_field(client, admin, body, field) -> None:  # type: ignore[no-untyped-def]
    r = await client.post("/v1/runs", json=body, headers=admin)
    assert 400 <= r.status_code < 500, r.text
    p = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    fields = [e["field"] for e in p.get("errors", [])]
    assert any(f == field or f.startswith(field + ".") for f in fields), (field, p)


async def test_removed_key_names_its_replacement(client, admin) -> None:  # type: ignore[no-untyped-def]
    r = await client.post("/v1/runs", json=_body(task_granularity_overrides={}), headers=admin)
    assert r.status_code == 422 and "target_level_overrides" in r.text


async def test_short_stall_timeout_states_the_minimum(client, admin) -> None:  # type: ignore[no-untyped-def]
    r = await client.post("/v1/runs", json=_body(stall_timeout_s=1), headers=admin)
    assert r.status_code == 422
    assert any(ch.isdigit() for ch in r.json()["detail"])


async def test_malformed_json_and_oversize_bodies(client, admin, settings) -> None:  # type: ignore[no-untyped-def]
    r = await client.post("/v1/runs", content=b"{not json", headers={**admin, "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"
    big = b'{"run_id": "r", "checkpoint_root": "/x", "pad": "' + b"x" * (settings.max_body_bytes + 10) + b'"}'
    r = await client.post("/v1/runs", content=big, headers={**admin, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"


async def test_bad_path_id_is_422_not_500(client, admin) -> None:  # type: ignore[no-untyped-def]
    r = await client.get("/v1/runs/bad%20id", headers=admin)
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"
