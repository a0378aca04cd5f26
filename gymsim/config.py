"""Instance configuration: one JSON document describes one Gym deployment instance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from .wire import INSTANCE_ID_RE, NAME_PATTERN, Spelling

BrokenBehaviour = Literal[
    "replay_different_scope",
    "commit_names_restart",
    "retire_while_open",
    "lease_never_expires",
    "ignore_stale_attempt",
]
FaultType = Literal["delay", "slow_reply", "error", "reset", "lost_reply", "refuse", "hang"]
# `published`: how the NeMo Gym control code that is actually public behaves;
# `pinned`: published, with agents that report `run_episode_ids` for every /run session they
# export, in the scope or not (the Gym NeMo RL pins, P8); `strict`: the protocol to the letter.
# docs/gym-protocol.md#gym-variants describes them; README.md lists every difference.
GymProfile = Literal["published", "pinned", "strict"]
# Profiles that behave as published Gym in everything but what they name as their own.
PUBLISHED_PROFILES = frozenset({"published", "pinned"})
# The error-code spelling each profile emits unless `wire_spelling` says otherwise (P6,
# docs/gym-protocol.md#error-codes).
PROFILE_SPELLING: dict[str, Spelling] = {"published": "legacy", "pinned": "legacy", "strict": "current"}
ServerName = Annotated[str, StringConstraints(pattern=NAME_PATTERN, min_length=1, max_length=128)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FaultSpec(_Strict):
    """One injected fault, matched by (server_name, op) in list order.

    `op` is a control op (`status`, `prepare`, ...) or a data-plane op: `run` (agent /run),
    `run_reply` (only `delay`: the finished episode's reply sits on the wire), `chat` (policy call),
    `mutate` and `session` (resources requests).

    `hang`: the request never gets a reply; it ends only when its caller gives up (a tool that
    hangs). `rollout_id`: only requests whose path names an episode of that rollout (`chat`,
    `mutate`, `session`), so that one episode of many is hit.
    """

    server_name: ServerName
    op: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    type: FaultType
    seconds: Seconds | None = None
    status: Annotated[int, Field(ge=100, le=599)] | None = None
    code: str | None = None
    detail: str | None = None
    times: Annotated[int, Field(ge=1)] | None = None
    rollout_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _needs(self) -> "FaultSpec":
        if self.type in ("delay", "slow_reply") and self.seconds is None:
            raise ValueError(f"a {self.type} fault needs seconds")
        if self.type == "refuse" and not self.code:
            raise ValueError("a refuse fault needs the protocol code to refuse with")
        return self


class ServerKnobs(_Strict):
    """Scenario knobs of one server; all of them can also be changed at runtime (admin API)."""

    # model: responses that become ready while a checkpoint is open wait for resume
    # (docs/gym-protocol.md#prepare).
    hold_responses: bool = True
    # model: time to compute a completion before it is ready to deliver.
    model_latency_seconds: Seconds = 0.0
    # model: how long a delivered response streams; a streaming response blocks readiness.
    stream_seconds: Seconds = 0.0
    # every participant: slow exports (commit) and installs (restore).
    export_seconds: Seconds = 0.0
    install_seconds: Seconds = 0.0
    # agent: cleanup time of a cancelled episode, so a retire can overrun its deadline.
    stop_seconds: Seconds = 0.0
    # multi-worker servers (NeMo Gym #3909): blockers <kind>-workers-unreported:<n>, <kind>-worker-lost.
    workers: Annotated[int, Field(ge=1)] = 1
    unreported_workers: Annotated[int, Field(ge=0)] = 0
    worker_lost: bool = False
    # behave as a process that already served data-plane work (restore refuses it).
    non_fresh: bool = False
    # commit accepts `stop` (None: the profile decides; strict accepts it, published Gym without the
    # field refuses it as an unknown field with 422).
    accepts_stop: bool | None = None
    # model: the commit reply carries `staging_keys_by_episode` (False: the older published model,
    # whose reply has `staging_keys` only).
    staging_map: bool = True


class EffectJournalConfig(_Strict):
    """Where the mail tool asks before it sends (the coordinator's effect journal): the
    coordinator's base URL, the run and its run token (the participant's credential)."""

    url: Annotated[str, StringConstraints(min_length=1)]
    run_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    token: Annotated[str, StringConstraints(min_length=1)]


# `same`: a continuation asks for the very mails the discarded timeline sent; `names_attempt`:
# the body names the Gym attempt, so a continuation asks for another mail at the same place
# (the journal answers `diverged`); `first_attempt_only`: attempts after the first send nothing,
# so what the discarded timeline sent is never asked for again (orphaned `not_repeated`).
MailVariant = Literal["same", "names_attempt", "first_attempt_only"]


class MailConfig(_Strict):
    """The resources server's mail tool: an effect outside what Gym checkpoints (README, "Mail tool")."""

    # A JSON-lines file every sent mail is appended to; never checkpointed nor restored.
    outbox: Annotated[str, StringConstraints(min_length=1)]
    to: Annotated[str, StringConstraints(min_length=1, max_length=256)] = "ops@example.com"
    # A mail on the first mutation of a session and then on every `every`-th.
    every: Annotated[int, Field(ge=1)] = 1
    variant: MailVariant = "same"
    # None: send without asking anyone (a restore's continuation sends again what it re-runs).
    journal: EffectJournalConfig | None = None


class ServerConfig(ServerKnobs):
    server_name: ServerName
    # None: not a participant (judge, relay, checkpointing off): status answers 404.
    kind: str | None = None
    # None: an older Gym whose status has no `mode` (it behaves as exported).
    mode: str | None = None
    # The status field `instance`; free-form so tests can make it differ, collide or break NAME.
    participant_name: str | None = None
    # agent: the servers of this instance that its episodes call (default: the first of each kind).
    model_server: ServerName | None = None
    resources_server: ServerName | None = None
    # None: the instance's profile.
    gym_profile: GymProfile | None = None
    # resources: send a mail on mutations (None: no mail tool).
    mail: MailConfig | None = None

    @property
    def name(self) -> str:
        return self.participant_name if self.participant_name is not None else self.server_name


class InstanceConfig(_Strict):
    instance_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    token: Annotated[str, StringConstraints(min_length=1)]
    lease_grace_seconds: Seconds = 600.0
    gym_profile: GymProfile = "published"
    # None: the spelling of each server's profile (published: legacy, strict: current).
    wire_spelling: Spelling | None = None
    turn_seconds: Seconds = 0.05
    default_turns: Annotated[int, Field(ge=0)] = 3
    servers: Annotated[list[ServerConfig], Field(min_length=1)]
    faults: list[FaultSpec] = []
    broken: list[BrokenBehaviour] = []

    @field_validator("instance_id")
    @classmethod
    def _instance_id(cls, value: str) -> str:
        if not INSTANCE_ID_RE.match(value):
            raise ValueError("instance_id is one or more NAME segments joined by '/'")
        return value

    @model_validator(mode="after")
    def _unique_and_wired(self) -> "InstanceConfig":
        names = [s.server_name for s in self.servers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate server_name: {duplicates}")
        known = set(names)
        for server in self.servers:
            for peer in (server.model_server, server.resources_server):
                if peer is not None and peer not in known:
                    raise ValueError(f"{server.server_name} names unknown server {peer!r}")
            if server.mail is not None and server.kind != "resources":
                raise ValueError(f"{server.server_name}: only a resources server has the mail tool")
        for fault in self.faults:
            if fault.server_name not in known:
                raise ValueError(f"fault names unknown server {fault.server_name!r}")
        return self

    def profile_of(self, server_name: str | None = None) -> GymProfile:
        """The profile of one server (its own, else the instance's); None: the instance's."""
        if server_name is not None:
            for server in self.servers:
                if server.server_name == server_name and server.gym_profile is not None:
                    return server.gym_profile
        return self.gym_profile

    def spelling_for(self, server_name: str | None = None) -> Spelling:
        """The code spelling a server emits: an explicit `wire_spelling` wins over its profile's."""
        if self.wire_spelling is not None:
            return self.wire_spelling
        return PROFILE_SPELLING[self.profile_of(server_name)]

    def server(self, name: str) -> ServerConfig:
        for server in self.servers:
            if server.server_name == name:
                return server
        raise KeyError(name)

    @classmethod
    def load(cls, path: str | Path) -> "InstanceConfig":
        return cls.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))

    @classmethod
    def coerce(cls, config: "dict[str, Any] | InstanceConfig") -> "InstanceConfig":
        return config if isinstance(config, InstanceConfig) else cls.model_validate(config)
