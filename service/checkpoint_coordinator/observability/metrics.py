"""The coordinator's metrics: one table, one registry, typed recording helpers.

The ledger's metrics have fixed names, types and labels (docs/ledger.md#metrics).
``METRIC_SPECS`` (in ``metric_specs``, re-exported here) holds them as a table (plus a few
operator metrics marked ``in_spec_table=False``); the registry is built from it and nothing else.
Code records through the helpers (``observe_snapshot_phase`` and friends), which check every
label value against a closed set, so a typo or an id leaking into a label fails loudly in tests
instead of silently exploding cardinality.

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
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from ..domain.snapshot_state import (
    REASON_OUTCOME,
    SnapshotOutcome,
    SnapshotReason,
    SnapshotTiming,
)
from ..domain.vocabulary import SchemaState, StrEnum
from ..domain.vocabulary import EffectAnswer, OrphanReason, PromptBucket
from .metric_specs import (
    METRIC_SPECS,
    OPEN,
    SPECS_BY_NAME,
    DecidedFate,
    FencedWork,
    GymCallOutcome,
    GymControlOp,
    GymParticipantKind,
    HttpMethod,
    LedgerState,
    MetricSpec,
    MetricType,
    OutboxOp,
    RestoreDisposition,
    RestoreOutcome,
    metrics_in_table,
    spec_table_metrics,
)

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
    "OPEN",
    "SPECS_BY_NAME",
    "metrics_in_table",
    "spec_table_metrics",
    "render_latest",
]


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
PROMPTS_TOTAL: Final[Counter] = _OBJECTS["ckptc_prompts_total"]  # type: ignore[assignment]
ROLLOUT_SECONDS_TOTAL: Final[Counter] = _OBJECTS["ckptc_rollout_seconds_total"]  # type: ignore[assignment]
EFFECT_BEGINS_TOTAL: Final[Counter] = _OBJECTS["ckptc_effect_begins_total"]  # type: ignore[assignment]
EFFECT_ORPHANS_TOTAL: Final[Counter] = _OBJECTS["ckptc_effect_orphans_total"]  # type: ignore[assignment]
HTTP_REQUEST_SECONDS: Final[Histogram] = _OBJECTS["ckptc_http_request_seconds"]  # type: ignore[assignment]
RESTORE_DURATION_SECONDS: Final[Histogram] = _OBJECTS["ckptc_restore_duration_seconds"]  # type: ignore[assignment]
GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL: Final[Counter] = _OBJECTS["ckptc_gym_exported_outside_scope_total"]  # type: ignore[assignment]
FENCED_WRITES_TOTAL: Final[Counter] = _OBJECTS["ckptc_fenced_writes_total"]  # type: ignore[assignment]
AUTH_FAILURES_TOTAL: Final[Counter] = _OBJECTS["ckptc_auth_failures_total"]  # type: ignore[assignment]
SNAPSHOT_RESUME_FAILURES_TOTAL: Final[Counter] = _OBJECTS["ckptc_snapshot_resume_failures_total"]  # type: ignore[assignment]
STRAGGLER_RETIREMENTS_TOTAL: Final[Counter] = _OBJECTS["ckptc_straggler_retirements_total"]  # type: ignore[assignment]
SNAPSHOT_LOSSES_WARNING: Final[Gauge] = _OBJECTS["ckptc_snapshot_losses_warning"]  # type: ignore[assignment]
RUN_LEASES_HELD: Final[Gauge] = _OBJECTS["ckptc_run_leases_held"]  # type: ignore[assignment]
READY: Final[Gauge] = _OBJECTS["ckptc_ready"]  # type: ignore[assignment]
DATABASE_UP: Final[Gauge] = _OBJECTS["ckptc_database_up"]  # type: ignore[assignment]
SCHEMA_STATE: Final[Gauge] = _OBJECTS["ckptc_schema_state"]  # type: ignore[assignment]
RUNS_WITHOUT_DRIVER: Final[Gauge] = _OBJECTS["ckptc_runs_without_driver"]  # type: ignore[assignment]
SNAPSHOT_FAILURES_CONSECUTIVE: Final[Gauge] = _OBJECTS["ckptc_snapshot_failures_consecutive"]  # type: ignore[assignment]
RUN_SNAPSHOTS_TOTAL: Final[Counter] = _OBJECTS["ckptc_run_snapshots_total"]  # type: ignore[assignment]
RUN_SNAPSHOT_PHASE_SECONDS: Final[Gauge] = _OBJECTS["ckptc_run_snapshot_phase_seconds"]  # type: ignore[assignment]
RUN_GYM_RESTARTED_EPISODES: Final[Gauge] = _OBJECTS["ckptc_run_gym_restarted_episodes"]  # type: ignore[assignment]
RUN_GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL: Final[Counter] = _OBJECTS["ckptc_run_gym_exported_outside_scope_total"]  # type: ignore[assignment]
RUN_GYM_CONTROL_CALLS_TOTAL: Final[Counter] = _OBJECTS["ckptc_run_gym_control_calls_total"]  # type: ignore[assignment]
RUN_RESTORE_SIBLINGS_TOTAL: Final[Counter] = _OBJECTS["ckptc_run_restore_siblings_total"]  # type: ignore[assignment]
RUN_RESTORE_SECONDS: Final[Gauge] = _OBJECTS["ckptc_run_restore_seconds"]  # type: ignore[assignment]
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
    for state in SchemaState:
        SCHEMA_STATE.labels(state=state.value).set(1 if state is SchemaState.unknown else 0)


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


# --------------------------------------------------------------------------- per-run series

# Every per-run child this process created, by run, and when one was last set: a run's series
# are dropped together when it ends or moves to another replica (``forget_run``), or they would
# stay at their last value for ever (a finished run's alert firing, series without bound).
_RUN_CHILDREN: dict[str, set[tuple[Counter | Gauge, tuple[str, ...]]]] = {}
_RUN_TOUCHED: dict[str, float] = {}


def _run_child(metric: Counter | Gauge, run_id: str, **labels: str) -> Counter | Gauge:
    run = _run_label(run_id)
    values = (run, *labels.values())
    _RUN_CHILDREN.setdefault(run, set()).add((metric, values))
    _RUN_TOUCHED[run] = time.monotonic()
    return metric.labels(*values)  # type: ignore[return-value]


# The streak gauges (losses, failures in a row) come from the ledger: every replica reports them for
# every open run with a streak (``set_run_streaks``, from the housekeeping round), so they outlive
# a lease moving and a restart; a snapshot's end sets its run's at once.
_STREAK_RUNS: set[str] = set()
_STREAK_GAUGES = (SNAPSHOT_LOSSES_CONSECUTIVE, SNAPSHOT_LOSSES_WARNING, SNAPSHOT_FAILURES_CONSECUTIVE)


def _streak(metric: Gauge, run_id: str) -> Gauge:
    run = _run_label(run_id)
    _STREAK_RUNS.add(run)
    return metric.labels(run)  # type: ignore[no-any-return]


def _drop_streaks(run: str) -> None:
    _STREAK_RUNS.discard(run)
    for gauge in _STREAK_GAUGES:
        with contextlib.suppress(KeyError):
            gauge.remove(run)


def set_run_streaks(streaks: Mapping[str, tuple[int, int, int]]) -> None:
    """Publish every open run's streaks, ``{run: (losses, failures, warn_after)}``, as read from
    the ledger; a run left out has none (any more) and its series go."""
    for run_id, (losses, failures, warn_after) in streaks.items():
        set_snapshot_losses(run_id, losses, warn_after)
        set_snapshot_failures(run_id, failures)
    for run in _STREAK_RUNS - set(streaks):
        _drop_streaks(run)


def runs_with_series() -> set[str]:
    return set(_RUN_TOUCHED)


def run_series_idle_s(run_id: str) -> float:
    """Seconds since this process last set a series of the run (inf when it has none)."""
    touched = _RUN_TOUCHED.get(run_id)
    return math.inf if touched is None else time.monotonic() - touched


def forget_run(run_id: str) -> None:
    """Drop a run's per-run series (the run ended, or another replica drives it now)."""
    _drop_streaks(run_id)
    _RUN_TOUCHED.pop(run_id, None)
    for metric, values in _RUN_CHILDREN.pop(run_id, set()):
        with contextlib.suppress(KeyError):
            metric.remove(*values)


