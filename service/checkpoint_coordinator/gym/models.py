"""Value objects and wire models of the Gym control protocol.

Requests name episodes as objects; replies name them as capture keys
(docs/gym-protocol.md#identifiers). Reply models ignore unknown fields, since participants may
add some, and are strict about the types of the fields the coordinator reads, since a wrong type
is a participant bug worth surfacing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from ..domain.identity import (
    CHECKPOINT_ID,
    INSTANCE_ID,
    SERVER_NAME,
    is_valid_rollout_id,
)
from ..domain.vocabulary import ParticipantKind

__all__ = [
    "AGENT",
    "CommitReply",
    "ENVIRONMENT",
    "Episode",
    "ForgetReply",
    "InstanceSpec",
    "InstanceTopology",
    "KINDS",
    "MODEL",
    "MODES",
    "Participant",
    "ParticipantManifest",
    "PHASES",
    "PrepareReply",
    "PrepareReport",
    "RenewReply",
    "RESOURCES",
    "RestoreReply",
    "ResumeReply",
    "RetireReply",
    "STAGE_OF_KIND",
    "StatusReply",
    "Topology",
    "episodes_to_wire",
    "format_capture_key",
    "instance_checkpoint_dir",
    "is_valid_checkpoint_id",
    "is_valid_instance_id",
    "is_valid_name",
    "is_valid_rollout_id",
    "parse_capture_key",
]

_CAPTURE_KEY_RE = re.compile(r"^(.+)-a([1-9][0-9]*)$")

ENVIRONMENT = ParticipantKind.environment
MODEL = ParticipantKind.model
AGENT = ParticipantKind.agent
RESOURCES = ParticipantKind.resources
STAGE_OF_KIND: dict[str, int] = {ENVIRONMENT: 0, MODEL: 1, AGENT: 2, RESOURCES: 3}
KINDS = frozenset(STAGE_OF_KIND)
MODES = frozenset({"exported", "stateless", "restart_only"})
# Gym spelled `exported` as `export_restore` before it settled the name.
MODE_ALIASES = {"export_restore": "exported"}
PHASES = frozenset({"idle", "preparing", "prepared", "committed", "restored"})

# The identifier rules are the domain's; the client checks what it sends and what it names.
is_valid_name = SERVER_NAME.is_valid
is_valid_checkpoint_id = CHECKPOINT_ID.is_valid
is_valid_instance_id = INSTANCE_ID.is_valid


class Episode(NamedTuple):
    """One attempt of one rollout. Ordering is ``(rollout_id, attempt)``, the wire sort order.

    A named tuple, not a dataclass: a commit sorts, hashes and compares tens of thousands of
    them while Gym is parked, and a tuple does that in C."""

    rollout_id: str
    attempt: int

    @classmethod
    def checked(cls, rollout_id: str, attempt: int) -> Episode:
        """An episode the coordinator may name in a request; raises ValueError otherwise."""
        if not is_valid_rollout_id(rollout_id):
            raise ValueError(f"invalid rollout id {rollout_id!r}")
        if type(attempt) is not int or attempt < 0:
            raise ValueError(f"invalid attempt {attempt!r} for rollout {rollout_id!r}")
        return cls(rollout_id, attempt)

    @property
    def capture_key(self) -> str:
        return format_capture_key(self.rollout_id, self.attempt)

    def next_attempt(self) -> Episode:
        return Episode(self.rollout_id, self.attempt + 1)

    def to_wire(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}

    @classmethod
    def from_capture_key(cls, key: str) -> Episode:
        rollout_id, attempt = parse_capture_key(key)
        return cls(rollout_id, attempt)

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> Episode:
        if set(obj) != {"rollout_id", "attempt"}:
            raise ValueError(f"an episode object has exactly rollout_id and attempt, got {sorted(obj)}")
        return cls.checked(obj["rollout_id"], obj["attempt"])


def format_capture_key(rollout_id: str, attempt: int) -> str:
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def parse_capture_key(key: str) -> tuple[str, int]:
    match = _CAPTURE_KEY_RE.fullmatch(key)
    if match is None:
        return key, 0
    return match.group(1), int(match.group(2))


def episodes_to_wire(episodes: Iterable[Episode]) -> list[dict[str, Any]]:
    """Request form of a scope: unique objects sorted by ``(rollout_id, attempt)``."""
    return [ep.to_wire() for ep in sorted(set(episodes))]


def instance_checkpoint_dir(snapshot_dir: str, instance_id: str) -> str:
    """``<snapshot_dir>/gym-instances/<instance_id>`` (docs/gym-protocol.md#commit); the instance id
    keeps its slashes."""
    return f"{snapshot_dir.rstrip('/')}/gym-instances/{instance_id}"


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """How the coordinator reaches one Gym deployment instance.

    ``servers`` lists every registered server, participants or not. The token is held as a
    ``SecretStr`` so neither repr nor logging can reveal it.
    """

    instance_id: str
    token: SecretStr
    servers: Mapping[str, str]

    def __init__(self, instance_id: str, token: str | SecretStr, servers: Mapping[str, str]) -> None:
        if not is_valid_instance_id(instance_id):
            raise ValueError(f"invalid instance id {instance_id!r}")
        for name in servers:
            if not is_valid_name(name):
                raise ValueError(f"invalid server name {name!r} in instance {instance_id!r}")
        secret = token if isinstance(token, SecretStr) else SecretStr(token)
        if not secret.get_secret_value():
            raise ValueError(f"instance {instance_id!r} has an empty control token")
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "token", secret)
        object.__setattr__(self, "servers", dict(sorted(servers.items())))


@dataclass(frozen=True, slots=True)
class Participant:
    """A server that answered status with 200, as discovery saw it."""

    server_name: str
    base_url: str
    kind: str
    participant_name: str
    mode: str | None
    phase: str
    stage: int
    # The active id and lease at discovery: used to recognise an orphaned checkpoint.
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None

    @property
    def sort_key(self) -> tuple[int, str]:
        return (self.stage, self.server_name)


@dataclass(frozen=True, slots=True)
class InstanceTopology:
    """One discovered instance: its registration, its participants and what discovery noticed."""

    spec: InstanceSpec
    participants: tuple[Participant, ...]
    non_participants: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # Non-idle participants at discovery: server name -> checkpoint id they hold.
    active_ids: Mapping[str, str] = field(default_factory=dict)

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    def by_name(self) -> dict[str, Participant]:
        return {p.server_name: p for p in self.participants}

    def stages(self, reverse: bool = False) -> list[list[Participant]]:
        """Participants grouped by stage, in prepare order (or resume order when reversed)."""
        groups: dict[int, list[Participant]] = {}
        for p in self.participants:
            groups.setdefault(p.stage, []).append(p)
        return [groups[s] for s in sorted(groups, reverse=reverse)]


Topology = Mapping[str, InstanceTopology]
"""What discovery returned for a run's instances, keyed by instance id."""


# --- reply models ------------------------------------------------------------------------------

StrictNonNegInt = Annotated[int, Field(ge=0, strict=True)]


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True)


