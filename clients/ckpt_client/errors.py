"""Exceptions raised by the client, mirroring the coordinator's stable error codes.

The coordinator answers every failure with ``application/problem+json``
``{type, title, status, code, detail, ...extra}``. :func:`error_from_problem` turns such a
document into the most specific exception below. Codes are part of the server's API; a code
this client does not know yet still lands on the right family because unknown codes are mapped
by HTTP status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CoordinatorError",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "InvalidRequest",
    "Conflict",
    "GateClosed",
    "RunStopped",
    "BatchRefused",
    "RefusedRow",
    "RunClosed",
    "Fenced",
    "SnapshotNotAwaiting",
    "NotAwaitingBarrier",
    "TooLarge",
    "Unavailable",
    "Unreachable",
    "ProtocolError",
    "SnapshotFailed",
    "SnapshotTimeout",
    "error_from_problem",
]


class CoordinatorError(Exception):
    """Base of every error the client raises about the coordinator.

    ``code`` is the server's stable code (or a client-side one such as ``unreachable``),
    ``status`` the HTTP status (0 when no HTTP answer was received), ``problem`` the whole
    problem document as received. ``batch_index`` is set by the batching helpers to the index
    of the batch that failed: batches before it were written (re-sending them is harmless,
    the server answers identical repeats with ``unchanged``).
    """

    default_code = "error"

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        status: int = 0,
        problem: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = code or self.default_code
        self.status = status
        self.problem: dict[str, Any] = dict(problem or {})
        self.batch_index: int | None = None

    def __str__(self) -> str:
        where = f" (batch {self.batch_index})" if self.batch_index is not None else ""
        status = f"{self.status} " if self.status else ""
        return f"{status}{self.code}: {self.detail}{where}"


class Unauthorized(CoordinatorError):
    """401: no usable bearer token was sent."""

    default_code = "unauthorized"


class Forbidden(CoordinatorError):
    """403: the token does not reach this run (an unknown run answers the same)."""

    default_code = "forbidden"


class NotFound(CoordinatorError):
    """404: run, group, dispatch, instance or snapshot unknown (see ``code``)."""

    default_code = "not_found"


class InvalidRequest(CoordinatorError):
    """422 (or 400): the request body or query failed validation.

    ``errors`` lists ``{field, message, type?}`` entries as the server reported them, with
    dotted field paths such as ``groups.0.group_id``.
    """

    default_code = "invalid_request"

    @property
    def errors(self) -> list[dict[str, Any]]:
        raw = self.problem.get("errors")
        return [dict(e) for e in raw if isinstance(e, Mapping)] if isinstance(raw, list) else []


class Conflict(CoordinatorError):
    """409: the request conflicts with the ledger's state; nothing was written."""

    default_code = "conflict"


