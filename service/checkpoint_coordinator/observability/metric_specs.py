"""The metrics table: every metric's name, type, help, unit and label value sets, as data.

The ledger's metrics have fixed names, types and labels (docs/ledger.md#metrics);
``METRIC_SPECS`` holds them as a table (plus a few operator metrics marked
``in_spec_table=False``). Kept apart from ``metrics``, which builds the one registry from this
table and records through typed helpers, so that the table reads as the specification it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from ..domain.snapshot_state import (
    FailureClass,
    SnapshotOutcome,
    SnapshotReason,
    SnapshotTiming,
)
from ..domain.vocabulary import (
    Disposition,
    GymOperation,
    LedgerTransition,
    ParticipantKind,
    EffectAnswer,
    OrphanReason,
    PromptBucket,
    WorkFate,
    SchemaState,
    StrEnum,
)
from ..domain.vocabulary import OutboxOp as OutboxOpWord

# --------------------------------------------------------------------------- label value sets


# The snapshot vocabulary is the domain's: phases timed (SnapshotTiming), outcomes, reasons and
# which outcome each reason belongs to.


# Counted dispositions: every one but ``dispatch`` (a row that never ran is not restored).
RestoreDisposition = StrEnum(  # type: ignore[misc]
    "RestoreDisposition", [(d.name.upper(), d.value) for d in Disposition if d is not Disposition.dispatch]
)


class RestoreOutcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"


#: The Gym operations a control call is labelled with (discovery is made of status calls).
GymControlOp = StrEnum(  # type: ignore[misc]
    "GymControlOp", [(o.name.upper(), o.value) for o in GymOperation if o is not GymOperation.discover]
)
#: A participant's kind (``unknown``: a status probe at discovery, before the server told it).
GymParticipantKind = StrEnum("GymParticipantKind", [(k.name.upper(), k.value) for k in ParticipantKind])  # type: ignore[misc]


#: ``ok`` or the control failure class of the call (docs/gym-protocol.md#failure-classes), built
#: from the one enum.
GymCallOutcome = StrEnum("GymCallOutcome", {"OK": "ok", **{c.name: c.value for c in FailureClass}})  # type: ignore[misc]


class FencedWork(StrEnum):
    """Background work a write of which was refused because its replica lost the run's lease."""

    SNAPSHOT = "snapshot"
    OUTBOX = "outbox"


#: The fates a rollout-second is counted under once decided: in-flight work is not (it is read
#: from the ledger, docs/accounting.md#where-it-shows).
DecidedFate = StrEnum("DecidedFate", [(f.name.upper(), f.value) for f in WorkFate if f is not WorkFate.in_flight])  # type: ignore[misc]


OutboxOp = StrEnum("OutboxOp", [(o.name.upper(), o.value) for o in OutboxOpWord])  # type: ignore[misc]


LedgerState = StrEnum("LedgerState", [(t.name.upper(), t.value) for t in LedgerTransition])  # type: ignore[misc]


class HttpMethod(StrEnum):
    GET = "GET"
    POST = "POST"
    PUT = "PUT"
    PATCH = "PATCH"
    DELETE = "DELETE"
    HEAD = "HEAD"
    OPTIONS = "OPTIONS"
    # Anything else a client sends; never the raw method, which is client-controlled.
    OTHER = "other"


# --------------------------------------------------------------------------- the table


