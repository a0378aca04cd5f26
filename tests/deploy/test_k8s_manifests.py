"""Kubernetes manifests: schema-valid offline, and the operational properties that matter.

With kubectl on PATH the kustomizations are rendered (`kubectl kustomize`);
without it the base's resource files are read as they are and the render-only
checks skip. Core kinds are validated with kubernetes-validate against the
oldest and newest Kubernetes versions we support; the two CRD kinds
(ServiceMonitor, CloudNativePG Cluster) have no bundled schema and are checked
against the small hand schemas below, which list the fields of those CRDs we use.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from _deploy_helpers import DEPLOY, which

K8S = DEPLOY / "k8s"
BASE = K8S / "base"
CNPG = K8S / "overlays" / "cnpg"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CONTROL_TIMEOUT_S = 60  # recovery-ledger.md section 3 default
REPLY_GRACE_S = 5  # gym-control-protocol.md section 2: min(control_timeout_s, 5)
SHUTDOWN_MARGIN_S = 10


def render(path: Path) -> list[dict[str, Any]]:
    kubectl = which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render kustomizations")
    result = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def raw_base() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / resource).read_text()) if d]
    return docs


@pytest.fixture(scope="module", params=["rendered", "raw"])
def base(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(K8S) if request.param == "rendered" else raw_base()


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- schema validation

SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "namespaceSelector": {"type": "object"},
                "sampleLimit": {"type": "integer"},
                "selector": {
                    "type": "object",
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                    "additionalProperties": False,
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                            "params": {"type": "object"},
                            "tlsConfig": {"type": "object"},
                            # The CRD's SafeAuthorization: a type and a key of a Secret in the namespace.
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {
                                        "type": "object",
                                        "required": ["key"],
                                        "additionalProperties": False,
                                        "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

CNPG_CLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "postgresql.cnpg.io/v1"},
        "kind": {"const": "Cluster"},
        "spec": {
            "type": "object",
            "required": ["instances", "storage"],
            "additionalProperties": False,
            "properties": {
                "instances": {"type": "integer", "minimum": 1},
                "primaryUpdateStrategy": {"enum": ["unsupervised", "supervised"]},
                "minSyncReplicas": {"type": "integer", "minimum": 0},
                "maxSyncReplicas": {"type": "integer", "minimum": 0},
                "imageName": {"type": "string"},
                "bootstrap": {
                    "type": "object",
                    "properties": {
                        "initdb": {
                            "type": "object",
                            "properties": {"database": {"type": "string"}, "owner": {"type": "string"}},
                            "required": ["database", "owner"],
                        }
                    },
                },
                "postgresql": {
                    "type": "object",
                    "properties": {"parameters": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "storage": {
                    "type": "object",
                    "required": ["size"],
                    "properties": {"size": {"type": "string", "pattern": "^[0-9]+(Mi|Gi|Ti)$"}},
                },
                "resources": {"type": "object"},
                "monitoring": {"type": "object", "properties": {"enablePodMonitor": {"type": "boolean"}}},
            },
        },
    },
}

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA,
    ("postgresql.cnpg.io/v1", "Cluster"): CNPG_CLUSTER_SCHEMA,
}


def validate(doc: dict[str, Any]) -> None:
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.validate(doc, schema)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_every_manifest_is_schema_valid(base: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in base}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Job", "ConfigMap", "ServiceMonitor", "NetworkPolicy"} <= kinds
    for doc in base:
        validate(doc)


def test_hand_schemas_reject_typos(base: list[dict[str, Any]]) -> None:
    monitor = one(base, "ServiceMonitor")
    broken = {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "http", "intervall": "30s"}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    deployment = one(base, "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_cnpg_overlay() -> None:
    docs = render(CNPG)
    cluster = one(docs, "Cluster")
    validate(cluster)
    assert cluster["metadata"]["namespace"] == "ckpt-coordinator"
    for doc in docs:
        validate(doc)
    for kind in ("Deployment", "Job"):
        env = {e["name"]: e for c in containers(one(docs, kind)) for e in c.get("env", [])}
        assert env["CKPTC_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{cluster['metadata']['name']}-app",
            "key": "uri",
        }, kind
    # The database port reaches this cluster's pods, nothing else.
    (database,) = [r for r in one(docs, "NetworkPolicy")["spec"]["egress"] if any(p["port"] == 5432 for p in r.get("ports", []))]
    assert database["to"] == [{"podSelector": {"matchLabels": {"cnpg.io/cluster": cluster["metadata"]["name"]}}}]


# --------------------------------------------------------------------------- deployment properties


def test_two_replicas_rolling_without_downtime(base: list[dict[str, Any]]) -> None:
    deployment = one(base, "Deployment", "ckpt-coordinator")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_security_context_is_restricted(base: list[dict[str, Any]]) -> None:
    for kind in ("Deployment", "Job"):
        pod = one(base, kind)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get("/tmp") in tmp_volumes, f"{kind}: /tmp must be a writable emptyDir"


def test_resources_are_bounded(base: list[dict[str, Any]]) -> None:
    for kind in ("Deployment", "Job"):
        for container in containers(one(base, kind)):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), kind
            assert "memory" in resources["limits"], kind


def test_probes(base: list[dict[str, Any]]) -> None:
    (container,) = containers(one(base, "Deployment"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080}
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/readyz", probe
    # Liveness must never depend on the database: a slow Postgres would restart every replica.
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        port = container[probe]["httpGet"]["port"]
        assert port in ports or port in ports.values(), probe
        assert container[probe]["timeoutSeconds"] < container[probe]["periodSeconds"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "startup must wait for the migration Job"


def test_shutdown_outlasts_a_gym_control_fan_out(base: list[dict[str, Any]]) -> None:
    deployment = one(base, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and int(command[1]) >= 5
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= int(command[1]) + CONTROL_TIMEOUT_S + REPLY_GRACE_S + SHUTDOWN_MARGIN_S


def test_configuration_and_secrets(base: list[dict[str, Any]]) -> None:
    configmap = one(base, "ConfigMap")
    data = configmap["data"]
    assert data["CKPTC_HOST"] == "0.0.0.0" and data["CKPTC_PORT"] == "8080"
    assert data["CKPTC_LOG_FORMAT"] == "json"
    assert not {"CKPTC_DATABASE_URL", "CKPTC_ADMIN_TOKEN"} & set(data), "secrets do not belong in the ConfigMap"
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    for kind in ("Deployment", "Job"):
        for container in containers(one(base, kind)):
            assert [s["configMapRef"]["name"] for s in container["envFrom"]] == [configmap["metadata"]["name"]]
            env = {e["name"]: e for e in container.get("env", [])}
            ref = env["CKPTC_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
            assert ref.get("optional") is not True, "the database URL is required in a cluster"
            for entry in env.values():
                assert "value" not in entry or not re.search(r"postgres(ql)?://|token", str(entry["value"]), re.I)
    deployment_env = {e["name"] for e in containers(one(base, "Deployment"))[0]["env"]}
    assert "CKPTC_ADMIN_TOKEN" in deployment_env


def test_configmap_keys_are_real_settings(base: list[dict[str, Any]]) -> None:
    try:
        from checkpoint_coordinator.config import Settings
    except ImportError:
        pytest.skip("checkpoint_coordinator.config is not there yet")
    fields = {f"CKPTC_{name.upper()}" for name in Settings.model_fields}
    data = one(base, "ConfigMap")["data"]
    assert set(data) <= fields, f"misspelt or unknown settings: {set(data) - fields}"
    env = {e["name"] for c in containers(one(base, "Deployment")) for e in c["env"]}
    assert env <= fields, env - fields


def test_secret_example_is_not_deployed() -> None:
    for kustomization in K8S.rglob("kustomization.yaml"):
        resources = yaml.safe_load(kustomization.read_text()).get("resources", [])
        assert not any("secret" in r for r in resources), kustomization
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert all("REPLACE" in v for v in secret["stringData"].values()), "the example must hold obvious placeholders"
    validate(secret)


def test_commands(base: list[dict[str, Any]]) -> None:
    (server,) = containers(one(base, "Deployment"))
    (migrate,) = containers(one(base, "Job"))
    # The Job migrates once; replicas must not race it with their own startup migration.
    assert server["args"] == ["serve", "--no-migrate"]
    assert migrate["args"] == ["migrate"]
    assert server["image"] == migrate["image"]
    job = one(base, "Job")
    assert job["spec"]["template"]["spec"]["restartPolicy"] in {"Never", "OnFailure"}
    assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["ttlSecondsAfterFinished"] > 0


def test_service_pdb_monitor_and_policy_select_the_server_pods(base: list[dict[str, Any]]) -> None:
    deployment = one(base, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    service = one(base, "Service")
    assert matches(service["spec"]["selector"], pod_labels)
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    pdb = one(base, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and matches(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    job_labels = one(base, "Job")["spec"]["template"]["metadata"]["labels"]
    assert not matches(service["spec"]["selector"], job_labels), "the migration pod must not receive traffic"

    monitor = one(base, "ServiceMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    # The alerts and dashboards select job="ckpt-coordinator".
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "ckpt-coordinator"

    policy = one(base, "NetworkPolicy")
    assert matches(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}


def test_network_policy_allows_exactly_what_the_service_needs(base: list[dict[str, Any]]) -> None:
    spec = one(base, "NetworkPolicy")["spec"]
    ingress_ports = {p["port"] for rule in spec["ingress"] for p in rule["ports"]}
    assert ingress_ports == {8080}
    sources = [peer for rule in spec["ingress"] for peer in rule["from"]]
    assert any("prometheus" in str(peer.get("podSelector")) for peer in sources)
    assert any("client" in str(peer.get("namespaceSelector")) for peer in sources)
    egress_ports = {(p["port"], p.get("protocol", "TCP")) for rule in spec["egress"] for p in rule.get("ports", [])}
    assert {(5432, "TCP"), (53, "UDP"), (53, "TCP")} <= egress_ports
    assert any("gym" in str(peer.get("namespaceSelector")) for rule in spec["egress"] for peer in rule.get("to", []))
    # The database port only towards the database, never to any host (issue: egress you choose).
    assert all(rule.get("to") for rule in spec["egress"] if any(p["port"] == 5432 for p in rule.get("ports", [])))


def test_rendered_base_is_namespaced_and_labelled() -> None:
    docs = render(K8S)
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "ckpt-coordinator", doc["kind"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "checkpoint-coordinator"
    namespace = one(docs, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"] == "ckpt-coordinator:0.1.0"
