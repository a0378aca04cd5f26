"""NeMo RL ledger import and export (docs/ledger.md#importing-a-nemo-rl-ledger), over the API and the CLI."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .ledger_helpers import group_body, new_run
from .test_restore_support import fetch


def _attempt(i: int, rid: str, status: str, **kw: Any) -> dict[str, Any]:
    return {
        "generation_index": i,
        "rollout_id": rid,
        "status": status,
        "row_attempts_used": kw.pop("row_attempts_used", 0),
        "reward": kw.pop("reward", None),
        "mask_sample": kw.pop("mask_sample", False),
        "staging_keys": kw.pop("staging_keys", []),
        "gym_instance_id": kw.pop("gym_instance_id", None),
        "gym_attempt": kw.pop("gym_attempt", 0),
    }


def _group(gid: str, level: str, status: str, attempts: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {
        "group_id": gid,
        "prompt_ref": {"sample_id": kw.pop("sample_id", gid), "task_name": "math"},
        "task_digest": f"sha256:{gid}",
        "task_source": kw.pop("task_source", None),
        "agent_name": kw.pop("agent_name", None),
        "restore_level": level,
        "expected_generations": len(attempts),
        "group_attempt": kw.pop("group_attempt", 0),
        "data_attempts_used": kw.pop("data_attempts_used", 0),
        "status": status,
        "target_step": kw.pop("target_step", 5),
        "weight_version": kw.pop("weight_version", "w5"),
        "attempts": attempts,
    }


def doc_v4() -> dict[str, Any]:
    return {
        "schema_version": 4,
        "groups": [
            _group(
                "gturn",
                "turn",
                "generating",
                [
                    _attempt(0, "gturn-r0", "sealed", reward=1.0, staging_keys=["tq/gturn-r0/0"]),
                    _attempt(1, "gturn-r1", "dispatched", gym_instance_id="math/replica-0"),
                    _attempt(2, "gturn-r2", "reserved", gym_instance_id="math/replica-0", gym_attempt=1),
                ],
            ),
            _group("gsib", "sibling", "generating", [_attempt(0, "gsib-r0", "sealed", reward=0.5), _attempt(1, "gsib-r1", "dispatched", row_attempts_used=1)]),
            _group("gpg", "prompt_group", "generating", [_attempt(0, "gpg-r0", "returned", reward=0.0), _attempt(1, "gpg-r1", "dispatched")], group_attempt=1, data_attempts_used=1),
            _group("gdone", "sibling", "finalized", [_attempt(0, "gdone-r0", "sealed", reward=1.0)], target_step=7),
        ],
        "batch_shortfall": 3,
        "sampler_stamps_target_steps": [5, 6],
    }


def as_old(doc: dict[str, Any], version: int) -> dict[str, Any]:
    """The same ledger as NeMo RL wrote it before turn-level recovery (no turn level)."""
    old = copy.deepcopy(doc)
    old["schema_version"] = version
    old["groups"] = [g for g in old["groups"] if g["restore_level"] != "turn"]
    for g in old["groups"]:
        g["recovery_granularity"] = g.pop("restore_level")
        for a in g["attempts"]:
            del a["gym_instance_id"], a["gym_attempt"]
    return old


EXPECTED_V4 = {"reused": 2, "continued": 0, "restarted": 2, "gym_restarted": 0, "rerun": 3, "dispatch": 0}


def _plan_shape(plan: dict[str, Any]) -> tuple[Any, ...]:
    """What must survive export -> import: counts, and each row's disposition and kept identity."""
    rows = sorted(
        (r["group_id"], r["generation_index"], r["disposition"], r["rollout_id"] if r["replaces_rollout_id"] is None else r["replaces_rollout_id"], r["group_attempt"])
        for r in plan["rows"]
    )
    return plan["counts"], plan["total"], plan["cohort_reruns"], rows


