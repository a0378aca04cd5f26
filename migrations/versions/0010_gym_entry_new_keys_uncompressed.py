"""gym entries' new keys stored uncompressed

The new keys of the last instance's Gym entry (a few thousand) are written while Gym is parked,
by the move to data_plane. PostgreSQL's compression of such arrays of distinct keys saves
nothing on such arrays and only made the write slower; the barrier's own
arrays are stored so since 0008.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 01:00:00
"""
from __future__ import annotations

from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE snapshot_gym_entries ALTER COLUMN new_keys SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE snapshot_gym_entries ALTER COLUMN new_keys SET STORAGE EXTENDED")
