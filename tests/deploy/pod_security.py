"""The Pod Security Standards' "restricted" profile (latest), checked on a manifest's pod templates.

Kubernetes enforces it through the namespace label (deploy/k8s/namespace.yaml) when a pod is
created; without an API server, this applies the same controls to every pod template a rendered
kustomization holds, so a patch that breaks one fails here rather than at the first rollout.
The controls, from the standard's published list: the baseline ones (host namespaces,
privileged, capabilities, hostPath, host ports, AppArmor, SELinux, /proc mount, seccomp, sysctls)
and the restricted ones (volume types, privilege escalation, running as non-root, non-root user,
seccomp, capabilities).
"""

from __future__ import annotations

from typing import Any

ALLOWED_VOLUME_SOURCES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
}
ALLOWED_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}

POD_TEMPLATE_PATHS = {
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
    "Pod": ("spec",),
}


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every object that makes pods."""
    out = []
    for doc in docs:
        path = POD_TEMPLATE_PATHS.get(doc.get("kind", ""))
        if path is None:
            continue
        spec: Any = doc
        for key in path:
            spec = spec[key]
        out.append((f"{doc['kind']}/{doc['metadata']['name']}", spec))
    return out


def violations(pod: dict[str, Any]) -> list[str]:
    """What a pod spec does that the restricted profile forbids (empty: it passes)."""
    found: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]

    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"{field} is set")
    for volume in pod.get("volumes", []):
        sources = set(volume) - {"name"}
        if not sources <= ALLOWED_VOLUME_SOURCES:
            found.append(f"volume {volume['name']} uses {sorted(sources - ALLOWED_VOLUME_SOURCES)}")
    for sysctl in psc.get("sysctls", []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl.get('name')} is not in the safe set")
    found += _selinux_and_apparmor("pod", psc)
    if psc.get("runAsUser") == 0:
        found.append("pod runAsUser is 0")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("pod windowsOptions.hostProcess is set")

    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for c in containers:
        name = f"container {c.get('name')}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"{name} is privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name} does not set allowPrivilegeEscalation: false")
        if not (sc.get("runAsNonRoot") is True or (psc.get("runAsNonRoot") is True and sc.get("runAsNonRoot") is not False)):
            found.append(f"{name} does not run as non-root (runAsNonRoot)")
        if sc.get("runAsUser") == 0:
            found.append(f"{name} runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name} has no RuntimeDefault or Localhost seccomp profile")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            found.append(f"{name} does not drop ALL capabilities")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name} adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{name} procMount is {sc['procMount']}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{name} windowsOptions.hostProcess is set")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                found.append(f"{name} uses hostPort {port['hostPort']}")
        found += _selinux_and_apparmor(name, sc)
    return found


def _selinux_and_apparmor(where: str, sc: dict[str, Any]) -> list[str]:
    found = []
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in ALLOWED_SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        found.append(f"{where} sets SELinux options the profile forbids")
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        found.append(f"{where} appArmorProfile is {apparmor}")
    return found
