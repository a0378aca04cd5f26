"""Gym registration at setup: the instances of a run, what discovery found on them, and the Gym
``checkpoint:`` settings the run expects (docs/ledger.md#recovery-configuration,
docs/gym-protocol.md#discover)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Depends, Path, Request
from pydantic import Field, SecretStr, field_validator, model_validator

from ..errors import BadRequest
from ..gym.egress import parse_gym_url
from ..ledger import gym_registry
from ..ledger.runs import get_run
from ..restore import registration
from .auth import Caller, require_run_access
from .common import INSTANCE_ID_PATTERN, NAME_PATTERN, FastJSONRoute, Strict
from .problem_docs import GYM, RUN, WRITE, problems
from .schemas import Answer, Timestamp, sometimes

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["gym"], route_class=FastJSONRoute)

_NAME = re.compile(NAME_PATTERN)
_INSTANCE = re.compile(INSTANCE_ID_PATTERN)
# Per registration (docs/configuration.md#limits): discovery probes every server it names.
MAX_SERVERS = 32
MAX_INSTANCES = 64
MAX_SERVERS_IN_ALL = 512


class InstanceIn(Strict):
    instance_id: str = Field(pattern=INSTANCE_ID_PATTERN, min_length=1, max_length=256, examples=["math/replica-0"])
    control_token: SecretStr = Field(
        description="The instance's checkpoint.control_auth_token. Stored to authenticate control calls; never returned or logged."
    )
    servers: dict[str, str] = Field(
        description="Every server of the instance, participant or not: server_name -> base URL (http or https).",
        examples=[{"policy_model": "http://10.0.0.5:8000", "workplace_agent": "http://10.0.0.5:8001"}],
    )

    @field_validator("control_token")
    @classmethod
    def _token(cls, v: SecretStr) -> SecretStr:
        raw = v.get_secret_value()
        if not raw or len(raw) > 4096:
            raise ValueError("must be a non-empty token of at most 4096 characters")
        if any(c.isspace() for c in raw):
            raise ValueError("must not contain whitespace (it is sent as a bearer token)")
        return v

    @field_validator("servers")
    @classmethod
    def _servers(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("must list at least one server")
        if len(v) > MAX_SERVERS:
            raise ValueError(f"at most {MAX_SERVERS} servers per instance")
        for name, url in v.items():
            if len(name) > 256 or not _NAME.fullmatch(name):
                raise ValueError(f"server name {name!r} does not match {NAME_PATTERN}")
            if len(url) > 2048:
                raise ValueError(f"server {name!r}: base URL longer than 2048 characters")
            try:
                parse_gym_url(url)
            except ValueError as e:
                raise ValueError(f"server {name!r}: base URL {e}") from None
        return dict(sorted(v.items()))


class RegisterIn(Strict):
    instances: list[InstanceIn] = Field(min_length=1, max_length=MAX_INSTANCES)

    @model_validator(mode="after")
    def _unique(self) -> RegisterIn:
        ids = [i.instance_id for i in self.instances]
        dups = sorted({i for i in ids if ids.count(i) > 1})
        if dups:
            raise ValueError(f"instance ids named twice: {', '.join(dups)}")
        total = sum(len(i.servers) for i in self.instances)
        if total > MAX_SERVERS_IN_ALL:
            raise ValueError(f"{total} servers in one registration; at most {MAX_SERVERS_IN_ALL} (register the instances in parts)")
        return self


# The answers are validated against these models when they leave (the routes return the
# registry's plain JSON): a member that only some answers carry is ``sometimes()``.


class ParticipantOut(Answer):
    server_name: str
    base_url: str
    kind: str
    participant_name: str
    mode: str | None
    stage: int
    phase: str = sometimes("Registration answers: the participant's checkpoint phase found by discovery.")
    restart_only: bool = sometimes("Registration answers: the participant cannot continue a session after a crash.")


class InstanceOut(Answer):
    instance_id: str
    servers: dict[str, str]
    participants: list[ParticipantOut]
    non_participants: list[str]
    registered_at: Timestamp = sometimes("Listings: when the instance was registered.")
    discovered_at: Timestamp | None = sometimes("Listings: when discovery last ran on it.")


class GymSettingsOut(Answer):
    checkpoint: dict[str, Any] = Field(description="Gym checkpoint settings the run expects (lease_grace_seconds = control_timeout_s).")
    excluded: list[str]
    note: str


class RegisteredOut(Answer):
    run_id: str
    instances: list[InstanceOut]
    restart_only_servers: list[str]
    warnings: list[str]
    gym_settings: GymSettingsOut


class InstanceListOut(Answer):
    run_id: str
    instances: list[InstanceOut]


class RunGymSettingsOut(GymSettingsOut):
    run_id: str


@router.post(
    "/gym-instances", operation_id="register_gym_instances", response_model=RegisteredOut, response_model_exclude_unset=True,
    responses=problems(WRITE, GYM, "gym_egress_refused", "restart_only_gym_servers", "snapshot_in_progress"),
)
async def register_gym_instances(body: RegisterIn, request: Request, caller: Caller = Depends(require_run_access)) -> RegisteredOut:
    """Discover and register Gym instances (re-registering replaces an instance's servers).

    Discovery fails as a whole, naming the servers; restart-only participants under
    ``target_level: turn`` are refused unless ``allow_restart_only_gym_servers``. Control tokens
    are never returned."""
    regs = [
        registration.Registration(i.instance_id, i.control_token.get_secret_value(), dict(i.servers)) for i in body.instances
    ]
    registered = await registration.register_instances(
        request.app.state.engine, str(caller.run_id), regs, transport=getattr(request.app.state, "gym_transport", None)
    )
    return RegisteredOut.model_validate(registered)


@router.get(
    "/gym-instances", operation_id="list_gym_instances", response_model=InstanceListOut, response_model_exclude_unset=True,
    responses=problems(RUN),
)
async def list_gym_instances(request: Request, caller: Caller = Depends(require_run_access)) -> InstanceListOut:
    """Registered instances and their participants (tokens are never returned)."""
    return InstanceListOut.model_validate(await registration.registered(request.app.state.engine, str(caller.run_id)))


@router.delete(
    "/gym-instances/{instance_id:path}", operation_id="delete_gym_instance", status_code=204,
    responses=problems(WRITE, "gym_instance_not_found", "snapshot_in_progress"),
)
async def delete_gym_instance(
    request: Request,
    instance_id: str = Path(..., pattern=INSTANCE_ID_PATTERN, max_length=256, description="Instance id, e.g. math/replica-0"),
    caller: Caller = Depends(require_run_access),
) -> None:
    """Unregister an instance (refused while a snapshot is in progress)."""
    if not _INSTANCE.fullmatch(instance_id):
        raise BadRequest(
            f"instance_id {instance_id!r} does not match {INSTANCE_ID_PATTERN}",
            errors=[{"field": "instance_id", "message": "invalid instance id"}],
        )
    await gym_registry.delete_instance(request.app.state.engine, str(caller.run_id), instance_id)


@router.get("/gym-settings", operation_id="get_gym_settings", response_model=RunGymSettingsOut, responses=problems(RUN, "invalid_config"))
async def get_gym_settings(request: Request, caller: Caller = Depends(require_run_access)) -> RunGymSettingsOut:
    """The Gym ``checkpoint:`` settings this run expects, control token excluded."""
    async with request.app.state.engine.connect() as conn:
        run = await get_run(conn, str(caller.run_id))
    return RunGymSettingsOut(run_id=run.run_id, **registration.gym_settings(registration.run_config(run.config)))
