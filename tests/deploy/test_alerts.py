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

    assert covered("ckptc_snapshots_total", 'outcome="failed"')
    assert covered("ckptc_snapshot_losses_consecutive") and covered("ckptc_snapshot_losses_warning")
    assert covered("ckptc_outbox_pending", "deriv(")
    assert covered("ckptc_outbox_oldest_age_seconds")
    assert covered("ckptc_gym_control_seconds_count", 'outcome!="ok"')
    assert covered("up", "== 0") and covered("ckptc_ready")


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

PROMTOOL_CASES: list[dict[str, Any]] = [
    case([series("up", "", "1 1 0x15")], "CkptcCoordinatorDown",
         [("4m", []), ("10m", [{"severity": "critical", **INSTANCE}])]),
    case([{"series": 'up{job="other"}', "values": "1x20"}], "CkptcCoordinatorAbsent",
         [("5m", []), ("15m", [{"severity": "critical", "job": "ckpt-coordinator"}])]),
    case([series("ckptc_ready", "", "1 1 0x20")], "CkptcCoordinatorNotReady",
         [("8m", []), ("14m", [{"severity": "critical", **INSTANCE}])]),
    case([series("ckptc_ready", "", "1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0")], "CkptcCoordinatorNotReady",
         [("15m", [])]),  # flapping readiness is not "not ready"
    case([series("ckptc_snapshots_total", 'outcome="failed", reason="gym_not_ready"', "0+1x20"),
          series("ckptc_snapshots_total", 'outcome="published", reason="ok"', "0x20")],
         "CkptcSnapshotsFailingRepeatedly",
         [("2m", []), ("15m", [{"severity": "warning", "reason": "gym_not_ready"}])]),
    case([series("ckptc_snapshots_total", 'outcome="failed", reason="gym_not_ready"', "0+1x20"),
          series("ckptc_snapshots_total", 'outcome="published", reason="ok"', "0+1x20")],
         "CkptcSnapshotsFailingRepeatedly",
         [("15m", [])]),  # failures between successful publishes are not "repeatedly failing"
    case([series("ckptc_snapshot_losses_warning", 'run="run-a"', "0 0 1x10"),
          series("ckptc_snapshot_losses_consecutive", 'run="run-a"', "1 2 3x10"),
          series("ckptc_snapshot_losses_warning", 'run="run-b"', "0x12"),
          series("ckptc_snapshot_losses_consecutive", 'run="run-b"', "12x12"),
          series("ckptc_snapshot_losses_warning", 'run="run-c"', "0x12"),
          series("ckptc_snapshot_losses_consecutive", 'run="run-c"', "2x12")],
         "CkptcSnapshotsLosingToTrainSteps",
         [("6m", [{"severity": "warning", "run": "run-a"}, {"severity": "warning", "run": "run-b"}])]),
    case([series("ckptc_snapshot_resume_failures_total", "", "0 0 0 1 1 1")], "CkptcSnapshotResumeFailed",
         [("2m", []), ("4m", [{"severity": "warning", **INSTANCE}])]),
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
]


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