# --------------------------------------------------------------------------- helpers: snapshots


def observe_snapshot_phase(phase: SnapshotTiming | str, seconds: float, run_id: str | None = None) -> None:
    """Record how long one snapshot phase took (use phase ``gym_parked`` for the park); with
    ``run_id`` also as that run's last snapshot's."""
    label = _closed(phase, SnapshotTiming, "phase")
    value = _non_negative(seconds, "seconds")
    SNAPSHOT_PHASE_SECONDS.labels(phase=label).observe(value)
    if run_id is not None:
        _run_child(RUN_SNAPSHOT_PHASE_SECONDS, run_id, phase=label).set(value)  # type: ignore[union-attr]


@contextlib.contextmanager
def snapshot_phase_timer(phase: SnapshotTiming | str) -> Iterator[None]:
    """Time a block as one snapshot phase; records even when the block raises."""
    label = _closed(phase, SnapshotTiming, "phase")
    start = time.perf_counter()
    try:
        yield
    finally:
        observe_snapshot_phase(label, time.perf_counter() - start)


def record_snapshot_outcome(outcome: SnapshotOutcome | str, reason: SnapshotReason | str, run_id: str | None = None) -> None:
    """Count a snapshot that reached a terminal outcome (with ``run_id``, for its run too).

    The pair must agree with ``REASON_OUTCOME`` (``published`` goes with ``ok``).
    """
    out = _closed(outcome, SnapshotOutcome, "outcome")
    why = _closed(reason, SnapshotReason, "reason")
    if REASON_OUTCOME[why] != out:
        raise MetricLabelError(f"reason={why} belongs to outcome={REASON_OUTCOME[why]}, not outcome={out}")
    SNAPSHOTS_TOTAL.labels(outcome=out, reason=why).inc()
    if run_id is not None:
        _run_child(RUN_SNAPSHOTS_TOTAL, run_id, outcome=out, reason=why).inc()


