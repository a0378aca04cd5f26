"""The run's recovery configuration (docs/ledger.md#recovery-configuration) and the rules that validate it.

Every key, its default and its bounds:

==================================  ========  ==================================================
key                                 default   rule
==================================  ========  ==================================================
``target_level``                    sibling   turn | sibling | prompt_group (``prefix`` refused)
``task_source_target_level_overrides``  {}    task source -> level, each coarser-or-equal to
                                              ``target_level``
``agent_target_level_overrides``    {}        agent server name -> level, same rule
``allow_restart_only_gym_servers``  false     only with ``target_level: turn``
``control_timeout_s``               60        (0, 3600]; budget of each Gym control call
``prepare_timeout_s``               300       (0, 86400]; ONE deadline for the whole prepare
                                              phase, all stages of all instances
``drain_timeout_s``                 120       (0, 86400]
``data_plane_timeout_s``            600       (0, 86400]
``resume_timeout_s``                null      (0, 86400]; total budget of the resume phase,
                                              retries of failed instances included; at least
                                              one control call (``control_timeout_s`` + reply
                                              grace). null means two control calls' worth.
``stall_timeout_s``                 1800      (0, 604800]; strictly longer than the longest
                                              Gym park (below)
``max_row_attempts``                3         [1, 100]; attempts per sibling before the whole
                                              cohort is retried
``max_group_attempts``              3         [1, 100]; cohort attempts for transport failures
``max_data_attempts``               2         [1, 100]; cohort attempts for data failures
``keep_latest_k``                   2         [1, 1000]; published snapshots kept per run
``snapshot_loss_warn_after``        3         [1, 10000]; consecutive snapshots lost to train
                                              steps before the coordinator warns
``max_blocking_snapshots``          3         [0, 1000]; consecutive snapshots one episode may
                                              block before it is retired and replaced
                                              (``straggler``); 0: never
``max_continue_staleness``          null      [0, 1000000] train steps; a restore restarts a
                                              continuation whose policy version is older than
                                              ``anchor - max_continue_staleness``
                                              (``too_stale``); null: no limit
==================================  ========  ==================================================

The ``max_*_attempts`` budgets count every attempt, the first one included.

Longest possible Gym park (docs/ledger.md#recovery-configuration). With
``reply_grace = min(control_timeout_s, 5)`` (the time a reply may take to come back after its
deadline, docs/gym-protocol.md#transport)::

    park_max = (prepare_timeout_s + reply_grace)        # prepare, every stage, one deadline
             + (control_timeout_s + reply_grace)        # commit fan-out
             + drain_timeout_s
             + data_plane_timeout_s
             + resume_budget_s                          # resume_timeout_s, or
                                                        # 2 * (control_timeout_s + reply_grace)

``stall_timeout_s`` must be strictly greater than ``park_max``; a refusal names the minimum.
With the defaults ``park_max = 305 + 65 + 120 + 600 + 130 = 1220`` seconds.

Every refusal is a :class:`~.errors.ConfigError` whose issues name each offending key (for a map
entry: ``agent_target_level_overrides.<agent>``). All issues of a document are reported at once.
Construction through any pydantic entry point (``RecoveryConfig(...)``,
``RecoveryConfig.model_validate``) raises ``ConfigError`` too, never a pydantic error.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Mapping

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import ConfigError, FieldIssue, LevelError
from .identity import SERVER_NAME, TASK_SOURCE
from .levels import RestoreLevel, parse_level

__all__ = [
    "RecoveryConfig",
    "load_recovery_config",
    "REMOVED_KEYS",
    "reply_grace_s",
    "resume_budget_s",
    "min_stall_timeout_s",
    "renew_interval_s",
    "gym_checkpoint_settings",
    "lease_grace_verdict",
    "RestartOnlyVerdict",
    "check_restart_only_servers",
]

#: Keys of the older granularity-based config, with the key that replaced each.
REMOVED_KEYS: Mapping[str, str] = {
    "default_granularity": "target_level",
    "task_granularity_overrides": "task_source_target_level_overrides",
    "task_source_granularity_overrides": "task_source_target_level_overrides",
    "agent_granularity_overrides": "agent_target_level_overrides",
}

_MAX_CONTROL_S = 3600.0
_MAX_PHASE_S = 86400.0
_MAX_STALL_S = 604800.0


def _seconds(default: float | None, upper: float) -> Any:
    return Field(default=default, strict=True, gt=0, le=upper, allow_inf_nan=False)


def _budget(default: int, upper: int) -> Any:
    return Field(default=default, strict=True, ge=1, le=upper)


class RecoveryConfig(BaseModel):
    """A run's recovery configuration. Immutable; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    target_level: RestoreLevel = RestoreLevel.sibling
    task_source_target_level_overrides: dict[str, RestoreLevel] = Field(default_factory=dict)
    agent_target_level_overrides: dict[str, RestoreLevel] = Field(default_factory=dict)
    allow_restart_only_gym_servers: Annotated[bool, Field(strict=True)] = False

    control_timeout_s: Annotated[float, _seconds(60.0, _MAX_CONTROL_S)] = 60.0
    prepare_timeout_s: Annotated[float, _seconds(300.0, _MAX_PHASE_S)] = 300.0
    drain_timeout_s: Annotated[float, _seconds(120.0, _MAX_PHASE_S)] = 120.0
    data_plane_timeout_s: Annotated[float, _seconds(600.0, _MAX_PHASE_S)] = 600.0
    resume_timeout_s: Annotated[float | None, _seconds(None, _MAX_PHASE_S)] = None
    stall_timeout_s: Annotated[float, _seconds(1800.0, _MAX_STALL_S)] = 1800.0

    max_row_attempts: Annotated[int, _budget(3, 100)] = 3
    max_group_attempts: Annotated[int, _budget(3, 100)] = 3
    max_data_attempts: Annotated[int, _budget(2, 100)] = 2
    keep_latest_k: Annotated[int, _budget(2, 1000)] = 2
    snapshot_loss_warn_after: Annotated[int, _budget(3, 10000)] = 3
    # Liveness (docs/ledger.md#stragglers, docs/ledger.md#stale-continuations).
    max_blocking_snapshots: Annotated[int, Field(default=3, strict=True, ge=0, le=1000)] = 3
    max_continue_staleness: Annotated[int | None, Field(default=None, strict=True, ge=0, le=1_000_000)] = None

    # -- field rules --------------------------------------------------------------------------

    @field_validator("target_level", mode="before")
    @classmethod
    def _level(cls, value: Any) -> RestoreLevel:
        return parse_level(value)

    @field_validator(
        "task_source_target_level_overrides", "agent_target_level_overrides", mode="before"
    )
    @classmethod
    def _overrides(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a map of name to restore level, got {type(value).__name__}")
        return value

    # -- whole-document rules -----------------------------------------------------------------

    @model_validator(mode="wrap")
    @classmethod
    def _as_config_error(cls, data: Any, handler: Any) -> "RecoveryConfig":
        """Report every problem of the document as one ConfigError naming each key."""
        if isinstance(data, RecoveryConfig):
            return data
        issues: list[FieldIssue] = []
        if not isinstance(data, Mapping):
            raise ConfigError(
                [FieldIssue((), f"the recovery config must be an object, got {type(data).__name__}")]
            )
        data = dict(data)
        for key in [k for k in data if k in REMOVED_KEYS]:
            issues.append(
                FieldIssue(
                    (key,),
                    f"{key!r} was removed; use {REMOVED_KEYS[key]!r} instead (restore levels "
                    "'turn' < 'sibling' < 'prompt_group' replace granularities; overrides go in "
                    "'task_source_target_level_overrides' and 'agent_target_level_overrides')",
                )
            )
            del data[key]
        # Rules that need only a few keys run before pydantic, so that they are reported
        # together with any unrelated type error, each naming its key.
        try:
            target: RestoreLevel | None = parse_level(data.get("target_level", RestoreLevel.sibling))
        except LevelError:
            target = None  # reported by the field validator
        for map_key, rule in (
            ("task_source_target_level_overrides", TASK_SOURCE),
            ("agent_target_level_overrides", SERVER_NAME),
        ):
            raw = data.get(map_key)
            if not isinstance(raw, Mapping):
                continue
            clean: dict[Any, Any] = {}
            for name, level in raw.items():
                reason = rule.problem(name)
                if reason is not None:
                    issues.append(FieldIssue((map_key, str(name)), reason))
                    continue
                try:
                    parsed = parse_level(level, (map_key, name))
                except LevelError as exc:
                    issues.extend(exc.issues)
                    continue
                if target is not None and parsed < target:
                    issues.append(
                        FieldIssue(
                            (map_key, name),
                            f"override {parsed.value!r} is finer than target_level "
                            f"{target.value!r}; an override may only make the level coarser "
                            "(turn < sibling < prompt_group)",
                        )
                    )
                    continue
                clean[name] = parsed
            data[map_key] = clean
        if (
            target is not None
            and target is not RestoreLevel.turn
            and data.get("allow_restart_only_gym_servers") is True
        ):
            issues.append(_restart_only_flag_issue(target))
        try:
            model = handler(data)
        except ValidationError as exc:
            issues.extend(_issues_from_pydantic(exc))
            raise ConfigError(_dedupe(issues)) from None
        if issues:
            raise ConfigError(_dedupe(issues))
        issues.extend(_cross_field_issues(model))
        if issues:
            raise ConfigError(issues)
        return model

    # -- derived values -----------------------------------------------------------------------

    # The module's functions, as properties of the config they are computed from.
    reply_grace_s = property(lambda self: reply_grace_s(self))
    resume_budget_s = property(lambda self: resume_budget_s(self))
    min_stall_timeout_s = property(lambda self: min_stall_timeout_s(self))
    renew_interval_s = property(lambda self: renew_interval_s(self))

    def public_dict(self) -> dict[str, Any]:
        """JSON-ready form, every key present (what a run's GET shows)."""
        return self.model_dump(mode="json")


def _issues_from_pydantic(exc: ValidationError) -> list[FieldIssue]:
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(err.get("loc", ()))
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, LevelError):
            out.append(FieldIssue(loc, ctx_error.message))
            continue
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            msg = "unknown key; a misspelled key must not silently disable a guarantee"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        out.append(FieldIssue(loc, msg))
    return out


