"""snapshot_cut_keys unlogged

A pre-cut's key rows are written after it commits, beside Gym's commit and the moves that follow
it; their log (about as much as the rows) was flushed by the next flushed commit, the move to
data_plane or the barrier, while Gym stood parked (docs/deviations.md#unflushed-snapshot-writes).
They are an index the barrier counts changed keys against (and a Gym entry's keys when they were
not found before it); a barrier that needs them and finds none copies the whole run, and the cut's
keys are then read from its rows. A crash that empties the table (what PostgreSQL does to an unlogged table) loses
nothing.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 10:00:00
"""
from __future__ import annotations

from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE snapshot_cut_keys SET UNLOGGED")


def downgrade() -> None:
    op.execute("ALTER TABLE snapshot_cut_keys SET LOGGED")