async def test_import_schema_4_plan_and_export_round_trip(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    doc = doc_v4()
    created = await api.post("/ledger-import", {"snapshot_id": "imp1", "document": doc}, 201)
    assert created["created"] is True and created["source_schema_version"] == 4 and created["groups"] == 4 and created["siblings"] == 8
    assert created["anchor_step"] == 7  # newest target step the document names
    snap = (await fetch(app.state.engine, "SELECT outcome, phase, gym_manifest FROM snapshots WHERE run_id = :r", r=api.run_id))[0]
    assert snap == {"outcome": "published", "phase": "published", "gym_manifest": None}
    plan = await api.get("/restore-plan?snapshot_id=imp1&include_reused=true")
    assert plan["counts"] == EXPECTED_V4 and plan["total"] == 7 and plan["cohort_reruns"] == ["gpg"]
    assert plan["gym_state"]["installs"] is False
    exported = await api.get("/snapshots/imp1/ledger-export")
    assert exported == {**doc, "groups": sorted(doc["groups"], key=lambda g: g["group_id"])}  # groups in id order
    # Export -> import gives the same plan.
    await api.post("/ledger-import", {"snapshot_id": "imp2", "document": exported}, 201)
    again = await api.get("/restore-plan?snapshot_id=imp2&include_reused=true")
    assert _plan_shape(again) == _plan_shape(plan)
    # Identical repeat: the stored snapshot; another document under the same id: a conflict.
    repeat = await api.post("/ledger-import", {"snapshot_id": "imp1", "document": doc}, 201)
    assert repeat["created"] is False and repeat["snapshot_id"] == "imp1"
    other = copy.deepcopy(doc)
    other["batch_shortfall"] = 4
    assert (await api.post("/ledger-import", {"snapshot_id": "imp1", "document": other}, 409))["code"] == "snapshot_exists"


@pytest.mark.parametrize("version", [2, 3])
async def test_import_old_schemas_rewritten_as_schema_4(client, admin, app, version: int) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    old = as_old(doc_v4(), version)
    created = await api.post("/ledger-import", {"snapshot_id": "old", "document": old, "anchor_step": 5}, 201)
    assert created["source_schema_version"] == version and created["anchor_step"] == 5
    assert "recovery_granularity became restore_level" in created["notes"][0]
    exported = await api.get("/snapshots/old/ledger-export")
    assert exported["schema_version"] == 4
    assert [g["restore_level"] for g in exported["groups"]] == ["sibling", "prompt_group", "sibling"]
    assert all(a["gym_instance_id"] is None and a["gym_attempt"] == 0 for g in exported["groups"] for a in g["attempts"])
    plan = await api.get("/restore-plan?snapshot_id=old")
    assert plan["counts"] == {"reused": 1, "continued": 0, "restarted": 0, "gym_restarted": 0, "rerun": 3, "dispatch": 0}


def _mut(path: str, value: Any = None, *, delete: bool = False) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
        target: Any = doc
        for k in keys[:-1]:
            target = target[k]
        if delete:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value

    return apply


REFUSALS = [
    (4, _mut("schema_version", 1), "document.schema_version", "legacy_ledger_version"),
    (4, _mut("schema_version", "4"), "document.schema_version", "legacy_ledger_version"),
    (4, _mut("schema_version", delete=True), "document.schema_version", "legacy_ledger_version"),
    (4, _mut("extra", 1), "document.extra", "legacy_ledger_invalid"),
    (4, _mut("batch_shortfall", delete=True), "document.batch_shortfall", "legacy_ledger_invalid"),
    (4, _mut("groups.0.colour", "red"), "document.groups[0].colour", "legacy_ledger_invalid"),
    (4, _mut("groups.0.attempts.1.colour", "red"), "document.groups[0].attempts[1].colour", "legacy_ledger_invalid"),
    (4, _mut("groups.0.recovery_granularity", "sibling"), "document.groups[0].recovery_granularity", "legacy_ledger_invalid"),
    (4, _mut("groups.0.attempts.1.gym_instance_id", delete=True), "document.groups[0].attempts[1].gym_instance_id", "legacy_ledger_invalid"),
    (4, _mut("groups.0.attempts.1.gym_attempt", delete=True), "document.groups[0].attempts[1].gym_attempt", "legacy_ledger_invalid"),
    (4, _mut("groups.1.attempts.1.gym_attempt", 2), "document.groups[1].attempts[1].gym_attempt", "legacy_ledger_invalid"),
    (4, _mut("groups.0.restore_level", "prefix"), "document.groups[0].restore_level", "legacy_ledger_invalid"),
    (4, _mut("groups.0.attempts.2.rollout_id", "gturn-r1"), "document.groups[0].attempts[2].rollout_id", "legacy_ledger_invalid"),
    (4, _mut("groups.0.attempts.2.rollout_id", "x-a3"), "document.groups[0].attempts[2].rollout_id", "legacy_ledger_invalid"),
    (4, _mut("groups.0.expected_generations", 4), "document.groups[0].attempts", "legacy_ledger_invalid"),
    (4, _mut("groups.0.attempts.1.status", "running"), "document.groups[0].attempts[1].status", "legacy_ledger_invalid"),
    (4, _mut("groups.0.attempts.0.reward", "high"), "document.groups[0].attempts[0].reward", "legacy_ledger_invalid"),
    (4, _mut("groups.1.attempts.0.status", "returned"), "document.groups[1].attempts[0].status", "legacy_ledger_invalid"),
    (3, _mut("groups.0.restore_level", "sibling"), "document.groups[0].restore_level", "legacy_ledger_invalid"),
    (3, _mut("groups.0.recovery_granularity", "turn"), "document.groups[0].recovery_granularity", "legacy_ledger_invalid"),
    (2, _mut("groups.0.attempts.0.gym_attempt", 1), "document.groups[0].attempts[0].gym_attempt", "legacy_ledger_invalid"),
    (2, _mut("groups.0.attempts.0.gym_instance_id", "math/replica-0"), "document.groups[0].attempts[0].gym_instance_id", "legacy_ledger_invalid"),
]


@pytest.mark.parametrize(("version", "mutate", "field", "code"), REFUSALS, ids=[f"v{v}-{f}" for v, _m, f, _c in REFUSALS])
async def test_refused_shapes_name_the_field_and_store_nothing(client, admin, app, version: int, mutate: Any, field: str, code: str) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    doc = doc_v4() if version == 4 else as_old(doc_v4(), version)
    mutate(doc)
    body = await api.post("/ledger-import", {"snapshot_id": "bad", "document": doc}, 422)
    assert body["code"] == code, body
    assert field in {e["field"] for e in body["errors"]}, body["errors"]
    assert (await fetch(app.state.engine, "SELECT count(*) AS n FROM snapshots WHERE run_id = :r", r=api.run_id))[0]["n"] == 0


async def test_import_request_validation(client, admin) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    for body, field in (
        ({"document": doc_v4()}, "snapshot_id"),
        ({"snapshot_id": "a b", "document": doc_v4()}, "snapshot_id"),
        ({"snapshot_id": "x", "document": [1]}, "document"),
        ({"snapshot_id": "x", "document": doc_v4(), "anchor_step": -1}, "anchor_step"),
        ({"snapshot_id": "x", "document": doc_v4(), "other": 1}, "other"),
    ):
        r = await client.post(f"/v1/runs/{api.run_id}/ledger-import", json=body, headers=api.h)
        assert r.status_code == 422 and field in {e["field"] for e in r.json()["errors"]}, (body, r.text)
    r = await client.get(f"/v1/runs/{api.run_id}/snapshots/nope/ledger-export", headers=api.h)
    assert r.status_code == 404 and r.json()["code"] == "snapshot_not_found"


async def test_restore_from_an_imported_ledger_into_an_empty_run(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="turn")
    await api.post("/ledger-import", {"snapshot_id": "imp", "document": doc_v4()}, 201)
    ans = await api.post("/restores", {"restore_id": "r1"})
    assert ans["counts"] == EXPECTED_V4 and ans["gym"]["reason"] == "the snapshot holds no Gym state"
    g = await api.group("gturn")
    cur = {s["generation_index"]: [a for a in s["attempts"] if a["is_current"]][0] for s in g["siblings"]}
    assert cur[0]["rollout_id"] == "gturn-r0" and cur[0]["status"] == "sealed"
    assert cur[1]["status"] == "reserved" and cur[1]["rollout_id"] != "gturn-r1"
    # What the ledger recorded as running on math/replica-0 is retired there (nothing is restored);
    # rows dispatched without an instance would be retired on every registered one (none here).
    retires = await fetch(app.state.engine, "SELECT rollout_id, gym_attempt, instance_id FROM outbox_items WHERE run_id = :r ORDER BY rollout_id", r=api.run_id)
    assert retires == [
        {"rollout_id": "gturn-r1", "gym_attempt": 0, "instance_id": "math/replica-0"},
        {"rollout_id": "gturn-r2", "gym_attempt": 1, "instance_id": "math/replica-0"},
    ]
    # The restored groups behave like admitted ones: re-admitting is an identical repeat.
    again = await api.admit({**group_body("gturn", 3), "prompt_ref": {"sample_id": "gturn", "task_name": "math"}, "target_step": 5, "weight_version": "w5"})
    assert again["groups"][0]["admitted"] is False


# --------------------------------------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    from checkpoint_coordinator.restore.import_cli import main

    return main(argv)


async def test_cli_imports_straight_into_the_database(client, admin, app, database_url, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    f = tmp_path / "ledger.json"
    f.write_text(json.dumps(doc_v4()))
    assert await asyncio.to_thread(_cli, [str(f), "--run", api.run_id, "--snapshot-id", "cli1", "--database-url", database_url]) == 0
    out = capsys.readouterr()
    assert "imported: snapshot cli1" in out.out and "4 group(s), 8 sibling(s)" in out.out
    assert (await api.get("/restore-plan?snapshot_id=cli1"))["counts"] == EXPECTED_V4
    # Default snapshot id from the digest; a repeat is reported, not an error.
    assert await asyncio.to_thread(_cli, [str(f), "--run", api.run_id, "--database-url", database_url]) == 0
    assert await asyncio.to_thread(_cli, [str(f), "--run", api.run_id, "--database-url", database_url]) == 0
    assert "already imported" in capsys.readouterr().out
    # A refused document: exit 1, the field named, no traceback.
    bad = doc_v4()
    bad["groups"][0]["attempts"][0]["colour"] = "red"
    f.write_text(json.dumps(bad))
    assert await asyncio.to_thread(_cli, [str(f), "--run", api.run_id, "--database-url", database_url]) == 1
    err = capsys.readouterr().err
    assert "groups[0].attempts[0].colour: unknown field" in err and "Traceback" not in err
    f.write_text("{not json")
    assert await asyncio.to_thread(_cli, [str(f), "--run", api.run_id, "--database-url", database_url]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    # Usage problems: exit 2 with a message.
    assert await asyncio.to_thread(_cli, [str(tmp_path / "missing.json"), "--run", api.run_id, "--database-url", database_url]) == 2
    assert "cannot read" in capsys.readouterr().err
    f.write_text(json.dumps(doc_v4()))
    assert await asyncio.to_thread(_cli, [str(f), "--run", "no-such-run", "--database-url", database_url]) == 1
    assert "run_not_found" in capsys.readouterr().err
    assert await asyncio.to_thread(_cli, [str(f), "--run", api.run_id, "--token", "t"]) == 2
    assert "--token needs --url" in capsys.readouterr().err


def test_cli_help_and_missing_database(monkeypatch, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from checkpoint_coordinator.cli import main as ckpt_main

    with pytest.raises(SystemExit) as e:
        _cli(["--help"])
    assert e.value.code == 0 and "NeMo RL rollout-recovery ledger" in capsys.readouterr().out
    monkeypatch.delenv("CKPTC_DATABASE_URL", raising=False)
    f = tmp_path / "l.json"
    f.write_text(json.dumps(doc_v4()))
    assert ckpt_main(["import-ledger", str(f), "--run", "r"]) == 2
    assert "CKPTC_DATABASE_URL" in capsys.readouterr().err
    assert _cli([str(f), "--run", "r", "--database-url", "mysql://x/y"]) == 2
    assert "invalid database URL" in capsys.readouterr().err


@pytest.fixture
def served(settings, database_url) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """The coordinator on a real port, for the CLI's HTTP path."""
    import socket

    import uvicorn

    from checkpoint_coordinator.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings, database_url=database_url), log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "coordinator did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_cli_imports_through_a_running_coordinator(served, admin, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import httpx

    r = httpx.post(f"{served}/v1/runs", json={"run_id": "run-cli", "checkpoint_root": "/tmp/x", "recovery": {}}, headers=admin)
    token = r.json()["run_token"]
    f = tmp_path / "ledger.json"
    f.write_text(json.dumps(as_old(doc_v4(), 2)))
    assert _cli([str(f), "--run", "run-cli", "--snapshot-id", "h1", "--url", served, "--token", token]) == 0
    assert "imported: snapshot h1" in capsys.readouterr().out
    plan = httpx.get(f"{served}/v1/runs/run-cli/restore-plan?snapshot_id=h1", headers={"Authorization": f"Bearer {token}"}).json()
    assert plan["counts"]["rerun"] == 3
    bad = as_old(doc_v4(), 3)
    bad["groups"][0]["restore_level"] = "sibling"
    f.write_text(json.dumps(bad))
    assert _cli([str(f), "--run", "run-cli", "--url", served, "--token", token]) == 1
    assert "groups[0].restore_level" in capsys.readouterr().err
    assert _cli([str(f), "--run", "run-cli", "--url", served, "--token", "wrong"]) == 2
    assert "refused the token" in capsys.readouterr().err
    assert _cli([str(f), "--run", "run-cli", "--url", "http://127.0.0.1:9", "--token", token]) == 2
    assert "cannot reach the coordinator" in capsys.readouterr().err
