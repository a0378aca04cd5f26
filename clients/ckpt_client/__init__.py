"""Thin trainer client of the checkpoint coordinator.

Depends only on httpx and the standard library. Two flavours share one sans-IO core:
:class:`CoordinatorClient` (blocking) and :class:`AsyncCoordinatorClient` (asyncio).
See README.md in this package for a trainer integration example.
"""

from __future__ import annotations

from ._core import RETRY_STATUSES, RetryPolicy
from .aio import AsyncCoordinatorClient
from .errors import (
    BatchRefused,
    Conflict,
    CoordinatorError,
    Fenced,
    Forbidden,
    GateClosed,
    InvalidRequest,
    NotAwaitingBarrier,
    SnapshotNotAwaiting,
    NotFound,
    ProtocolError,
    RefusedRow,
    RunClosed,
    SnapshotFailed,
    SnapshotTimeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    Unreachable,
)
from .helpers import batched, new_id
from .models import (
    AdmitResult,
    AdmittedGroup,
    AttemptInfo,
    BarrierResult,
    DataPlaneRef,
    DispatchResult,
    FailedRow,
    FailResult,
    GroupDetail,
    GroupNext,
    GroupOutcome,
    GroupSpec,
    GroupsResult,
    GymInstance,
    GymRegistration,
    LiveCounts,
    OutboxPage,
    PlanRow,
    RefusedResult,
    RestorePlan,
    RestoreResult,
    RowResult,
    Run,
    SealedRow,
    SealResult,
    SendRow,
    SiblingInfo,
    Snapshot,
    StreamEndedResult,
    TrainStep,
)
from .sync import CoordinatorClient

__version__ = "0.1.0"

__all__ = [
    "CoordinatorClient",
    "AsyncCoordinatorClient",
    "RetryPolicy",
    "RETRY_STATUSES",
    "batched",
    "new_id",
    # inputs
    "GroupSpec",
    "SealedRow",
    "FailedRow",
    "DataPlaneRef",
    "GymInstance",
    # results
    "SendRow",
    "AdmittedGroup",
    "AdmitResult",
    "DispatchResult",
    "RefusedResult",
    "RowResult",
    "SealResult",
    "GroupNext",
    "FailResult",
    "StreamEndedResult",
    "GroupOutcome",
    "GroupsResult",
    "LiveCounts",
    "AttemptInfo",
    "SiblingInfo",
    "GroupDetail",
    "OutboxPage",
    "Run",
    "Snapshot",
    "BarrierResult",
    "TrainStep",
    "PlanRow",
    "RestorePlan",
    "RestoreResult",
    "GymRegistration",
    # errors
    "CoordinatorError",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "InvalidRequest",
    "Conflict",
    "GateClosed",
    "BatchRefused",
    "RefusedRow",
    "RunClosed",
    "Fenced",
    "NotAwaitingBarrier",
    "SnapshotNotAwaiting",
    "TooLarge",
    "Unavailable",
    "Unreachable",
    "ProtocolError",
    "SnapshotFailed",
    "SnapshotTimeout",
]
