"""The coordinator's metrics: one table, one registry, typed recording helpers.

Section 10 of ``recovery-ledger.md`` fixes the names, types and labels of the
metrics. ``METRIC_SPECS`` below is that table (plus a few operator metrics marked
``in_spec_table=False``); the registry is built from it and nothing else. Code
records through the helpers (``observe_snapshot_phase`` and friends), which
check every label value against a closed set, so a typo or an id leaking into a
label fails loudly in tests instead of silently exploding cardinality.

No label ever carries a group, sibling, attempt, rollout or snapshot id. The
only open-valued labels are ``run`` (bounded by the runs a fleet serves),
``route`` (bounded by the app's route templates), ``status`` (HTTP codes) and
the build-info labels; ``tests/unit/test_metrics_contract.py`` enforces both
rules.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from ..domain.vocabulary import Disposition, LedgerTransition

from ..domain.snapshot_state import REASON_OUTCOME, FailureClass, SnapshotOutcome, SnapshotReason, SnapshotTiming

__all__ = [
    "REGISTRY",
    "METRIC_SPECS",
    "MetricSpec",
    "MetricType",
    "MetricLabelError",
    "SnapshotTiming",
    "SnapshotOutcome",
    "SnapshotReason",
    "REASON_OUTCOME",
    "RestoreDisposition",
    "RestoreOutcome",
    "GymControlOp",
    "GymParticipantKind",
    "GymCallOutcome",
    "OutboxOp",
    "FencedWork",
    "LedgerState",
    "HttpMethod",
    "HELPER_METRICS",
    "metrics_in_table",
    "spec_table_metrics",
    "render_latest",
]


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


class GymControlOp(StrEnum):
    STATUS = "status"
    PREPARE = "prepare"
    RENEW = "renew"
    COMMIT = "commit"
    RESUME = "resume"
    RESTORE = "restore"
    RETIRE = "retire"
    FORGET = "forget"


class GymParticipantKind(StrEnum):
    ENVIRONMENT = "environment"
    MODEL = "model"
    AGENT = "agent"
    RESOURCES = "resources"
    # A status probe at discovery, before the server has told its kind.
    UNKNOWN = "unknown"


#: ``ok`` or the control failure class of the call (protocol section 9), built from the one enum.
GymCallOutcome = StrEnum("GymCallOutcome", {"OK": "ok", **{c.name: c.value for c in FailureClass}})  # type: ignore[misc]


class FencedWork(StrEnum):
    """Background work a write of which was refused because its replica lost the run's lease."""

    SNAPSHOT = "snapshot"
    OUTBOX = "outbox"


class OutboxOp(StrEnum):
    RETIRE = "retire"
    FORGET = "forget"


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
    # ---- recovery-ledger.md section 10 ----
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
        help="Result of the last readiness check (database reachable and migrations at "
        "head): 1 ready, 0 not ready (boolean, unitless).",
        unit="boolean",
        attr="READY",
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
)

SPECS_BY_NAME: Final[Mapping[str, MetricSpec]] = {spec.name: spec for spec in METRIC_SPECS}


def metrics_in_table() -> set[str]:
    """Every metric name the registry exposes (the fixed table plus operator metrics)."""
    return {spec.name for spec in METRIC_SPECS}


def spec_table_metrics() -> set[str]:
    """Only the names of recovery-ledger.md section 10."""
    return {spec.name for spec in METRIC_SPECS if spec.in_spec_table}


# --------------------------------------------------------------------------- registry


