#!/usr/bin/env python3
"""Write deploy/k8s/base/prometheusrule.yaml: the alert rules of alerts.yml as a PrometheusRule.

alerts.yml is the one source (promtool and a plain Prometheus read it); the Prometheus operator
reads the PrometheusRule this script makes of it. `--check` writes nothing and exits 1 when the
committed object differs from what alerts.yml gives (tests/deploy/test_alerts.py runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE / "alerts.yml"
TARGET = HERE.parent / "k8s" / "base" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by deploy/prometheus/rule.py: edit alerts.yml and
# run the script. The labels are those the ServiceMonitor carries, so a kube-prometheus-stack that
# selects one selects the other (deploy/README.md, "Prometheus").
"""


def render() -> str:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "ckpt-coordinator",
            "labels": {"app.kubernetes.io/name": "ckpt-coordinator", "release": "kube-prometheus-stack"},
        },
        "spec": {"groups": groups},
    }
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the committed object is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text(encoding="utf-8") != text:
            print(f"stale {TARGET.relative_to(HERE.parents[1])} (run deploy/prometheus/rule.py)", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
