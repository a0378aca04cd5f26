"""The ledger schema (docs/ledger.md#prompt-groups-siblings-and-attempts) as SQLAlchemy 2 typed
models.

The alembic revisions in ``migrations/`` create exactly this schema; a test runs autogenerate
against a migrated database and fails on any difference. Uniqueness rules
(docs/ledger.md#fencing-and-concurrency) live in constraints, not only in code: one current
attempt per sibling (partial unique index), unique rollout ids per run, one non-terminal snapshot
per run, unique ``(run_id, step)`` train steps.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    PrimaryKeyConstraint,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..domain.vocabulary import (
    AttemptStatus,
    GroupStatus,
    OutboxState,
    RetirementState,
    RunState,
)
from .accounting_models import (
    ABANDON_REASONS,
    END_REASONS,
    Effect,
    GroupAdmission,
    RestoreRewoundGroup,
    RestoreWork,
    SnapshotBlocker,
)
from .model_base import (
    ATTEMPT_STATUSES,
    GROUP_STATUSES,
    LEVELS,
    NAMING,
    OUTBOX_OPS,
    OUTBOX_STATES,
    RETIREMENT_STATES,
    RUN_STATES,
    SNAPSHOT_OUTCOMES,
    TS,
    Base,
    in_values,
)
from .snapshot_models import (
    SNAPSHOT_GROUP_COLUMNS,
    SNAPSHOT_SIBLING_FIELDS,
    Snapshot,
    SnapshotChangedGroup,
    SnapshotCutGroup,
    SnapshotCutKey,
    SnapshotGymEntry,
    SnapshotSiblings,
)
from .triggers import (
    CHANGE_TRACKING_PHASES,
    CHANGED_GROUPS_TRIGGERS_DOWN,
    CHANGED_GROUPS_TRIGGERS_UP,
    GROUP_CHILDREN_TRIGGER_DOWN,
    GROUP_CHILDREN_TRIGGER_UP,
)

# Every model, constant and trigger of the schema: alembic's env and the schema tests read them here.
__all__ = [
    "NAMING",
    "RUN_STATES",
    "GROUP_STATUSES",
    "ATTEMPT_STATUSES",
    "RETIREMENT_STATES",
    "SNAPSHOT_OUTCOMES",
    "OUTBOX_OPS",
    "OUTBOX_STATES",
    "LEVELS",
    "Base",
    "TS",
    "Run",
    "RunQuota",
    "GymInstance",
    "GymParticipant",
    "PromptGroup",
    "Sibling",
    "Attempt",
    "DispatchCall",
    "TrainStep",
    "Snapshot",
    "SNAPSHOT_SIBLING_FIELDS",
    "SNAPSHOT_GROUP_COLUMNS",
    "SnapshotSiblings",
    "SnapshotChangedGroup",
    "SnapshotCutKey",
    "SnapshotGymEntry",
    "SnapshotCutGroup",
    "OutboxItem",
    "SchemaCompat",
    "OwnershipLease",
    "Restore",
    "RestoreRowChunk",
    "RESTORE_ROWS_PER_CHUNK",
    "RESTORE_ROW_CHUNK_TEXT_COLUMNS",
    "GroupAdmission",
    "RestoreRewoundGroup",
    "RestoreWork",
    "SnapshotBlocker",
    "Effect",
    "GROUP_CHILDREN_TRIGGER_UP",
    "GROUP_CHILDREN_TRIGGER_DOWN",
    "CHANGE_TRACKING_PHASES",
    "CHANGED_GROUPS_TRIGGERS_UP",
    "CHANGED_GROUPS_TRIGGERS_DOWN",
]

class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        PrimaryKeyConstraint("run_id"),
        CheckConstraint(in_values("state", RUN_STATES), name="state"),
        CheckConstraint("epoch >= 1", name="epoch"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    checkpoint_root: Mapped[str] = mapped_column(Text)
    token_hash: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(Text, server_default=RunState.open)
    epoch: Mapped[int] = mapped_column(BigInteger, server_default="1")
    restored_from_rollout_snapshot: Mapped[str | None] = mapped_column(Text)
    consecutive_snapshot_losses: Mapped[int] = mapped_column(Integer, server_default="0")
    # Snapshots ended failed since the last published one (aborts leave it as it is).
    consecutive_snapshot_failures: Mapped[int] = mapped_column(Integer, server_default="0")
    # Dispatch gate: closed while a snapshot holds it (docs/ledger.md#the-gate).
    gate_snapshot_id: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    closed_at: Mapped[datetime | None] = mapped_column(TS)


class RunQuota(Base):
    """What a run has used of its quotas (docs/configuration.md#limits): the sibling rows it admitted. Kept
    apart from ``runs``: its update serialises a run's admits only from that update to their
    commit, while the run row stays read-locked by every writer."""

    __tablename__ = "run_quotas"
    __table_args__ = (
        PrimaryKeyConstraint("run_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint("admitted_rows >= 0", name="admitted_rows"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    admitted_rows: Mapped[int] = mapped_column(BigInteger, server_default="0")


class GymInstance(Base):
    __tablename__ = "gym_instances"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "instance_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    instance_id: Mapped[str] = mapped_column(Text)
    servers: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # Sent to Gym on every control call, so it cannot be hashed; never returned by the API.
    control_token: Mapped[str] = mapped_column(Text)
    registered_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    discovered_at: Mapped[datetime | None] = mapped_column(TS)


class GymParticipant(Base):
    __tablename__ = "gym_participants"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "instance_id", "server_name"),
        ForeignKeyConstraint(
            ["run_id", "instance_id"],
            ["gym_instances.run_id", "gym_instances.instance_id"],
            ondelete="CASCADE",
        ),
        UniqueConstraint("run_id", "instance_id", "kind", "participant_name"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    instance_id: Mapped[str] = mapped_column(Text)
    server_name: Mapped[str] = mapped_column(Text)
    base_url: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(Text)
    participant_name: Mapped[str] = mapped_column(Text)
    mode: Mapped[str | None] = mapped_column(Text)
    stage: Mapped[int] = mapped_column(Integer)


class PromptGroup(Base):
    __tablename__ = "prompt_groups"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "group_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint(in_values("status", GROUP_STATUSES), name="status"),
        CheckConstraint(in_values("restore_level", LEVELS), name="restore_level"),
        CheckConstraint("expected_generations >= 1", name="expected_generations"),
        CheckConstraint(in_values("abandon_reason", ABANDON_REASONS), name="abandon_reason"),
        Index(None, "run_id", "status"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    group_id: Mapped[str] = mapped_column(Text)
    prompt_ref: Mapped[dict[str, Any]] = mapped_column(JSONB)
    task_digest: Mapped[str] = mapped_column(Text)
    task_source: Mapped[str | None] = mapped_column(Text)
    agent_name: Mapped[str | None] = mapped_column(Text)
    restore_level: Mapped[str] = mapped_column(Text)
    expected_generations: Mapped[int] = mapped_column(Integer)
    target_step: Mapped[int | None] = mapped_column(BigInteger)
    weight_version: Mapped[str | None] = mapped_column(Text)
    group_attempt: Mapped[int] = mapped_column(Integer, server_default="0")
    data_attempts_used: Mapped[int] = mapped_column(Integer, server_default="0")
    status: Mapped[str] = mapped_column(Text, server_default=GroupStatus.generating.value)
    # Why it was abandoned (docs/accounting.md#prompt-conservation); NULL otherwise, or unrecorded.
    abandon_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    ended_at: Mapped[datetime | None] = mapped_column(TS)


class Sibling(Base):
    __tablename__ = "siblings"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "group_id", "generation_index"),
        # No foreign key to ``prompt_groups`` (its per-row check was most of an admit's
        # ``INSERT siblings``): siblings are inserted only with their group, under its lock, and a
        # deleted group takes its siblings and attempts with it through the statement-level
        # trigger ``prompt_groups_drop_children`` (see ``GROUP_CHILDREN_TRIGGER``).
        CheckConstraint("generation_index >= 0", name="generation_index"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    group_id: Mapped[str] = mapped_column(Text)
    generation_index: Mapped[int] = mapped_column(Integer)
    # The current attempt is the sibling's attempt row with is_current (unique partial index).
    row_attempts_used: Mapped[int] = mapped_column(Integer, server_default="0")


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (
        PrimaryKeyConstraint("attempt_id"),
        # No foreign key to ``siblings`` (its per-row check was a large part of ``INSERT attempts``):
        # attempts are inserted only for siblings of a group the transaction holds locked (admit
        # inserts the siblings first, a replacement reuses an existing sibling, a restore inserts
        # the siblings of the groups it recreates), and ``prompt_groups_drop_children`` deletes
        # a deleted group's attempts, as the cascade did.
        UniqueConstraint("run_id", "rollout_id"),
        CheckConstraint(in_values("status", ATTEMPT_STATUSES), name="status"),
        CheckConstraint(in_values("retirement", RETIREMENT_STATES), name="retirement"),
        CheckConstraint("gym_attempt >= 0", name="gym_attempt"),
        CheckConstraint(in_values("end_reason", END_REASONS), name="end_reason"),
        # One current attempt per sibling (docs/ledger.md#fencing-and-concurrency).
        Index(
            "uq_attempts_current_per_sibling",
            "run_id",
            "group_id",
            "generation_index",
            unique=True,
            postgresql_where=text("is_current"),
        ),
        # Deliberately no index on status nor on dispatch_id: a dispatch and a seal then change no
        # indexed column and can stay heap-only updates. "Stream ended" finds a dispatch's rows
        # through ``dispatch_calls``.
        # Room on each page so a dispatch or a seal (no indexed column) is a HOT update: at 40 %
        # a freshly admitted page keeps room for a second version of each of its rows, so the
        # dispatch's update stays on the page.
        {"postgresql_with": {"fillfactor": "40"}},
    )
    attempt_id: Mapped[int] = mapped_column(BigInteger, Identity(always=False))
    run_id: Mapped[str] = mapped_column(Text)
    group_id: Mapped[str] = mapped_column(Text)
    generation_index: Mapped[int] = mapped_column(Integer)
    rollout_id: Mapped[str] = mapped_column(Text)
    gym_instance_id: Mapped[str | None] = mapped_column(Text)
    gym_attempt: Mapped[int] = mapped_column(Integer, server_default="0")
    group_attempt: Mapped[int] = mapped_column(Integer, server_default="0")
    status: Mapped[str] = mapped_column(Text, server_default=AttemptStatus.reserved.value)
    is_current: Mapped[bool] = mapped_column(Boolean, server_default="true")
    refusals: Mapped[int] = mapped_column(Integer, server_default="0")
    receipt: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    reward: Mapped[float | None] = mapped_column(Float)
    mask_sample: Mapped[bool | None] = mapped_column(Boolean)
    staging_keys: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    failure_class: Mapped[str | None] = mapped_column(Text)
    retirement: Mapped[str] = mapped_column(Text, server_default=RetirementState.none.value)
    # Set when Gym holds restored state for this attempt (a continuation at gym_attempt).
    gym_owned: Mapped[bool] = mapped_column(Boolean, server_default="false")
    # The trainer's dispatch this attempt went out in, so "stream ended" can name the missing rows.
    dispatch_id: Mapped[str | None] = mapped_column(Text)
    replaced_by_attempt_id: Mapped[int | None] = mapped_column(BigInteger)
    # The newest train step announced when it was dispatched (docs/ledger.md#stale-continuations).
    policy_version: Mapped[int | None] = mapped_column(BigInteger)
    # Why it ended when neither the trainer nor its group ended it: a restore, or the straggler rule.
    end_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    dispatched_at: Mapped[datetime | None] = mapped_column(TS)
    ended_at: Mapped[datetime | None] = mapped_column(TS)


class DispatchCall(Base):
    """The attempts one dispatch call sent, so "stream ended" can find a dispatch's rows without
    an index on ``attempts.dispatch_id`` (which made every dispatch update a non-HOT one). A
    candidate list only: the attempt's own ``dispatch_id`` stays the truth (a refusal clears it,
    a restore may delete the attempt), so the lookup joins back and checks it."""

    __tablename__ = "dispatch_calls"
    __table_args__ = (
        PrimaryKeyConstraint("call_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        Index(None, "run_id", "dispatch_id"),
    )
    call_id: Mapped[int] = mapped_column(BigInteger, Identity(always=False))
    run_id: Mapped[str] = mapped_column(Text)
    dispatch_id: Mapped[str] = mapped_column(Text)
    attempt_ids: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())


class TrainStep(Base):
    """Every announce of a train step. A restore retires the steps announced after its anchor
    (their lineage is gone); they stay as history, and the step may be announced again."""

    __tablename__ = "train_steps"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "announce_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint("step >= 0", name="step"),
        CheckConstraint("(retired_at IS NULL) = (retired_by_restore IS NULL)", name="retired"),
        Index("uq_train_steps_current", "run_id", "step", unique=True, postgresql_where=text("retired_at IS NULL")),
    )
    run_id: Mapped[str] = mapped_column(Text)
    announce_id: Mapped[int] = mapped_column(BigInteger, Identity(always=False))
    step: Mapped[int] = mapped_column(BigInteger)
    checkpoint_ref: Mapped[str | None] = mapped_column(Text)
    announced_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    retired_at: Mapped[datetime | None] = mapped_column(TS)
    retired_by_restore: Mapped[str | None] = mapped_column(Text)



class OutboxItem(Base):
    """One retire (an episode) or forget (a rollout id) owed to one Gym instance (docs/ledger.md#the-outbox)."""

    __tablename__ = "outbox_items"
    __table_args__ = (
        PrimaryKeyConstraint("item_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint(in_values("op", OUTBOX_OPS), name="op"),
        CheckConstraint(in_values("state", OUTBOX_STATES), name="state"),
        Index("ix_outbox_items_due", "run_id", "instance_id", "op", "next_attempt_at", postgresql_where=text(f"state = '{OutboxState.pending}'")),
    )
    item_id: Mapped[int] = mapped_column(BigInteger, Identity(always=False))
    run_id: Mapped[str] = mapped_column(Text)
    instance_id: Mapped[str] = mapped_column(Text)
    op: Mapped[str] = mapped_column(Text)
    rollout_id: Mapped[str] = mapped_column(Text)
    gym_attempt: Mapped[int | None] = mapped_column(Integer)
    attempt_id: Mapped[int | None] = mapped_column(BigInteger)
    # Gym checkpoint id to send: 'retire'/'forget' while idle, or a restore id for restore cleanup.
    checkpoint_id: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(Text, server_default=OutboxState.pending)
    # A delivery claim: who is sending it and until when (a crashed sender's claim expires).
    claimed_by: Mapped[str | None] = mapped_column(Text)
    claimed_until: Mapped[datetime | None] = mapped_column(TS)
    # Participants that acknowledged this item, so a restarted delivery skips finished stages.
    servers_done: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'::text[]"))
    tries: Mapped[int] = mapped_column(Integer, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    delivered_at: Mapped[datetime | None] = mapped_column(TS)


class SchemaCompat(Base):
    """One row: the oldest revision whose code runs on this schema (``runs_on_from``), written by
    every migration run (``migrations/env.py``) and read by replicas of every release
    (``ledger.schema``)."""

    __tablename__ = "schema_compat"
    __table_args__ = (
        PrimaryKeyConstraint("id"),
        CheckConstraint("id", name="one_row"),
    )
    id: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    runs_on_from: Mapped[str] = mapped_column(Text)


class OwnershipLease(Base):
    """Who drives a run's background work (snapshots, outbox); the epoch fences a lost owner."""

    __tablename__ = "ownership_leases"
    __table_args__ = (
        PrimaryKeyConstraint("run_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    owner: Mapped[str] = mapped_column(Text)
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime] = mapped_column(TS)


class Restore(Base):
    __tablename__ = "restores"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "restore_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    restore_id: Mapped[str] = mapped_column(Text)
    snapshot_id: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(Text)
    with_gym_state: Mapped[bool] = mapped_column(Boolean)
    gym_restore_id: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    ended_at: Mapped[datetime | None] = mapped_column(TS)


class RestoreRowChunk(Base):
    """The rows an applied restore answers (what the trainer sends next), in answer order, as
    column arrays of up to ``RESTORE_ROWS_PER_CHUNK`` rows each: written with the rewind in its
    transaction (the idempotent answer commits with the ledger change) and read back by page.
    A large restore answers hundreds of thousands of rows, far cheaper to store as column chunks
    than as one JSON document on ``restores.result``. Capture keys are not stored: ``rollout_id``
    at ``gym_attempt`` 0, else ``<rollout_id>-a<n>``. The text arrays are stored uncompressed
    (``SET STORAGE EXTERNAL`` in the migration): compression made the write slower."""

    __tablename__ = "restore_row_chunks"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "restore_id", "chunk"),
        ForeignKeyConstraint(["run_id", "restore_id"], ["restores.run_id", "restores.restore_id"], ondelete="CASCADE"),
        CheckConstraint("chunk >= 0", name="chunk"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    restore_id: Mapped[str] = mapped_column(Text)
    chunk: Mapped[int] = mapped_column(Integer)
    group_ids: Mapped[list[str]] = mapped_column(ARRAY(Text))
    generation_indexes: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    dispositions: Mapped[list[str]] = mapped_column(ARRAY(Text))
    rollout_ids: Mapped[list[str]] = mapped_column(ARRAY(Text))
    gym_attempts: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    group_attempts: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    instance_ids: Mapped[list[str | None]] = mapped_column(ARRAY(Text))
    replaces_rollout_ids: Mapped[list[str | None]] = mapped_column(ARRAY(Text))
    # Null in chunks stored before rows carried a reason.
    reasons: Mapped[list[str] | None] = mapped_column(ARRAY(Text), nullable=True)


RESTORE_ROWS_PER_CHUNK = 10_000
RESTORE_ROW_CHUNK_TEXT_COLUMNS = ("group_ids", "dispositions", "rollout_ids", "instance_ids", "replaces_rollout_ids", "reasons")
