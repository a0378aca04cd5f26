"""The README's Kubernetes section works as written against the manifests as they are."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_deploy_readme import image_build_problems

ROOT = Path(__file__).resolve().parents[2]


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Running on Kubernetes")
    return text[start : text.index("\n## ", start + 5)]


def _commands() -> list[str]:
    block = re.search(r"```\n(.*?)```", _section(), re.S)
    assert block, "the Kubernetes section has a command block"
    return [ln for ln in block.group(1).replace("\\\n", " ").splitlines() if ln.strip()]


def test_every_path_the_readme_applies_exists() -> None:
    for cmd in _commands():
        for path in re.findall(r"(?:-f|-k)\s+(\S+)", cmd):
            assert (ROOT / path).exists(), f"{cmd!r} names {path}, which does not exist"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
def test_readme_names_match_rendered_manifests() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy/k8s")], check=True, capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    names = {(d["kind"].lower(), d["metadata"]["name"]) for d in docs}
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    cmds = " ".join(_commands())
    assert namespaces == {"ckpt-coordinator"} and "-n ckpt-coordinator" in cmds
    for kind, name in re.findall(r"(job|deployment)/([a-z0-9.-]*[a-z0-9])", cmds):
        assert (kind, name) in names, f"README waits on {kind}/{name}, not rendered"
    secret = re.search(r"create secret generic (\S+)", cmds).group(1)  # type: ignore[union-attr]
    refs = set(re.findall(r"secretKeyRef:\s*\n\s*(?:key: \S+\s*\n\s*)?name: (\S+)", rendered)) | set(re.findall(r"secretRef:\s*\n\s*name: (\S+)", rendered))
    assert secret in refs, f"README creates secret {secret}, manifests use {refs}"
    keys = set(re.findall(r"--from-literal=(\w+)=", cmds))
    assert {"CKPTC_ADMIN_TOKEN", "CKPTC_DATABASE_URL"} <= keys


def test_section_says_how_to_build_the_image() -> None:
    assert image_build_problems(_section()) == []
