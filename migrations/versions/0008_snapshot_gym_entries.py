"""snapshot gym entries: a pending snapshot's Gym manifest, one row per instance, written while
Gym still commits the other instances

Each instance's manifest entry is stored as soon as its commit replies are validated, with the
entry's staging keys that the pre-cut's key rows do not hold (``new_keys``, looked up once the
pre-cut is in). The move to ``data_plane`` then writes no manifest, and the barrier only unions
``new_keys`` instead of looking the manifest's keys up while Gym and the trainer wait. At the
snapshot's end the entries are joined into ``snapshots.gym_manifest`` (after Gym was resumed)
and go. The barrier's delta columns are stored uncompressed.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 10:40:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'snapshot_gym_entries',
        sa.Column('run_id', sa.Text(), nullable=False),
        sa.Column('snapshot_id', sa.Text(), nullable=False),
        sa.Column('instance_id', sa.Text(), nullable=False),
        sa.Column('entry', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('new_keys', postgresql.ARRAY(sa.Text(collation='C')), nullable=True),
        sa.PrimaryKeyConstraint('run_id', 'snapshot_id', 'instance_id', name=op.f('pk_snapshot_gym_entries')),
    )
    # The barrier writes its delta (10 000 keys at 10 000 episodes in flight) while Gym waits:
    # stored as it is, not compressed first (compressing only lengthened that wait).
    op.execute("ALTER TABLE snapshots ALTER COLUMN cut_keys_added SET STORAGE EXTERNAL")
    op.execute("ALTER TABLE snapshots ALTER COLUMN cut_keys_removed SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE snapshots ALTER COLUMN cut_keys_removed SET STORAGE EXTENDED")
    op.execute("ALTER TABLE snapshots ALTER COLUMN cut_keys_added SET STORAGE EXTENDED")
    op.drop_table('snapshot_gym_entries')
