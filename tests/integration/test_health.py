from __future__ import annotations

from sqlalchemy import create_engine, text

from checkpoint_coordinator.ledger import db


async def test_healthz_needs_no_database(client) -> None:  # type: ignore[no-untyped-def]
    r = await client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_readyz_ok_at_head(client) -> None:  # type: ignore[no-untyped-def]
    r = await client.get("/readyz")
    assert r.status_code == 200
    assert r.json()["migration"] == db.head_revision()


def _set_schema(database_url: str, revision: str, runs_on_from: str | None = None) -> None:
    eng = create_engine(db.sqlalchemy_url(database_url))
    with eng.begin() as c:
        c.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": revision})
        if runs_on_from is not None:
            c.execute(text("UPDATE schema_compat SET runs_on_from = :v"), {"v": runs_on_from})
    eng.dispose()


async def test_a_schema_behind_this_release_is_not_ready_and_the_api_says_why(client, database_url: str, admin) -> None:  # type: ignore[no-untyped-def]
    _set_schema(database_url, "0012")  # the migration of this release has not run
    r = await client.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "not_ready" and body["schema"]["state"] == "behind" and body["migration"] == "0012"
    assert "ckpt-coordinator migrate" in body["reason"]
    # Whoever reaches the replica directly gets a 503 it retries, not a query on a schema it does not know.
    api = await client.get("/v1/runs", headers=admin)
    assert api.status_code == 503 and api.json()["code"] == "schema_mismatch"
    assert api.headers["retry-after"] == "30" and api.json()["schema"]["head"] == db.head_revision()
    assert (await client.get("/healthz")).status_code == 200
    _set_schema(database_url, db.head_revision())
    assert (await client.get("/readyz")).status_code == 200
    assert (await client.get("/v1/runs", headers=admin)).status_code == 200


async def test_a_newer_schema_that_runs_this_release_keeps_it_ready(client, database_url: str, admin) -> None:  # type: ignore[no-untyped-def]
    _set_schema(database_url, "9001", runs_on_from=db.head_revision())
    r = await client.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["schema"] == {"state": "ahead", "revision": "9001", "head": db.head_revision(), "runs_on_from": db.head_revision()}
    assert (await client.get("/v1/runs", headers=admin)).status_code == 200


async def test_a_newer_schema_that_does_not_run_this_release_takes_it_out(client, database_url: str, admin) -> None:  # type: ignore[no-untyped-def]
    _set_schema(database_url, "9001", runs_on_from="9001")
    r = await client.get("/readyz")
    assert r.status_code == 503 and r.json()["schema"]["state"] == "incompatible"
    assert "Rolling back" in r.json()["reason"]
    assert (await client.get("/v1/runs", headers=admin)).json()["code"] == "schema_mismatch"


async def test_readyz_stays_ready_through_a_database_outage_and_the_api_answers_503(settings, admin) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from checkpoint_coordinator.app import create_app

    app = create_app(settings, database_url="postgresql://nobody@127.0.0.1:1/none?connect_timeout=1")
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
            r = await c.get("/readyz")
            api = await c.get("/v1/runs", headers=admin)
            assert (await c.get("/healthz")).status_code == 200
    # In the Service, so that trainers get the replica's 503 and Retry-After, not a refused connection.
    assert r.status_code == 200 and r.json()["database"] == "unreachable" and r.json()["status"] == "ready"
    assert "nobody" not in r.text  # never echo the URL
    assert api.status_code == 503 and api.json()["code"] == "unavailable" and "retry-after" in api.headers


async def test_a_draining_replica_is_not_ready_and_refuses_new_snapshots(client, app, admin) -> None:  # type: ignore[no-untyped-def]
    app.state.draining = True
    try:
        r = await client.get("/readyz")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        created = await client.post("/v1/runs", json={"run_id": "drain-run", "checkpoint_root": "/tmp/ckptc-drain", "recovery": {"target_level": "sibling"}}, headers=admin)
        assert created.status_code == 201, created.text
        token = {"Authorization": f"Bearer {created.json()['run_token']}"}
        snap = await client.post("/v1/runs/drain-run/snapshots", json={"snapshot_id": "s0", "anchor_step": 0}, headers=token)
        assert snap.status_code == 503 and snap.json()["code"] == "replica_draining" and snap.headers["retry-after"] == "1"
    finally:
        app.state.draining = False


async def test_unknown_route_is_a_problem_document(client) -> None:  # type: ignore[no-untyped-def]
    r = await client.get("/v1/nope")
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == "not_found"


async def test_openapi_has_stable_operation_ids(client) -> None:  # type: ignore[no-untyped-def]
    spec = (await client.get("/openapi.json")).json()
    ops = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert {"create_run", "get_run", "list_runs", "close_run", "healthz", "readyz"} <= ops
    assert all("__" not in o for o in ops), "operation ids must be set explicitly, not generated"
