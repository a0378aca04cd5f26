"""deploy/README.md stays in step with the metrics table, the alerts, the manifests and the Dockerfile."""

from __future__ import annotations

import re

import yaml
from _deploy_helpers import DEPLOY, ROOT

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
    for step in ("kubectl apply -k deploy/k8s", "wait --for=condition=complete job/ckpt-coordinator-migrate-0.1.0",
                 "create secret generic ckpt-coordinator-secrets"):
        assert step in FLAT, step


def test_documented_paths_exist() -> None:
    for path in ("k8s/namespace.yaml", "k8s/secret.example.yaml", "k8s/overlays/cnpg/kustomization.yaml",
                 "k8s/overlays/production/kustomization.yaml", "k8s/components/cnpg/objectstore.yaml", "prometheus/rule.py",
                 "prometheus/alerts.yml", "prometheus/prometheus.yml", "grafana/generate.py",
                 "grafana/fleet-overview.json", "grafana/run-drilldown.json"):
        assert (DEPLOY / path).exists(), path


def _base_image_default() -> str:
    match = re.search(r"^ARG BASE_IMAGE=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert match, "the Dockerfile declares ARG BASE_IMAGE with a default"
    return match.group(1)


def image_build_problems(text: str) -> list[str]:
    """What a README's image-build instructions get wrong (shared with the top-level README's test)."""
    problems = []
    flat = " ".join(text.replace("**", "").split())
    if f"`BASE_IMAGE` (default `{_base_image_default()}`" not in flat:
        problems.append("BASE_IMAGE and its default are not stated")
    if "--build-arg BASE_IMAGE=" not in text:
        problems.append("no build line with --build-arg BASE_IMAGE=")
    for tool in ("docker build", "podman build", "buildah bud"):
        if tool not in text:
            problems.append(f"no {tool} line")
    for command in re.finditer(r"\b(?:podman build|buildah bud)\b[^#&;\n]*", text):
        if "--format docker" not in command.group(0):
            problems.append(f"an OCI image drops the HEALTHCHECK; needs --format docker: {command.group(0).strip()}")
    return problems


def test_image_build_is_documented_for_every_builder() -> None:
    assert image_build_problems(README) == []


def test_image_build_check_catches_a_missing_format() -> None:
    bad = README.replace("podman build --format docker", "podman build")
    assert any("needs --format docker" in p for p in image_build_problems(bad))
