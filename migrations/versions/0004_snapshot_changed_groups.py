"""the barrier re-copies the groups written since the pre-cut, recorded as they are written

Statement triggers on ``prompt_groups``, ``siblings`` and ``attempts`` record, while a run's
snapshot is between its prepare and its barrier, the groups each statement wrote
(``snapshot_changed_groups``). The barrier then re-copies those groups without looking for
changes across the whole run.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 03:10:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from checkpoint_coordinator.ledger.models import CHANGED_GROUPS_TRIGGERS_DOWN, CHANGED_GROUPS_TRIGGERS_UP

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'snapshot_changed_groups',
        sa.Column('run_id', sa.Text(), nullable=False),
        sa.Column('group_id', sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint('run_id', 'group_id', name=op.f('pk_snapshot_changed_groups')),
    )
    for sql in CHANGED_GROUPS_TRIGGERS_UP:
        op.execute(sql)


def downgrade() -> None:
    for sql in CHANGED_GROUPS_TRIGGERS_DOWN:
        op.execute(sql)
    op.drop_table('snapshot_changed_groups')
