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


async def test_readyz_503_when_not_at_head(client, database_url: str) -> None:  # type: ignore[no-untyped-def]
    eng = create_engine(db.sqlalchemy_url(database_url))
    with eng.begin() as c:
        c.execute(text("UPDATE alembic_version SET version_num = 'older'"))
    eng.dispose()
    r = await client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["status"] == "not_ready" and r.json()["migration"] == "older"


async def test_readyz_503_when_database_unreachable(settings) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from checkpoint_coordinator.app import create_app

    app = create_app(settings, database_url="postgresql://nobody@127.0.0.1:1/none?connect_timeout=1")
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
            r = await c.get("/readyz")
            assert (await c.get("/healthz")).status_code == 200
    assert r.status_code == 503
    assert r.json()["database"] == "unreachable"
    assert "nobody" not in r.text  # never echo the URL


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
