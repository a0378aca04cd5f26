"""stopping snapshots: a snapshot may stop the run (Gym left parked, dispatch refused) by a deadline

A stopping snapshot (docs/ledger.md#stopping-snapshots) is recorded as such (``stop``) with the
moment it must have ended by (``deadline_at``), so that whichever replica drives it, or takes it
over, applies the same rules.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 03:50:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('snapshots', sa.Column('stop', sa.Boolean(), server_default=sa.text('false'), nullable=False))
    op.add_column('snapshots', sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('snapshots', 'deadline_at')
    op.drop_column('snapshots', 'stop')
