"""snapshot cut keys: a pending snapshot's staging keys as rows, so that its barrier changes and
answers only what changed since its pre-cut

The pre-cut writes the keys of the groups it copied (``snapshot_cut_keys``, a count of the cut
groups naming each); the barrier updates the keys of the groups it copies again (the Gym
manifest's keys stay in the manifest and are looked up: changed after this revision, no schema
change), and records
what it added and removed against the pre-cut's keys (``cut_keys_added``, ``cut_keys_removed``)
for a trainer that fetched them before the barrier. At the snapshot's end the
keys move into ``snapshots.cut_staging_keys`` as before.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 10:45:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'snapshot_cut_keys',
        sa.Column('run_id', sa.Text(), nullable=False),
        sa.Column('snapshot_id', sa.Text(), nullable=False),
        sa.Column('key', sa.Text(collation='C'), nullable=False),
        sa.Column('refs', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('run_id', 'snapshot_id', 'key', name=op.f('pk_snapshot_cut_keys')),
    )
    op.add_column('snapshots', sa.Column('cut_keys_added', postgresql.ARRAY(sa.Text()), nullable=True))
    op.add_column('snapshots', sa.Column('cut_keys_removed', postgresql.ARRAY(sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column('snapshots', 'cut_keys_removed')
    op.drop_column('snapshots', 'cut_keys_added')
    op.drop_table('snapshot_cut_keys')
