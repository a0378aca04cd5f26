"""The snapshot tables of the ledger schema (docs/ledger.md#snapshots): a snapshot's row, its
ledger cut (one row per group, the siblings in one array) and what a pending snapshot keeps
while it runs (changed groups, staging keys, Gym manifest entries). Kept apart from the live
ledger's tables (``models``, which re-exports these)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKeyConstraint,
    Index,
    Integer,
    PrimaryKeyConstraint,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import UserDefinedType

from .model_base import SNAPSHOT_OUTCOMES, TS, Base, in_values


class Snapshot(Base):
    __tablename__ = "snapshots"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "snapshot_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint(f"outcome IS NULL OR {in_values('outcome', SNAPSHOT_OUTCOMES)}", name="outcome"),
        # One non-terminal snapshot per run (docs/ledger.md#fencing-and-concurrency).
        Index("uq_snapshots_one_open_per_run", "run_id", unique=True, postgresql_where=text("outcome IS NULL")),
        Index(None, "run_id", "outcome", "published_at"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    snapshot_id: Mapped[str] = mapped_column(Text)
    anchor_step: Mapped[int] = mapped_column(BigInteger)
    # A stopping snapshot (docs/ledger.md#stopping-snapshots): Gym is left parked after the cut and dispatch stays
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
