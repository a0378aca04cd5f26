"""restore answers stored as row chunks

The rows an applied restore answers move from one JSON document on ``restores.result`` to
``restore_row_chunks`` (column arrays of up to 10 000 rows, read back by page): at a million
siblings the document was slow to build and store, and too large to answer in one piece.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 11:20:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

# Kept in step with ``ledger.models.RESTORE_ROW_CHUNK_TEXT_COLUMNS``.
TEXT_COLUMNS = ("group_ids", "dispositions", "rollout_ids", "instance_ids", "replaces_rollout_ids")


def upgrade() -> None:
    op.create_table('restore_row_chunks',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('restore_id', sa.Text(), nullable=False),
    sa.Column('chunk', sa.Integer(), nullable=False),
    sa.Column('group_ids', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('generation_indexes', postgresql.ARRAY(sa.Integer()), nullable=False),
    sa.Column('dispositions', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('rollout_ids', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('gym_attempts', postgresql.ARRAY(sa.Integer()), nullable=False),
    sa.Column('group_attempts', postgresql.ARRAY(sa.Integer()), nullable=False),
    sa.Column('instance_ids', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.Column('replaces_rollout_ids', postgresql.ARRAY(sa.Text()), nullable=False),
    sa.CheckConstraint('chunk >= 0', name=op.f('ck_restore_row_chunks_chunk')),
    sa.ForeignKeyConstraint(['run_id', 'restore_id'], ['restores.run_id', 'restores.restore_id'], name=op.f('fk_restore_row_chunks_run_id_restore_id_restores'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'restore_id', 'chunk', name=op.f('pk_restore_row_chunks'))
    )
    for col in TEXT_COLUMNS:
        op.execute(f"ALTER TABLE restore_row_chunks ALTER COLUMN {col} SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.drop_table('restore_row_chunks')
