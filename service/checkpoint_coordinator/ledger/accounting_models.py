"""The accounting tables of the ledger schema (docs/accounting.md): what a run's accounting reads
beside the live ledger, because a restore removes or rewrites the rows it would otherwise read;
and the effect journal (docs/effects.md). Kept apart from the live ledger's tables (``models``,
which re-exports these)."""

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
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..domain.vocabulary import AbandonReason, EffectState, OrphanReason, WorkFate, WorkReason
from .model_base import TS, Base, in_values

#: ``attempts.end_reason``: why an attempt ended other than by the trainer's report.
END_REASONS = (WorkReason.straggler.value, WorkReason.retired_by_restore.value)
ABANDON_REASONS = tuple(r.value for r in AbandonReason)
WORK_FATES = tuple(f.value for f in WorkFate)
WORK_REASONS = tuple(r.value for r in WorkReason)


class GroupAdmission(Base):
    """Groups admitted, one row per admit call that inserted any (``restore_id`` set: groups a
    restore put back after an earlier one had rewound them). Counted apart from the groups
    themselves, so a group that left the ledger unrecorded shows as a gap."""

    __tablename__ = "group_admissions"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "admission_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint("groups >= 1", name="groups"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    admission_id: Mapped[int] = mapped_column(BigInteger, Identity(always=False))
    groups: Mapped[int] = mapped_column(Integer)
    restore_id: Mapped[str | None] = mapped_column(Text)
    admitted_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())


class RestoreRewoundGroup(Base):
    """A group a restore removed because it was admitted after the restored cut."""

    __tablename__ = "restore_rewound_groups"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "restore_id", "group_id"),
        ForeignKeyConstraint(["run_id", "restore_id"], ["restores.run_id", "restores.restore_id"], ondelete="CASCADE"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    restore_id: Mapped[str] = mapped_column(Text)
    group_id: Mapped[str] = mapped_column(Text)
    admitted_at: Mapped[datetime] = mapped_column(TS)


class RestoreWork(Base):
    """The rollout-seconds of the attempts a restore continued, replaced or ended, summed by
    instance, level, fate and reason. ``found``: work that was in flight or sealed when the
    restore came (not already thrown away). ``kept``: the attempts stay in the ledger (their
    work is read there), so the run's totals skip the row."""

    __tablename__ = "restore_work"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "restore_id", "item"),
        ForeignKeyConstraint(["run_id", "restore_id"], ["restores.run_id", "restores.restore_id"], ondelete="CASCADE"),
        CheckConstraint(in_values("fate", WORK_FATES), name="fate"),
        CheckConstraint(in_values("reason", WORK_REASONS), name="reason"),
        CheckConstraint("seconds >= 0", name="seconds"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    restore_id: Mapped[str] = mapped_column(Text)
    item: Mapped[int] = mapped_column(Integer)
    instance_id: Mapped[str | None] = mapped_column(Text)
    restore_level: Mapped[str] = mapped_column(Text)
    fate: Mapped[str] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    found: Mapped[bool] = mapped_column(Boolean)
    kept: Mapped[bool] = mapped_column(Boolean)
    attempts: Mapped[int] = mapped_column(BigInteger)
    seconds: Mapped[float] = mapped_column(Float)


class SnapshotBlocker(Base):
    """An episode that kept a snapshot from its cut: named by Gym's prepare, or still running
    when the drain gave up (docs/ledger.md#stragglers)."""

    __tablename__ = "snapshot_blockers"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "snapshot_id", "rollout_id"),
        ForeignKeyConstraint(["run_id", "snapshot_id"], ["snapshots.run_id", "snapshots.snapshot_id"], ondelete="CASCADE"),
    )
    run_id: Mapped[str] = mapped_column(Text)
    snapshot_id: Mapped[str] = mapped_column(Text)
    rollout_id: Mapped[str] = mapped_column(Text)
    attempt_id: Mapped[int | None] = mapped_column(BigInteger)
    instance_id: Mapped[str | None] = mapped_column(Text)


EFFECT_STATES = tuple(s.value for s in EffectState)
ORPHAN_REASONS = tuple(r.value for r in OrphanReason)


class Effect(Base):
    """One call of a tool with an effect outside Gym (docs/effects.md): begun, completed with its
    result, or abandoned; an orphan once the timeline it was made in was discarded."""

    __tablename__ = "effects"
    __table_args__ = (
        PrimaryKeyConstraint("run_id", "effect_id"),
        ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        CheckConstraint(in_values("state", EFFECT_STATES), name="state"),
        CheckConstraint(in_values("orphan_reason", ORPHAN_REASONS), name="orphan_reason"),
        CheckConstraint("(orphaned_at IS NULL) = (orphan_reason IS NULL)", name="orphaned"),
        CheckConstraint("seq >= 0", name="seq"),
        CheckConstraint(f"live = (orphaned_at IS NULL AND state <> '{EffectState.abandoned}')", name="live"),
        # One live record per key: an orphaned or abandoned one leaves the key to a new one. On
        # ``live``, not on ``state``: a completion then changes no indexed column and is a HOT
        # update, kept on its page by the fillfactor's room (docs/effects.md#cost).
        Index("uq_effects_live_key", "run_id", "rollout_id", "seq", unique=True, postgresql_where=text("live")),
        Index("ix_effects_orphans", "run_id", "effect_id", postgresql_where=text("orphaned_at IS NOT NULL")),
        {"postgresql_with": {"fillfactor": "90"}},
    )
    run_id: Mapped[str] = mapped_column(Text)
    effect_id: Mapped[int] = mapped_column(BigInteger, Identity(always=False))
    rollout_id: Mapped[str] = mapped_column(Text)
    seq: Mapped[int] = mapped_column(Integer)
    effect: Mapped[str] = mapped_column(Text)
    digest: Mapped[str] = mapped_column(Text)
    # The begin's idempotency id: a repeat of the same begin (a lost reply) proceeds again.
    call_id: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(Text, server_default=EffectState.in_progress.value)
    result: Mapped[Any | None] = mapped_column(JSONB)
    attempt_id: Mapped[int] = mapped_column(BigInteger)
    gym_attempt: Mapped[int] = mapped_column(Integer)
    begun_at: Mapped[datetime] = mapped_column(TS, server_default=func.now())
    completed_at: Mapped[datetime | None] = mapped_column(TS)
    # Set by the restore that continued the episode from a cut older than this effect: the
    # continuation must make it again before it seals, or it becomes an orphan (not_repeated).
    pending_restore: Mapped[str | None] = mapped_column(Text)
    orphaned_at: Mapped[datetime | None] = mapped_column(TS)
    orphan_reason: Mapped[str | None] = mapped_column(Text)
    orphaned_by: Mapped[str | None] = mapped_column(Text)
    # Neither orphaned nor abandoned (``ck_effects_live``): cleared by whatever orphans or abandons.
    live: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
