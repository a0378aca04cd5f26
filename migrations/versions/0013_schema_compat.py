"""schema_compat: which releases can run on this schema; runs count failed snapshots in a row

A rolling upgrade keeps the previous release's replicas serving while the new schema is already
in: each revision from this one on says whether it is ``additive`` (code that ran on the schema
before it still runs on it), every migration run writes the oldest revision whose code runs on
the schema it leaves (``runs_on_from``, computed along the chain) into this one-row table, and
replicas of any release read it there (deploy/README.md, "Upgrades and rollbacks").

``consecutive_snapshot_failures`` is beside ``consecutive_snapshot_losses``: the failing-snapshots
alert is per run, and a run whose lease moves to another replica keeps its count.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 14:00:00
"""
from __future__ import annotations

from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None
# A new table and a column with a default: code that ran on 0012 runs on this schema unchanged.
additive = True


def upgrade() -> None:
    op.execute(
        "CREATE TABLE schema_compat ("
        "id boolean NOT NULL DEFAULT true, runs_on_from text NOT NULL, "
        "CONSTRAINT pk_schema_compat PRIMARY KEY (id), CONSTRAINT ck_schema_compat_one_row CHECK (id))"
    )
    op.execute("ALTER TABLE runs ADD COLUMN consecutive_snapshot_failures integer NOT NULL DEFAULT 0")


def downgrade() -> None:
    op.execute("ALTER TABLE runs DROP COLUMN consecutive_snapshot_failures")
    op.execute("DROP TABLE schema_compat")