def _dedupe(issues: list[FieldIssue]) -> list[FieldIssue]:
    seen: set[tuple[Any, str]] = set()
    out = []
    for i in issues:
        if (i.loc, i.message) not in seen:
            seen.add((i.loc, i.message))
            out.append(i)
    return out


def _cross_field_issues(cfg: RecoveryConfig) -> list[FieldIssue]:
    """Rules across timeouts; the level rules ran before pydantic."""
    issues: list[FieldIssue] = []
    grace = reply_grace_s(cfg)
    if cfg.resume_timeout_s is not None and cfg.resume_timeout_s < cfg.control_timeout_s + grace:
        issues.append(
            FieldIssue(
                ("resume_timeout_s",),
                f"must allow at least one resume call: control_timeout_s + reply grace = "
                f"{_fmt(cfg.control_timeout_s + grace)} s, got {_fmt(cfg.resume_timeout_s)} s",
            )
        )
    minimum = min_stall_timeout_s(cfg)
    if not cfg.stall_timeout_s > minimum:
        issues.append(
            FieldIssue(
                ("stall_timeout_s",),
                f"must be strictly longer than the longest possible Gym park, {_fmt(minimum)} s "
                f"= prepare ({_fmt(cfg.prepare_timeout_s)} + {_fmt(grace)} grace) + commit "
                f"({_fmt(cfg.control_timeout_s)} + {_fmt(grace)} grace) + drain "
                f"({_fmt(cfg.drain_timeout_s)}) + data plane ({_fmt(cfg.data_plane_timeout_s)}) "
                f"+ resume ({_fmt(resume_budget_s(cfg))}); got {_fmt(cfg.stall_timeout_s)} s",
            )
        )
    return issues


