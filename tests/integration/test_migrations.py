"""The schema is created by migrations alone, they go both ways, and the models agree with them."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from checkpoint_coordinator.ledger import db
from checkpoint_coordinator.ledger.models import Base

LEDGER_TABLES = {
    "runs", "gym_instances", "gym_participants", "prompt_groups", "siblings", "attempts", "snapshots",
    "snapshot_groups", "snapshot_attempts", "train_steps", "outbox_items", "ownership_leases", "restores",
}


def _tables(url: str) -> set[str]:
    eng = create_engine(db.sqlalchemy_url(url))
    try:
        return set(inspect(eng).get_table_names())
    finally:
        eng.dispose()


def test_upgrade_empty_database_to_head_and_back_down(empty_database_url: str) -> None:
    assert _tables(empty_database_url) == set()
    db.migrate(empty_database_url)
    assert LEDGER_TABLES <= _tables(empty_database_url)
    db.downgrade(empty_database_url, "base")
    assert _tables(empty_database_url) <= {"alembic_version"}
    db.migrate(empty_database_url)  # and up again: downgrade left nothing behind that blocks it
    assert LEDGER_TABLES <= _tables(empty_database_url)


def test_models_and_migrations_agree(database_url: str) -> None:
    eng = create_engine(db.sqlalchemy_url(database_url))
    try:
        with eng.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        eng.dispose()
    assert diff == [], f"models and migrations disagree: {diff}"


def test_single_head_is_what_readyz_expects(database_url: str) -> None:
    eng = create_engine(db.sqlalchemy_url(database_url))
    try:
        with eng.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    finally:
        eng.dispose()
    assert current == db.head_revision()
