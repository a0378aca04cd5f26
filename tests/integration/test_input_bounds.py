"""Inputs that used to reach PostgreSQL and end in a 500: each is now a typed 422 naming the field,
and nothing is written. Found by a random fuzz of the API (tests/fuzz has the property test)."""

from __future__ import annotations

from typing import Any

import pytest

from .ledger_helpers import group_body, new_run

BIG = 2**63


async def _refused(api: Any, method: str, path: str, field: str, **kwargs: Any) -> dict[str, Any]:
    r = await api.c.request(method, f"/v1/runs/{api.run_id}{path}", headers=api.h, **kwargs)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == "invalid_request"
    assert field in {e["field"] for e in body["errors"]}, body
    return body


async def test_step_beyond_bigint_is_refused(client, admin) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    await _refused(api, "POST", "/train-steps", "step", json={"step": BIG})
    await _refused(api, "POST", "/snapshots", "anchor_step", json={"snapshot_id": "s1", "anchor_step": BIG})
    await _refused(api, "GET", "/restore-plan", "step", params={"step": "1e20"})
    await _refused(api, "POST", "/groups/admit", "groups.0.target_step", json={"groups": [{**group_body("g1", 2), "target_step": BIG}]})
    # The largest value that fits is taken.
    r = await client.post(f"/v1/runs/{api.run_id}/train-steps", json={"step": BIG - 1}, headers=api.h)
    assert r.status_code == 200, r.text
    assert (await api.get("/snapshots"))["snapshots"] == []


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/train-steps", {"step": 1, "checkpoint_ref": "ckpt\u0000/1"}, "checkpoint_ref"),
        ("/groups/admit", {"groups": [{**group_body("g1", 2), "task_digest": "d\u0000"}]}, "groups.0.task_digest"),
        ("/groups/admit", {"groups": [{**group_body("g1", 2), "prompt_ref": {"sample_id": "s\u0000", "task_name": "t"}}]}, "groups.0.prompt_ref.sample_id"),
    ],
)
async def test_nul_characters_are_refused_naming_the_field(client, admin, path: str, body: dict[str, Any], field: str) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    await _refused(api, "POST", path, field, json=body)
    counts = await api.get("/counts")
    assert not any(v for k, v in counts.items() if isinstance(v, int)), counts


async def test_a_body_that_is_not_utf8_is_a_422(client, admin) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    r = await client.post(f"/v1/runs/{api.run_id}/attempts/dispatch", content=b"\xff\xfe{", headers={**api.h, "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
