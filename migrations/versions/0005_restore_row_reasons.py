"""restore answers say why each row does what it does

Every row a restore answers carries a reason (docs/ledger.md#row-reasons); the stored answer chunks get a
column of them. Chunks stored before have none (their rows answer a null reason).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 03:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('restore_row_chunks', sa.Column('reasons', postgresql.ARRAY(sa.Text()), nullable=True))
    op.execute("ALTER TABLE restore_row_chunks ALTER COLUMN reasons SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.drop_column('restore_row_chunks', 'reasons')
