"""snapshot gym entries stored uncompressed

The last instance's entry is written while Gym is parked and the trainer waits for the barrier;
compressing its JSON was a large part of that write. The rows live only
while their snapshot is pending.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 16:00:00
"""
from __future__ import annotations

from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE snapshot_gym_entries ALTER COLUMN entry SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE snapshot_gym_entries ALTER COLUMN entry SET STORAGE EXTENDED")
