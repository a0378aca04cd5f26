"""Error codes and failure classes of the Gym control protocol (docs/gym-protocol.md#error-codes,
docs/gym-protocol.md#failure-classes).

Every control failure leaves this package as one exception, :class:`GymControlError`, whose
payload is plain data (``to_dict()``) so the snapshot and restore choreographies can persist it
or send it across a process boundary without pickling live objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..domain.snapshot_state import FailureClass

__all__ = [
    "BLOCKED_EPISODES",
    "DETAIL_LIMIT_BYTES",
    "FailureClass",
    "GymControlError",
    "ServerFailure",
    "INSTANCE_WIDE",
    "SAMPLE",
    "TRANSIENT_CLASSES",
    "classify",
    "classify_status",
    "normalize_code",
    "parts_summary",
    "sample",
    "server_failure",
    "truncate_detail",
]

# The coordinator truncates what it logs or propagates to 4 KiB (docs/gym-protocol.md#transport).
DETAIL_LIMIT_BYTES = 4096
# How many sample ids a failure or a warning names at most.
SAMPLE = 10



TRANSIENT_CLASSES = frozenset(
    {
        FailureClass.NOT_READY,
        FailureClass.UNAVAILABLE,
        FailureClass.LEASE_LOST,
        FailureClass.DRAIN_TIMEOUT,
    }
)

# When parts of one failure have different classes, the combined failure takes the first class
# of this list that occurs: what an operator must fix comes before what merely needs a retry.
_SEVERITY = (
    FailureClass.CONFIG_ERROR,
    FailureClass.TOPOLOGY_MISMATCH,
    FailureClass.CHECKPOINT_STATE,
    FailureClass.CONFLICT,
    FailureClass.PROTOCOL_ERROR,
    FailureClass.LEASE_LOST,
    FailureClass.NOT_READY,
    FailureClass.DRAIN_TIMEOUT,
    FailureClass.UNAVAILABLE,
)

# docs/gym-protocol.md#error-codes: legacy code -> (current spelling, also-accepted spellings,
# HTTP status).
LEGACY_CODES: dict[str, tuple[str, tuple[str, ...], int]] = {
    "checkpoint_error": ("checkpoint_error", (), 409),
    "stale_checkpoint": ("checkpoint_stale_checkpoint", ("checkpoint_stale",), 409),
    "checkpoint_conflict": ("checkpoint_conflict", (), 409),
    "invalid_phase": ("checkpoint_invalid_phase", (), 409),
    "deadline_exceeded": ("checkpoint_deadline_exceeded", (), 409),
    "restart_in_scope": ("checkpoint_restart_in_scope", (), 409),
    "invalid_checkpoint_state": (
        "checkpoint_invalid_checkpoint_state",
        ("checkpoint_invalid_state",),
        422,
    ),
    "unauthorized": ("checkpoint_unauthorized", (), 401),
    "checkpoint_coordinator_unavailable": ("checkpoint_coordinator_unavailable", (), 503),
    "admission_closed": (
        "checkpoint_parked",
        ("checkpoint_admission_closed", "agent_admission_closed"),
        409,
    ),
    "stale_attempt": ("checkpoint_stale_attempt", (), 409),
    "rollout_id_required": ("checkpoint_rollout_id_required", (), 400),
}

_ALIASES: dict[str, str] = {}
for _legacy, (_current, _also, _status) in LEGACY_CODES.items():
    _ALIASES[_current] = _legacy
    for _alias in _also:
        _ALIASES[_alias] = _legacy

_PREFIX = "checkpoint_"


def normalize_code(code: str) -> str:
    """Map any spelling of a protocol error code to its legacy name; keep unknown codes as they
    are.

    The order is that of docs/gym-protocol.md#error-codes: the current and also-accepted columns
    first, then the ``checkpoint_`` prefix rule, so a future prefixed spelling of a legacy code
    still matches.
    """
    mapped = _ALIASES.get(code)
    if mapped is not None:
        return mapped
    if code.startswith(_PREFIX):
        rest = code[len(_PREFIX) :]
        if rest in LEGACY_CODES:
            return rest
    return code


def classify_status(http_status: int) -> FailureClass:
    """Class of a refusal whose code is unknown or absent (docs/gym-protocol.md#error-codes)."""
    if http_status == 401:
        # Every control route is authenticated, so a 401 means the token is wrong however the
        # body is spelled (a proxy may strip the envelope).
        return FailureClass.CONFIG_ERROR
    if http_status in (408, 429) or http_status >= 500:
        return FailureClass.UNAVAILABLE
    return FailureClass.PROTOCOL_ERROR


# Classes of known codes on a control call. stale_checkpoint is protocol_error here; the client
# turns it into lease_lost itself where docs/gym-protocol.md#error-codes says so (renew or commit
# before the cut).
_CODE_CLASS: dict[str, FailureClass] = {
    "stale_checkpoint": FailureClass.PROTOCOL_ERROR,
    "checkpoint_conflict": FailureClass.CONFLICT,
    "invalid_phase": FailureClass.UNAVAILABLE,
    "deadline_exceeded": FailureClass.UNAVAILABLE,
    "restart_in_scope": FailureClass.PROTOCOL_ERROR,
    "invalid_checkpoint_state": FailureClass.CHECKPOINT_STATE,
    "unauthorized": FailureClass.CONFIG_ERROR,
    "checkpoint_coordinator_unavailable": FailureClass.UNAVAILABLE,
    # Data-plane codes have no business on a control route: the participant is confused.
    "admission_closed": FailureClass.PROTOCOL_ERROR,
    "stale_attempt": FailureClass.PROTOCOL_ERROR,
    "rollout_id_required": FailureClass.PROTOCOL_ERROR,
}


def classify(code: str | None, http_status: int) -> FailureClass:
    """Failure class of an HTTP error reply to a control call; ``code`` must be normalised."""
    if code == "checkpoint_error":
        # A generic refusal is the participant's own fault when it is a 500, a real refusal
        # (not fresh, model commit without scope) otherwise.
        return FailureClass.UNAVAILABLE if http_status >= 500 else FailureClass.PROTOCOL_ERROR
    if code is not None:
        known = _CODE_CLASS.get(code)
        if known is not None:
            return known
    return classify_status(http_status)


def truncate_detail(detail: object, limit: int = DETAIL_LIMIT_BYTES) -> str:
    """Cut a detail string to ``limit`` UTF-8 bytes without splitting a character."""
    text = detail if isinstance(detail, str) else str(detail)
    if len(text) <= limit // 4:
        # Fast path: even four bytes per character stays under the limit.
        return text
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", "ignore")


ServerFailure = dict[str, Any]
"""One part of a failure: ``{op, http_status, code, detail, class, transient, ...}``.

``class``/``transient`` say what this part alone would be; op-specific extras such as
``blocker_count`` and ``blockers`` (not_ready) sit beside them.
"""

# The server key for a part that concerns the instance as a whole (a missing instance, a
# cross-participant validation rule) rather than one server.
INSTANCE_WIDE = "*"

# The ``extra`` key of a prepare that was not ready, or a drain that timed out: per instance,
# every episode (capture key, or Gym's blocker name) that kept the save from its cut.
BLOCKED_EPISODES = "blocked_episodes"


def server_failure(
    failure_class: FailureClass,
    op: str,
    detail: object,
    *,
    http_status: int | None = None,
    code: str | None = None,
    **extra: Any,
) -> ServerFailure:
    part: ServerFailure = {
        "op": op,
        "http_status": http_status,
        "code": code,
        "detail": truncate_detail(detail),
        "class": str(failure_class),
        "transient": failure_class in TRANSIENT_CLASSES,
    }
    part.update(extra)
    return part


def sample(items: Iterable[str]) -> list[str]:
    return sorted(items)[:SAMPLE]


def parts_summary(parts: Mapping[str, Mapping[str, ServerFailure]]) -> str:
    """One line per failed server, for messages."""
    return "; ".join(
        f"{iid}/{server}: {part['op']} {part['class']}: {part['detail']}"
        for iid, servers in sorted(parts.items())
        for server, part in sorted(servers.items())
    )


class GymControlError(Exception):
    """A control failure, with plain data only so it pickles and serialises.

    ``instances`` maps instance id -> server name (or ``"*"`` for the instance as a whole) ->
    the part of the failure that server caused. ``extra`` carries op-specific data such as the
    drain's pending sample or the rollouts a failed restore must restart.
    """

    def __init__(
        self,
        failure_class: FailureClass | str,
        message: str,
        *,
        instances: Mapping[str, Mapping[str, ServerFailure]] | None = None,
        transient: bool | None = None,
        extra: Mapping[str, Any] | None = None,
        resume_failure: GymControlError | None = None,
    ) -> None:
        self.failure_class = FailureClass(failure_class)
        self.message = truncate_detail(message)
        self.instances: dict[str, dict[str, ServerFailure]] = {
            iid: dict(servers) for iid, servers in (instances or {}).items()
        }
        self.transient = (
            self.failure_class in TRANSIENT_CLASSES if transient is None else transient
        )
        self.extra: dict[str, Any] = dict(extra or {})
        self.resume_failure = resume_failure
        super().__init__(self.message)

    def __str__(self) -> str:
        text = f"{self.failure_class}: {self.message}"
        if self.resume_failure is not None:
            text += f" (resume also failed: {self.resume_failure.failure_class})"
        return text

    def __repr__(self) -> str:
        return f"GymControlError({self.failure_class!s}, {self.message!r}, transient={self.transient})"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "class": str(self.failure_class),
            "transient": self.transient,
            "message": self.message,
            "instances": {
                iid: {name: dict(part) for name, part in servers.items()}
                for iid, servers in self.instances.items()
            },
        }
        data.update(self.extra)
        if self.resume_failure is not None:
            data["resume_failure"] = self.resume_failure.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GymControlError:
        known = {"class", "transient", "message", "instances", "resume_failure"}
        resume = data.get("resume_failure")
        return cls(
            data["class"],
            data.get("message", ""),
            instances=data.get("instances") or {},
            transient=data.get("transient"),
            extra={k: v for k, v in data.items() if k not in known},
            resume_failure=cls.from_dict(resume) if resume else None,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through their args by default, which would lose every keyword.
        return (GymControlError.from_dict, (self.to_dict(),))

    def server_names(self) -> dict[str, list[str]]:
        """Servers named by this failure, per instance (sorted), for messages and tests."""
        return {iid: sorted(servers) for iid, servers in self.instances.items()}

    @classmethod
    def single(
        cls, instance_id: str, server_name: str, part: ServerFailure, message: str | None = None
    ) -> GymControlError:
        return cls(
            part["class"],
            message or f"{instance_id}/{server_name}: {part['op']}: {part['detail']}",
            instances={instance_id: {server_name: part}},
        )

    @classmethod
    def from_parts(
        cls,
        parts: Mapping[str, Mapping[str, ServerFailure]],
        message: str,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> GymControlError:
        """One failure from per-server parts: transient only if every part is
        (docs/gym-protocol.md#failure-classes)."""
        classes = [FailureClass(p["class"]) for servers in parts.values() for p in servers.values()]
        if not classes:
            raise ValueError("a failure needs at least one part")
        return cls(
            _most_severe(classes),
            message,
            instances=parts,
            transient=all(bool(p["transient"]) for s in parts.values() for p in s.values()),
            extra=extra,
        )

    @classmethod
    def combine(cls, errors: Iterable[GymControlError], message: str | None = None) -> GymControlError:
        """Merge failures of several instances or steps into one.

        Parts of the same server in two errors keep the first one. Extras merge with the first
        error winning on a key clash, so an op-specific sample is never silently replaced.
        """
        errs = list(errors)
        if not errs:
            raise ValueError("nothing to combine")
        if len(errs) == 1 and message is None:
            return errs[0]
        instances: dict[str, dict[str, ServerFailure]] = {}
        extra: dict[str, Any] = {}
        for err in errs:
            for iid, servers in err.instances.items():
                target = instances.setdefault(iid, {})
                for name, part in servers.items():
                    target.setdefault(name, part)
            for key, value in err.extra.items():
                extra.setdefault(key, value)
        resume_failures = [e.resume_failure for e in errs if e.resume_failure is not None]
        combined = cls(
            _most_severe([e.failure_class for e in errs]),
            message or "; ".join(e.message for e in errs),
            instances=instances,
            transient=all(e.transient for e in errs),
            extra=extra,
            resume_failure=cls.combine(resume_failures) if resume_failures else None,
        )
        return combined


def _most_severe(classes: Iterable[FailureClass]) -> FailureClass:
    present = set(classes)
    for candidate in _SEVERITY:
        if candidate in present:
            return candidate
    raise ValueError("no failure class")
