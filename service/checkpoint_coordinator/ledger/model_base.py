"""What every ledger model shares: the declarative base with the constraint naming convention,
the timestamp type and the value sets of the check constraints. Kept apart so that the live
ledger's tables (``models``) and the snapshots' (``snapshot_models``) stand on one base."""

from __future__ import annotations

from sqlalchemy import DateTime, MetaData
from sqlalchemy.orm import DeclarativeBase

from ..domain.levels import RestoreLevel
from ..domain.snapshot_state import SnapshotOutcome
from ..domain.vocabulary import (
    AttemptStatus,
    GroupStatus,
    OutboxOp,
    OutboxState,
    RetirementState,
    RunState,
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RUN_STATES = tuple(s.value for s in RunState)
GROUP_STATUSES = tuple(s.value for s in GroupStatus)
ATTEMPT_STATUSES = tuple(s.value for s in AttemptStatus)
RETIREMENT_STATES = tuple(s.value for s in RetirementState)
SNAPSHOT_OUTCOMES = tuple(o.value for o in SnapshotOutcome)
OUTBOX_OPS = tuple(o.value for o in OutboxOp)
OUTBOX_STATES = tuple(s.value for s in OutboxState)
LEVELS = tuple(lv.value for lv in RestoreLevel)


def in_values(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


TS = DateTime(timezone=True)
