"""One run's token (or none) cannot probe or break the coordinator: the small findings of the
review, each as a user meets it (docs/configuration.md#limits)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from checkpoint_coordinator.config import Settings
from tests.conftest import ADMIN_TOKEN

from .ledger_helpers import group_body, new_run

pytestmark = pytest.mark.timeout(60)


async def test_answers_are_never_cached_and_a_trailing_slash_is_no_redirect(client, admin) -> None:  # type: ignore[no-untyped-def]
    r = await client.post("/v1/runs", json={"run_id": "run-1", "checkpoint_root": "/tmp/x", "recovery": {"target_level": "sibling"}}, headers=admin)
    assert r.status_code == 201 and r.json()["run_token"] and r.headers["cache-control"] == "no-store"
    slash = await client.get("/v1/runs/", headers={**admin, "Host": "evil.example"})
    assert slash.status_code == 404 and "evil.example" not in slash.text and "location" not in slash.headers


async def test_ids_ending_in_a_newline_are_refused(client, admin) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    mapped = await client.get("/v1/runs/run-1/restore-plan", params={"instance_map": "math/replica-0=job-2/gym-0\n"}, headers=api.h)
    assert mapped.status_code == 422 and mapped.json()["code"] in ("instance_map_invalid", "invalid_request"), mapped.text
    pending = await client.post("/v1/runs/run-1/attempts/pending", json={"rollout_ids": ["abc\n"]}, headers=api.h)
    assert pending.status_code in (400, 422) and pending.json()["code"] == "invalid_request", pending.text


async def test_an_admit_is_bounded_in_rows_and_a_run_by_its_quota(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    big = [group_body(f"g{k}", 1024) for k in range(20)]  # 20 480 rows in 20 groups
    refused = await api.admit(*big, expect=422)
    assert refused["code"] == "invalid_request" and "at most 20000" in refused["errors"][0]["message"]
    app.state.settings = app.state.settings.model_copy(update={"max_run_rows": 10})
    await api.admit(group_body("a", 8))
    over = await api.admit(group_body("b", 4), expect=409)
    assert over["code"] == "run_row_quota" and over["admitted_rows"] == 8 and over["quota"] == 10
    assert "CKPTC_MAX_RUN_ROWS" in over["detail"]
    assert (await api.get("/groups/b", expect=404))["code"]  # nothing of it was written
    await api.admit(group_body("a", 8))  # a repeat admits nothing new: not counted again
    await api.admit(group_body("c", 2))  # exactly up to the quota


async def test_open_runs_are_bounded(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    app.state.settings = app.state.settings.model_copy(update={"max_open_runs": 2})
    await new_run(client, admin, run_id="r1")
    await new_run(client, admin, run_id="r2")
    r = await client.post("/v1/runs", json={"run_id": "r3", "checkpoint_root": "/tmp/x", "recovery": {"target_level": "sibling"}}, headers=admin)
    assert r.status_code == 409 and r.json()["code"] == "run_quota" and "close finished runs" in r.json()["detail"]
    assert (await client.post("/v1/runs/r1/close", headers=admin)).status_code == 200
    r = await client.post("/v1/runs", json={"run_id": "r3", "checkpoint_root": "/tmp/x", "recovery": {"target_level": "sibling"}}, headers=admin)
    assert r.status_code == 201


async def test_refused_tokens_are_throttled_per_client(client, admin) -> None:  # type: ignore[no-untyped-def]
    from checkpoint_coordinator.observability.metrics import REGISTRY

    def refused(status: str) -> float:
        return REGISTRY.get_sample_value("ckptc_auth_failures_total", {"status": status}) or 0.0

    api = await new_run(client, admin)
    before = {s: refused(s) for s in ("403", "429")}
    bad = {"Authorization": "Bearer not-the-token"}
    for _ in range(20):
        assert (await client.get("/v1/runs/run-1", headers=bad)).status_code == 403
    throttled = await client.get("/v1/runs/run-1", headers=bad)
    assert throttled.status_code == 429 and throttled.json()["code"] == "too_many_auth_failures"
    assert int(throttled.headers["retry-after"]) >= 1
    # The client is refused before its token is looked at, a good one included.
    assert (await client.get("/v1/runs/run-1", headers=api.h)).status_code == 429
    assert refused("403") - before["403"] == 20 and refused("429") - before["429"] == 2


async def test_a_body_is_not_read_before_the_token_is_checked(client, admin) -> None:  # type: ignore[no-untyped-def]
    """A request without a valid token whose 8 MiB body never arrives is answered at once: nothing
    waited for its body, nor parsed it."""
    await new_run(client, admin)
    sent_body = asyncio.Event()

    async def body():  # type: ignore[no-untyped-def]
        await sent_body.wait()  # never: the answer must come without it
        yield b"x"

    r = await asyncio.wait_for(
        client.post("/v1/runs/run-1/groups/admit", content=body(), headers={"Authorization": "Bearer wrong", "Content-Length": str(8 << 20)}), 10
    )
    assert r.status_code == 403
    r = await asyncio.wait_for(client.post("/v1/runs/run-1/groups/admit", content=body(), headers={"Content-Length": str(8 << 20)}), 10)
    assert r.status_code == 401


async def test_metrics_need_the_metrics_or_admin_token(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    assert (await client.get("/metrics")).status_code == 401
    assert (await client.get("/metrics", headers=api.h)).status_code == 403  # a run's token: no
    assert (await client.get("/metrics", headers=admin)).status_code == 200
    token = "m" * 40
    app.state.settings = app.state.settings.model_copy(update={"metrics_token": Settings.model_validate({"metrics_token": token}).metrics_token})
    assert (await client.get("/metrics", headers={"Authorization": f"Bearer {token}"})).status_code == 200


def test_the_admin_token_must_be_long(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        Settings(admin_token="change-me", _env_file=None)
    assert "at least 32 characters" in str(info.value) and "secrets.token_hex(32)" in str(info.value)
    assert Settings(admin_token=ADMIN_TOKEN, _env_file=None).admin_token is not None