class PrepareReport(_Reply):
    ready: bool
    blockers: list[str]
    blocker_count: StrictNonNegInt
    restarts: list[str]
    counts: dict[str, int] = Field(default_factory=dict)


class StatusReply(_Reply):
    kind: str
    instance: str
    phase: str
    # Absent on older Gym versions; such a participant is never flagged as restart-only.
    mode: str | None = None
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    retired_rollouts: StrictNonNegInt | None = None
    report: PrepareReport | None = None


class PrepareReply(_Reply):
    phase: Literal["preparing", "prepared", "idle"]
    report: PrepareReport


class RenewReply(_Reply):
    lease_expires_at: float


class ParticipantManifest(_Reply):
    schema_version: int
    kind: str
    instance: str
    checkpoint_id: str
    records_file: Annotated[str, Field(min_length=1)]
    records_sha256: Annotated[str, Field(min_length=1)]
    record_count: StrictNonNegInt


class CommitReply(_Reply):
    phase: Literal["committed"]
    manifest: ParticipantManifest
    episode_ids: list[str]
    staging_keys: list[str] | None = None
    staging_keys_by_episode: dict[str, list[str]] | None = None
    run_episode_ids: list[str] | None = None


class ResumeReply(_Reply):
    phase: Literal["idle"]
    idempotent: bool


class RestoreReply(_Reply):
    phase: Literal["restored"]
    source_checkpoint_id: str
    restored: list[str]


class RetireReply(_Reply):
    retired: list[str]


class ForgetReply(_Reply):
    forgotten: list[str]