def _restart_only_flag_issue(target: RestoreLevel) -> FieldIssue:
    return FieldIssue(
        ("allow_restart_only_gym_servers",),
        f"only allowed with target_level 'turn' (it is {target.value!r}): restart-only Gym "
        "servers matter only to turn-level recovery; remove the flag",
    )


def _fmt(x: float) -> str:
    return f"{x:g}"


# -- derived timings --------------------------------------------------------------------------


def reply_grace_s(cfg: RecoveryConfig) -> float:
    """Time a control reply may take after its deadline: ``min(control_timeout_s, 5)``."""
    return min(cfg.control_timeout_s, 5.0)


def resume_budget_s(cfg: RecoveryConfig) -> float:
    """The resume phase budget: ``resume_timeout_s`` or two control calls with their grace."""
    if cfg.resume_timeout_s is not None:
        return cfg.resume_timeout_s
    return 2.0 * (cfg.control_timeout_s + reply_grace_s(cfg))


def min_stall_timeout_s(cfg: RecoveryConfig) -> float:
    """The longest possible Gym park; ``stall_timeout_s`` must be strictly longer."""
    grace = reply_grace_s(cfg)
    return (
        cfg.prepare_timeout_s
        + grace
        + cfg.control_timeout_s
        + grace
        + cfg.drain_timeout_s
        + cfg.data_plane_timeout_s
        + resume_budget_s(cfg)
    )


