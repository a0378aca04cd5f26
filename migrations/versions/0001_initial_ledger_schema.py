"""initial ledger schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 22:09:49.840868
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import UserDefinedType

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None

# Written by hand (autogenerate cannot express a composite type or a view): the type of a cut
# sibling, and the views that read the per-group cut storage ``snapshot_cut_groups`` as the
# per-group and per-sibling rows (``ledger/models.py`` SnapshotCutGroup). Kept in both directions.
SNAPSHOT_SIBLING_TYPE = """CREATE TYPE snapshot_sibling AS (
    attempt_id bigint, generation_index integer, row_attempts_used integer, rollout_id text, gym_instance_id text,
    gym_attempt integer, group_attempt integer, status text, refusals integer, receipt jsonb, reward double precision,
    mask_sample boolean, staging_keys text[], gym_owned boolean)"""
# The cut concatenates the staging-key arrays of a group's sealed and returned siblings.
TEXT_CAT_AGGREGATE = "CREATE AGGREGATE ckptc_text_cat(text[]) (SFUNC = array_cat, STYPE = text[])"
SNAPSHOT_GROUPS_VIEW = """CREATE VIEW snapshot_groups AS
    SELECT run_id, snapshot_id, group_id, prompt_ref, task_digest, task_source, agent_name, restore_level,
           expected_generations, target_step, weight_version, group_attempt, data_attempts_used, status
    FROM snapshot_cut_groups"""
SNAPSHOT_ATTEMPTS_VIEW = """CREATE VIEW snapshot_attempts AS
    SELECT c.run_id, c.snapshot_id, s.attempt_id, c.group_id, s.generation_index, s.row_attempts_used, s.rollout_id,
           s.gym_instance_id, s.gym_attempt, s.group_attempt, s.status, s.refusals, s.receipt, s.reward, s.mask_sample,
           s.staging_keys, s.gym_owned
    FROM snapshot_cut_groups c CROSS JOIN LATERAL unnest(c.siblings) AS s"""


class SnapshotSiblings(UserDefinedType):  # type: ignore[type-arg]
    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "snapshot_sibling[]"


def upgrade() -> None:
    op.execute(SNAPSHOT_SIBLING_TYPE)
    op.execute(TEXT_CAT_AGGREGATE)

    op.create_table('attempts',
    sa.Column('attempt_id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('group_id', sa.Text(), nullable=False),
    sa.Column('generation_index', sa.Integer(), nullable=False),
    sa.Column('rollout_id', sa.Text(), nullable=False),
    sa.Column('gym_instance_id', sa.Text(), nullable=True),
    sa.Column('gym_attempt', sa.Integer(), server_default='0', nullable=False),
    sa.Column('group_attempt', sa.Integer(), server_default='0', nullable=False),
    sa.Column('status', sa.Text(), server_default='reserved', nullable=False),
    sa.Column('is_current', sa.Boolean(), server_default='true', nullable=False),
    sa.Column('refusals', sa.Integer(), server_default='0', nullable=False),
    sa.Column('receipt', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('mask_sample', sa.Boolean(), nullable=True),
    sa.Column('staging_keys', postgresql.ARRAY(sa.Text()), nullable=True),
    sa.Column('failure_class', sa.Text(), nullable=True),
    sa.Column('retirement', sa.Text(), server_default='none', nullable=False),
    sa.Column('gym_owned', sa.Boolean(), server_default='false', nullable=False),
    sa.Column('dispatch_id', sa.Text(), nullable=True),
    sa.Column('replaced_by_attempt_id', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("retirement IN ('none', 'retire_pending', 'retired', 'forget_pending', 'forgotten')", name=op.f('ck_attempts_retirement')),
    sa.CheckConstraint("status IN ('reserved', 'dispatched', 'returned', 'sealed', 'failed', 'abandoned')", name=op.f('ck_attempts_status')),
    sa.CheckConstraint('gym_attempt >= 0', name=op.f('ck_attempts_gym_attempt')),
    sa.PrimaryKeyConstraint('attempt_id', name=op.f('pk_attempts')),
    sa.UniqueConstraint('run_id', 'rollout_id', name=op.f('uq_attempts_run_id_rollout_id')),
    postgresql_with={'fillfactor': '40'}
    )
    op.create_index('uq_attempts_current_per_sibling', 'attempts', ['run_id', 'group_id', 'generation_index'], unique=True, postgresql_where=sa.text('is_current'))
    op.create_table('runs',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('config', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('checkpoint_root', sa.Text(), nullable=False),
    sa.Column('token_hash', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), server_default='open', nullable=False),
    sa.Column('epoch', sa.BigInteger(), server_default='1', nullable=False),
    sa.Column('restored_from_rollout_snapshot', sa.Text(), nullable=True),
    sa.Column('consecutive_snapshot_losses', sa.Integer(), server_default='0', nullable=False),
    sa.Column('gate_snapshot_id', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("state IN ('open', 'closed')", name=op.f('ck_runs_state')),
    sa.CheckConstraint('epoch >= 1', name=op.f('ck_runs_epoch')),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_runs'))
    )
    op.create_table('siblings',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('group_id', sa.Text(), nullable=False),
    sa.Column('generation_index', sa.Integer(), nullable=False),
    sa.Column('row_attempts_used', sa.Integer(), server_default='0', nullable=False),
    sa.CheckConstraint('generation_index >= 0', name=op.f('ck_siblings_generation_index')),
    sa.PrimaryKeyConstraint('run_id', 'group_id', 'generation_index', name=op.f('pk_siblings'))
    )
    op.create_table('snapshot_cut_groups',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('snapshot_id', sa.Text(), nullable=False),
    sa.Column('group_id', sa.Text(), nullable=False),
    sa.Column('prompt_ref', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('task_digest', sa.Text(), nullable=False),
    sa.Column('task_source', sa.Text(), nullable=True),
    sa.Column('agent_name', sa.Text(), nullable=True),
    sa.Column('restore_level', sa.Text(), nullable=False),
    sa.Column('expected_generations', sa.Integer(), nullable=False),
    sa.Column('target_step', sa.BigInteger(), nullable=True),
    sa.Column('weight_version', sa.Text(), nullable=True),
    sa.Column('group_attempt', sa.Integer(), nullable=False),
    sa.Column('data_attempts_used', sa.Integer(), nullable=False),
    sa.Column('status', sa.Text(), nullable=False),
    sa.Column('siblings', SnapshotSiblings(), nullable=False),
    sa.Column('staging_keys', postgresql.ARRAY(sa.Text()), nullable=True),
    sa.PrimaryKeyConstraint('run_id', 'snapshot_id', 'group_id', name=op.f('pk_snapshot_cut_groups')),
    postgresql_with={'toast_tuple_target': '8160'}
    )
    op.create_table('dispatch_calls',
    sa.Column('call_id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('dispatch_id', sa.Text(), nullable=False),
    sa.Column('attempt_ids', postgresql.ARRAY(sa.BigInteger()), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_dispatch_calls_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('call_id', name=op.f('pk_dispatch_calls'))
    )
    op.create_index(op.f('ix_dispatch_calls_run_id_dispatch_id'), 'dispatch_calls', ['run_id', 'dispatch_id'], unique=False)
    op.create_table('gym_instances',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('instance_id', sa.Text(), nullable=False),
    sa.Column('servers', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('control_token', sa.Text(), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('discovered_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_gym_instances_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'instance_id', name=op.f('pk_gym_instances'))
    )
    op.create_table('outbox_items',
    sa.Column('item_id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('instance_id', sa.Text(), nullable=False),
    sa.Column('op', sa.Text(), nullable=False),
    sa.Column('rollout_id', sa.Text(), nullable=False),
    sa.Column('gym_attempt', sa.Integer(), nullable=True),
    sa.Column('attempt_id', sa.BigInteger(), nullable=True),
    sa.Column('checkpoint_id', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), server_default='pending', nullable=False),
    sa.Column('claimed_by', sa.Text(), nullable=True),
    sa.Column('claimed_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('servers_done', postgresql.ARRAY(sa.Text()), server_default=sa.text("'{}'::text[]"), nullable=False),
    sa.Column('tries', sa.Integer(), server_default='0', nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("op IN ('retire', 'forget')", name=op.f('ck_outbox_items_op')),
    sa.CheckConstraint("state IN ('pending', 'delivered', 'superseded')", name=op.f('ck_outbox_items_state')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_outbox_items_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('item_id', name=op.f('pk_outbox_items'))
    )
    op.create_index('ix_outbox_items_due', 'outbox_items', ['run_id', 'instance_id', 'op', 'next_attempt_at'], unique=False, postgresql_where=sa.text("state = 'pending'"))
    op.create_table('ownership_leases',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('owner', sa.Text(), nullable=False),
    sa.Column('epoch', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_ownership_leases_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_ownership_leases'))
    )
    op.create_table('prompt_groups',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('group_id', sa.Text(), nullable=False),
    sa.Column('prompt_ref', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('task_digest', sa.Text(), nullable=False),
    sa.Column('task_source', sa.Text(), nullable=True),
    sa.Column('agent_name', sa.Text(), nullable=True),
    sa.Column('restore_level', sa.Text(), nullable=False),
    sa.Column('expected_generations', sa.Integer(), nullable=False),
    sa.Column('target_step', sa.BigInteger(), nullable=True),
    sa.Column('weight_version', sa.Text(), nullable=True),
    sa.Column('group_attempt', sa.Integer(), server_default='0', nullable=False),
    sa.Column('data_attempts_used', sa.Integer(), server_default='0', nullable=False),
    sa.Column('status', sa.Text(), server_default='generating', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("restore_level IN ('turn', 'sibling', 'prompt_group')", name=op.f('ck_prompt_groups_restore_level')),
    sa.CheckConstraint("status IN ('generating', 'ready', 'finalized', 'abandoned')", name=op.f('ck_prompt_groups_status')),
    sa.CheckConstraint('expected_generations >= 1', name=op.f('ck_prompt_groups_expected_generations')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_prompt_groups_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'group_id', name=op.f('pk_prompt_groups'))
    )
    op.create_index(op.f('ix_prompt_groups_run_id_status'), 'prompt_groups', ['run_id', 'status'], unique=False)
    op.create_table('restores',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('restore_id', sa.Text(), nullable=False),
    sa.Column('snapshot_id', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('with_gym_state', sa.Boolean(), nullable=False),
    sa.Column('gym_restore_id', sa.Text(), nullable=True),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_restores_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'restore_id', name=op.f('pk_restores'))
    )
    op.create_table('snapshots',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('snapshot_id', sa.Text(), nullable=False),
    sa.Column('anchor_step', sa.BigInteger(), nullable=False),
    sa.Column('phase', sa.Text(), nullable=False),
    sa.Column('outcome', sa.Text(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('detail', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('owner', sa.Text(), nullable=False),
    sa.Column('gym_checkpoint_id', sa.Text(), nullable=True),
    sa.Column('snapshot_dir', sa.Text(), nullable=True),
    sa.Column('phase_timings', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('candidates', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('gym_manifest', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('cut_staging_keys', postgresql.ARRAY(sa.Text()), nullable=True),
    sa.Column('cut_base_xid', sa.BigInteger(), nullable=True),
    sa.Column('cut_xmin', sa.BigInteger(), nullable=True),
    sa.Column('cut_system_id', sa.Text(), nullable=True),
    sa.Column('data_plane_ref', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('counts', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('gym_parked_seconds', sa.Float(), nullable=True),
    sa.Column('gym_restarted_episodes', sa.Integer(), nullable=True),
    sa.Column('resume_failure', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('abort_requested', sa.Text(), nullable=True),
    sa.Column('cut_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('published_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("outcome IS NULL OR outcome IN ('published', 'failed', 'aborted')", name=op.f('ck_snapshots_outcome')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_snapshots_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'snapshot_id', name=op.f('pk_snapshots'))
    )
    op.create_index(op.f('ix_snapshots_run_id_outcome_published_at'), 'snapshots', ['run_id', 'outcome', 'published_at'], unique=False)
    op.create_index('uq_snapshots_one_open_per_run', 'snapshots', ['run_id'], unique=True, postgresql_where=sa.text('outcome IS NULL'))
    op.create_table('train_steps',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('checkpoint_ref', sa.Text(), nullable=True),
    sa.Column('announced_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('step >= 0', name=op.f('ck_train_steps_step')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_train_steps_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'step', name=op.f('pk_train_steps'))
    )
    op.create_table('gym_participants',
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('instance_id', sa.Text(), nullable=False),
    sa.Column('server_name', sa.Text(), nullable=False),
    sa.Column('base_url', sa.Text(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('participant_name', sa.Text(), nullable=False),
    sa.Column('mode', sa.Text(), nullable=True),
    sa.Column('stage', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['run_id', 'instance_id'], ['gym_instances.run_id', 'gym_instances.instance_id'], name=op.f('fk_gym_participants_run_id_instance_id_gym_instances'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'instance_id', 'server_name', name=op.f('pk_gym_participants')),
    sa.UniqueConstraint('run_id', 'instance_id', 'kind', 'participant_name', name=op.f('uq_gym_participants_run_id_instance_id_kind_participant_name'))
    )

    # By hand (autogenerate does not see functions or triggers): a deleted prompt group takes its
    # siblings and attempts with it, set-based, instead of the per-row ON DELETE CASCADE foreign
    # keys (see ledger/triggers.py, GROUP_CHILDREN_TRIGGER_UP; keep the two identical).
    op.execute(
        "CREATE FUNCTION prompt_groups_drop_children() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        "BEGIN\n"
        "    IF EXISTS (SELECT 1 FROM gone) THEN\n"
        "        DELETE FROM attempts a USING gone g WHERE a.run_id = g.run_id AND a.group_id = g.group_id;\n"
        "        DELETE FROM siblings s USING gone g WHERE s.run_id = g.run_id AND s.group_id = g.group_id;\n"
        "    END IF;\n"
        "    RETURN NULL;\n"
        "END\n"
        "$$"
    )
    op.execute(
        "CREATE TRIGGER prompt_groups_drop_children AFTER DELETE ON prompt_groups REFERENCING OLD TABLE AS gone "
        "FOR EACH STATEMENT EXECUTE FUNCTION prompt_groups_drop_children()"
    )
    # The cut's staging keys are written at the barrier while Gym is parked: stored out of line but
    # not compressed, because compressing them lengthened the park.
    op.execute("ALTER TABLE snapshots ALTER COLUMN cut_staging_keys SET STORAGE EXTERNAL")
    op.execute(SNAPSHOT_GROUPS_VIEW)
    op.execute(SNAPSHOT_ATTEMPTS_VIEW)


def downgrade() -> None:
    op.execute('DROP VIEW snapshot_attempts')
    op.execute('DROP VIEW snapshot_groups')
    op.execute("DROP TRIGGER IF EXISTS prompt_groups_drop_children ON prompt_groups")
    op.execute("DROP FUNCTION IF EXISTS prompt_groups_drop_children()")

    op.drop_table('gym_participants')
    op.drop_table('train_steps')
    op.drop_index('uq_snapshots_one_open_per_run', table_name='snapshots', postgresql_where=sa.text('outcome IS NULL'))
    op.drop_index(op.f('ix_snapshots_run_id_outcome_published_at'), table_name='snapshots')
    op.drop_table('snapshots')
    op.drop_table('restores')
    op.drop_index(op.f('ix_prompt_groups_run_id_status'), table_name='prompt_groups')
    op.drop_table('prompt_groups')
    op.drop_table('ownership_leases')
    op.drop_index('ix_outbox_items_due', table_name='outbox_items', postgresql_where=sa.text("state = 'pending'"))
    op.drop_table('outbox_items')
    op.drop_table('gym_instances')
    op.drop_index(op.f('ix_dispatch_calls_run_id_dispatch_id'), table_name='dispatch_calls')
    op.drop_table('dispatch_calls')
    op.drop_table('snapshot_cut_groups')
    op.drop_table('siblings')
    op.drop_table('runs')
    op.drop_index('uq_attempts_current_per_sibling', table_name='attempts', postgresql_where=sa.text('is_current'))
    op.drop_table('attempts')
    op.execute('DROP TYPE snapshot_sibling')
    op.execute('DROP AGGREGATE ckptc_text_cat(text[])')
