"""The metrics registry: built from one table, closed label sets, working helpers."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from checkpoint_coordinator.observability import metrics as m

# Labels that would carry per-rollout identities and explode cardinality.
ID_LABEL_DENYLIST = {
    "group", "group_id", "sibling", "sibling_id", "attempt", "attempt_id", "rollout",
    "rollout_id", "episode", "episode_id", "capture_key", "snapshot", "snapshot_id",
    "checkpoint_id", "restore_id", "receipt", "staging_key", "path",
}
# The only labels allowed without a closed value set (see metrics.py docstring).
OPEN_LABELS_ALLOWED = {"run", "route", "status", "version", "python"}


def sample(name: str, **labels: str) -> float:
    value = m.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_table_names_are_unique_and_prefixed() -> None:
    names = [spec.name for spec in m.METRIC_SPECS]
    assert len(names) == len(set(names))
    assert all(name.startswith("ckptc_") for name in names)
    attrs = [spec.attr for spec in m.METRIC_SPECS]
    assert len(attrs) == len(set(attrs))


def test_spec_section_10_is_in_the_table_with_its_types_and_labels() -> None:
    expected = {
        "ckptc_snapshot_phase_seconds": ("histogram", ("phase",)),
        "ckptc_snapshots_total": ("counter", ("outcome", "reason")),
        "ckptc_snapshots_in_progress": ("gauge", ()),
        "ckptc_snapshot_losses_consecutive": ("gauge", ("run",)),
        "ckptc_gym_restarted_episodes": ("histogram", ()),
        "ckptc_restore_siblings_total": ("counter", ("disposition",)),
        "ckptc_gym_control_seconds": ("histogram", ("op", "kind", "outcome")),
        "ckptc_outbox_pending": ("gauge", ("op",)),
        "ckptc_outbox_oldest_age_seconds": ("gauge", ("op",)),
        "ckptc_ledger_transitions_total": ("counter", ("to",)),
        "ckptc_http_request_seconds": ("histogram", ("route", "method", "status")),
        "ckptc_prompts_total": ("counter", ("bucket",)),
        "ckptc_rollout_seconds_total": ("counter", ("fate",)),
    }
    assert m.spec_table_metrics() == set(expected)
    for name, (mtype, labels) in expected.items():
        spec = m.SPECS_BY_NAME[name]
        assert (spec.type.value, spec.label_names) == (mtype, labels), name
    assert m.spec_table_metrics() <= m.metrics_in_table()


def test_closed_sets_of_the_spec() -> None:
    assert m.SPECS_BY_NAME["ckptc_snapshot_phase_seconds"].labels["phase"] == {
        "gate", "prepare", "commit", "drain", "data_plane", "resume", "total", "gym_parked",
    }
    assert m.SPECS_BY_NAME["ckptc_restore_siblings_total"].labels["disposition"] == {
        "reused", "rerun", "continued", "restarted", "gym_restarted",
    }


def test_every_metric_object_is_a_module_attribute_registered_in_registry() -> None:
    families = {f.name: f for f in m.REGISTRY.collect()}
    for spec in m.METRIC_SPECS:
        obj = getattr(m, spec.attr)
        family = spec.name.removesuffix("_total") if spec.type is m.MetricType.COUNTER else spec.name
        assert family in families, spec.name
        assert families[family].type == spec.type.value
        assert obj._labelnames == spec.label_names  # the object exposed is the one registered


def test_help_text_states_the_unit() -> None:
    for spec in m.METRIC_SPECS:
        assert spec.unit, spec.name
        assert spec.unit in spec.help, f"{spec.name}: help must state its unit ({spec.unit})"
        if spec.name.endswith("_seconds"):
            assert spec.unit == "seconds"


def test_no_label_carries_an_id() -> None:
    for spec in m.METRIC_SPECS:
        for label, values in spec.labels.items():
            assert label not in ID_LABEL_DENYLIST, f"{spec.name} has id label {label}"
            if values is None:
                assert label in OPEN_LABELS_ALLOWED, f"{spec.name}.{label} needs a closed value set"
            else:
                assert values, f"{spec.name}.{label} has an empty value set"
                assert all(v and len(v) < 40 for v in values)


def test_histograms_have_increasing_buckets() -> None:
    for spec in m.METRIC_SPECS:
        if spec.type is m.MetricType.HISTOGRAM:
            assert spec.buckets is not None and list(spec.buckets) == sorted(set(spec.buckets)), spec.name
    # A Gym park can reach prepare (300 s) + drain; the phase buckets must reach past it.
    assert max(m.SPECS_BY_NAME["ckptc_snapshot_phase_seconds"].buckets or ()) >= 600
    # Control calls are bounded by control_timeout_s (60) plus grace.
    assert max(m.SPECS_BY_NAME["ckptc_gym_control_seconds"].buckets or ()) >= 65


def test_fresh_registry_has_the_same_shape() -> None:
    registry, objects = m.build_registry()
    assert set(objects) == m.metrics_in_table()
    assert registry is not m.REGISTRY


def test_observe_snapshot_phase_records_and_rejects_unknown_phase() -> None:
    before = sample("ckptc_snapshot_phase_seconds_count", phase="gym_parked")
    before_sum = sample("ckptc_snapshot_phase_seconds_sum", phase="gym_parked")
    m.observe_snapshot_phase(m.SnapshotTiming.gym_parked, 12.5)
    m.observe_snapshot_phase("gym_parked", 0.5)
    assert sample("ckptc_snapshot_phase_seconds_count", phase="gym_parked") == before + 2
    assert sample("ckptc_snapshot_phase_seconds_sum", phase="gym_parked") == pytest.approx(before_sum + 13.0)
    with pytest.raises(m.MetricLabelError, match="phase"):
        m.observe_snapshot_phase("parking", 1.0)
    with pytest.raises(m.MetricLabelError):
        m.observe_snapshot_phase("gate", -1.0)
    with pytest.raises(m.MetricLabelError):
        m.observe_snapshot_phase("gate", math.nan)


def test_snapshot_phase_timer_records_even_on_error() -> None:
    before = sample("ckptc_snapshot_phase_seconds_count", phase="drain")
    with pytest.raises(RuntimeError):
        with m.snapshot_phase_timer("drain"):
            raise RuntimeError("drain failed")
    assert sample("ckptc_snapshot_phase_seconds_count", phase="drain") == before + 1


def test_snapshot_outcome_pairs_are_validated() -> None:
    before = sample("ckptc_snapshots_total", outcome="aborted", reason="train_step_committed")
    m.record_snapshot_outcome("aborted", m.SnapshotReason.train_step_committed)
    assert sample("ckptc_snapshots_total", outcome="aborted", reason="train_step_committed") == before + 1
    with pytest.raises(m.MetricLabelError):
        m.record_snapshot_outcome("published", "drain_timeout")
    with pytest.raises(m.MetricLabelError):
        m.record_snapshot_outcome("failed", "ok")
    with pytest.raises(m.MetricLabelError):
        m.record_snapshot_outcome("aborted", "drain_timeout")  # drain timeouts fail, not abort
    with pytest.raises(m.MetricLabelError):
        m.record_snapshot_outcome("exploded", "ok")
    assert set(m.REASON_OUTCOME) == {r.value for r in m.SnapshotReason}


def test_failure_series_exist_at_zero_before_the_first_failure() -> None:
    # increase() cannot see a counter child born at 1; the valid pairs start at 0.
    text = m.render_latest()[0].decode()
    assert 'ckptc_snapshots_total{outcome="failed",reason="drain_timeout"}' in text
    assert 'ckptc_restore_siblings_total{disposition="gym_restarted"}' in text
    assert 'ckptc_snapshots_total{outcome="published",reason="drain_timeout"}' not in text


def test_in_progress_gauge_tracks_blocks() -> None:
    base = sample("ckptc_snapshots_in_progress")
    with m.snapshot_in_progress():
        assert sample("ckptc_snapshots_in_progress") == base + 1
        with pytest.raises(ValueError):
            with m.snapshot_in_progress():
                assert sample("ckptc_snapshots_in_progress") == base + 2
                raise ValueError
        assert sample("ckptc_snapshots_in_progress") == base + 1
    assert sample("ckptc_snapshots_in_progress") == base


def test_losses_gauge_and_warning_per_run_and_forget() -> None:
    m.set_snapshot_losses("run-a", 2, warn_threshold=3)
    assert sample("ckptc_snapshot_losses_consecutive", run="run-a") == 2
    assert sample("ckptc_snapshot_losses_warning", run="run-a") == 0
    m.set_snapshot_losses("run-a", 3, warn_threshold=3)
    assert sample("ckptc_snapshot_losses_warning", run="run-a") == 1
    m.set_snapshot_losses("run-a", 0, warn_threshold=3)
    assert sample("ckptc_snapshot_losses_warning", run="run-a") == 0
    m.forget_run("run-a")
    assert m.REGISTRY.get_sample_value("ckptc_snapshot_losses_consecutive", {"run": "run-a"}) is None
    m.forget_run("run-a")  # idempotent
    with pytest.raises(m.MetricLabelError):
        m.set_snapshot_losses("bad run id with spaces", 1)


def test_restore_plan_counts_every_disposition() -> None:
    before = {d.value: sample("ckptc_restore_siblings_total", disposition=d.value) for d in m.RestoreDisposition}
    m.record_restore_plan({"reused": 5, m.RestoreDisposition.CONTINUED: 2})
    after = {d.value: sample("ckptc_restore_siblings_total", disposition=d.value) for d in m.RestoreDisposition}
    assert {k: after[k] - before[k] for k in after} == {
        "reused": 5, "continued": 2, "rerun": 0, "restarted": 0, "gym_restarted": 0,
    }
    with pytest.raises(m.MetricLabelError):
        m.record_restore_plan({"resurrected": 1})
    with pytest.raises(m.MetricLabelError):
        m.record_restore_siblings("reused", -1)


def test_gym_control_validates_each_label() -> None:
    labels = {"op": "prepare", "kind": "model", "outcome": "not_ready"}
    before = sample("ckptc_gym_control_seconds_count", **labels)
    m.observe_gym_control("prepare", m.GymParticipantKind.MODEL, m.GymCallOutcome.NOT_READY, 3.0)
    assert sample("ckptc_gym_control_seconds_count", **labels) == before + 1
    for bad in ({"op": "ping"}, {"kind": "judge"}, {"outcome": "timeout"}):
        args = {"op": "prepare", "kind": "model", "outcome": "ok", **bad}
        with pytest.raises(m.MetricLabelError):
            m.observe_gym_control(args["op"], args["kind"], args["outcome"], 1.0)


def test_outbox_backlog_age_is_zero_when_empty() -> None:
    m.set_outbox_backlog("retire", 12, 40.0)
    assert sample("ckptc_outbox_pending", op="retire") == 12
    assert sample("ckptc_outbox_oldest_age_seconds", op="retire") == 40.0
    m.set_outbox_backlog(m.OutboxOp.RETIRE, 0, 40.0)
    assert sample("ckptc_outbox_oldest_age_seconds", op="retire") == 0.0
    with pytest.raises(m.MetricLabelError):
        m.set_outbox_backlog("delete", 1, 1.0)


def test_ledger_transitions_count_batches() -> None:
    before = sample("ckptc_ledger_transitions_total", to="sealed")
    m.record_ledger_transition("sealed", 1000)
    m.record_ledger_transition(m.LedgerState.SEALED)
    assert sample("ckptc_ledger_transitions_total", to="sealed") == before + 1001
    with pytest.raises(m.MetricLabelError):
        m.record_ledger_transition("sealed", True)  # a bool is not a count
    with pytest.raises(m.MetricLabelError):
        m.record_ledger_transition("group-123")


def test_http_helper_refuses_raw_paths_and_normalizes_methods() -> None:
    m.observe_http_request("/v1/runs/{run_id}", "brew", 200, 0.01)
    assert sample("ckptc_http_request_seconds_count", route="/v1/runs/{run_id}", method="other", status="200") >= 1
    with pytest.raises(m.MetricLabelError):
        m.observe_http_request("v1/no-leading-slash", "GET", 200, 0.1)
    with pytest.raises(m.MetricLabelError):
        m.observe_http_request("/x", "GET", 999, 0.1)


def test_ready_and_leases_and_resume_failures_and_restore_duration() -> None:
    m.set_ready(False)
    assert sample("ckptc_ready") == 0
    m.set_ready(True)
    assert sample("ckptc_ready") == 1
    m.set_run_leases_held(4)
    assert sample("ckptc_run_leases_held") == 4
    before = sample("ckptc_snapshot_resume_failures_total")
    m.record_snapshot_resume_failure()
    assert sample("ckptc_snapshot_resume_failures_total") == before + 1
    before = sample("ckptc_restore_duration_seconds_count", outcome="failed")
    m.observe_restore_duration(2.0, "failed")
    assert sample("ckptc_restore_duration_seconds_count", outcome="failed") == before + 1
    before = sample("ckptc_gym_restarted_episodes_count")
    m.observe_gym_restarted_episodes(0)
    assert sample("ckptc_gym_restarted_episodes_count") == before + 1


def test_build_info_has_one_series() -> None:
    m.set_build_info("1.2.3")
    m.set_build_info("1.2.4")
    series = [s for f in m.REGISTRY.collect() if f.name == "ckptc_build_info" for s in f.samples]
    assert len(series) == 1 and series[0].labels["version"] == "1.2.4" and series[0].value == 1


def test_render_latest_parses_and_negotiates_openmetrics() -> None:
    body, content_type = m.render_latest()
    assert content_type.startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    # Counters are exposed as families without _total by the parser.
    assert {"ckptc_snapshot_phase_seconds", "ckptc_snapshots", "ckptc_ledger_transitions"} <= names
    body, content_type = m.render_latest("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
