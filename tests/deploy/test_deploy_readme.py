"""deploy/README.md stays in step with the metrics table, the alerts and the manifests."""

from __future__ import annotations

import yaml
from _deploy_helpers import DEPLOY

from checkpoint_coordinator.observability import metrics as m

README = (DEPLOY / "README.md").read_text()
FLAT = " ".join(README.replace("**", "").split())  # wrapped lines and emphasis do not matter


def test_every_metric_is_documented() -> None:
    missing = {name for name in m.metrics_in_table() if f"`{name}`" not in README}
    assert missing == set()
    for reason in m.SnapshotReason:
        assert f"`{reason.value}`" in README, reason


def test_every_alert_is_documented() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        assert f"`{rule['alert']}`" in README, rule["alert"]


def test_operational_facts_are_stated() -> None:
    assert "`CKPTC_DATABASE_URL` is required in a cluster" in FLAT
    assert "embedded PostgreSQL" in FLAT and "single machine only" in FLAT
    assert "only one replica at a time" in FLAT and "ownership lease" in FLAT
    assert "secret.example.yaml" in FLAT
    for step in ("kubectl apply -k deploy/k8s", "wait --for=condition=complete job/ckpt-coordinator-migrate",
                 "create secret generic ckpt-coordinator-secrets"):
        assert step in FLAT, step


def test_documented_paths_exist() -> None:
    for path in ("k8s/base/namespace.yaml", "k8s/secret.example.yaml", "k8s/overlays/cnpg/kustomization.yaml",
                 "prometheus/alerts.yml", "prometheus/prometheus.yml", "grafana/generate.py",
                 "grafana/fleet-overview.json", "grafana/run-drilldown.json"):
        assert (DEPLOY / path).exists(), path