def set_snapshot_failures(run_id: str, consecutive: int) -> None:
    """Publish how many of a run's snapshots failed since its last published one."""
    _streak(SNAPSHOT_FAILURES_CONSECUTIVE, run_id).set(_count(consecutive, "consecutive"))


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
    n = _count(consecutive, "consecutive")
    _streak(SNAPSHOT_LOSSES_CONSECUTIVE, run_id).set(n)
    warn = warn_threshold is not None and n >= _count(warn_threshold, "warn_threshold") > 0
    _streak(SNAPSHOT_LOSSES_WARNING, run_id).set(1 if warn else 0)


def observe_gym_restarted_episodes(count: int, run_id: str | None = None) -> None:
    """Record, per published snapshot, the episodes that would restart after a crash."""
    n = _count(count, "count")
    GYM_RESTARTED_EPISODES.observe(n)
    if run_id is not None:
        _run_child(RUN_GYM_RESTARTED_EPISODES, run_id).set(n)  # type: ignore[union-attr]


def record_exported_outside_scope(kind: str, count: int, run_id: str | None = None) -> None:
    """Count exports a commit accepted outside its scope (P2 of
    docs/gym-protocol.md#what-differs-rule-by-rule)."""
    n = _count(count, "count")
    GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL.labels(kind=_closed(kind, GymParticipantKind, "kind")).inc(n)
    if run_id is not None:
        _run_child(RUN_GYM_EXPORTED_OUTSIDE_SCOPE_TOTAL, run_id).inc(n)


def record_snapshot_resume_failure() -> None:
    """Count a snapshot whose final Gym resume failed after a successful cut."""
    SNAPSHOT_RESUME_FAILURES_TOTAL.inc()


