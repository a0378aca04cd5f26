"""The pending snapshot: its state machine and the one writer of a snapshot's phase and outcome
(docs/architecture.md#the-pending-snapshot)."""

from .ledger_port import LedgerStore
from .machine import PendingSnapshot
from .ownership import Created, create_in_request, end_orphan, take_over
from .support import (
    SHUTDOWN_GRACE_S,
    MonotonicClock,
    Opened,
    SnapshotContext,
    outcome_of,
    wait_event,
)

__all__ = [
    "SHUTDOWN_GRACE_S", "Created", "LedgerStore", "MonotonicClock", "Opened", "PendingSnapshot", "SnapshotContext",
    "create_in_request", "end_orphan", "outcome_of", "take_over", "wait_event",
]