def _build(spec: MetricSpec, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    labelnames = spec.label_names
    if spec.type is MetricType.COUNTER:
        return Counter(spec.name, spec.help, labelnames, registry=registry)
    if spec.type is MetricType.GAUGE:
        return Gauge(spec.name, spec.help, labelnames, registry=registry)
    assert spec.buckets is not None, spec.name
    return Histogram(spec.name, spec.help, labelnames, buckets=spec.buckets, registry=registry)


def build_registry() -> tuple[CollectorRegistry, dict[str, Counter | Gauge | Histogram]]:
    """Build a fresh registry from the table (the module's ``REGISTRY`` is one of these)."""
    registry = CollectorRegistry(auto_describe=True)
    objects = {spec.name: _build(spec, registry) for spec in METRIC_SPECS}
    return registry, objects


REGISTRY: Final[CollectorRegistry]
REGISTRY, _OBJECTS = build_registry()

SNAPSHOT_PHASE_SECONDS: Final[Histogram] = _OBJECTS["ckptc_snapshot_phase_seconds"]  # type: ignore[assignment]
SNAPSHOTS_TOTAL: Final[Counter] = _OBJECTS["ckptc_snapshots_total"]  # type: ignore[assignment]
SNAPSHOTS_IN_PROGRESS: Final[Gauge] = _OBJECTS["ckptc_snapshots_in_progress"]  # type: ignore[assignment]
SNAPSHOT_LOSSES_CONSECUTIVE: Final[Gauge] = _OBJECTS["ckptc_snapshot_losses_consecutive"]  # type: ignore[assignment]
GYM_RESTARTED_EPISODES: Final[Histogram] = _OBJECTS["ckptc_gym_restarted_episodes"]  # type: ignore[assignment]
RESTORE_SIBLINGS_TOTAL: Final[Counter] = _OBJECTS["ckptc_restore_siblings_total"]  # type: ignore[assignment]
GYM_CONTROL_SECONDS: Final[Histogram] = _OBJECTS["ckptc_gym_control_seconds"]  # type: ignore[assignment]
OUTBOX_PENDING: Final[Gauge] = _OBJECTS["ckptc_outbox_pending"]  # type: ignore[assignment]
OUTBOX_OLDEST_AGE_SECONDS: Final[Gauge] = _OBJECTS["ckptc_outbox_oldest_age_seconds"]  # type: ignore[assignment]
LEDGER_TRANSITIONS_TOTAL: Final[Counter] = _OBJECTS["ckptc_ledger_transitions_total"]  # type: ignore[assignment]
HTTP_REQUEST_SECONDS: Final[Histogram] = _OBJECTS["ckptc_http_request_seconds"]  # type: ignore[assignment]
RESTORE_DURATION_SECONDS: Final[Histogram] = _OBJECTS["ckptc_restore_duration_seconds"]  # type: ignore[assignment]
GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL: Final[Counter] = _OBJECTS["ckptc_gym_exported_outside_scope_total"]  # type: ignore[assignment]
FENCED_WRITES_TOTAL: Final[Counter] = _OBJECTS["ckptc_fenced_writes_total"]  # type: ignore[assignment]
AUTH_FAILURES_TOTAL: Final[Counter] = _OBJECTS["ckptc_auth_failures_total"]  # type: ignore[assignment]
SNAPSHOT_RESUME_FAILURES_TOTAL: Final[Counter] = _OBJECTS["ckptc_snapshot_resume_failures_total"]  # type: ignore[assignment]
SNAPSHOT_LOSSES_WARNING: Final[Gauge] = _OBJECTS["ckptc_snapshot_losses_warning"]  # type: ignore[assignment]
RUN_LEASES_HELD: Final[Gauge] = _OBJECTS["ckptc_run_leases_held"]  # type: ignore[assignment]
READY: Final[Gauge] = _OBJECTS["ckptc_ready"]  # type: ignore[assignment]
BUILD_INFO: Final[Gauge] = _OBJECTS["ckptc_build_info"]  # type: ignore[assignment]


def _initialize_series() -> None:
    """Create the zero-valued children of small closed label sets.

    A counter child that first appears with value 1 is invisible to ``increase()``
    and ``rate()``; pre-creating the valid combinations makes the first failed
    snapshot or the first restore count in dashboards and alerts. Gym control
    calls and HTTP requests are not pre-created: their label product is large.
    """
    for phase in SnapshotTiming:
        SNAPSHOT_PHASE_SECONDS.labels(phase=phase.value)
    for reason, outcome in REASON_OUTCOME.items():
        SNAPSHOTS_TOTAL.labels(outcome=str(outcome), reason=str(reason))
    for disposition in RestoreDisposition:
        RESTORE_SIBLINGS_TOTAL.labels(disposition=disposition.value)
    for restore_outcome in RestoreOutcome:
        RESTORE_DURATION_SECONDS.labels(outcome=restore_outcome.value)
    for state in LedgerState:
        LEDGER_TRANSITIONS_TOTAL.labels(to=state.value)
    for work in FencedWork:
        FENCED_WRITES_TOTAL.labels(work=work.value)
    for status in ("401", "403", "429"):
        AUTH_FAILURES_TOTAL.labels(status=status)


_initialize_series()


# --------------------------------------------------------------------------- validation


class MetricLabelError(ValueError):
    """A label value outside its closed set, or a malformed open label value."""


_RUN_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ROUTE_RE: Final = re.compile(r"^(/[^\s]*|unmatched)$")


def _closed(value: str | StrEnum, enum: type[StrEnum], label: str) -> str:
    text = value.value if isinstance(value, StrEnum) else value
    try:
        return enum(text).value
    except ValueError:
        allowed = ", ".join(sorted(m.value for m in enum))
        raise MetricLabelError(f"label {label}={text!r} is not one of: {allowed}") from None


def _run_label(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise MetricLabelError(f"label run={run_id!r} is not a run id")
    return run_id


def _non_negative(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise MetricLabelError(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def _count(n: int, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise MetricLabelError(f"{what} must be a non-negative int, got {n!r}")
    return n


# --------------------------------------------------------------------------- helpers: snapshots


def observe_snapshot_phase(phase: SnapshotTiming | str, seconds: float) -> None:
    """Record how long one snapshot phase took (use phase ``gym_parked`` for the park)."""
    SNAPSHOT_PHASE_SECONDS.labels(phase=_closed(phase, SnapshotTiming, "phase")).observe(
        _non_negative(seconds, "seconds")
    )


@contextlib.contextmanager
def snapshot_phase_timer(phase: SnapshotTiming | str) -> Iterator[None]:
    """Time a block as one snapshot phase; records even when the block raises."""
    label = _closed(phase, SnapshotTiming, "phase")
    start = time.perf_counter()
    try:
        yield
    finally:
        observe_snapshot_phase(label, time.perf_counter() - start)


def record_snapshot_outcome(outcome: SnapshotOutcome | str, reason: SnapshotReason | str) -> None:
    """Count a snapshot that reached a terminal outcome.

    The pair must agree with ``REASON_OUTCOME`` (``published`` goes with ``ok``).
    """
    out = _closed(outcome, SnapshotOutcome, "outcome")
    why = _closed(reason, SnapshotReason, "reason")
    if REASON_OUTCOME[why] != out:
        raise MetricLabelError(f"reason={why} belongs to outcome={REASON_OUTCOME[why]}, not outcome={out}")
    SNAPSHOTS_TOTAL.labels(outcome=out, reason=why).inc()


@contextlib.contextmanager
def snapshot_in_progress() -> Iterator[None]:
    """Count the enclosed block as one snapshot this replica is driving."""
    SNAPSHOTS_IN_PROGRESS.inc()
    try:
        yield
    finally:
        SNAPSHOTS_IN_PROGRESS.dec()


def set_snapshots_in_progress(count: int) -> None:
    """Set the in-progress gauge from an authoritative count (e.g. after a restart)."""
    SNAPSHOTS_IN_PROGRESS.set(_count(count, "count"))


def set_snapshot_losses(run_id: str, consecutive: int, warn_threshold: int | None = None) -> None:
    """Publish a run's consecutive losses to train steps, and its warning flag.

    ``warn_threshold`` is the run's configured count after which the coordinator
    warns; ``None`` leaves the warning gauge at 0.
    """
    run = _run_label(run_id)
    n = _count(consecutive, "consecutive")
    SNAPSHOT_LOSSES_CONSECUTIVE.labels(run=run).set(n)
    warn = warn_threshold is not None and n >= _count(warn_threshold, "warn_threshold") > 0
    SNAPSHOT_LOSSES_WARNING.labels(run=run).set(1 if warn else 0)


def forget_run(run_id: str) -> None:
    """Drop a run's per-run series (call when the run ends or its lease moves away)."""
    run = _run_label(run_id)
    for gauge in (SNAPSHOT_LOSSES_CONSECUTIVE, SNAPSHOT_LOSSES_WARNING):
        with contextlib.suppress(KeyError):
            gauge.remove(run)


def observe_gym_restarted_episodes(count: int) -> None:
    """Record, per published snapshot, the episodes that would restart after a crash."""
    GYM_RESTARTED_EPISODES.observe(_count(count, "count"))


def record_exported_outside_scope(kind: str, count: int) -> None:
    """Count exports a commit accepted outside its scope (protocol section 13 P2)."""
    GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL.labels(kind=_closed(kind, GymParticipantKind, "kind")).inc(_count(count, "count"))


def record_snapshot_resume_failure() -> None:
    """Count a snapshot whose final Gym resume failed after a successful cut."""
    SNAPSHOT_RESUME_FAILURES_TOTAL.inc()


# --------------------------------------------------------------------------- helpers: restore


def record_restore_siblings(disposition: RestoreDisposition | str, count: int = 1) -> None:
    """Count siblings of an applied restore plan under one disposition."""
    label = _closed(disposition, RestoreDisposition, "disposition")
    n = _count(count, "count")
    # Touch the child even for 0 so every disposition exists as a series from the first restore.
    RESTORE_SIBLINGS_TOTAL.labels(disposition=label).inc(n)


def record_restore_plan(counts: Mapping[RestoreDisposition | str, int]) -> None:
    """Count every disposition of an applied plan (missing dispositions count 0)."""
    normalized = {_closed(k, RestoreDisposition, "disposition"): _count(v, "count") for k, v in counts.items()}
    for disposition in RestoreDisposition:
        record_restore_siblings(disposition, normalized.get(disposition.value, 0))


def observe_restore_duration(seconds: float, outcome: RestoreOutcome | str) -> None:
    RESTORE_DURATION_SECONDS.labels(outcome=_closed(outcome, RestoreOutcome, "outcome")).observe(
        _non_negative(seconds, "seconds")
    )


# --------------------------------------------------------------------------- helpers: gym, outbox, ledger


def observe_gym_control(
    op: GymControlOp | str,
    kind: GymParticipantKind | str,
    outcome: GymCallOutcome | str,
    seconds: float,
) -> None:
    """Record one control call to one participant."""
    GYM_CONTROL_SECONDS.labels(
        op=_closed(op, GymControlOp, "op"),
        kind=_closed(kind, GymParticipantKind, "kind"),
        outcome=_closed(outcome, GymCallOutcome, "outcome"),
    ).observe(_non_negative(seconds, "seconds"))


def set_outbox_backlog(op: OutboxOp | str, pending: int, oldest_age_seconds: float) -> None:
    """Publish the outbox backlog of one op (pending items and the oldest one's age)."""
    label = _closed(op, OutboxOp, "op")
    n = _count(pending, "pending")
    age = _non_negative(oldest_age_seconds, "oldest_age_seconds")
    OUTBOX_PENDING.labels(op=label).set(n)
    OUTBOX_OLDEST_AGE_SECONDS.labels(op=label).set(age if n else 0.0)


def record_ledger_transition(to: LedgerState | str, count: int = 1) -> None:
    """Count ledger rows moved to a state; batch calls pass the row count at once."""
    LEDGER_TRANSITIONS_TOTAL.labels(to=_closed(to, LedgerState, "to")).inc(_count(count, "count"))


def record_fenced_write(work: FencedWork | str) -> None:
    FENCED_WRITES_TOTAL.labels(work=_closed(work, FencedWork, "work")).inc()


def record_auth_failure(status: int) -> None:
    if status not in (401, 403, 429):
        raise MetricLabelError(f"label status={status!r} is not an authentication refusal")
    AUTH_FAILURES_TOTAL.labels(status=str(status)).inc()


def set_run_leases_held(count: int) -> None:
    RUN_LEASES_HELD.set(_count(count, "count"))


def set_ready(ready: bool) -> None:
    """Record the result of a readiness check (called by ``/readyz``)."""
    READY.set(1 if ready else 0)


# --------------------------------------------------------------------------- helpers: http, build


_KNOWN_METHODS: Final = frozenset(m.value for m in HttpMethod if m is not HttpMethod.OTHER)


def normalize_method(method: str) -> str:
    upper = method.upper()
    return upper if upper in _KNOWN_METHODS else HttpMethod.OTHER.value


def observe_http_request(route: str, method: str, status: int, seconds: float) -> None:
    """Record one HTTP request by route *template*; never pass the raw path."""
    if not isinstance(route, str) or not _ROUTE_RE.fullmatch(route):
        raise MetricLabelError(f"label route={route!r} is not a route template or 'unmatched'")
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise MetricLabelError(f"label status={status!r} is not an HTTP status code")
    HTTP_REQUEST_SECONDS.labels(route=route, method=normalize_method(method), status=str(status)).observe(
        _non_negative(seconds, "seconds")
    )


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("checkpoint-coordinator")
    except metadata.PackageNotFoundError:
        return "unknown"


def set_build_info(version: str | None = None) -> None:
    """Expose ``ckptc_build_info{version, python} 1`` (idempotent)."""
    py = "{}.{}.{}".format(*sys.version_info[:3])
    BUILD_INFO.clear()
    BUILD_INFO.labels(version=version or _package_version(), python=py).set(1)


# --------------------------------------------------------------------------- helper index

#: Which metrics each recording helper writes. The contract test reads this to
#: find, in the source tree, what code records each metric, and checks that every
#: public recording helper of this module is listed.
HELPER_METRICS: Final[Mapping[str, tuple[str, ...]]] = {
    "observe_snapshot_phase": ("ckptc_snapshot_phase_seconds",),
    "snapshot_phase_timer": ("ckptc_snapshot_phase_seconds",),
    "record_snapshot_outcome": ("ckptc_snapshots_total",),
    "snapshot_in_progress": ("ckptc_snapshots_in_progress",),
    "set_snapshots_in_progress": ("ckptc_snapshots_in_progress",),
    "set_snapshot_losses": ("ckptc_snapshot_losses_consecutive", "ckptc_snapshot_losses_warning"),
    "observe_gym_restarted_episodes": ("ckptc_gym_restarted_episodes",),
    "record_snapshot_resume_failure": ("ckptc_snapshot_resume_failures_total",),
    "record_exported_outside_scope": ("ckptc_gym_exported_outside_scope_total",),
    "record_restore_siblings": ("ckptc_restore_siblings_total",),
    "record_restore_plan": ("ckptc_restore_siblings_total",),
    "observe_restore_duration": ("ckptc_restore_duration_seconds",),
    "observe_gym_control": ("ckptc_gym_control_seconds",),
    "set_outbox_backlog": ("ckptc_outbox_pending", "ckptc_outbox_oldest_age_seconds"),
    "record_ledger_transition": ("ckptc_ledger_transitions_total",),
    "set_run_leases_held": ("ckptc_run_leases_held",),
    "record_fenced_write": ("ckptc_fenced_writes_total",),
    "record_auth_failure": ("ckptc_auth_failures_total",),
    "set_ready": ("ckptc_ready",),
    "observe_http_request": ("ckptc_http_request_seconds",),
    "set_build_info": ("ckptc_build_info",),
}


# --------------------------------------------------------------------------- exposition


def render_latest(accept: str | None = None) -> tuple[bytes, str]:
    """Render ``REGISTRY`` for ``/metrics``: (body, content type).

    Pass the request's ``Accept`` header to serve OpenMetrics to scrapers that ask
    for it; without it, the Prometheus text format is returned.
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(REGISTRY), content_type