def record_straggler_retirements(count: int) -> None:
    """Count episodes a snapshot's gate gave up as stragglers (docs/ledger.md#stragglers)."""
    STRAGGLER_RETIREMENTS_TOTAL.inc(_count(count, "count"))


# --------------------------------------------------------------------------- helpers: restore


def record_restore_siblings(disposition: RestoreDisposition | str, count: int = 1, run_id: str | None = None) -> None:
    """Count siblings of an applied restore plan under one disposition."""
    label = _closed(disposition, RestoreDisposition, "disposition")
    n = _count(count, "count")
    # Touch the child even for 0 so every disposition exists as a series from the first restore.
    RESTORE_SIBLINGS_TOTAL.labels(disposition=label).inc(n)
    if run_id is not None:
        _run_child(RUN_RESTORE_SIBLINGS_TOTAL, run_id, disposition=label).inc(n)


def record_restore_plan(counts: Mapping[RestoreDisposition | str, int], run_id: str | None = None) -> None:
    """Count every disposition of an applied plan (missing dispositions count 0)."""
    normalized = {_closed(k, RestoreDisposition, "disposition"): _count(v, "count") for k, v in counts.items()}
    for disposition in RestoreDisposition:
        record_restore_siblings(disposition, normalized.get(disposition.value, 0), run_id)


def observe_restore_duration(seconds: float, outcome: RestoreOutcome | str, run_id: str | None = None) -> None:
    label = _closed(outcome, RestoreOutcome, "outcome")
    value = _non_negative(seconds, "seconds")
    RESTORE_DURATION_SECONDS.labels(outcome=label).observe(value)
    if run_id is not None:
        for other in RestoreOutcome:  # the last restore's outcome only
            if other.value != label and (RUN_RESTORE_SECONDS, (run_id, other.value)) in _RUN_CHILDREN.get(run_id, set()):
                RUN_RESTORE_SECONDS.remove(run_id, other.value)
                _RUN_CHILDREN[run_id].discard((RUN_RESTORE_SECONDS, (run_id, other.value)))
        _run_child(RUN_RESTORE_SECONDS, run_id, outcome=label).set(value)  # type: ignore[union-attr]


# --------------------------------------------------------------------------- helpers: gym, outbox, ledger


def observe_gym_control(
    op: GymControlOp | str,
    kind: GymParticipantKind | str,
    outcome: GymCallOutcome | str,
    seconds: float,
    run_id: str | None = None,
) -> None:
    """Record one control call to one participant (with ``run_id``, counted for its run too)."""
    op_label = _closed(op, GymControlOp, "op")
    outcome_label = _closed(outcome, GymCallOutcome, "outcome")
    GYM_CONTROL_SECONDS.labels(
        op=op_label, kind=_closed(kind, GymParticipantKind, "kind"), outcome=outcome_label
    ).observe(_non_negative(seconds, "seconds"))
    if run_id is not None:
        _run_child(RUN_GYM_CONTROL_CALLS_TOTAL, run_id, op=op_label, outcome=outcome_label).inc()


def set_outbox_backlog(op: OutboxOp | str, pending: int, oldest_age_seconds: float) -> None:
    """Publish the outbox backlog of one op (pending items and the oldest one's age)."""
    label = _closed(op, OutboxOp, "op")
    n = _count(pending, "backlog")
    age = _non_negative(oldest_age_seconds, "oldest_age_seconds")
    OUTBOX_PENDING.labels(op=label).set(n)
    OUTBOX_OLDEST_AGE_SECONDS.labels(op=label).set(age if n else 0.0)


def record_ledger_transition(to: LedgerState | str, count: int = 1) -> None:
    """Count ledger rows moved to a state; batch calls pass the row count at once."""
    LEDGER_TRANSITIONS_TOTAL.labels(to=_closed(to, LedgerState, "to")).inc(_count(count, "count"))


def record_prompts(bucket: PromptBucket | str, count: int = 1) -> None:
    """Count prompt groups entering a bucket (docs/accounting.md#prompt-conservation)."""
    if count:
        PROMPTS_TOTAL.labels(bucket=_closed(bucket, PromptBucket, "bucket")).inc(_count(count, "count"))


