"""The schema is created by migrations alone, they go both ways, and the models agree with them."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from checkpoint_coordinator.ledger import db
from checkpoint_coordinator.ledger.models import Base

LEDGER_TABLES = {
    "runs", "gym_instances", "gym_participants", "prompt_groups", "siblings", "attempts", "snapshots",
    "snapshot_cut_groups", "train_steps", "outbox_items", "ownership_leases", "restores",
}


# Written by hand in the migration: the cut's per-group storage read as the former tables.
LEDGER_VIEWS = {"snapshot_groups", "snapshot_attempts"}


def _tables(url: str) -> set[str]:
    eng = create_engine(db.sqlalchemy_url(url))
    try:
        return set(inspect(eng).get_table_names())
    finally:
        eng.dispose()


def _views_and_types(url: str) -> tuple[set[str], set[str]]:
    eng = create_engine(db.sqlalchemy_url(url))
    try:
        with eng.connect() as conn:
            views = set(inspect(conn).get_view_names())
            types = set(conn.execute(text("SELECT typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
                                          "WHERE n.nspname = 'public' AND t.typtype = 'c' AND t.typrelid IN "
                                          "(SELECT oid FROM pg_class WHERE relkind = 'c')")).scalars())
        return views, types
    finally:
        eng.dispose()


def test_upgrade_empty_database_to_head_and_back_down(empty_database_url: str) -> None:
    assert _tables(empty_database_url) == set()
    db.migrate(empty_database_url)
    assert LEDGER_TABLES <= _tables(empty_database_url)
    assert _views_and_types(empty_database_url) == (LEDGER_VIEWS, {"snapshot_sibling"})
    db.downgrade(empty_database_url, "base")
    assert _tables(empty_database_url) <= {"alembic_version"}
    assert _views_and_types(empty_database_url) == (set(), set())
    db.migrate(empty_database_url)  # and up again: downgrade left nothing behind that blocks it
    assert LEDGER_TABLES <= _tables(empty_database_url)


# The cut's sibling array has a type of its own, which reflection does not know (its columns are
# checked by the migration test above and the cut tests).
@pytest.mark.filterwarnings("ignore:Did not recognize type 'snapshot_sibling'")
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


def test_what_is_written_while_gym_is_parked_is_stored_uncompressed(database_url: str) -> None:
    """Compressing these (a Gym entry and its new keys, the barrier's key arrays) saved nothing
    and was most of their write while Gym waits (migrations 0008, 0009, 0010)."""
    eng = create_engine(db.sqlalchemy_url(database_url))
    try:
        with eng.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT c.relname || '.' || a.attname, a.attstorage FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                    "WHERE (c.relname, a.attname) IN (('snapshot_gym_entries', 'entry'), ('snapshot_gym_entries', 'new_keys'), "
                    "('snapshots', 'cut_keys_added'), ('snapshots', 'cut_keys_removed'))"
                )
            ).all()
    finally:
        eng.dispose()
    assert dict(rows) == {
        "snapshot_gym_entries.entry": "e", "snapshot_gym_entries.new_keys": "e", "snapshots.cut_keys_added": "e",
        "snapshots.cut_keys_removed": "e",
    }


def test_the_pre_cut_s_key_rows_are_unlogged(database_url: str) -> None:
    """They are written while Gym may be parked, and the next flushed commit flushed their log
    (migration 0011); a crash that empties them loses nothing: a barrier that finds none copies
    the whole run, and the cut's keys are read from its rows (tests/integration/test_snapshot_precut.py)."""
    eng = create_engine(db.sqlalchemy_url(database_url))
    try:
        with eng.connect() as conn:
            persistence = conn.execute(text("SELECT relpersistence FROM pg_class WHERE relname = 'snapshot_cut_keys'")).scalar()
    finally:
        eng.dispose()
    assert persistence == "u"
