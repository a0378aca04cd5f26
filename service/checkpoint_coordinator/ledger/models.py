"""The ledger schema (recovery-ledger.md section 1) as SQLAlchemy 2 typed models.

The alembic revisions in ``migrations/`` create exactly this schema; a test runs autogenerate
against a migrated database and fails on any difference. Uniqueness rules of section 2 live in
constraints, not only in code: one current attempt per sibling (partial unique index), unique
rollout ids per run, one non-terminal snapshot per run, unique ``(run_id, step)`` train steps.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.types import UserDefinedType
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..domain.snapshot_state import SnapshotOutcome, SnapshotPhase
from ..domain.vocabulary import AttemptStatus, GroupStatus, RetirementState

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RUN_STATES = ("open", "closed")
GROUP_STATUSES = tuple(s.value for s in GroupStatus)
ATTEMPT_STATUSES = tuple(s.value for s in AttemptStatus)
RETIREMENT_STATES = tuple(s.value for s in RetirementState)
SNAPSHOT_OUTCOMES = tuple(o.value for o in SnapshotOutcome)
OUTBOX_OPS = ("retire", "forget")
OUTBOX_STATES = ("pending", "delivered", "superseded")
LEVELS = ("turn", "sibling", "prompt_group")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


TS = DateTime(timezone=True)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        PrimaryKeyConstraint("run_id"),
        CheckConstraint(_in("state", RUN_STATES), name="state"),
        CheckConstraint("epoch >= 1", name="epoch"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    checkpoint_root: Mapped[str] = mapped_column(Text)
    token_hash: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(Text, server_default="open")
    epoch: Mapped[int] = mapped_column(BigInteger, server_default="1")
    restored_from_rollout_snapshot: Mapped[str | None] = mapped_column(Text)
    consecutive_snapshot_losses: Mapped[int] = mapped_column(Integer, server_default="0")
    # Snapshots ended failed since the last published one (aborts leave it as it is).
    consecutive_snapshot_failures: Mapped[int] = mapped_column(Integer, server_default="0")
    # Dispatch gate: closed while a snapshot holds it (section 4.2 / 5.2).
    gate_snapshot_id: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    closed_at: Mapped[datetime | None] = mapped_column(TS)


class RunQuota(Base):
    """What a run has used of its quotas (README, "Limits"): the sibling rows it admitted. Kept
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
        CheckConstraint(_in("status", GROUP_STATUSES), name="status"),
        CheckConstraint(_in("restore_level", LEVELS), name="restore_level"),
        CheckConstraint("expected_generations >= 1", name="expected_generations"),
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
        # No foreign key to ``siblings`` (its per-row check was 35-40 % of ``INSERT attempts``):
        # attempts are inserted only for siblings of a group the transaction holds locked (admit
        # inserts the siblings first, a replacement reuses an existing sibling, a restore inserts
        # the siblings of the groups it recreates), and ``prompt_groups_drop_children`` deletes
        # a deleted group's attempts, as the cascade did.
        UniqueConstraint("run_id", "rollout_id"),
        CheckConstraint(_in("status", ATTEMPT_STATUSES), name="status"),
        CheckConstraint(_in("retirement", RETIREMENT_STATES), name="retirement"),
        CheckConstraint("gym_attempt >= 0", name="gym_attempt"),
        # One current attempt per sibling (section 2).
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
        # dispatch's update stays on the page (see bench/README.md ledger_ingest for what it
        # saves and costs).
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


