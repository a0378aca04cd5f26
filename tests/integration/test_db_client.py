"""The service's database connections carry client timeouts: a dead peer or a runaway statement
ends instead of hanging a request or a snapshot for minutes."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from checkpoint_coordinator.ledger import db


def test_client_options_fill_in_what_the_url_leaves_out() -> None:
    options = db.client_options("postgresql://u@db.example:5432/x", statement_timeout_s=1.5)
    assert options["connect_timeout"] == 10 and options["tcp_user_timeout"] == 30_000
    assert options["keepalives"] == 1 and options["keepalives_idle"] == 10
    assert options["options"] == "-c statement_timeout=1500"
    # What the URL sets is the operator's choice, never overridden.
    mine = db.client_options("postgresql://u@db.example/x?connect_timeout=3&keepalives_idle=60")
    assert "connect_timeout" not in mine and "keepalives_idle" not in mine and "options" not in mine


async def test_a_statement_past_the_timeout_is_ended_by_the_server(database_url: str) -> None:
    import psycopg

    engine = db.make_async_engine(database_url, pool_size=1, statement_timeout_s=0.5)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SHOW statement_timeout"))).scalar() == "500ms"
            with pytest.raises(Exception) as caught:
                await conn.execute(text("SELECT pg_sleep(5)"))
        assert isinstance(caught.value.orig, psycopg.errors.QueryCanceled)  # type: ignore[attr-defined]
    finally:
        await engine.dispose()


async def test_the_app_sets_the_configured_statement_timeout(app) -> None:  # type: ignore[no-untyped-def]
    async with app.state.engine.connect() as conn:
        assert (await conn.execute(text("SHOW statement_timeout"))).scalar() == "15min"