class GateClosed(Conflict):
    """409 ``gate_closed``: a snapshot holds the run's dispatch gate. Nothing was dispatched.

    ``retry_after_s`` comes from the problem body (a float) or else the ``Retry-After`` header.
    """

    default_code = "gate_closed"

    def __init__(self, *args: Any, retry_after_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        body_value = self.problem.get("retry_after_s")
        self.retry_after_s: float | None = _as_float(body_value) if body_value is not None else retry_after_s

    @property
    def snapshot_id(self) -> str | None:
        value = self.problem.get("snapshot_id")
        return str(value) if value is not None else None


@dataclass(frozen=True)
class RefusedRow:
    """One refused row of an atomic batch. ``key`` is the rollout id or the group id.
    ``replaced_by``: for a seal of a replaced attempt (``attempt_replaced``, ``retired_straggler``),
    the rollout id of the attempt that replaced it."""

    key: str
    code: str
    detail: str
    rollout_id: str | None = None
    group_id: str | None = None
    replaced_by: str | None = None


class RunStopped(Conflict):
    """409 ``run_stopped``: a stopping snapshot ended dispatch for this allocation
    (docs/ledger.md#stopping-snapshots). It stays refused until a restore or ``reopen()``;
    waiting does not help."""

    default_code = "run_stopped"

    @property
    def snapshot_id(self) -> str | None:
        value = self.problem.get("snapshot_id")
        return str(value) if value is not None else None


class BatchRefused(Conflict):
    """409 naming refused rows: the batch is atomic, so none of its rows were written.

    The server sets ``code`` to the rows' common code (``seal_conflict``, ``group_conflict``,
    ``unknown_rollout``...) or ``batch_refused`` when they differ; ``rows`` has every row's own
    code. ``refused_count`` may exceed ``len(rows)`` because the server caps the list.
    """

    default_code = "batch_refused"

    @property
    def rows(self) -> list[RefusedRow]:
        raw = self.problem.get("rows")
        out: list[RefusedRow] = []
        for r in raw if isinstance(raw, list) else []:
            if not isinstance(r, Mapping):
                continue
            rid = r.get("rollout_id")
            gid = r.get("group_id")
            out.append(
                RefusedRow(
                    key=str(rid if rid is not None else gid),
                    code=str(r.get("code", "")),
                    detail=str(r.get("detail", "")),
                    rollout_id=None if rid is None else str(rid),
                    group_id=None if gid is None else str(gid),
                    replaced_by=None if r.get("replaced_by") is None else str(r.get("replaced_by")),
                )
            )
        return out

    @property
    def refused_count(self) -> int:
        n = self.problem.get("refused_count")
        return int(n) if isinstance(n, int) else len(self.rows)

    def codes(self) -> dict[str, str]:
        """Refused key (rollout or group id) -> row code."""
        return {r.key: r.code for r in self.rows}

    def __str__(self) -> str:
        # Each refused row's code and what it says, so that a log line says what to do.
        rows = self.rows
        shown = "; ".join(f"{r.key}: {r.code}" + (f" ({r.detail})" if r.detail else "") for r in rows[:10])
        more = self.refused_count - min(len(rows), 10)
        listed = f" [{self.refused_count} refused: {shown}" + (f"; and {more} more" if more > 0 else "") + "]" if rows else ""
        return super().__str__() + listed


class RunClosed(Conflict):
    """409 ``run_closed``: the run no longer accepts writes."""

    default_code = "run_closed"


class Fenced(Conflict):
    """409 ``fenced``: the run's epoch moved under the request (a restore happened)."""

    default_code = "fenced"


class SnapshotNotAwaiting(Conflict):
    """409 ``snapshot_not_awaiting``: the snapshot is not waiting for this trainer call (the
    barrier too early or too late, a capture before the cut or after the end). ``reason`` is
    set when the snapshot is being aborted (e.g. ``train_step_committed``): it will not ask
    again."""

    default_code = "snapshot_not_awaiting"

    @property
    def phase(self) -> str | None:
        value = self.problem.get("phase")
        return str(value) if value is not None else None

    @property
    def reason(self) -> str | None:
        value = self.problem.get("reason")
        return str(value) if value is not None else None


#: The name the client contract used for the barrier's refusal.
NotAwaitingBarrier = SnapshotNotAwaiting


class TooLarge(CoordinatorError):
    """413: the body exceeds the server's limit; send smaller batches."""

    default_code = "payload_too_large"


class Unavailable(CoordinatorError):
    """503 (or 502/504): the coordinator or its database is not serving; raised after retries."""

    default_code = "unavailable"


class Unreachable(Unavailable):
    """No HTTP answer at all (connection refused/reset, timeout) after every retry."""

    default_code = "unreachable"


class ProtocolError(CoordinatorError):
    """A 2xx answer this client cannot read (not JSON, or a required field missing)."""

    default_code = "protocol_error"


class SnapshotFailed(CoordinatorError):
    """The snapshot ended ``failed`` or ``aborted``; ``snapshot`` is its last document.

    ``retryable`` says whether the reason is one after which simply requesting a new snapshot
    later is expected to work (a train step won the race, Gym was not ready, a timeout...).
    """

    default_code = "snapshot_failed"
    _TRANSIENT_REASONS = frozenset(
        {
            "gym_not_ready",
            "gym_unavailable",
            "lease_lost",
            "drain_timeout",
            "data_plane_timeout",
            "database_unavailable",
            "train_step_committed",
            "coordinator_restart",
            "superseded",
            "cancelled",
            "restored",
            "deadline_exceeded",
        }
    )

    def __init__(self, snapshot: Any) -> None:
        self.snapshot = snapshot
        self.outcome: str | None = getattr(snapshot, "outcome", None)
        self.reason: str | None = getattr(snapshot, "reason", None)
        #: Why it ended and what to do, as the coordinator says it (None from an older one).
        self.cause: str | None = getattr(snapshot, "cause", None)
        sid = getattr(snapshot, "snapshot_id", "?")
        said = f": {self.cause}" if self.cause else ""
        super().__init__(f"snapshot {sid} ended {self.outcome} ({self.reason}){said}", code=f"snapshot_{self.outcome}")

    @property
    def retryable(self) -> bool:
        """Whether requesting a new snapshot later is expected to work: the coordinator's own
        verdict when it gives one, else the reason's."""
        said = getattr(self.snapshot, "retryable", None)
        if isinstance(said, bool):
            return said
        return self.reason in self._TRANSIENT_REASONS


class SnapshotTimeout(CoordinatorError):
    """The client's own deadline passed before the snapshot ended. The snapshot may still be
    live on the coordinator, which ends it by its own timeouts; ``snapshot`` is the last
    document seen (None if none was read)."""

    default_code = "client_timeout"

    def __init__(self, detail: str, snapshot: Any) -> None:
        super().__init__(detail)
        self.snapshot = snapshot


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# Codes whose class is more specific than what the status alone says.
_BY_CODE: dict[str, type[CoordinatorError]] = {
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "invalid_request": InvalidRequest,
    "invalid_config": InvalidRequest,
    "gate_closed": GateClosed,
    "run_stopped": RunStopped,
    "run_closed": RunClosed,
    "fenced": Fenced,
    "snapshot_not_awaiting": SnapshotNotAwaiting,
    "snapshot_not_awaiting_barrier": SnapshotNotAwaiting,
    "payload_too_large": TooLarge,
    "unavailable": Unavailable,
}

_BY_STATUS: dict[int, type[CoordinatorError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: InvalidRequest,
    502: Unavailable,
    503: Unavailable,
    504: Unavailable,
}


def error_from_problem(status: int, problem: Mapping[str, Any], *, retry_after_s: float | None = None) -> CoordinatorError:
    """The exception for one error answer. ``retry_after_s`` is the parsed Retry-After header."""
    code = str(problem.get("code") or "")
    detail = str(problem.get("detail") or problem.get("title") or f"HTTP {status}")
    cls = _BY_CODE.get(code)
    if cls is None and status == 409 and isinstance(problem.get("rows"), Sequence) and not isinstance(problem.get("rows"), str):
        # Atomic batch refusal: the top-level code is the rows' common code, so it is
        # recognised by its rows, not by its code.
        cls = BatchRefused
    if cls is None:
        cls = _BY_STATUS.get(status, CoordinatorError)
    kwargs: dict[str, Any] = {"code": code or None, "status": status, "problem": problem}
    if cls is GateClosed:
        return GateClosed(detail, retry_after_s=retry_after_s, **kwargs)
    return cls(detail, **kwargs)
