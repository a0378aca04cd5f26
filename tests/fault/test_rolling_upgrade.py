"""A rolling upgrade, with real processes on a real PostgreSQL.

A replica of this release serves while a newer release's migration is applied under it (a
test-only revision one ahead of this release's head, written as a newer release would: additive,
and saying this release still runs on it). The replica never leaves the Service, keeps driving
snapshots, and the ledger stays whole. A later revision that says this release may no longer run
takes it out (not ready, the API answering ``schema_mismatch``); downgrading that revision with
the newer release's scripts, as a rollback does, brings it back.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from checkpoint_coordinator.ledger import db
from checkpoint_coordinator.ledger.db import sqlalchemy_url
from gymsim.testing import GymsimInstance, default_instance_config

from ..conftest import admin_headers
from ..e2e.harness import Trainer, drive_snapshot, register_by_discovery
from ..integration.ledger_helpers import group_body, new_run
from .coordinator_process import CoordinatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HEAD = db.head_revision()
NEXT = f"{int(HEAD) + 1:04d}"
FLOOR = "0012"  # every revision from 0013 to the head is additive over 0012, which is not
AFTER = f"{int(HEAD) + 2:04d}"

# What a newer release's additive migration may do: a new table, a nullable column, an index.
ADDITIVE = f'''"""a newer release's additive revision (test only)"""
from alembic import op

revision = {NEXT!r}
down_revision = {HEAD!r}
branch_labels = None
depends_on = None
additive = True


def upgrade():
    op.execute("CREATE TABLE newer_release_notes (run_id text PRIMARY KEY REFERENCES runs (run_id) ON DELETE CASCADE, note text)")
    op.execute("ALTER TABLE siblings ADD COLUMN newer_release_note text")
    op.execute("CREATE INDEX ix_snapshots_newer_release ON snapshots (run_id, created_at)")


def downgrade():
    op.execute("DROP INDEX ix_snapshots_newer_release")
    op.execute("ALTER TABLE siblings DROP COLUMN newer_release_note")
    op.execute("DROP TABLE newer_release_notes")
'''

# One this release cannot run on: a column it reads is renamed.
BREAKING = f'''"""a newer release's breaking revision (test only)"""
from alembic import op

revision = {AFTER!r}
down_revision = {NEXT!r}
branch_labels = None
depends_on = None
additive = False


def upgrade():
    op.execute("ALTER TABLE runs RENAME COLUMN consecutive_snapshot_losses TO snapshot_losses_in_a_row")


def downgrade():
    op.execute("ALTER TABLE runs RENAME COLUMN snapshot_losses_in_a_row TO consecutive_snapshot_losses")
