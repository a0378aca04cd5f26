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


# --------------------------------------------------------------------------- upgrades that roll


def _scripts() -> list:  # type: ignore[type-arg]
    from alembic.script import ScriptDirectory

    return list(reversed(list(ScriptDirectory.from_config(db.alembic_config("postgresql://localhost/unused")).walk_revisions())))


def test_every_revision_from_the_compat_table_on_says_whether_it_is_additive() -> None:
    scripts = _scripts()
    order = [s.revision for s in scripts]
    for script in scripts[order.index("0013"):]:
        assert isinstance(getattr(script.module, "additive", None), bool), (
            f"revision {script.revision} must say additive = True or False (deploy/README.md, 'Writing a migration')"
        )


def test_the_floor_walks_down_every_additive_revision(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two additive revisions in a row still run the release before both; a breaking one starts
    the floor again."""
    import shutil

    from alembic.script import ScriptDirectory

    from checkpoint_coordinator.ledger.schema import runs_on_from_of

    head = db.head_revision()
    shutil.copytree(db.migrations_dir(), tmp_path / "m", ignore=shutil.ignore_patterns("__pycache__"))
    chain = [("9001", head, True), ("9002", "9001", True), ("9003", "9002", False), ("9004", "9003", True)]
    for rev, down, additive in chain:
        (tmp_path / "m" / "versions" / f"{rev}_t.py").write_text(
            f"revision = {rev!r}\ndown_revision = {down!r}\nbranch_labels = None\ndepends_on = None\nadditive = {additive}\n"
            "def upgrade():\n    pass\ndef downgrade():\n    pass\n"
        )
    cfg = db.alembic_config("postgresql://localhost/unused")
    cfg.set_main_option("script_location", str(tmp_path / "m"))
    scripts = ScriptDirectory.from_config(cfg)
    floor_of_head = runs_on_from_of(scripts, head)
    assert [runs_on_from_of(scripts, r) for r, _, _ in chain] == [floor_of_head, floor_of_head, "9003", "9003"]
    assert runs_on_from_of(scripts, "0012") == "0012"  # before the convention: only its own code


def _compat(url: str) -> tuple[str | None, str | None]:
    eng = create_engine(db.sqlalchemy_url(url))
    try:
        with eng.connect() as conn:
            revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            if conn.execute(text("SELECT to_regclass('schema_compat')")).scalar() is None:
                return revision, None
            return revision, conn.execute(text("SELECT runs_on_from FROM schema_compat")).scalar()
    finally:
        eng.dispose()


def test_each_migration_run_writes_who_runs_on_the_schema_it_leaves(empty_database_url: str) -> None:
    from checkpoint_coordinator.ledger.schema import SchemaState, read_status_sync

    assert read_status_sync(empty_database_url).state is SchemaState.behind  # no ledger yet
    db.migrate(empty_database_url, "0012")
    assert _compat(empty_database_url) == ("0012", None)
    assert read_status_sync(empty_database_url).state is SchemaState.behind
    db.migrate(empty_database_url)
    assert _compat(empty_database_url) == (db.head_revision(), "0012")  # 0013 on are additive over 0012
    assert read_status_sync(empty_database_url).state is SchemaState.at_head
    db.downgrade(empty_database_url, "0012")
    assert _compat(empty_database_url) == ("0012", None)


def test_a_second_migration_waits_for_the_first_and_gives_up_cleanly(empty_database_url: str) -> None:
    from checkpoint_coordinator.ledger.schema import MIGRATION_LOCK_KEY, MigrationLockBusy

    db.migrate(empty_database_url, "0011")
    holder = create_engine(db.sqlalchemy_url(empty_database_url))
    try:
        with holder.connect() as conn:
            assert conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY}).scalar()
            conn.commit()
            with pytest.raises(MigrationLockBusy):
                db.migrate(empty_database_url, lock_wait_s=1.0)
            assert _compat(empty_database_url) == ("0011", None)  # nothing changed
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
            conn.commit()
    finally:
        holder.dispose()
    db.migrate(empty_database_url)
    assert _compat(empty_database_url)[0] == db.head_revision()


def test_a_table_lock_held_by_a_long_transaction_rolls_the_migration_back_whole(empty_database_url: str) -> None:
    import subprocess
    import sys

    db.migrate(empty_database_url, "0012")
    holder = create_engine(db.sqlalchemy_url(empty_database_url))
    try:
        with holder.connect() as conn:
            conn.execute(text("LOCK TABLE runs IN ACCESS SHARE MODE"))  # a reader that does not end
            result = subprocess.run(
                [sys.executable, "-m", "checkpoint_coordinator.cli", "migrate", "--database-url", empty_database_url,
                 "--lock-timeout", "0.5", "--attempts", "2"],
                capture_output=True, text=True, timeout=120,
            )
            conn.rollback()
    finally:
        holder.dispose()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rolled back 2 times" in result.stderr and "nothing was changed" in result.stderr
    assert "Traceback" not in result.stderr
    assert _compat(empty_database_url) == ("0012", None)  # 0013's table and column both rolled back
    eng = create_engine(db.sqlalchemy_url(empty_database_url))
    try:
        with eng.connect() as conn:
            columns = set(conn.execute(text("SELECT column_name FROM information_schema.columns WHERE table_name = 'runs'")).scalars())
    finally:
        eng.dispose()
    assert "consecutive_snapshot_failures" not in columns
    done = subprocess.run([sys.executable, "-m", "checkpoint_coordinator.cli", "migrate", "--database-url", empty_database_url],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"revision 0012 -> {db.head_revision()}" in done.stdout and "this release's head" in done.stdout


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_database_url_is_refused_not_taken_for_the_embedded_one(value: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    env = {**os.environ, "CKPTC_DATABASE_URL": value, "CKPTC_DATA_DIR": str(tmp_path / "data")}
    for args in (["migrate"], ["serve", "--port", "0"]):
        result = subprocess.run([sys.executable, "-m", "checkpoint_coordinator.cli", *args], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        assert "CKPTC_DATABASE_URL is set but empty" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()  # no embedded PostgreSQL was started
    flag = subprocess.run([sys.executable, "-m", "checkpoint_coordinator.cli", "migrate", "--database-url", ""],
                          env={k: v for k, v in os.environ.items() if k != "CKPTC_DATABASE_URL"}, capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and "--database-url is empty" in flag.stderr
