"""Wire-level vocabulary of the Gen B control protocol: identifiers, request bodies and error codes.

Everything here is pure (no I/O) so that the phase machine, the data plane and the tests share one
definition of what a valid id, a capture key or a refusal looks like.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
NAME_RE = re.compile(NAME_PATTERN)
_CAPTURE_SUFFIX_RE = re.compile(r"^(.+)-a([1-9][0-9]*)$")
_RESERVED_SUFFIX_RE = re.compile(r"-a[0-9]+$")
INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")
RECORDS_FILE_RE = re.compile(r"^(records-[0-9a-f]{64}\.jsonl|records\.jsonl)$")

MAX_BLOCKERS = 100
RESUMED_MEMORY = 64
MAX_BATCH = 1024

PHASES = ("idle", "preparing", "prepared", "committed", "restored")
KINDS = ("environment", "model", "agent", "resources")
MODES = ("exported", "stateless", "restart_only")


def is_name(value: str) -> bool:
    return bool(NAME_RE.match(value))


def capture_key(rollout_id: str, attempt: int) -> str:
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def parse_capture_key(key: str) -> tuple[str, int]:
    match = _CAPTURE_SUFFIX_RE.match(key)
    if match:
        return match.group(1), int(match.group(2))
    return key, 0


def is_valid_capture_key(key: str) -> bool:
    """A capture key is a NAME whose rollout part is itself a valid rollout id."""
    if not (1 <= len(key) <= 300) or not is_name(key):
        return False
    rollout_id, _ = parse_capture_key(key)
    return _valid_rollout_id(rollout_id)


def _valid_rollout_id(value: str) -> bool:
    return 1 <= len(value) <= 256 and is_name(value) and not _RESERVED_SUFFIX_RE.search(value)


def _check_rollout_id(value: str) -> str:
    if _RESERVED_SUFFIX_RE.search(value):
        raise ValueError("a rollout id must not end in -a<digits>: that suffix is reserved for capture keys")
    return value


CheckpointId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NAME_PATTERN)]
RolloutId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256, pattern=NAME_PATTERN),
    AfterValidator(_check_rollout_id),
]
DeadlineTs = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    # strict: a string is never a number and a bool is never an int; forbid: unknown fields are 422.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class EpisodeRef(_Body):
    rollout_id: RolloutId
    attempt: Annotated[StrictInt, Field(ge=0)]

    @property
    def key(self) -> str:
        return capture_key(self.rollout_id, self.attempt)

    @property
    def pair(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt)


class PrepareBody(_Body):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs


RenewBody = PrepareBody
ResumeBody = PrepareBody


class CommitBodyWithoutStop(_Body):
    """A commit body as Gym versions that predate `stop` define it: `stop` is an unknown field (422)."""

    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs
    checkpoint_dir: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    # Optional at the schema level so that a model can answer a missing scope with the protocol's
    # own checkpoint_error (docs/gym-protocol.md#commit); the other kinds export everything they
    # hold, as older Gym did.
    episode_ids: list[EpisodeRef] | None = None


class CommitBody(CommitBodyWithoutStop):
    stop: StrictBool | None = None


class RestoreBody(_Body):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs
    checkpoint_dir: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    episode_ids: list[EpisodeRef]


class RetireBody(_Body):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs
    episode_ids: Annotated[list[EpisodeRef], Field(min_length=1, max_length=MAX_BATCH)]


class ForgetBody(_Body):
    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs
    rollout_ids: Annotated[list[RolloutId], Field(min_length=1, max_length=MAX_BATCH)]


BODY_MODELS: dict[str, type[_Body]] = {
    "prepare": PrepareBody,
    "renew": RenewBody,
    "commit": CommitBody,
    "resume": ResumeBody,
    "restore": RestoreBody,
    "retire": RetireBody,
    "forget": ForgetBody,
}
CONTROL_OPS = ("status", *BODY_MODELS)

# ---------------------------------------------------------------------------------------------
# Error codes (docs/gym-protocol.md#error-codes). Internally every refusal is named by its legacy
# code; the instance's wire_spelling picks the emitted form.

Spelling = Literal["current", "legacy"]

_CURRENT: dict[str, str] = {
    "checkpoint_error": "checkpoint_error",
    "stale_checkpoint": "checkpoint_stale_checkpoint",
    "checkpoint_conflict": "checkpoint_conflict",
    "invalid_phase": "checkpoint_invalid_phase",
    "deadline_exceeded": "checkpoint_deadline_exceeded",
    "restart_in_scope": "checkpoint_restart_in_scope",
    "invalid_checkpoint_state": "checkpoint_invalid_checkpoint_state",
    "unauthorized": "checkpoint_unauthorized",
    "checkpoint_coordinator_unavailable": "checkpoint_coordinator_unavailable",
    "admission_closed": "checkpoint_parked",
    "stale_attempt": "checkpoint_stale_attempt",
    "rollout_id_required": "checkpoint_rollout_id_required",
}
_ALSO_ACCEPTED: dict[str, str] = {
    "checkpoint_stale": "stale_checkpoint",
    "checkpoint_invalid_state": "invalid_checkpoint_state",
    "checkpoint_admission_closed": "admission_closed",
    "agent_admission_closed": "admission_closed",
}
_STATUS: dict[str, int] = {
    "invalid_checkpoint_state": 422,
    "unauthorized": 401,
    "checkpoint_coordinator_unavailable": 503,
    "rollout_id_required": 400,
}
LEGACY_CODES = tuple(_CURRENT)
CURRENT_CODES = tuple(_CURRENT.values())


def normalize_code(code: str) -> str:
    """Map any spelling of a protocol error code to its legacy name; unknown codes are returned as is."""
    for legacy, current in _CURRENT.items():
        if code == current:
            return legacy
    if code in _ALSO_ACCEPTED:
        return _ALSO_ACCEPTED[code]
    if code.startswith("checkpoint_") and code[len("checkpoint_") :] in _CURRENT:
        return code[len("checkpoint_") :]
    return code


def spell(code: str, spelling: Spelling) -> str:
    legacy = normalize_code(code)
    if legacy not in _CURRENT:
        return code
    return legacy if spelling == "legacy" else _CURRENT[legacy]


def http_status(code: str) -> int:
    return _STATUS.get(normalize_code(code), 409)


class ProtocolError(Exception):
    """A refusal with a protocol error code (legacy name), rendered as the error envelope."""

    def __init__(self, code: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = normalize_code(code)
        self.detail = detail[:4096]
        self.status = status if status is not None else http_status(self.code)

    def envelope(self, spelling: Spelling) -> dict[str, Any]:
        return {"error": {"code": spell(self.code, spelling), "detail": self.detail}}