class Snapshot(Base):
    __tablename__ = "snapshots"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "snapshot_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint(f"outcome IS NULL OR {_in('outcome', SNAPSHOT_OUTCOMES)}", name="outcome"),
        # One non-terminal snapshot per run (section 2).
        Index("uq_snapshots_one_open_per_run", "run_id", unique=True, postgresql_where=text("outcome IS NULL")),
        Index(None, "run_id", "outcome", "published_at"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    snapshot_id: Mapped[str] = mapped_column(Text)
    anchor_step: Mapped[int] = mapped_column(BigInteger)
    # A stopping snapshot (section 5.1): Gym is left parked after the cut and dispatch stays
    # refused until a restore or a reopen; it must end by ``deadline_at``.
    stop: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    deadline_at: Mapped[datetime | None] = mapped_column(TS)
    phase: Mapped[str] = mapped_column(Text)
    outcome: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    owner: Mapped[str] = mapped_column(Text)
    gym_checkpoint_id: Mapped[str | None] = mapped_column(Text)
    snapshot_dir: Mapped[str | None] = mapped_column(Text)
    phase_timings: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    candidates: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    gym_manifest: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    cut_staging_keys: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    # The barrier's answer against the pre-cut's keys (sorted), when a pre-cut was taken.
    cut_keys_added: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    cut_keys_removed: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    # The pre-cut (``ledger.snapshots.pre_cut``): the 64-bit xmin of the snapshot its copy was
    # read under. At the barrier, only groups with a row written by a transaction at or after it
    # (or gone since) are copied again; NULL while no pre-cut was taken.
    cut_base_xid: Mapped[int | None] = mapped_column(BigInteger)
    # The barrier (``ledger.snapshots.take_cut``): the 64-bit xmin of a snapshot taken once the
    # barrier's transaction held the run lock and before it copied anything, so every row version
    # written by an older transaction was committed before the cut read the ledger and is the
    # version the cut holds.
    # A restore compares only newer rows with the cut (``ledger.restore``); NULL for cuts taken
    # before this column existed and for imported ones (then every row is compared).
    cut_xmin: Mapped[int | None] = mapped_column(BigInteger)
    # ... and the PostgreSQL cluster it counts in (``pg_control_system().system_identifier``): xids
    # mean nothing in another cluster (a logical dump loaded elsewhere writes every row anew).
    cut_system_id: Mapped[str | None] = mapped_column(Text)
    data_plane_ref: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    counts: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    gym_parked_seconds: Mapped[float | None] = mapped_column(Float)
    gym_restarted_episodes: Mapped[int | None] = mapped_column(Integer)
    resume_failure: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # Set by a train-step announce (or a cancel) that must abort the snapshot before its cut.
    abort_requested: Mapped[str | None] = mapped_column(Text)
    cut_at: Mapped[datetime | None] = mapped_column(TS)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    published_at: Mapped[datetime | None] = mapped_column(TS)
    ended_at: Mapped[datetime | None] = mapped_column(TS)


# The fields of one sibling (and its current attempt) in a snapshot's ledger cut, in this order:
# the composite type ``snapshot_sibling`` (created by the migration, which autogenerate cannot
# express) and the columns of the ``snapshot_attempts`` view.
SNAPSHOT_SIBLING_FIELDS = (
    ("attempt_id", "bigint"), ("generation_index", "integer"), ("row_attempts_used", "integer"), ("rollout_id", "text"),
    ("gym_instance_id", "text"), ("gym_attempt", "integer"), ("group_attempt", "integer"), ("status", "text"),
    ("refusals", "integer"), ("receipt", "jsonb"), ("reward", "double precision"), ("mask_sample", "boolean"),
    ("staging_keys", "text[]"), ("gym_owned", "boolean"),
)
# The group columns of a cut row, also the columns of the ``snapshot_groups`` view after run_id, snapshot_id.
SNAPSHOT_GROUP_COLUMNS = (
    "group_id", "prompt_ref", "task_digest", "task_source", "agent_name", "restore_level", "expected_generations",
    "target_step", "weight_version", "group_attempt", "data_attempts_used", "status",
)


class SnapshotSiblings(UserDefinedType[Any]):
    """``snapshot_sibling[]``: a cut group's siblings, one composite value each."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "snapshot_sibling[]"


class SnapshotChangedGroup(Base):
    """The groups of a run written while its pending snapshot may hold a pre-cut (phases
    ``CHANGE_TRACKING_PHASES``): fed by statement triggers (``CHANGED_GROUPS_TRIGGERS_UP``) on the
    tables a cut copies, so that the barrier re-copies exactly these groups instead of looking
    for changes across the whole run. Emptied by the pre-cut before its copy, by the barrier
    as it re-copies, and when the snapshot ends."""

    __tablename__ = "snapshot_changed_groups"
    __table_args__ = (PrimaryKeyConstraint("run_id", "group_id"),)
    run_id: Mapped[str] = mapped_column(Text)
    group_id: Mapped[str] = mapped_column(Text)


class SnapshotCutKey(Base):
    """The staging keys of a pending snapshot's cut groups while it is pending, one row per key
    with the number of cut groups that name it (the Gym manifest's keys stay in the manifest and
    are unioned in where the keys are read). Written after the pre-cut, for the groups it copied,
    by a transaction of its own (``ledger.snapshots.pre_cut``); the barrier then changes only the keys of the groups it copies again and looks the manifest's up,
    so its cost (and its answer, ``added``/``removed`` against the pre-cut's keys) grows with what
    changed, not with the run. At the snapshot's end the keys move into
    ``snapshots.cut_staging_keys`` (published) and these rows go.

    Unlogged (migration 0011): the rows are written after the pre-cut commits, while Gym may be
    parked, and nothing depends on them surviving a crash. A barrier that needs them (groups to
    copy again, a Gym entry stored without its ``new_keys``) and finds none copies the whole run,
    and the cut's keys are then read from its rows (``ledger.staging_keys.KEYS``)."""

    __tablename__ = "snapshot_cut_keys"
    # No foreign key, as for the cut's groups: written and deleted with them.
    __table_args__ = (PrimaryKeyConstraint("run_id", "snapshot_id", "key"), {"prefixes": ["UNLOGGED"]})
    run_id: Mapped[str] = mapped_column(Text)
    snapshot_id: Mapped[str] = mapped_column(Text)
    # Byte order: the keys are answered sorted by code point, and the key's index gives that order.
    key: Mapped[str] = mapped_column(Text(collation="C"))
    refs: Mapped[int] = mapped_column(Integer)


class SnapshotGymEntry(Base):
    """A pending snapshot's Gym manifest, one row per instance, stored as soon as that instance's
    commit is validated (while Gym still commits the others), so that no manifest is written
    while Gym is parked and waits. ``new_keys``: the entry's staging keys that the pre-cut's key
    rows lack (NULL when no pre-cut was in), what the barrier adds for the manifest. At the
    snapshot's end the entries are joined into ``snapshots.gym_manifest`` and these rows go.
    ``entry`` and ``new_keys`` are stored uncompressed (``SET STORAGE EXTERNAL``, migrations 0009
    and 0010): the last entry is written while Gym is parked, and compressing it was about half of
    that write."""

    __tablename__ = "snapshot_gym_entries"
    __table_args__ = (PrimaryKeyConstraint("run_id", "snapshot_id", "instance_id"),)
    run_id: Mapped[str] = mapped_column(Text)
    snapshot_id: Mapped[str] = mapped_column(Text)
    instance_id: Mapped[str] = mapped_column(Text)
    entry: Mapped[dict[str, Any]] = mapped_column(JSONB)
    new_keys: Mapped[list[str] | None] = mapped_column(ARRAY(Text(collation="C")))


class SnapshotCutGroup(Base):
    """Immutable copy of a live prompt group and its siblings (each with its current attempt) at a
    snapshot's ledger cut: one row per group, the siblings in one array of ``snapshot_sibling``.

    One row per group, not per sibling: the cut inserts one row and primary-key entry per group
    instead of one per group and per sibling (the per-row B-tree insert into the old per-sibling
    table's key was most of the cut's time). Readers use the views ``snapshot_groups`` (the group columns)
    and ``snapshot_attempts`` (one row per sibling, ``unnest`` of the array), which have the columns
    of the former tables; their ``run_id`` / ``snapshot_id`` conditions reach this table's key.
    Writers go through ``ledger.snapshots.insert_cut_rows`` (or the cut's own statement).
    ``toast_tuple_target`` 8160: a group row of a few kilobytes stays inline and is not run
    through compression (the cut's data barely compresses and pglz costs CPU).
    """

    __tablename__ = "snapshot_cut_groups"
    # No foreign key to ``snapshots``: its per-row trigger slowed the cut. The rows are written
    # only by the cut (and the import) in the transaction that holds their snapshot row FOR
    # UPDATE, and deleted with it by retention (``ledger.snapshots.end``).
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "snapshot_id", "group_id"),
        {"postgresql_with": {"toast_tuple_target": "8160"}},
    )
    run_id: Mapped[str] = mapped_column(Text)
    snapshot_id: Mapped[str] = mapped_column(Text)
    group_id: Mapped[str] = mapped_column(Text)
    prompt_ref: Mapped[dict[str, Any]] = mapped_column(JSONB)
    task_digest: Mapped[str] = mapped_column(Text)
    task_source: Mapped[str | None] = mapped_column(Text)
    agent_name: Mapped[str | None] = mapped_column(Text)
    restore_level: Mapped[str] = mapped_column(Text)
    expected_generations: Mapped[int] = mapped_column(Integer)
    target_step: Mapped[int | None] = mapped_column(BigInteger)
    weight_version: Mapped[str | None] = mapped_column(Text)
    group_attempt: Mapped[int] = mapped_column(Integer)
    data_attempts_used: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(Text)
    siblings: Mapped[Any] = mapped_column(SnapshotSiblings())
    # The staging keys of the group's sealed and returned siblings, written by the cut itself
    # (NULL from other writers): the barrier's answer is their union with the Gym manifest's.
    staging_keys: Mapped[list[str] | None] = mapped_column(ARRAY(Text))


