"""Prometheus alert rules: registry metrics only, runbooks present, and each alert's logic.

The logic tests are promtool unit tests generated here (promtool compares
annotations verbatim, so they run against a copy of the rules with annotations
removed; `promtool check rules` validates the real file, annotation templates
included). They skip when promtool is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from _deploy_helpers import DEPLOY, check_expr, metric_names, which

ALERTS = DEPLOY / "prometheus" / "alerts.yml"
JOB = 'job="ckpt-coordinator"'


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def by_name() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules()}


def test_alert_names_are_unique_and_every_rule_is_an_alert() -> None:
    names = [rule.get("alert") for rule in rules()]
    assert all(names) and len(names) == len(set(names))


@pytest.mark.parametrize("alert", sorted(by_name()))
def test_alert_reads_registry_metrics_of_our_job(alert: str) -> None:
    expr = by_name()[alert]["expr"]
    assert check_expr(expr) == []
    assert JOB in expr, "every selector must be scoped to the coordinator's job"


@pytest.mark.parametrize("alert", sorted(by_name()))
def test_alert_has_severity_and_runbook(alert: str) -> None:
    rule = by_name()[alert]
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    runbook = annotations["runbook"]
    # Real steps, not a link to nowhere: several lines naming what to look at.
    assert len(runbook.strip().splitlines()) >= 3 and len(runbook) >= 200, alert


def test_the_operational_risks_are_covered() -> None:
    exprs = {name: rule["expr"] for name, rule in by_name().items()}

    def covered(metric: str, needle: str = "") -> bool:
        return any(metric in metric_names(e) and needle in e for e in exprs.values())

    assert covered("ckptc_snapshot_failures_consecutive", "by (run)")
    assert covered("ckptc_snapshot_losses_consecutive") and covered("ckptc_snapshot_losses_warning")
    assert covered("ckptc_outbox_pending", "deriv(")
    assert covered("ckptc_outbox_oldest_age_seconds")
    assert covered("ckptc_gym_control_seconds_count", 'outcome!="ok"')
    assert covered("up", "== 0") and covered("ckptc_ready")
    assert covered("ckptc_database_up") and covered("ckptc_schema_state", 'state="behind"') and covered("ckptc_schema_state", 'state="incompatible"')
    assert covered("ckptc_runs_without_driver") and covered("ckptc_fenced_writes_total") and covered("ckptc_http_request_seconds_bucket", "histogram_quantile")


def test_promtool_check_rules() -> None:
    promtool = which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules())} rules found" in result.stdout


def test_promtool_check_example_config() -> None:
    promtool = which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    with tempfile.TemporaryDirectory() as tmp:
        # As installed: beside its rules, with the metrics token where the config reads it from.
        config = Path(tmp) / "prometheus.yml"
        token = Path(tmp) / "ckptc-metrics-token"
        token.write_text("t" * 64)
        config.write_text((DEPLOY / "prometheus" / "prometheus.yml").read_text().replace("/etc/prometheus/ckptc-metrics-token", str(token)))
        shutil.copy(DEPLOY / "prometheus" / "alerts.yml", Path(tmp) / "alerts.yml")
        result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- promtool unit tests

S = 'job="ckpt-coordinator", instance="coord-0:8080"'


def series(name: str, labels: str, values: str) -> dict[str, str]:
    inner = S + (", " + labels if labels else "")
    return {"series": f"{name}{{{inner}}}", "values": values}


def case(input_series: list[dict[str, str]], alert: str, checks: list[tuple[str, list[dict[str, str]]]]) -> dict[str, Any]:
    return {
        "interval": "1m",
        "input_series": input_series,
        "alert_rule_test": [
            {"eval_time": t, "alertname": alert, "exp_alerts": [{"exp_labels": labels} for labels in expected]}
            for t, expected in checks
        ],
    }


INSTANCE = {"job": "ckpt-coordinator", "instance": "coord-0:8080"}

HOT = 'route="/v1/runs/{run_id}/attempts/sealed", method="POST"'
LONG_POLL = 'route="/v1/runs/{run_id}/snapshots/{snapshot_id}?wait_s", method="GET"'
EXPORT = 'route="/v1/runs/{run_id}/snapshots/{snapshot_id}/ledger-export", method="GET"'


def latency(labels: str, slow: bool) -> list[dict[str, str]]:
    """A route's request histogram over 40 minutes, 100 requests a minute: every one under 1 s, or
    2 % over 10 s."""
    under = "0+98x40" if slow else "0+100x40"
    buckets = [series("ckptc_http_request_seconds_bucket", f'{labels}, status="200", le="{le}"', values)
               for le, values in (("1", under), ("10", under), ("+Inf", "0+100x40"))]
    return [*buckets, series("ckptc_http_request_seconds_count", f'{labels}, status="200"', "0+100x40")]


# Each alert: at least one case where it fires and one where it stays quiet (a test checks both).
PROMTOOL_CASES: list[dict[str, Any]] = [
    case([series("up", "", "1 1 0x15"), series("ckptc_ready", "", "1 1 0x15")], "CkptcCoordinatorDown",
         [("1m", []), ("6m", [{"severity": "critical"}])]),
    case([series("up", "", "1 1 0x15"), {"series": 'up{job="ckpt-coordinator", instance="coord-1:8080"}', "values": "1x15"},
          series("ckptc_ready", "", "1x15"), {"series": 'ckptc_ready{job="ckpt-coordinator", instance="coord-1:8080"}', "values": "1x15"}],
         "CkptcCoordinatorDown", [("10m", [])]),  # one replica of two down: the other serves
    case([series("up", "", "1x15"), series("ckptc_ready", "", "1 1 0x15")], "CkptcCoordinatorDown",
         [("6m", [{"severity": "critical"}])]),  # scrapable, but none ready: the Service is empty
    case([series("up", "", "1 1 0x15")], "CkptcReplicaDown",
         [("4m", []), ("10m", [{"severity": "warning", **INSTANCE}])]),
    case([series("up", "", "1 0 0 1 1 0 0 1x10")], "CkptcReplicaDown", [("10m", [])]),  # a restart is not "down"
    case([{"series": 'up{job="other"}', "values": "1x20"}], "CkptcCoordinatorAbsent",
         [("5m", []), ("15m", [{"severity": "critical", "job": "ckpt-coordinator"}])]),
    case([series("up", "", "1x20")], "CkptcCoordinatorAbsent", [("15m", [])]),
    case([series("ckptc_ready", "", "1 1 0x20")], "CkptcCoordinatorNotReady",
         [("8m", []), ("14m", [{"severity": "warning", **INSTANCE}])]),
    case([series("ckptc_ready", "", "1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0")], "CkptcCoordinatorNotReady",
         [("15m", [])]),  # flapping readiness is not "not ready"
    case([series("ckptc_database_up", "", "1 1 0x10"), {"series": 'ckptc_database_up{job="ckpt-coordinator", instance="coord-1:8080"}', "values": "1 1 0x10"}],
         "CkptcDatabaseUnreachable", [("2m", []), ("6m", [{"severity": "critical"}])]),
    case([series("ckptc_database_up", "", "1 1 0x10"), {"series": 'ckptc_database_up{job="ckpt-coordinator", instance="coord-1:8080"}', "values": "1x12"}],
         "CkptcDatabaseUnreachable", [("6m", [])]),  # one replica's path only: its own probe, not the database
    case([series("ckptc_schema_state", 'state="behind"', "0 1x20"), series("ckptc_schema_state", 'state="at_head"', "1 0x20")],
         "CkptcMigrationNotApplied", [("5m", []), ("15m", [{"severity": "warning", "instance": "coord-0:8080"}])]),
    case([series("ckptc_schema_state", 'state="behind"', "0 1 1 0x20"), series("ckptc_schema_state", 'state="at_head"', "1 0 0 1x20")],
         "CkptcMigrationNotApplied", [("15m", [])]),  # the Job ran within minutes: the rollout went on
    case([series("ckptc_schema_state", 'state="incompatible"', "0 1x20")], "CkptcSchemaTooNew",
         [("5m", []), ("15m", [{"severity": "warning", "instance": "coord-0:8080"}])]),
    case([series("ckptc_schema_state", 'state="ahead"', "0 1x20"), series("ckptc_schema_state", 'state="incompatible"', "0x20")],
         "CkptcSchemaTooNew", [("15m", [])]),  # a newer schema this release runs on is fine
    case([series("ckptc_runs_without_driver", "", "0 2x10")], "CkptcRunsWithoutDriver",
         [("3m", []), ("8m", [{"severity": "warning"}])]),
    case([series("ckptc_runs_without_driver", "", "0 1 0 1 0 1 0 1 0 1")], "CkptcRunsWithoutDriver",
         [("9m", [])]),  # a lease changing hands for a moment
    case([series("ckptc_fenced_writes_total", 'work="snapshot"', "0 0 1x10"), series("ckptc_fenced_writes_total", 'work="outbox"', "0x12")],
         "CkptcFencedWrites", [("1m", []), ("5m", [{"severity": "warning", "work": "snapshot"}])]),
    case([series("ckptc_fenced_writes_total", 'work="snapshot"', "3x60")], "CkptcFencedWrites",
         [("55m", [])]),  # an old count that no longer grows
    case(latency(HOT, slow=True), "CkptcApiSlow",
         [("10m", []), ("35m", [{"severity": "warning", "route": "/v1/runs/{run_id}/attempts/sealed"}])]),
    case(latency(HOT, slow=False) + latency(LONG_POLL, slow=True) + latency(EXPORT, slow=True), "CkptcApiSlow",
         [("35m", [])]),  # fast trainer calls; a long poll that waits on purpose and a bulk export are not counted
    case([series("ckptc_snapshot_failures_consecutive", 'run="run-a"', "1 2 3x10"),
          series("ckptc_snapshot_failures_consecutive", 'run="run-b"', "0x12")],
         "CkptcSnapshotsFailingRepeatedly", [("3m", []), ("9m", [{"severity": "warning", "run": "run-a"}])]),
    case([series("ckptc_snapshot_failures_consecutive", 'run="run-a"', "1 2 0 1 2 0 1 2 0 1 2 0")],
         "CkptcSnapshotsFailingRepeatedly", [("11m", [])]),  # failures between published snapshots
    case([series("ckptc_snapshot_losses_warning", 'run="run-a"', "0 0 1x10"),
          series("ckptc_snapshot_losses_consecutive", 'run="run-a"', "1 2 3x10"),
          series("ckptc_snapshot_losses_warning", 'run="run-b"', "0x12"),
          series("ckptc_snapshot_losses_consecutive", 'run="run-b"', "12x12"),
          series("ckptc_snapshot_losses_warning", 'run="run-c"', "0x12"),
          series("ckptc_snapshot_losses_consecutive", 'run="run-c"', "2x12")],
         "CkptcSnapshotsLosingToTrainSteps",
         [("6m", [{"severity": "warning", "run": "run-a"}, {"severity": "warning", "run": "run-b"}])]),
    case([series("ckptc_snapshot_losses_warning", 'run="run-c"', "0x12"), series("ckptc_snapshot_losses_consecutive", 'run="run-c"', "2x12")],
         "CkptcSnapshotsLosingToTrainSteps", [("6m", [])]),
    case([series("ckptc_snapshot_resume_failures_total", "", "0 0 0 1 1 1")], "CkptcSnapshotResumeFailed",
         [("2m", []), ("4m", [{"severity": "warning", **INSTANCE}])]),
    case([series("ckptc_snapshot_resume_failures_total", "", "1x90")], "CkptcSnapshotResumeFailed", [("85m", [])]),
    case([series("ckptc_outbox_pending", 'op="retire"', "0+10x70"),
          series("ckptc_outbox_pending", 'op="forget"', "500x70")],
         "CkptcOutboxBacklogGrowing",
         [("20m", []), ("60m", [{"severity": "warning", "op": "retire"}])]),
    case([series("ckptc_outbox_oldest_age_seconds", 'op="retire"', "0+60x30"),
          series("ckptc_outbox_oldest_age_seconds", 'op="forget"', "30x30")],
         "CkptcOutboxOldestItemOld",
         [("15m", []), ("25m", [{"severity": "warning", "op": "retire"}])]),
    case([series("ckptc_gym_control_seconds_count", 'op="prepare", kind="model", outcome="ok"', "0+10x30"),
          series("ckptc_gym_control_seconds_count", 'op="prepare", kind="model", outcome="unavailable"', "0+5x30"),
          series("ckptc_gym_control_seconds_count", 'op="prepare", kind="agent", outcome="ok"', "0+10x30"),
          series("ckptc_gym_control_seconds_count", 'op="prepare", kind="agent", outcome="not_ready"', "0+10x30")],
         "CkptcGymControlErrors",
         [("5m", []), ("25m", [{"severity": "warning", "op": "prepare", "kind": "model"}])]),
    case([series("ckptc_http_request_seconds_count", 'route="/v1/runs/{run_id}", method="GET", status="200"', "0+100x30"),
          series("ckptc_http_request_seconds_count", 'route="/v1/runs/{run_id}", method="GET", status="500"', "0+10x30")],
         "CkptcHttpServerErrors",
         [("5m", []), ("25m", [{"severity": "warning"}])]),
    case([series("ckptc_http_request_seconds_count", 'route="/v1/runs/{run_id}", method="GET", status="200"', "0+100x30"),
          series("ckptc_http_request_seconds_count", 'route="/v1/runs/{run_id}", method="GET", status="500"', "0+1x30")],
         "CkptcHttpServerErrors",
         [("25m", [])]),  # 1% errors stays quiet
    case([series("ckptc_snapshot_phase_seconds_bucket", f'phase="gym_parked", le="{le}"', values)
          for le, values in (("120", "0x80"), ("300", "0x80"), ("600", "0+1x80"), ("+Inf", "0+1x80"))],
         "CkptcGymParkedTooLong",
         [("10m", []), ("70m", [{"severity": "info"}])]),
    case([series("ckptc_snapshot_phase_seconds_bucket", f'phase="gym_parked", le="{le}"', values)
          for le, values in (("120", "0+1x80"), ("300", "0+1x80"), ("600", "0+1x80"), ("+Inf", "0+1x80"))],
         "CkptcGymParkedTooLong", [("70m", [])]),
]


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for c in PROMTOOL_CASES:
        for t in c["alert_rule_test"]:
            (firing if t["exp_alerts"] else quiet).add(t["alertname"])
    assert firing == set(by_name()) == quiet, (set(by_name()) - firing, set(by_name()) - quiet)


def test_promtool_alert_logic(tmp_path: Path) -> None:
    promtool = which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    tested = {t["alertname"] for c in PROMTOOL_CASES for t in c["alert_rule_test"]}
    assert tested == set(by_name()), f"alerts without a logic test: {set(by_name()) - tested}"
    test_file = tmp_path / "alerts.test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": PROMTOOL_CASES}))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """A wrong expectation must make promtool fail, or the logic test proves nothing."""
    promtool = which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    wrong = case([series("up", "", "1x15")], "CkptcCoordinatorDown", [("10m", [{"severity": "critical", **INSTANCE}])])
    test_file = tmp_path / "alerts.test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": [wrong]}))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
