"""train steps keep their history; a restore retires the ones after its anchor

A restore to anchor step A ends the trainer lineage that announced the steps after A: they are
retired (``retired_at``, ``retired_by_restore``) in the restore's transaction, so the new lineage
may announce them again, with other checkpoint references, and snapshots anchored on them are
accepted. Each announce is a row (``announce_id``); one live row per step.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 22:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('train_steps', sa.Column('announce_id', sa.BigInteger(), sa.Identity(always=False), nullable=False))
    op.add_column('train_steps', sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('train_steps', sa.Column('retired_by_restore', sa.Text(), nullable=True))
    op.drop_constraint('pk_train_steps', 'train_steps', type_='primary')
    op.create_primary_key('pk_train_steps', 'train_steps', ['run_id', 'announce_id'])
    op.create_check_constraint(op.f('ck_train_steps_retired'), 'train_steps', '(retired_at IS NULL) = (retired_by_restore IS NULL)')
    op.create_index('uq_train_steps_current', 'train_steps', ['run_id', 'step'], unique=True, postgresql_where=sa.text('retired_at IS NULL'))


def downgrade() -> None:
    # The history of retired announces has no place in the old table.
    op.execute("DELETE FROM train_steps WHERE retired_at IS NOT NULL")
    op.drop_index('uq_train_steps_current', table_name='train_steps', postgresql_where=sa.text('retired_at IS NULL'))
    op.drop_constraint(op.f('ck_train_steps_retired'), 'train_steps', type_='check')
    op.drop_constraint('pk_train_steps', 'train_steps', type_='primary')
    op.create_primary_key('pk_train_steps', 'train_steps', ['run_id', 'step'])
    op.drop_column('train_steps', 'retired_by_restore')
    op.drop_column('train_steps', 'retired_at')
    op.drop_column('train_steps', 'announce_id')
