"""Kubernetes manifests: schema-valid offline, and the operational properties that matter.

With kubectl on PATH the kustomizations are rendered (`kubectl kustomize`);
without it the base's resource files are read as they are and the render-only
checks skip. Core kinds are validated with kubernetes-validate against the
oldest and newest Kubernetes versions we support; the two CRD kinds
(ServiceMonitor, CloudNativePG Cluster) have no bundled schema and are checked
against the small hand schemas below, which list the fields of those CRDs we use.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from _deploy_helpers import DEPLOY, which
from pod_security import pod_specs, violations

K8S = DEPLOY / "k8s"
BASE = K8S / "base"
CNPG = K8S / "overlays" / "cnpg"
PRODUCTION = K8S / "overlays" / "production"
# Every kustomization a user applies (each sets the image and names the migration Job after it).
TOP_LEVEL = {"default": K8S, "cnpg": CNPG, "production": PRODUCTION}
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
SHUTDOWN_MARGIN_S = 10


def render(path: Path) -> list[dict[str, Any]]:
    kubectl = which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render kustomizations")
    result = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module", params=sorted(TOP_LEVEL))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(TOP_LEVEL[request.param])


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
                "priorityClassName": {"type": "string"},
                "affinity": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enablePodAntiAffinity": {"type": "boolean"},
                        "topologyKey": {"type": "string"},
                        "podAntiAffinityType": {"enum": ["preferred", "required"]},
                        "nodeAffinity": {"type": "object"},
                        "nodeSelector": {"type": "object"},
                        "tolerations": {"type": "array"},
                    },
                },
                # The Barman Cloud plugin (CNPG-I): WAL archiving and base backups.
                "plugins": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "enabled": {"type": "boolean"},
                            "isWALArchiver": {"type": "boolean"},
                            "parameters": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
}

PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "interval": {"type": "string"},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"},
                                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
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

_SECRET_KEY = {
    "type": "object",
    "required": ["name", "key"],
    "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
}

# barmancloud.cnpg.io/v1 ObjectStore: the fields of the configuration we use.
OBJECT_STORE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "barmancloud.cnpg.io/v1"},
        "kind": {"const": "ObjectStore"},
        "spec": {
            "type": "object",
            "required": ["configuration"],
            "additionalProperties": False,
            "properties": {
                "retentionPolicy": {"type": "string", "pattern": "^[1-9][0-9]*[dwm]$"},
                "instanceSidecarConfiguration": {"type": "object"},
                "configuration": {
                    "type": "object",
                    "required": ["destinationPath"],
                    "additionalProperties": False,
                    "properties": {
                        "destinationPath": {"type": "string", "pattern": "^(s3|gs|https?)://"},
                        "endpointURL": {"type": "string"},
                        "s3Credentials": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "accessKeyId": _SECRET_KEY, "secretAccessKey": _SECRET_KEY, "region": _SECRET_KEY,
                                "sessionToken": _SECRET_KEY, "inheritFromIAMRole": {"type": "boolean"},
                            },
                        },
                        "wal": {"type": "object", "properties": {"compression": {"enum": ["gzip", "bzip2", "snappy", "lz4", "xz", "zstd"]}}},
                        "data": {"type": "object", "properties": {"compression": {"enum": ["gzip", "bzip2", "snappy"]}}},
                    },
                },
            },
        },
    },
}

SCHEDULED_BACKUP_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "postgresql.cnpg.io/v1"},
        "kind": {"const": "ScheduledBackup"},
        "spec": {
            "type": "object",
            "required": ["schedule", "cluster"],
            "additionalProperties": False,
            "properties": {
                # CloudNativePG's schedule has six fields: seconds first.
                "schedule": {"type": "string", "pattern": r"^\S+( \S+){5}$"},
                "immediate": {"type": "boolean"},
                "suspend": {"type": "boolean"},
                "backupOwnerReference": {"enum": ["none", "self", "cluster"]},
                "cluster": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                "method": {"enum": ["barmanObjectStore", "volumeSnapshot", "plugin"]},
                "pluginConfiguration": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            },
        },
    },
}

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE_SCHEMA,
    ("postgresql.cnpg.io/v1", "Cluster"): CNPG_CLUSTER_SCHEMA,
    ("postgresql.cnpg.io/v1", "ScheduledBackup"): SCHEDULED_BACKUP_SCHEMA,
    ("barmancloud.cnpg.io/v1", "ObjectStore"): OBJECT_STORE_SCHEMA,
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
    assert {"Deployment", "Service", "PodDisruptionBudget", "Job", "ConfigMap", "ServiceMonitor", "PrometheusRule", "NetworkPolicy"} <= kinds
    for doc in base:
        validate(doc)


def test_every_kustomization_renders_valid_and_restricted(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    for doc in docs:
        validate(doc)
        if doc["kind"] not in ("PriorityClass", "Namespace"):
            assert doc["metadata"]["namespace"] == "ckpt-coordinator", (name, doc["kind"])
    # The namespace is applied on its own: no kustomization can delete it (and its Secret, its database).
    assert not [d for d in docs if d["kind"] == "Namespace"], name
    pods = pod_specs(docs)
    assert {p for p, _ in pods} >= {"Deployment/ckpt-coordinator", "Job/ckpt-coordinator-migrate-0.1.0"}, name
    for where, pod in pods:
        assert violations(pod) == [], (name, where)


def test_the_restricted_check_catches_each_kind_of_breach() -> None:
    (_, pod), = [p for p in pod_specs(render(PRODUCTION)) if p[0].startswith("Deployment")]
    assert violations(pod) == []

    def broken(change: Any) -> list[str]:
        copy = yaml.safe_load(yaml.safe_dump(pod))
        change(copy)
        return violations(copy)

    assert broken(lambda p: p.update(hostNetwork=True)) == ["hostNetwork is set"]
    assert broken(lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}})) == ["volume h uses ['hostPath']"]
    assert broken(lambda p: p["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True))
    assert broken(lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]))
    assert broken(lambda p: p["containers"][0]["securityContext"].update(runAsNonRoot=False))
    assert broken(lambda p: p["securityContext"].pop("seccompProfile"))
    assert broken(lambda p: p["containers"][0]["ports"][0].update(hostPort=8080))
    assert broken(lambda p: p["containers"][0]["securityContext"].update(privileged=True))


def test_the_namespace_enforces_restricted_and_is_applied_alone() -> None:
    namespace = yaml.safe_load((K8S / "namespace.yaml").read_text())
    validate(namespace)
    assert namespace["metadata"]["name"] == "ckpt-coordinator"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for kustomization in K8S.rglob("kustomization.yaml"):
        listed = yaml.safe_load(kustomization.read_text()).get("resources", [])
        assert not any("namespace" in r for r in listed), kustomization


def test_the_migration_job_is_named_after_the_release(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    tag = containers(one(docs, "Deployment"))[0]["image"].rsplit(":", 1)[1]
    job = one(docs, "Job")
    assert job["metadata"]["name"] == f"ckpt-coordinator-migrate-{tag}", name
    assert job["metadata"]["labels"]["app.kubernetes.io/version"] == tag
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/version"] == tag
    # No TTL: a GitOps tool would see the Job vanish and apply it again; Argo CD runs it first.
    assert "ttlSecondsAfterFinished" not in job["spec"]
    assert job["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"] == "-1"


def test_a_new_tag_names_a_new_job(tmp_path: Path) -> None:
    overlay = tmp_path / "mine"
    overlay.mkdir()
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    kustomization["resources"] = [os.path.relpath(BASE, overlay)]
    kustomization["images"] = [{"name": "ckpt-coordinator", "newName": "registry.example.com/ckptc", "newTag": "0.2.0"}]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    docs = render(overlay)
    assert one(docs, "Job")["metadata"]["name"] == "ckpt-coordinator-migrate-0.2.0"
    assert containers(one(docs, "Job"))[0]["image"] == "registry.example.com/ckptc:0.2.0"


def test_every_image_setting_kustomization_carries_the_same_job_naming() -> None:
    blocks = {name: yaml.safe_load((path / "kustomization.yaml").read_text())["replacements"] for name, path in TOP_LEVEL.items()}
    assert all(blocks.values()) and len({yaml.safe_dump(b) for b in blocks.values()}) == 1, blocks
    for kustomization in K8S.rglob("kustomization.yaml"):
        doc = yaml.safe_load(kustomization.read_text())
        assert ("images" in doc) == ("replacements" in doc), kustomization


def test_hand_schemas_reject_typos(base: list[dict[str, Any]]) -> None:
    monitor = one(base, "ServiceMonitor")
    broken = {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "http", "intervall": "30s"}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    deployment = one(base, "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


@pytest.mark.parametrize("overlay", [CNPG, PRODUCTION], ids=["cnpg", "production"])
def test_cnpg_overlays(overlay: Path) -> None:
    docs = render(overlay)
    cluster = one(docs, "Cluster")
    validate(cluster)
    assert cluster["metadata"]["namespace"] == "ckpt-coordinator"
    for doc in docs:
        validate(doc)
    name = cluster["metadata"]["name"]
    for kind in ("Deployment", "Job"):
        (container,) = containers(one(docs, kind))
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["CKPTC_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": f"{name}-app", "key": "uri"}, kind
        # TLS checked against the cluster's own CA, the server's name included.
        assert env["PGSSLMODE"]["value"] == "verify-full", kind
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["pg-ca"]
        assert env["PGSSLROOTCERT"]["value"] == f"{mount}/ca.crt", kind
        (ca,) = [v for v in one(docs, kind)["spec"]["template"]["spec"]["volumes"] if v["name"] == "pg-ca"]
        assert ca["secret"]["secretName"] == f"{name}-ca" and ca["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    # Backups: WAL archived to the object store, a base backup every night, and neither pruned by GitOps.
    (plugin,) = cluster["spec"]["plugins"]
    store = one(docs, "ObjectStore")
    assert plugin == {"name": "barman-cloud.cloudnative-pg.io", "isWALArchiver": True, "parameters": {"barmanObjectName": store["metadata"]["name"]}}
    assert store["spec"]["retentionPolicy"] and store["spec"]["configuration"]["wal"]["compression"]
    backup = one(docs, "ScheduledBackup")
    assert backup["spec"]["cluster"]["name"] == name and backup["spec"]["method"] == "plugin"
    assert backup["spec"]["pluginConfiguration"]["name"] == plugin["name"]
    for doc in (cluster, store):
        assert "Prune=false" in doc["metadata"]["annotations"]["argocd.argoproj.io/sync-options"]
        assert doc["metadata"]["annotations"]["kustomize.toolkit.fluxcd.io/prune"] == "disabled"
    # The database port reaches this cluster's pods, nothing else.
    (database,) = [r for r in one(docs, "NetworkPolicy")["spec"]["egress"] if any(p["port"] == 5432 for p in r.get("ports", []))]
    assert database["to"] == [{"podSelector": {"matchLabels": {"cnpg.io/cluster": cluster["metadata"]["name"]}}}]


# --------------------------------------------------------------------------- deployment properties


def test_production_overlay_schedules_beside_gpu_pods() -> None:
    docs = render(PRODUCTION)
    priority = one(docs, "PriorityClass")
    assert priority["value"] >= 1_000_000 and not priority.get("globalDefault")
    assert priority["value"] < 2_000_000_000, "below the system classes"
    name = priority["metadata"]["name"]
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == name
    assert one(docs, "Job")["spec"]["template"]["spec"]["priorityClassName"] == name
    assert one(docs, "Cluster")["spec"]["priorityClassName"] == name
    spreads = {(c["topologyKey"], c["whenUnsatisfiable"]) for c in pod["topologySpreadConstraints"]}
    assert spreads == {("kubernetes.io/hostname", "DoNotSchedule"), ("topology.kubernetes.io/zone", "ScheduleAnyway")}
    for constraint in pod["topologySpreadConstraints"]:
        assert matches(constraint["labelSelector"]["matchLabels"], pod_labels := deployment["spec"]["template"]["metadata"]["labels"]), pod_labels
    gpu = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]["matchExpressions"][0]
    assert gpu["key"] == "nvidia.com/gpu.present" and gpu["operator"] == "NotIn"
    (container,) = pod["containers"]
    # Guaranteed QoS: evicted last under memory pressure from a neighbour.
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])


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
    # Startup and liveness are the process alone: a database outage or a migration not yet run
    # must neither kill a starting pod nor restart a running one.
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        port = container[probe]["httpGet"]["port"]
        assert port in ports or port in ports.values(), probe
        assert container[probe]["timeoutSeconds"] < container[probe]["periodSeconds"]
    pdb = one(base, "PodDisruptionBudget")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", "a drain must not wait on a pod that serves nothing"


def test_the_grace_period_covers_the_drain(base: list[dict[str, Any]]) -> None:
    from checkpoint_coordinator.config import Settings
    from checkpoint_coordinator.server import HTTP_DRAIN_S
    from checkpoint_coordinator.snapshots.pending import SHUTDOWN_GRACE_S

    deployment = one(base, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and int(command[1]) >= 5
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    configmap = one(base, "ConfigMap")["data"]
    drain = float(configmap.get("CKPTC_SHUTDOWN_DRAIN_S") or env.get("CKPTC_SHUTDOWN_DRAIN_S") or Settings.model_fields["shutdown_drain_s"].default)
    # After preStop, requests in flight and the snapshots' drain (then their cancellation) run side by side.
    needed = int(command[1]) + max(HTTP_DRAIN_S, drain + SHUTDOWN_GRACE_S) + SHUTDOWN_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed, needed


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
    assert job["spec"]["backoffLimit"] >= 1


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
        assert doc["metadata"]["namespace"] == "ckpt-coordinator", doc["kind"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "checkpoint-coordinator"
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"] == "ckpt-coordinator:0.1.0"


def test_prometheus_operator_objects_are_selected_and_current(base: list[dict[str, Any]]) -> None:
    import subprocess
    import sys

    monitor, rule = one(base, "ServiceMonitor"), one(base, "PrometheusRule")
    # kube-prometheus-stack selects both by its release label; they carry the same.
    assert monitor["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    check = subprocess.run([sys.executable, str(DEPLOY / "prometheus" / "rule.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
