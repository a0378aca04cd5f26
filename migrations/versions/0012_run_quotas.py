"""run_quotas: the sibling rows each run admitted, against its quota

One admit of 5 000 groups of 1 024 generations wrote five million rows; a run's token could fill
the database. The count a run's admits are checked against lives in a table of its own, so that
updating it does not contend with the run row every writer read-locks. Existing runs are counted
from their siblings.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 10:00:00
"""
from __future__ import annotations

from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE run_quotas ("
        "run_id text NOT NULL, admitted_rows bigint NOT NULL DEFAULT 0, "
        "CONSTRAINT pk_run_quotas PRIMARY KEY (run_id), "
        "CONSTRAINT fk_run_quotas_run_id_runs FOREIGN KEY (run_id) REFERENCES runs (run_id) ON DELETE CASCADE, "
        "CONSTRAINT ck_run_quotas_admitted_rows CHECK (admitted_rows >= 0))"
    )
    op.execute(
        "INSERT INTO run_quotas (run_id, admitted_rows) "
        "SELECT r.run_id, (SELECT count(*) FROM siblings s WHERE s.run_id = r.run_id) FROM runs r"
    )


def downgrade() -> None:
    op.execute("DROP TABLE run_quotas")