def renew_interval_s(cfg: RecoveryConfig) -> float:
    """Lease renew cadence while parked: ``max(0.01, min(control_timeout_s / 3, 10))``."""
    return max(0.01, min(cfg.control_timeout_s / 3.0, 10.0))


def gym_checkpoint_settings(cfg: RecoveryConfig) -> dict[str, Any]:
    """The Gym ``checkpoint:`` settings the coordinator expects for this run, token excluded.

    ``lease_grace_seconds = control_timeout_s`` (docs/gym-protocol.md#leases-and-renewals): a
    lease then outlives its last renewal by ``2 * control_timeout_s`` and a crashed coordinator
    keeps Gym parked at most that long. ``control_auth_token`` is deliberately absent: it is a
    secret per instance.
    """
    return {"lease_grace_seconds": cfg.control_timeout_s}


def lease_grace_verdict(
    cfg: RecoveryConfig, observed_s: float
) -> Literal["ok", "too_short", "too_long"]:
    """Judge ``observed = lease_expires_at - deadline_ts`` from the first renew of a checkpoint.

    ``too_short`` (below ``control_timeout_s``: a few failed renewals lose the lease) and
    ``too_long`` (above ``4 * control_timeout_s``: parks run long after a crash) deserve a
    warning naming the expected ``lease_grace_seconds``."""
    if not math.isfinite(observed_s):
        return "too_long"
    if observed_s < cfg.control_timeout_s:
        return "too_short"
    if observed_s > 4.0 * cfg.control_timeout_s:
        return "too_long"
    return "ok"


# -- restart-only policy (applied at setup after discovery; docs/ledger.md#recovery-configuration)


class RestartOnlyVerdict(BaseModel):
    """Outcome of the restart-only policy: refuse (``error``) or accept with ``warnings``."""

    model_config = ConfigDict(frozen=True)

    error: str | None = None
    warnings: tuple[str, ...] = ()
    restart_only_servers: tuple[str, ...] = ()

    @property
    def accepted(self) -> bool:
        return self.error is None


def check_restart_only_servers(
    cfg: RecoveryConfig, restart_only_servers: Mapping[str, list[str] | tuple[str, ...]]
) -> RestartOnlyVerdict:
    """Apply ``allow_restart_only_gym_servers`` to what discovery found.

    ``restart_only_servers`` maps instance id to the names of its restart-only participants (a
    resources server in mode ``restart_only`` or an agent that cannot continue sessions). A
    participant without a reported mode must not be listed. Named servers are rendered
    ``<instance_id>:<server_name>``, sorted."""
    named = tuple(
        sorted(f"{iid}:{srv}" for iid, servers in restart_only_servers.items() for srv in servers)
    )
    if named:
        if cfg.target_level is not RestoreLevel.turn:
            # Coarser levels never continue a turn, so restart-only servers lose nothing.
            return RestartOnlyVerdict(restart_only_servers=named)
        listing = ", ".join(named)
        if not cfg.allow_restart_only_gym_servers:
            return RestartOnlyVerdict(
                error=(
                    f"target_level is 'turn' but these Gym servers are restart-only, so their "
                    f"in-flight rollouts would silently start over after a crash: {listing}; "
                    "make them export state or set allow_restart_only_gym_servers: true"
                ),
                restart_only_servers=named,
            )
        return RestartOnlyVerdict(
            warnings=(
                f"restart-only Gym servers accepted (allow_restart_only_gym_servers): their "
                f"in-flight rollouts start over from their tasks after a crash: {listing}",
            ),
            restart_only_servers=named,
        )
    if cfg.allow_restart_only_gym_servers:
        return RestartOnlyVerdict(
            warnings=(
                "allow_restart_only_gym_servers is set but no Gym server is restart-only; the "
                "flag has no effect",
            )
        )
    return RestartOnlyVerdict()


def load_recovery_config(obj: Any) -> RecoveryConfig:
    """Validate a run's recovery config document; :class:`ConfigError` lists every issue."""
    return RecoveryConfig.model_validate(obj)