'''

# The newer release's `ckpt-coordinator migrate`: alembic on its own copy of the scripts, through
# this project's migration environment (the lock, the compat row).
MIGRATE = (
    "import sys\n"
    "from alembic import command\n"
    "from checkpoint_coordinator.ledger import db\n"
    "cfg = db.alembic_config(sys.argv[1])\n"
    "cfg.set_main_option('script_location', sys.argv[2])\n"
    "getattr(command, sys.argv[3])(cfg, sys.argv[4])\n"
)


def newer_release_scripts(tmp_path: Path) -> Path:
    scripts = tmp_path / "newer-release-migrations"
    shutil.copytree(db.migrations_dir(), scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / f"{NEXT}_newer_release_additive.py").write_text(ADDITIVE)
    (scripts / "versions" / f"{AFTER}_newer_release_breaking.py").write_text(BREAKING)
    return scripts


def run_migration(database_url: str, scripts: Path, direction: str, revision: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", MIGRATE, database_url, str(scripts), direction, revision], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _this_release_migrate(replica: CoordinatorProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "checkpoint_coordinator.cli", "migrate"], env=replica.env,
                          capture_output=True, text=True, timeout=120)


async def test_a_replica_of_the_previous_release_serves_and_snapshots_through_a_newer_schema(database_url: str, tmp_path: Path) -> None:
    scripts = newer_release_scripts(tmp_path)
    replica = CoordinatorProcess(database_url, tmp_path, coordinator_id="previous-release", CKPTC_SNAPSHOT_POLL_S="0.5")
    replica.start()
    # `serve --no-migrate` says what it read, not what it assumes.
    assert f"the database schema is at revision {HEAD}, this release's head" in (tmp_path / "coordinator-1.log").read_text()
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-up", turn_seconds=0.05))
    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        async with httpx.AsyncClient(base_url=replica.url, timeout=30) as c:
            api = await new_run(c, admin_headers(), target_level="turn", data_plane_timeout_s=60)
            await register_by_discovery(engine, api.run_id, [gym])
            trainer = Trainer(api, {gym.instance_id: gym}, turns=2)
            await trainer.admit_and_dispatch([group_body("before", 2)], gym.instance_id)
            await trainer.wait_idle()
            assert (await drive_snapshot(api, "s0", 0, tmp_path / "dp"))["outcome"] == "published"

            # Readiness is watched all through the newer release's migration.
            answers: list[int] = []
            stop = asyncio.Event()

            async def watch_readiness() -> None:
                while not stop.is_set():
                    answers.append((await c.get("/readyz")).status_code)
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch_readiness())
            await asyncio.to_thread(run_migration, database_url, scripts, "upgrade", NEXT)
            await asyncio.sleep(0.3)
            stop.set()
            await watcher
            assert answers and set(answers) == {200}, answers

            ready = (await c.get("/readyz")).json()
            # Additive over an additive head: the floor is the last breaking revision below them.
            assert ready["schema"] == {"state": "ahead", "revision": NEXT, "head": HEAD, "runs_on_from": FLOOR}, ready
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar() == NEXT
                assert (await conn.execute(text("SELECT to_regclass('newer_release_notes') IS NOT NULL"))).scalar()

            # This release's migration Job applied again (a rollback of the Deployment) changes
            # nothing and succeeds, rather than fail on a revision it has no script of.
            again = _this_release_migrate(replica)
            assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr

            # And it goes on as before: admits, dispatches, seals and a published snapshot.
            await trainer.admit_and_dispatch([group_body("after", 2)], gym.instance_id)
            await trainer.wait_idle()
            await trainer.aclose()
            s1 = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
            assert s1["outcome"] == "published", s1
            for group_id in ("before", "after"):
                assert (await api.get(f"/groups/{group_id}"))["group_id"] == group_id
            assert [h["snapshot_id"] for h in (await api.get("/snapshots"))["snapshots"]] == ["s1", "s0"]

            # A revision this release must not run on takes it out of the Service at once.
            await asyncio.to_thread(run_migration, database_url, scripts, "upgrade", AFTER)
            out = await c.get("/readyz")
            assert out.status_code == 503 and out.json()["schema"]["state"] == "incompatible", out.text
            refused = await c.get(f"/v1/runs/{api.run_id}", headers=api.h)
            assert refused.status_code == 503 and refused.json()["code"] == "schema_mismatch"
            assert "retry-after" in refused.headers
            wrong_image = _this_release_migrate(replica)
            assert wrong_image.returncode == 1 and "use the newer release's image" in wrong_image.stderr

            # Rolled back with the newer release's scripts, the schema runs this release again.
            await asyncio.to_thread(run_migration, database_url, scripts, "downgrade", NEXT)
            back = await c.get("/readyz")
            assert back.status_code == 200 and back.json()["schema"]["state"] == "ahead", back.text
            assert (await api.get(""))["run_id"] == api.run_id
            s2 = await drive_snapshot(api, "s2", 0, tmp_path / "dp")
            assert s2["outcome"] == "published", s2
    finally:
        await engine.dispose()
        replica.stop()
        gym.stop()


async def test_a_replica_started_before_its_migration_waits_then_serves(database_url: str, tmp_path: Path) -> None:
    """The new release's pods start while its migration Job has not run: they start (their
    startup probe is the process), stay out of the Service and answer schema_mismatch, and serve
    as soon as the migration ran, without a restart."""
    import time

    previous = f"{int(HEAD) - 1:04d}"
    db.downgrade(database_url, previous)
    replica = CoordinatorProcess(database_url, tmp_path, coordinator_id="next-release")
    replica.proc = subprocess.Popen(
        [sys.executable, "-m", "checkpoint_coordinator.cli", "serve", "--port", str(replica.port), "--no-migrate"],
        env=replica.env, stdout=open(tmp_path / "next-release.log", "wb"), stderr=subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(base_url=replica.url, timeout=10) as c:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if (await c.get("/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and replica.proc.poll() is None, (tmp_path / "next-release.log").read_text()[-2000:]
                await asyncio.sleep(0.05)
            waiting = await c.get("/readyz")
            assert waiting.status_code == 503 and waiting.json()["schema"]["state"] == "behind", waiting.text
            refused = await c.get("/v1/runs", headers=admin_headers())
            assert refused.status_code == 503 and refused.json()["code"] == "schema_mismatch"
            log = (tmp_path / "next-release.log").read_text()
            assert f"at revision {previous}; this release needs {HEAD}: run `ckpt-coordinator migrate`" in log, log[-2000:]

            # The migration Job of the release.
            job = subprocess.run([sys.executable, "-m", "checkpoint_coordinator.cli", "migrate"], env=replica.env,
                                 capture_output=True, text=True, timeout=120)
            assert job.returncode == 0, job.stderr
            assert f"revision {previous} -> {HEAD}" in job.stdout
            ready = await c.get("/readyz")
            assert ready.status_code == 200 and ready.json()["schema"]["state"] == "at_head", ready.text
            assert (await c.get("/v1/runs", headers=admin_headers())).status_code == 200
    finally:
        replica.stop()
