#!/usr/bin/env python3
"""Generate the coordinator's Grafana dashboards.

    python deploy/grafana/generate.py            # rewrite the JSON files beside this script
    python deploy/grafana/generate.py --check    # exit 1 if the committed JSON is stale

Dashboards are code so that every query is reviewed in one place and a test can
check each metric name against the registry. The data source is the template
variable ``${datasource}``: import the JSON and pick a Prometheus data source.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job="$job", instance=~"$instance"'  # every query is scoped to the chosen job and replicas

# --------------------------------------------------------------------------- building blocks


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    title: str
    description: str
    targets: list[Target]
    kind: str = "timeseries"  # timeseries | stat | table
    unit: str = "short"
    width: int = 12
    height: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    title: str


def _variables(with_run: bool) -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str, *, multi: bool) -> dict[str, Any]:
        var: dict[str, Any] = {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-variable"},
            "refresh": 2,  # on time range change: new runs and replicas appear
            "sort": 1,
            "hide": 0,
            "includeAll": multi,
            "multi": multi,
            "current": {},
            "options": [],
            "regex": "",
        }
        if multi:
            var["allValue"] = ".*"
            var["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
        return var

    variables: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "includeAll": False,
            "multi": False,
            "options": [],
            "refresh": 1,
            "regex": "",
        },
        query_var("job", "Job", "label_values(ckptc_build_info, job)", multi=False),
        query_var("instance", "Replica", 'label_values(ckptc_build_info{job="$job"}, instance)', multi=True),
    ]
    if with_run:
        variables.append(
            # Every run that talked to Gym (a snapshot, a restore, an outbox delivery) on a replica.
            query_var("run", "Run", 'label_values(ckptc_run_gym_control_calls_total{job="$job"}, run)', multi=True)
        )
        variables.append(
            {
                "name": "window",
                "label": "Window",
                "type": "interval",
                "query": "15m,1h,6h,1d,7d",
                "current": {"selected": True, "text": "1h", "value": "1h"},
                "options": [
                    {"selected": v == "1h", "text": v, "value": v} for v in ("15m", "1h", "6h", "1d", "7d")
                ],
                "auto": False,
                "hide": 0,
                "refresh": 2,
            }
        )
    return variables


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = []
    for i, target in enumerate(panel.targets):
        t: dict[str, Any] = {
            "refId": chr(ord("A") + i),
            "datasource": DS,
            "expr": target.expr,
            "legendFormat": target.legend or "__auto",
            "range": not target.instant,
            "instant": target.instant,
        }
        if panel.kind == "table":
            t["format"] = "table"
        targets.append(t)
    body: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
    }
    if panel.kind == "timeseries":
        body["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "spanNulls": False}
        body["options"] = {
            "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.kind == "stat":
        body["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
        }
    elif panel.kind == "table":
        body["options"] = {"showHeader": True}
    body.update(panel.extra)
    return body


def _dashboard(uid: str, title: str, description: str, items: list[Panel | Row], *, with_run: bool, tags: list[str]) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    x = y = row_height = 0
    next_id = 1
    for item in items:
        if isinstance(item, Row):
            if x:
                y += row_height
            x, row_height = 0, 0
            panels.append(
                {"id": next_id, "type": "row", "title": item.title, "collapsed": False, "panels": [],
                 "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
            )
            next_id += 1
            y += 1
            continue
        if x + item.width > 24:
            x, y, row_height = 0, y + row_height, 0
        panels.append(_panel_json(item, next_id, x, y))
        next_id += 1
        x += item.width
        row_height = max(row_height, item.height)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [
            {"title": "Fleet overview" if uid != "ckptc-fleet" else "Run drill-down", "type": "link",
             "url": "/d/ckptc-run" if uid == "ckptc-fleet" else "/d/ckptc-fleet", "keepTime": True, "includeVars": True}
        ],
        "templating": {"list": _variables(with_run)},
        "panels": panels,
    }


def _rate(metric: str, extra: str = "", window: str = "$__rate_interval") -> str:
    selector = SEL + (", " + extra if extra else "")
    return f"rate({metric}{{{selector}}}[{window}])"


def _quantile(q: str, metric: str, by: str, extra: str = "", window: str = "$__rate_interval") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({_rate(metric + '_bucket', extra, window)}))" if by else (
        f"histogram_quantile({q}, sum by (le) ({_rate(metric + '_bucket', extra, window)}))"
    )


# --------------------------------------------------------------------------- fleet overview


def fleet_overview() -> dict[str, Any]:
    control_all = _rate("ckptc_gym_control_seconds_count")
    control_errors = _rate("ckptc_gym_control_seconds_count", 'outcome!~"ok|not_ready"')
    http_all = _rate("ckptc_http_request_seconds_count")
    http_5xx = _rate("ckptc_http_request_seconds_count", 'status=~"5.."')
    carried = f'increase(ckptc_rollout_seconds_total{{{SEL}, fate="carried"}}[1d])'
    carried_or_redone = f'increase(ckptc_rollout_seconds_total{{{SEL}, fate=~"carried|redone"}}[1d])'
    items: list[Panel | Row] = [
        Row("Fleet"),
        Panel("Replicas up", "Coordinator replicas Prometheus scraped successfully.",
              [Target(f'sum(up{{{SEL}}})')], kind="stat", width=4, height=4),
        Panel("Replicas ready", "Replicas in the Service: a schema their release runs on, not shutting down (a database "
              "outage leaves them in; they answer 503 themselves).",
              [Target(f"sum(ckptc_ready{{{SEL}}})")], kind="stat", width=4, height=4),
        Panel("Database reachable", "Replicas whose last check (every 5 s) reached the ledger database.",
              [Target(f"sum(ckptc_database_up{{{SEL}}})")], kind="stat", width=4, height=4),
        Panel("Runs without a driver", "Open runs owing work (a snapshot not ended, outbox items due) whose lease no replica holds.",
              [Target(f"max(ckptc_runs_without_driver{{{SEL}}})")], kind="stat", width=4, height=4),
        Panel("Runs driven", "Runs whose background work (snapshots, outbox) a replica holds the ownership lease of. "
              "Only one replica drives a run at a time.",
              [Target(f"sum(ckptc_run_leases_held{{{SEL}}})")], kind="stat", width=4, height=4),
        Panel("Snapshots in progress", "Snapshots requested and not yet terminal, over all replicas.",
              [Target(f"sum(ckptc_snapshots_in_progress{{{SEL}}})")], kind="stat", width=4, height=4),
        Panel("Runs losing to train steps", "Runs whose consecutive snapshot losses reached the configured warning threshold.",
              [Target(f"count(max by (run) (ckptc_snapshot_losses_warning{{{SEL}}}) > 0) or vector(0)")],
              kind="stat", width=4, height=4),
        Panel("Resume failures (24h)", "Snapshots whose final Gym resume failed after the cut; Gym's lease reopened them.",
              [Target(f"sum(increase(ckptc_snapshot_resume_failures_total{{{SEL}}}[1d]))")], kind="stat", width=4, height=4),
        Panel("Fenced writes (24h)", "Background writes refused because their replica had lost the run's lease to another one "
              "(it stopped driving that run's snapshot or outbox there).",
              [Target(f"sum(increase(ckptc_fenced_writes_total{{{SEL}}}[1d]))")], kind="stat", width=4, height=4),
        Panel("Stragglers given up (24h)", "Episodes that blocked max_blocking_snapshots snapshots in a row (a tool that hangs), "
              "retired on Gym and replaced by the next snapshot's gate (docs/ledger.md#stragglers).",
              [Target(f"sum(increase(ckptc_straggler_retirements_total{{{SEL}}}[1d]))")], kind="stat", width=4, height=4),
        Panel("Refused tokens (1h)", "Requests refused for their token (401, 403) and clients throttled for refusing too "
              "often (429): a trainer with a stale token, or someone probing.",
              [Target(f"sum(increase(ckptc_auth_failures_total{{{SEL}}}[1h]))")], kind="stat", width=4, height=4),
        Row("Snapshots"),
        Panel("Snapshots per outcome", "Terminal snapshots per interval, by outcome.",
              [Target(f"sum by (outcome) (increase(ckptc_snapshots_total{{{SEL}}}[$__rate_interval]))", "{{outcome}}")]),
        Panel("Failed and aborted snapshots per reason", "Why snapshots did not publish (closed enum of reasons).",
              [Target(f'sum by (outcome, reason) (increase(ckptc_snapshots_total{{{SEL}, outcome!="published"}}[$__rate_interval])) > 0',
                      "{{outcome}}: {{reason}}")]),
        Panel("Consecutive losses to train steps per run", "Snapshots of a run aborted in a row because a train step committed first.",
              [Target(f"max by (run) (ckptc_snapshot_losses_consecutive{{{SEL}}})", "{{run}}")]),
        Panel("Snapshot total duration p50 / p95 (1h)", "End-to-end snapshot duration, request to publish or abort, "
              "over the last hour (snapshots are rare, a short window would mostly be empty).",
              [Target(_quantile("0.5", "ckptc_snapshot_phase_seconds", "", 'phase="total"', "1h"), "p50"),
               Target(_quantile("0.95", "ckptc_snapshot_phase_seconds", "", 'phase="total"', "1h"), "p95")], unit="s"),
        Row("Outbox and ledger"),
        Panel("Outbox backlog", "Retire and forget items owed to Gym instances (max over replicas: every replica reads the same table).",
              [Target(f"max by (op) (ckptc_outbox_pending{{{SEL}}})", "{{op}}")]),
        Panel("Outbox oldest item age", "Age of the oldest undelivered retire or forget.",
              [Target(f"max by (op) (ckptc_outbox_oldest_age_seconds{{{SEL}}})", "{{op}}")], unit="s"),
        Panel("Ledger transitions per second", "Rows moved to each state by admit, dispatch, seal, fail and finalize.",
              [Target(f"sum by (to) ({_rate('ckptc_ledger_transitions_total')})", "{{to}}")], unit="ops", width=24),
        Row("HTTP API"),
        Panel("Requests per second by status", "All API traffic by HTTP status code.",
              [Target(f"sum by (status) ({_rate('ckptc_http_request_seconds_count')})", "{{status}}")], unit="reqps"),
        Panel("Server error ratio", "Share of requests answered 5xx.",
              [Target(f"sum({http_5xx}) / clamp_min(sum({http_all}), 1e-9)", "5xx ratio")],
              unit="percentunit"),
        Panel("Latency p99 by route", "99th percentile request duration per route template.",
              [Target(_quantile("0.99", "ckptc_http_request_seconds", "route", 'route!="unmatched"'), "{{route}}")], unit="s"),
        Panel("Latency p50 by route", "Median request duration per route template.",
              [Target(_quantile("0.5", "ckptc_http_request_seconds", "route", 'route!="unmatched"'), "{{route}}")], unit="s"),
        Panel("Versions", "Coordinator and Python version of each replica.",
              [Target(f"ckptc_build_info{{{SEL}}}", instant=True)], kind="table", width=12, height=5),
        Panel("Schema", "The state of the database schema for each replica's release: at_head, ahead (a newer "
              "release's schema it runs on), behind (its migration has not run), incompatible.",
              [Target(f"ckptc_schema_state{{{SEL}}} == 1", instant=True)], kind="table", width=12, height=5),
        Row("Snapshot phases and Gym, all runs"),
        Panel("Phase duration p95", "95th percentile duration of each snapshot phase over the last hour, all runs.",
              [Target(_quantile("0.95", "ckptc_snapshot_phase_seconds", "phase", window="1h"), "{{phase}}")], unit="s"),
        Panel("Gym parked", "How long Gym admission stayed closed per snapshot (first prepare sent until resume answered), last hour.",
              [Target(_quantile(q, "ckptc_snapshot_phase_seconds", "", 'phase="gym_parked"', "1h"), f"p{int(float(q) * 100)}")
               for q in ("0.5", "0.95", "0.99")], unit="s"),
        Panel("Episodes that would restart after a crash", "Gym restarts per published snapshot (restart-only participants), last hour.",
              [Target(_quantile("0.95", "ckptc_gym_restarted_episodes", "", window="1h"), "p95")]),
        Panel("Gym exports outside the commit scope", "Episodes Gym exported outside a commit's scope (published Gym's agents "
              "and resources export every live session): accepted and left out of the snapshot, by exporter kind.",
              [Target(f"sum by (kind) (increase(ckptc_gym_exported_outside_scope_total{{{SEL}}}[1h]))", "{{kind}}")]),
        Panel("Control call latency p95 by op and kind", "Successful control calls to one participant.",
              [Target(_quantile("0.95", "ckptc_gym_control_seconds", "op, kind", 'outcome="ok"'), "{{op}} {{kind}}")], unit="s"),
        Panel("Control error ratio by op and kind", "Share of control calls that did not end ok (not_ready is a normal prepare answer).",
              [Target(f"sum by (op, kind) ({control_errors}) / clamp_min(sum by (op, kind) ({control_all}), 1e-9)", "{{op}} {{kind}}")],
              unit="percentunit"),
        Panel("Restored siblings by disposition", "Siblings of applied restore plans, all runs, last day.",
              [Target(f"sum by (disposition) (increase(ckptc_restore_siblings_total{{{SEL}}}[1d]))", "{{disposition}}")]),
        Panel("Restore duration p95", "Plan checks to applied ledger, by outcome, last day.",
              [Target(_quantile("0.95", "ckptc_restore_duration_seconds", "outcome", window="1d"), "{{outcome}}")], unit="s"),
        # The accounting counters carry no run label (docs/accounting.md#where-it-shows), so this
        # row is fleet-wide only; one run's figures come from `ckpt-coordinator accounting`.
        Row("Work kept and lost"),
        Panel("Prompt groups by bucket", "Prompt groups entering each bucket per second, all runs: live when admitted, "
              "trained when finalized, abandoned, rewound by a restore (the trainer's data loader owes them again). Whether "
              "a run's buckets add up is per run: ckpt-coordinator accounting (docs/accounting.md#prompt-conservation).",
              [Target(f"sum by (bucket) ({_rate('ckptc_prompts_total')})", "{{bucket}}")], width=8),
        Panel("Rollout-seconds by fate", "Rollout work per second by what became of it, all runs: trained (sealed), carried "
              "(continued by a restore from Gym state, up to its cut), redone (failed, abandoned, or thrown away by a "
              "restore) (docs/accounting.md#rollout-seconds).",
              [Target(f"sum by (fate) ({_rate('ckptc_rollout_seconds_total')})", "{{fate}}")], width=8),
        Panel("Share of work carried (1d)", "carried / (carried + redone) rollout-seconds over the last day, all runs: of the "
              "work a restore or a failure put in question, the part that was not done again "
              "(docs/accounting.md#what-a-restore-kept). Empty while there is nothing of either.",
              [Target(f"sum({carried}) / (sum({carried_or_redone}) > 0)", "carried share")],
              unit="percentunit", width=8),
        Row("Effect journal"),
        Panel("Effect journal: begins by answer", "Begins of tools that act outside Gym, per second, all runs: proceed (acts), "
              "done (acted before: not again), unknown (reconciled), diverged (docs/effects.md#begin-and-complete).",
              [Target(f"sum by (answer) ({_rate('ckptc_effect_begins_total')})", "{{answer}}")], width=12),
        Panel("Effect journal: orphans (1d)", "Effects of discarded timelines over the last day, by reason: they happened and "
              "may need compensating; ckpt-coordinator effects lists them (docs/effects.md#orphans).",
              [Target(f"sum by (reason) (increase(ckptc_effect_orphans_total{{{SEL}}}[1d]))", "{{reason}}")], width=12),
    ]
    return _dashboard(
        "ckptc-fleet",
        "Checkpoint coordinator — fleet overview",
        "Runs, snapshot outcomes, outbox backlog and HTTP health of every coordinator replica.",
        items,
        with_run=False,
        tags=["checkpoint-coordinator"],
    )


# --------------------------------------------------------------------------- run drill-down


def run_drilldown() -> dict[str, Any]:
    w = "$window"
    run = f'{SEL}, run=~"$run"'  # every query of this dashboard is the selected runs'

    def calls(extra: str = "") -> str:
        return f"rate(ckptc_run_gym_control_calls_total{{{run}{', ' + extra if extra else ''}}}[$__rate_interval])"

    failed = calls('outcome!~"ok|not_ready"')
    items: list[Panel | Row] = [
        Row("Selected runs"),
        Panel("Consecutive losses to train steps", "Snapshots aborted in a row because a train step committed first; "
              "resets when a snapshot publishes.",
              [Target(f"max by (run) (ckptc_snapshot_losses_consecutive{{{run}}})", "{{run}}")], width=8),
        Panel("Loss warning", "1 while a run is at or above its configured warning threshold.",
              [Target(f"max by (run) (ckptc_snapshot_losses_warning{{{run}}})", "{{run}}")], width=8),
        Panel("Failed snapshots since the last published", "Snapshots that ended failed since the run's last published one "
              "(CkptcSnapshotsFailingRepeatedly fires at 3).",
              [Target(f"max by (run) (ckptc_snapshot_failures_consecutive{{{run}}})", "{{run}}")], width=8),
        Row("Snapshots"),
        Panel("Snapshot outcomes over the window", "Terminal snapshots by outcome and reason.",
              [Target(f"sum by (run, outcome, reason) (increase(ckptc_run_snapshots_total{{{run}}}[{w}])) > 0",
                      "{{run}} {{outcome}}: {{reason}}")], width=24),
        Panel("Last snapshot's phases", "How long each phase of the run's last ended snapshot took (a step per snapshot).",
              [Target(f'max by (run, phase) (ckptc_run_snapshot_phase_seconds{{{run}, phase!~"total|gym_parked"}})',
                      "{{run}} {{phase}}")], unit="s"),
        Panel("Last snapshot's total and Gym park", "The whole snapshot, and how long Gym admission stayed closed for it.",
              [Target(f'max by (run, phase) (ckptc_run_snapshot_phase_seconds{{{run}, phase=~"total|gym_parked"}})',
                      "{{run}} {{phase}}")], unit="s"),
        Panel("Episodes that would restart after a crash", "Gym restarts of the run's last published snapshot "
              "(restart-only participants).",
              [Target(f"max by (run) (ckptc_run_gym_restarted_episodes{{{run}}})", "{{run}}")]),
        Panel("Gym exports outside the commit scope", "Episodes Gym exported outside the run's commit scopes (accepted and "
              "left out of its snapshots).",
              [Target(f"sum by (run) (increase(ckptc_run_gym_exported_outside_scope_total{{{run}}}[{w}]))", "{{run}}")]),
        Row("Restore"),
        Panel("Restored siblings by disposition", "Siblings of the run's applied restore plans: reused, rerun, continued, "
              "restarted, gym_restarted.",
              [Target(f"sum by (run, disposition) (increase(ckptc_run_restore_siblings_total{{{run}}}[{w}]))",
                      "{{run}} {{disposition}}")]),
        Panel("Last restore's duration", "Plan checks to applied ledger, by its outcome.",
              [Target(f"max by (run, outcome) (ckptc_run_restore_seconds{{{run}}})", "{{run}} {{outcome}}")], unit="s"),
        Row("Gym control"),
        Panel("Control calls by op and outcome", "The run's control calls per second by op and outcome (ok or the failure class).",
              [Target(f"sum by (run, op, outcome) ({calls()})", "{{run}} {{op}} {{outcome}}")], unit="ops"),
        Panel("Control error ratio by op", "Share of the run's control calls that did not end ok (not_ready is a normal "
              "prepare answer).",
              [Target(f"sum by (run, op) ({failed}) / clamp_min(sum by (run, op) ({calls()}), 1e-9)", "{{run}} {{op}}")],
              unit="percentunit"),
    ]
    return _dashboard(
        "ckptc-run",
        "Checkpoint coordinator — run drill-down",
        "One run or a few, every panel filtered by the selected runs: snapshot outcomes, phases and Gym park, restores and "
        "Gym control. Fleet-wide distributions are on the fleet overview. Metric labels never carry group, rollout or "
        "snapshot ids.",
        items,
        with_run=True,
        tags=["checkpoint-coordinator"],
    )


# Values that stand in for Grafana's template variables when a query is evaluated
# outside Grafana (tests, bench/prometheus_check.py).
DEFAULT_VARIABLES: dict[str, str] = {
    "__rate_interval": "1m",
    "__interval": "30s",
    "__range": "1h",
    "window": "1h",
    "job": "ckpt-coordinator",
    "instance": ".*",
    "run": ".*",
}


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    """Replace ``$name`` and ``${name}`` by concrete values (longest names first)."""
    merged = {**DEFAULT_VARIABLES, **(values or {})}
    for name in sorted(merged, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", merged[name]).replace("$" + name, merged[name])
    return expr


def all_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target, rows included."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((panel.get("title", ""), target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


DASHBOARDS = {"fleet-overview.json": fleet_overview, "run-drilldown.json": run_drilldown}


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name](), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="directory to write into (default: beside this script)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a file differs")
    args = parser.parse_args(argv)
    stale = []
    for name in DASHBOARDS:
        path = args.out / name
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (run deploy/grafana/generate.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
