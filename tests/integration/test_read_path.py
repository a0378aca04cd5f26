"""The service engine's read path: autocommit reads without a pre-ping, transactional writes, a
dropped connection replaced without failing the request, and the run-token hash cache (which may
only ever speed up an acceptance, never keep a rotated-out token alive in the process that
rotated it)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from checkpoint_coordinator.ledger import db
from checkpoint_coordinator.ledger.runs import hash_token, run_token_valid


def _plain(url: str) -> str:
    return db.sqlalchemy_url(url).replace("postgresql+psycopg", "postgresql")


def _kill_client_backends(url: str) -> int:
    with psycopg.connect(_plain(url), autocommit=True) as k:
        return len(
            k.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            ).fetchall()
        )


async def test_reads_run_without_a_transaction_writes_inside_one(database_url: str) -> None:
    engine = db.make_async_engine(database_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t_rp (x int)"))
            # inside begin(): one transaction across statements
            assert (await conn.execute(text("SELECT now() <> statement_timestamp() OR pg_current_xact_id_if_assigned() IS NOT NULL"))).scalar()
        with pytest.raises(RuntimeError):
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO t_rp VALUES (1)"))
                raise RuntimeError("roll back")
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t_rp VALUES (2)"))
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT array_agg(x) FROM t_rp"))).scalar() == [2]
            # a plain read is its own statement: no transaction is open around it
            assert (await conn.execute(text("SELECT now() = statement_timestamp()"))).scalar() is True
            assert (await conn.execute(text("SELECT pg_current_xact_id_if_assigned() IS NULL"))).scalar() is True
        assert await db.read_rows(engine, "SELECT x FROM t_rp WHERE x = ANY(%(xs)s)", {"xs": [1, 2, 3]}) == [(2,)]
    finally:
        await engine.dispose()


async def test_a_connection_ended_by_the_server_is_replaced_without_an_error(database_url: str) -> None:
    engine = db.make_async_engine(database_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t_rp2 (x int)"))
        assert await db.read_rows(engine, "SELECT count(*) FROM t_rp2", {}) == [(0,)]
        assert _kill_client_backends(database_url) >= 1
        await asyncio.sleep(0.2)
        # the pooled connection was used a moment ago (no idle ping), yet its death is noticed
        assert await db.read_rows(engine, "SELECT count(*) FROM t_rp2", {}) == [(0,)]
        _kill_client_backends(database_url)
        await asyncio.sleep(0.2)
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t_rp2 VALUES (1)"))
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM t_rp2"))).scalar() == 1
    finally:
        await engine.dispose()


async def _create(client: Any, admin: dict[str, str], run_id: str = "run-1") -> str:
    r = await client.post("/v1/runs", json={"run_id": run_id, "checkpoint_root": "/tmp/ckptc-rp", "recovery": {"target_level": "sibling"}}, headers=admin)
    assert r.status_code == 201, r.text
    return str(r.json()["run_token"])


async def test_rotation_ends_the_old_token_at_once_despite_the_cache(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    assert app.state.settings.run_token_cache_s > 0
    old = await _create(client, admin)
    h_old = {"Authorization": f"Bearer {old}"}
    for _ in range(3):  # accepted, and from then on served from the cache
        assert (await client.get("/v1/runs/run-1/counts", headers=h_old)).status_code == 200
    new = (await client.post("/v1/runs/run-1/token", headers=admin)).json()["run_token"]
    r = await client.get("/v1/runs/run-1/counts", headers=h_old)
    assert r.status_code == 403 and r.json()["code"] == "forbidden"
    assert (await client.get("/v1/runs/run-1/counts", headers={"Authorization": f"Bearer {new}"})).status_code == 200


async def test_cache_serves_acceptances_only(app, client, admin, database_url) -> None:  # type: ignore[no-untyped-def]
    """A token changed behind this process's back (another replica rotated it): the new token is
    accepted at once (a refusal is always checked against the database); the old one only until
    its cached hash expires."""
    engine = app.state.engine
    old = await _create(client, admin)
    assert await run_token_valid(engine, "run-1", old, cache_s=0.5)
    new = "ckptc_run_rotated-elsewhere"
    with psycopg.connect(_plain(database_url), autocommit=True) as c:
        c.execute("UPDATE runs SET token_hash = %s WHERE run_id = 'run-1'", (hash_token(new),))
    assert await run_token_valid(engine, "run-1", new, cache_s=0.5)
    # the refusal path re-read the stored hash, so the old token's entry is gone already
    assert not await run_token_valid(engine, "run-1", old, cache_s=0.5)
    assert not await run_token_valid(engine, "run-404", old, cache_s=0.5)
    assert not await run_token_valid(engine, "run-1", "", cache_s=0.5)


async def test_cached_acceptance_expires(app, client, admin, database_url) -> None:  # type: ignore[no-untyped-def]
    engine = app.state.engine
    old = await _create(client, admin)
    assert await run_token_valid(engine, "run-1", old, cache_s=0.3)
    with psycopg.connect(_plain(database_url), autocommit=True) as c:
        c.execute("UPDATE runs SET token_hash = %s WHERE run_id = 'run-1'", (hash_token("ckptc_run_other"),))
    assert await run_token_valid(engine, "run-1", old, cache_s=0.3)  # within the cache time, as documented
    await asyncio.sleep(0.4)
    assert not await run_token_valid(engine, "run-1", old, cache_s=0.3)


async def test_no_cache_when_disabled(app, client, admin, database_url) -> None:  # type: ignore[no-untyped-def]
    engine = app.state.engine
    old = await _create(client, admin)
    assert await run_token_valid(engine, "run-1", old, cache_s=0)
    with psycopg.connect(_plain(database_url), autocommit=True) as c:
        c.execute("UPDATE runs SET token_hash = %s WHERE run_id = 'run-1'", (hash_token("ckptc_run_other"),))
    assert not await run_token_valid(engine, "run-1", old, cache_s=0)