def record_rollout_seconds(fate: DecidedFate | str, seconds: float) -> None:
    """Count rollout-seconds whose fate was just decided (docs/accounting.md#rollout-seconds)."""
    if seconds > 0:
        ROLLOUT_SECONDS_TOTAL.labels(fate=_closed(fate, DecidedFate, "fate")).inc(float(seconds))


def record_effect_begin(answer: EffectAnswer | str) -> None:
    EFFECT_BEGINS_TOTAL.labels(answer=_closed(answer, EffectAnswer, "answer")).inc()


def record_effect_orphans(reason: OrphanReason | str, count: int) -> None:
    """Count journalled effects that became orphans (docs/effects.md#orphans)."""
    if count:
        EFFECT_ORPHANS_TOTAL.labels(reason=_closed(reason, OrphanReason, "reason")).inc(_count(count, "count"))


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


def set_database_up(up: bool) -> None:
    DATABASE_UP.set(1 if up else 0)


def set_schema_state(state: SchemaState | str) -> None:
    current = _closed(state, SchemaState, "state")
    for member in SchemaState:
        SCHEMA_STATE.labels(state=member.value).set(1 if member.value == current else 0)


def set_runs_without_driver(count: int) -> None:
    RUNS_WITHOUT_DRIVER.set(_count(count, "count"))


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
    "observe_snapshot_phase": ("ckptc_snapshot_phase_seconds", "ckptc_run_snapshot_phase_seconds"),
    "snapshot_phase_timer": ("ckptc_snapshot_phase_seconds",),
    "record_snapshot_outcome": ("ckptc_snapshots_total", "ckptc_run_snapshots_total"),
    "set_snapshot_failures": ("ckptc_snapshot_failures_consecutive",),
    "set_run_streaks": ("ckptc_snapshot_losses_consecutive", "ckptc_snapshot_losses_warning", "ckptc_snapshot_failures_consecutive"),
    "snapshot_in_progress": ("ckptc_snapshots_in_progress",),
    "set_snapshots_in_progress": ("ckptc_snapshots_in_progress",),
    "set_snapshot_losses": ("ckptc_snapshot_losses_consecutive", "ckptc_snapshot_losses_warning"),
    "observe_gym_restarted_episodes": ("ckptc_gym_restarted_episodes", "ckptc_run_gym_restarted_episodes"),
    "record_snapshot_resume_failure": ("ckptc_snapshot_resume_failures_total",),
    "record_straggler_retirements": ("ckptc_straggler_retirements_total",),
    "record_exported_outside_scope": ("ckptc_gym_exported_outside_scope_total", "ckptc_run_gym_exported_outside_scope_total"),
    "record_restore_siblings": ("ckptc_restore_siblings_total", "ckptc_run_restore_siblings_total"),
    "record_restore_plan": ("ckptc_restore_siblings_total", "ckptc_run_restore_siblings_total"),
    "observe_restore_duration": ("ckptc_restore_duration_seconds", "ckptc_run_restore_seconds"),
    "observe_gym_control": ("ckptc_gym_control_seconds", "ckptc_run_gym_control_calls_total"),
    "set_outbox_backlog": ("ckptc_outbox_pending", "ckptc_outbox_oldest_age_seconds"),
    "record_ledger_transition": ("ckptc_ledger_transitions_total",),
    "record_prompts": ("ckptc_prompts_total",),
    "record_rollout_seconds": ("ckptc_rollout_seconds_total",),
    "record_effect_begin": ("ckptc_effect_begins_total",),
    "record_effect_orphans": ("ckptc_effect_orphans_total",),
    "set_run_leases_held": ("ckptc_run_leases_held",),
    "record_fenced_write": ("ckptc_fenced_writes_total",),
    "record_auth_failure": ("ckptc_auth_failures_total",),
    "set_ready": ("ckptc_ready",),
    "set_database_up": ("ckptc_database_up",),
    "set_schema_state": ("ckptc_schema_state",),
    "set_runs_without_driver": ("ckptc_runs_without_driver",),
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