class OutboxItem(Base):
    """One retire (an episode) or forget (a rollout id) owed to one Gym instance (section 7)."""

    __tablename__ = "outbox_items"
    __table_args__ = (
        PrimaryKeyConstraint("item_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint(_in("op", OUTBOX_OPS), name="op"),
        CheckConstraint(_in("state", OUTBOX_STATES), name="state"),
        Index("ix_outbox_items_due", "run_id", "instance_id", "op", "next_attempt_at", postgresql_where=text("state = 'pending'")),
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
    state: Mapped[str] = mapped_column(Text, server_default="pending")
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


# Written by hand into the migration (autogenerate does not see functions or triggers); keep the
# two in step. It replaces the ``ON DELETE CASCADE`` foreign keys ``siblings -> prompt_groups``
# and ``attempts -> siblings``, whose per-row checks were most of the cost of an admit: one
# set-based delete per statement that removed groups (the restore's rewind, or a run's deletion
# cascading to its groups) instead of a check per inserted row.
GROUP_CHILDREN_TRIGGER_UP = (
    "CREATE FUNCTION prompt_groups_drop_children() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "    IF EXISTS (SELECT 1 FROM gone) THEN\n"
    "        DELETE FROM attempts a USING gone g WHERE a.run_id = g.run_id AND a.group_id = g.group_id;\n"
    "        DELETE FROM siblings s USING gone g WHERE s.run_id = g.run_id AND s.group_id = g.group_id;\n"
    "    END IF;\n"
    "    RETURN NULL;\n"
    "END\n"
    "$$",
    "CREATE TRIGGER prompt_groups_drop_children AFTER DELETE ON prompt_groups REFERENCING OLD TABLE AS gone "
    "FOR EACH STATEMENT EXECUTE FUNCTION prompt_groups_drop_children()",
)
GROUP_CHILDREN_TRIGGER_DOWN = (
    "DROP TRIGGER IF EXISTS prompt_groups_drop_children ON prompt_groups",
    "DROP FUNCTION IF EXISTS prompt_groups_drop_children()",
)


#: Phases in which a pending snapshot's pre-cut may be taken or may wait for its barrier: writes
#: to the cut's tables are then recorded in ``snapshot_changed_groups``.
CHANGE_TRACKING_PHASES = (SnapshotPhase.prepare, SnapshotPhase.commit, SnapshotPhase.drain, SnapshotPhase.data_plane)
_TRACKED = ", ".join(f"'{p.value}'" for p in CHANGE_TRACKING_PHASES)
# (table, event, transition table): a statement on a cut table that wrote rows of a run whose
# snapshot is in a tracking phase records their group ids. One open snapshot lookup (a partial
# index of the open snapshots) per statement; nothing more when none is tracking.
_CHANGED_GROUPS_EVENTS = tuple(
    (table, event, "OLD" if event == "DELETE" else "NEW")
    for table in ("prompt_groups", "siblings", "attempts")
    for event in ("INSERT", "UPDATE", "DELETE")
)
CHANGED_GROUPS_TRIGGERS_UP = (
    "CREATE FUNCTION ckptc_note_changed_groups() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "DECLARE tracked text[];\n"
    "BEGIN\n"
    f"    SELECT array_agg(run_id) INTO tracked FROM snapshots WHERE outcome IS NULL AND cut_at IS NULL AND phase IN ({_TRACKED});\n"
    "    IF tracked IS NOT NULL THEN\n"
    "        INSERT INTO snapshot_changed_groups (run_id, group_id)\n"
    "        SELECT DISTINCT c.run_id, c.group_id FROM changed_rows c WHERE c.run_id = ANY(tracked) ORDER BY 1, 2\n"
    # An update, not DO NOTHING: it locks the row, so the pre-cut's DELETE waits for this
    # writer to commit and its copy then sees the write (DO NOTHING takes no lock, and a group
    # recorded before could be copied without this write and never recorded again).
    "        ON CONFLICT (run_id, group_id) DO UPDATE SET group_id = EXCLUDED.group_id;\n"
    "    END IF;\n"
    "    RETURN NULL;\n"
    "END\n"
    "$$",
    *(
        f"CREATE TRIGGER ckptc_changed_groups_{event.lower()} AFTER {event} ON {table} REFERENCING {which} TABLE AS changed_rows "
        "FOR EACH STATEMENT EXECUTE FUNCTION ckptc_note_changed_groups()"
        for table, event, which in _CHANGED_GROUPS_EVENTS
    ),
)
CHANGED_GROUPS_TRIGGERS_DOWN = (
    *(f"DROP TRIGGER IF EXISTS ckptc_changed_groups_{event.lower()} ON {table}" for table, event, _ in _CHANGED_GROUPS_EVENTS),
    "DROP FUNCTION IF EXISTS ckptc_note_changed_groups()",
)