class MetricType(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


OPEN = None  # label whose values are not a closed set (documented per label)

_SECONDS_PHASE_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
)
_SECONDS_CONTROL_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
    60.0, 90.0, 120.0, 300.0,
)
_SECONDS_HTTP_BUCKETS: Final = (
    0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
_EPISODE_COUNT_BUCKETS: Final = (
    0.0, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0,
    5000.0, 10000.0,
)


@dataclass(frozen=True)
class MetricSpec:
    """One row of the metrics table.

    ``name`` is the exposed name (counters end in ``_total``). ``labels`` maps
    each label name to its closed value set, or ``OPEN`` for the few labels
    documented above. ``attr`` is the module attribute holding the metric object.
    """

    name: str
    type: MetricType
    help: str
    unit: str
    attr: str
    labels: Mapping[str, frozenset[str] | None] = field(default_factory=dict)
    buckets: tuple[float, ...] | None = None
    in_spec_table: bool = True

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(self.labels)


def _values(enum: type[StrEnum]) -> frozenset[str]:
    return frozenset(member.value for member in enum)


METRIC_SPECS: Final[tuple[MetricSpec, ...]] = (
    # ---- the ledger's metrics (docs/ledger.md#metrics) ----
    MetricSpec(
        name="ckptc_snapshot_phase_seconds",
        type=MetricType.HISTOGRAM,
        help="Duration of one phase of a snapshot, in seconds; phase=total is the whole "
        "snapshot and phase=gym_parked the time from the first prepare sent until resume answered.",
        unit="seconds",
        attr="SNAPSHOT_PHASE_SECONDS",
        labels={"phase": _values(SnapshotTiming)},
        buckets=_SECONDS_PHASE_BUCKETS,
    ),
    MetricSpec(
        name="ckptc_snapshots_total",
        type=MetricType.COUNTER,
        help="Snapshots that reached a terminal outcome, counted in snapshots, by outcome "
        "(published, failed, aborted) and reason (ok for published).",
        unit="snapshots",
        attr="SNAPSHOTS_TOTAL",
        labels={"outcome": _values(SnapshotOutcome), "reason": _values(SnapshotReason)},
    ),
    MetricSpec(
        name="ckptc_snapshots_in_progress",
        type=MetricType.GAUGE,
        help="Snapshots this replica is currently driving (requested and not yet terminal), in snapshots.",
        unit="snapshots",
        attr="SNAPSHOTS_IN_PROGRESS",
    ),
    MetricSpec(
        name="ckptc_snapshot_losses_consecutive",
        type=MetricType.GAUGE,
        help="Consecutive snapshots of a run aborted because a newer train step committed "
        "first, in snapshots; reset to 0 by a published snapshot.",
        unit="snapshots",
        attr="SNAPSHOT_LOSSES_CONSECUTIVE",
        labels={"run": OPEN},
    ),
    MetricSpec(
        name="ckptc_gym_restarted_episodes",
        type=MetricType.HISTOGRAM,
        help="Episodes per published snapshot that Gym reported as restarts and that would "
        "start over from their task after a crash, in episodes.",
        unit="episodes",
        attr="GYM_RESTARTED_EPISODES",
        buckets=_EPISODE_COUNT_BUCKETS,
    ),
    MetricSpec(
        name="ckptc_restore_siblings_total",
        type=MetricType.COUNTER,
        help="Siblings placed by applied restore plans, in siblings, by disposition.",
        unit="siblings",
        attr="RESTORE_SIBLINGS_TOTAL",
        labels={"disposition": _values(RestoreDisposition)},
    ),
    MetricSpec(
        name="ckptc_prompts_total",
        type=MetricType.COUNTER,
        help="Prompt groups that entered a bucket, in groups: live when admitted, trained when finalized, "
        "abandoned, rewound by a restore (docs/accounting.md#prompt-conservation).",
        unit="groups",
        attr="PROMPTS_TOTAL",
        labels={"bucket": _values(PromptBucket)},
    ),
    MetricSpec(
        name="ckptc_rollout_seconds_total",
        type=MetricType.COUNTER,
        help="Rollout-seconds of attempts by fate once decided, in seconds: trained (sealed), carried (continued "
        "by a restore up to its cut), redone (failed, abandoned, or thrown away by a restore).",
        unit="seconds",
        attr="ROLLOUT_SECONDS_TOTAL",
        labels={"fate": _values(DecidedFate)},
    ),
    MetricSpec(
        name="ckptc_gym_control_seconds",
        type=MetricType.HISTOGRAM,
        help="Duration of one Gym control call to one participant, in seconds, by op, "
        "participant kind and outcome (ok or the control failure class).",
        unit="seconds",
        attr="GYM_CONTROL_SECONDS",
        labels={
            "op": _values(GymControlOp),
            "kind": _values(GymParticipantKind),
            "outcome": _values(GymCallOutcome),
        },
        buckets=_SECONDS_CONTROL_BUCKETS,
    ),
    MetricSpec(
        name="ckptc_outbox_pending",
        type=MetricType.GAUGE,
        help="Retire or forget items waiting in the durable outbox, in items, by op.",
        unit="items",
        attr="OUTBOX_PENDING",
        labels={"op": _values(OutboxOp)},
    ),
    MetricSpec(
        name="ckptc_outbox_oldest_age_seconds",
        type=MetricType.GAUGE,
        help="Age of the oldest undelivered outbox item, in seconds, by op; 0 when none is pending.",
        unit="seconds",
        attr="OUTBOX_OLDEST_AGE_SECONDS",
        labels={"op": _values(OutboxOp)},
    ),
    MetricSpec(
        name="ckptc_ledger_transitions_total",
        type=MetricType.COUNTER,
        help="Ledger state transitions committed, in transitions, by target state "
        "(attempt, group or retirement state).",
        unit="transitions",
        attr="LEDGER_TRANSITIONS_TOTAL",
        labels={"to": _values(LedgerState)},
    ),
    MetricSpec(
        name="ckptc_http_request_seconds",
        type=MetricType.HISTOGRAM,
        help="Duration of HTTP requests served, in seconds, by route template "
        "(unmatched for unknown paths), method and status code.",
        unit="seconds",
        attr="HTTP_REQUEST_SECONDS",
        labels={"route": OPEN, "method": _values(HttpMethod), "status": OPEN},
        buckets=_SECONDS_HTTP_BUCKETS,
    ),
    # ---- operator metrics beyond the table ----
    MetricSpec(
        name="ckptc_restore_duration_seconds",
        type=MetricType.HISTOGRAM,
        help="Duration of one restore from plan checks to applied ledger, in seconds, by outcome.",
        unit="seconds",
        attr="RESTORE_DURATION_SECONDS",
        labels={"outcome": _values(RestoreOutcome)},
        buckets=_SECONDS_PHASE_BUCKETS,
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_gym_exported_outside_scope_total",
        type=MetricType.COUNTER,
        help="Episodes Gym participants exported outside a commit's scope (published Gym's agents "
        "and resources export every live session); accepted and left out of the snapshot, in "
        "episodes, by the exporter's kind.",
        unit="episodes",
        attr="GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL",
        labels={"kind": _values(GymParticipantKind)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_fenced_writes_total",
        type=MetricType.COUNTER,
        help="Background writes refused because this replica no longer held the run's lease "
        "(another replica took the run over); the work stopped here, in writes, by the work.",
        unit="writes",
        attr="FENCED_WRITES_TOTAL",
        labels={"work": _values(FencedWork)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_auth_failures_total",
        type=MetricType.COUNTER,
        help="Requests refused for their token: 401 (none or malformed), 403 (not valid for the route) and 429 "
        "(a client refused too often lately, throttled before its token is looked at), in requests.",
        unit="requests",
        attr="AUTH_FAILURES_TOTAL",
        labels={"status": frozenset({"401", "403", "429"})},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_snapshot_resume_failures_total",
        type=MetricType.COUNTER,
        help="Snapshots whose Gym resume still failed after a successful cut (the snapshot "
        "is kept and Gym's lease reopens admission), in snapshots.",
        unit="snapshots",
        attr="SNAPSHOT_RESUME_FAILURES_TOTAL",
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_straggler_retirements_total",
        type=MetricType.COUNTER,
        help="Episodes given up as stragglers (they blocked max_blocking_snapshots snapshots in a row), retired "
        "on Gym and replaced at the next snapshot's gate, in episodes.",
        unit="episodes",
        attr="STRAGGLER_RETIREMENTS_TOTAL",
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_snapshot_losses_warning",
        type=MetricType.GAUGE,
        help="1 while a run's consecutive losses to train steps are at or above the "
        "configured warning threshold, else 0 (boolean, unitless).",
        unit="boolean",
        attr="SNAPSHOT_LOSSES_WARNING",
        labels={"run": OPEN},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_run_leases_held",
        type=MetricType.GAUGE,
        help="Runs whose background-work ownership lease this replica holds, in runs.",
        unit="runs",
        attr="RUN_LEASES_HELD",
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_ready",
        type=MetricType.GAUGE,
        help="Result of the last readiness check: 1 ready (a schema this release runs on, not shutting down; a "
        "database outage leaves it ready, the API then answers 503 itself), 0 not ready (boolean, unitless).",
        unit="boolean",
        attr="READY",
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_database_up",
        type=MetricType.GAUGE,
        help="1 while the ledger database answered this replica's last check (every 5 s), else 0 (boolean, unitless).",
        unit="boolean",
        attr="DATABASE_UP",
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_schema_state",
        type=MetricType.GAUGE,
        help="1 for the state the database schema is in for this replica's release, 0 for the others (boolean, "
        "unitless): at_head, ahead (a newer release's schema this one runs on), behind (a migration to run), "
        "incompatible (a newer schema this release must not run on), unknown (not read yet).",
        unit="boolean",
        attr="SCHEMA_STATE",
        labels={"state": _values(SchemaState)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_runs_without_driver",
        type=MetricType.GAUGE,
        help="Open runs with work owed (a snapshot not ended, outbox items due for a minute) whose lease no "
        "replica holds, in runs; every replica reports the fleet's count.",
        unit="runs",
        attr="RUNS_WITHOUT_DRIVER",
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_snapshot_failures_consecutive",
        type=MetricType.GAUGE,
        help="Snapshots of a run that ended failed since its last published one, in snapshots (aborts leave it as "
        "it is); reported by the replica that ended the last one.",
        unit="snapshots",
        attr="SNAPSHOT_FAILURES_CONSECUTIVE",
        labels={"run": OPEN},
        in_spec_table=False,
    ),
    # ---- per run, for the run drill-down: small label sets, dropped when the run ends or moves ----
    MetricSpec(
        name="ckptc_run_snapshots_total",
        type=MetricType.COUNTER,
        help="Snapshots of a run that reached a terminal outcome on this replica, in snapshots, by outcome and reason.",
        unit="snapshots",
        attr="RUN_SNAPSHOTS_TOTAL",
        labels={"run": OPEN, "outcome": _values(SnapshotOutcome), "reason": _values(SnapshotReason)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_run_snapshot_phase_seconds",
        type=MetricType.GAUGE,
        help="How long each phase of a run's last ended snapshot took, in seconds (phase=total: the whole "
        "snapshot; gym_parked: Gym's park).",
        unit="seconds",
        attr="RUN_SNAPSHOT_PHASE_SECONDS",
        labels={"run": OPEN, "phase": _values(SnapshotTiming)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_run_gym_restarted_episodes",
        type=MetricType.GAUGE,
        help="Episodes of a run's last published snapshot that would start over from their task after a crash, in episodes.",
        unit="episodes",
        attr="RUN_GYM_RESTARTED_EPISODES",
        labels={"run": OPEN},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_run_gym_exported_outside_scope_total",
        type=MetricType.COUNTER,
        help="Episodes Gym exported outside a run's commit scopes (accepted, left out of its snapshots), in episodes.",
        unit="episodes",
        attr="RUN_GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL",
        labels={"run": OPEN},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_run_gym_control_calls_total",
        type=MetricType.COUNTER,
        help="Gym control calls made for a run, in calls, by op and outcome (ok or the control failure class).",
        unit="calls",
        attr="RUN_GYM_CONTROL_CALLS_TOTAL",
        labels={"run": OPEN, "op": _values(GymControlOp), "outcome": _values(GymCallOutcome)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_run_restore_siblings_total",
        type=MetricType.COUNTER,
        help="Siblings placed by a run's applied restore plans on this replica, in siblings, by disposition.",
        unit="siblings",
        attr="RUN_RESTORE_SIBLINGS_TOTAL",
        labels={"run": OPEN, "disposition": _values(RestoreDisposition)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_run_restore_seconds",
        type=MetricType.GAUGE,
        help="How long a run's last restore took from plan checks to applied ledger, in seconds, by its outcome.",
        unit="seconds",
        attr="RUN_RESTORE_SECONDS",
        labels={"run": OPEN, "outcome": _values(RestoreOutcome)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_build_info",
        type=MetricType.GAUGE,
        help="Always 1 (constant, unitless); the labels carry the coordinator version and "
        "the Python version.",
        unit="constant",
        attr="BUILD_INFO",
        labels={"version": OPEN, "python": OPEN},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_effect_begins_total",
        type=MetricType.COUNTER,
        help="Effect journal begins, in calls, by answer: proceed, done (not acted again), unknown, diverged "
        "(docs/effects.md).",
        unit="calls",
        attr="EFFECT_BEGINS_TOTAL",
        labels={"answer": _values(EffectAnswer)},
        in_spec_table=False,
    ),
    MetricSpec(
        name="ckptc_effect_orphans_total",
        type=MetricType.COUNTER,
        help="Journalled effects found in a discarded timeline, in effects, by reason: a user may have to "
        "compensate them (docs/effects.md#orphans).",
        unit="effects",
        attr="EFFECT_ORPHANS_TOTAL",
        labels={"reason": _values(OrphanReason)},
        in_spec_table=False,
    ),
)

SPECS_BY_NAME: Final[Mapping[str, MetricSpec]] = {spec.name: spec for spec in METRIC_SPECS}


def metrics_in_table() -> set[str]:
    """Every metric name the registry exposes (the fixed table plus operator metrics)."""
    return {spec.name for spec in METRIC_SPECS}


def spec_table_metrics() -> set[str]:
    """Only the names of the ledger's metrics table (docs/ledger.md#metrics)."""
    return {spec.name for spec in METRIC_SPECS if spec.in_spec_table}
