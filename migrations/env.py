"""Alembic environment: runs migrations on a synchronous psycopg 3 connection.

Every online run takes one advisory lock first, so two migrators (two ``serve`` processes on
one embedded database, a Job retried beside a manual run) take turns instead of racing, and
runs its DDL under a short ``lock_timeout``: a table lock that a long transaction holds fails
the migration (nothing is changed, the transaction rolls back) rather than queueing every
replica's writes behind it. At the end, in the same transaction, it writes which releases can
run on the schema it leaves (deploy/README.md, "Upgrades").
"""

from __future__ import annotations

import time

from alembic import context
from sqlalchemy import create_engine, pool, text
from sqlalchemy.engine import Connection

from checkpoint_coordinator.ledger.db import client_options
from checkpoint_coordinator.ledger.models import Base
from checkpoint_coordinator.ledger.schema import (
    DEFAULT_LOCK_TIMEOUT_S,
    DEFAULT_LOCK_WAIT_S,
    MIGRATION_LOCK_KEY,
    MigrationLockBusy,
    runs_on_from_of,
)

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _take_migration_lock(connection: Connection, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        taken = connection.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY}).scalar()
        connection.commit()  # the lock is the session's: no transaction stays open around the wait
        if taken:
            return
        if time.monotonic() >= deadline:
            raise MigrationLockBusy(wait_s)
        time.sleep(0.5)


def _write_compat(connection: Connection) -> None:
    revision = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    if revision is None or connection.execute(text("SELECT to_regclass('schema_compat')")).scalar() is None:
        return  # below the revision that has the table
    connection.execute(
        text("INSERT INTO schema_compat (id, runs_on_from) VALUES (true, :v) ON CONFLICT (id) DO UPDATE SET runs_on_from = EXCLUDED.runs_on_from"),
        {"v": runs_on_from_of(context.script, revision)},
    )


def _migrate(connection: Connection) -> None:
    _take_migration_lock(connection, float(config.attributes.get("lock_wait_s", DEFAULT_LOCK_WAIT_S)))
    try:
        lock_timeout_ms = int(float(config.attributes.get("lock_timeout_s", DEFAULT_LOCK_TIMEOUT_S)) * 1000)
        connection.execute(text(f"SET lock_timeout = {lock_timeout_ms}"))
        connection.commit()
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
            _write_compat(connection)
    finally:
        if connection.in_transaction():
            connection.rollback()
        connection.execute(text("RESET lock_timeout"))
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
        connection.commit()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _migrate(connectable)
        return
    url = config.get_main_option("sqlalchemy.url")
    engine = create_engine(url, poolclass=pool.NullPool, connect_args=client_options(url))
    try:
        with engine.connect() as connection:
            _migrate(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
