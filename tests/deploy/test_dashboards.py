"""Grafana dashboards: generated from code, every query reads registry metrics."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from _deploy_helpers import DEPLOY, check_expr, load_module, metric_names, series_index, which

from checkpoint_coordinator.observability import metrics as m

GRAFANA = DEPLOY / "grafana"
generate = load_module(GRAFANA / "generate.py", "ckptc_grafana_generate")


def dashboards() -> dict[str, dict]:
    return {name: json.loads((GRAFANA / name).read_text()) for name in generate.DASHBOARDS}


def test_committed_json_matches_the_generator(tmp_path: Path) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    for name in generate.DASHBOARDS:
        assert (GRAFANA / name).read_text() == (tmp_path / name).read_text(), (
            f"{name} is stale: run python deploy/grafana/generate.py"
        )
    assert generate.main(["--check"]) == 0


def test_check_mode_detects_a_stale_file(tmp_path: Path) -> None:
    generate.main(["--out", str(tmp_path)])
    (tmp_path / "run-drilldown.json").write_text("{}")
    assert generate.main(["--out", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize("name", list(generate.DASHBOARDS))
def test_every_query_reads_registry_metrics(name: str) -> None:
    queries = generate.all_queries(dashboards()[name])
    assert len(queries) >= 8
    problems = [p for _, expr in queries for p in check_expr(expr)]
    assert problems == []


def test_fleet_and_drilldown_cover_what_operators_asked_for() -> None:
    fleet = " ".join(e for _, e in generate.all_queries(dashboards()["fleet-overview.json"]))
    drill = " ".join(e for _, e in generate.all_queries(dashboards()["run-drilldown.json"]))
    for needle in ("ckptc_run_leases_held", "ckptc_snapshots_total", "sum by (outcome, reason)",
                   "ckptc_snapshots_in_progress", "ckptc_snapshot_losses_consecutive", "ckptc_outbox_pending",
                   "ckptc_outbox_oldest_age_seconds", 'status=~"5.."', "ckptc_http_request_seconds_bucket",
                   'phase="gym_parked"', "sum by (le, phase)", "ckptc_restore_siblings_total", "ckptc_database_up",
                   "ckptc_schema_state", "ckptc_runs_without_driver", "sum by (le, op, kind) (rate(ckptc_gym_control_seconds_bucket"):
        assert needle in fleet, needle
    for needle in ("ckptc_snapshot_failures_consecutive", "ckptc_run_snapshots_total", "ckptc_run_snapshot_phase_seconds",
                   'phase=~"total|gym_parked"', "ckptc_run_restore_siblings_total", "ckptc_run_gym_control_calls_total"):
        assert needle in drill, needle


def test_work_kept_and_lost_row_shows_buckets_fates_and_the_carried_share() -> None:
    """docs/accounting.md#where-it-shows: prompts by bucket, rollout-seconds by fate, and the share
    carried, on the fleet overview (the counters carry no run label, so not on the drill-down)."""
    panels = dashboards()["fleet-overview.json"]["panels"]
    [start] = [k for k, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Work kept and lost"]
    row = list(itertools.takewhile(lambda p: p["type"] != "row", panels[start + 1:]))
    exprs = {p["title"]: p["targets"][0]["expr"] for p in row}
    assert len(row) == 3, list(exprs)
    assert any("sum by (bucket)" in e and "rate(ckptc_prompts_total{" in e for e in exprs.values()), exprs
    assert any("sum by (fate)" in e and "rate(ckptc_rollout_seconds_total{" in e for e in exprs.values()), exprs
    [share] = [p for p in row if p["fieldConfig"]["defaults"]["unit"] == "percentunit"]
    numerator, denominator = share["targets"][0]["expr"].split(" / ")
    assert 'fate="carried"' in numerator and 'fate=~"carried|redone"' in denominator and denominator.endswith("> 0)")
    drill = " ".join(e for _, e in generate.all_queries(dashboards()["run-drilldown.json"]))
    assert "ckptc_prompts_total" not in drill and "ckptc_rollout_seconds_total" not in drill


def test_the_drilldown_filters_by_run_throughout() -> None:
    queries = generate.all_queries(dashboards()["run-drilldown.json"])
    assert len(queries) >= 12
    for title, expr in queries:
        selectors = re.findall(r"(ckptc_\w+)\{([^}]*)\}", expr)
        assert selectors and len(selectors) == len(re.findall(r"ckptc_\w+", expr)), title
        assert all('run=~"$run"' in labels for _, labels in selectors), title


def test_every_metric_of_the_table_is_on_a_dashboard() -> None:
    index = series_index()
    shown = {index[n][0].name for d in dashboards().values() for _, e in generate.all_queries(d)
             for n in metric_names(e) if n in index}
    assert m.metrics_in_table() - shown == set()


@pytest.mark.parametrize("name", list(generate.DASHBOARDS))
def test_datasource_is_a_template_variable(name: str) -> None:
    dash = dashboards()[name]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}"
            assert not check_expr(var["definition"].removeprefix("label_values(").rsplit(",", 1)[0])


@pytest.mark.parametrize("name", list(generate.DASHBOARDS))
def test_variables_used_are_defined(name: str) -> None:
    dash = dashboards()[name]
    defined = {v["name"] for v in dash["templating"]["list"]}
    for title, expr in generate.all_queries(dash):
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert {u for u in used if not u.startswith("__")} <= defined, title
        assert "$" not in generate.substitute(expr), title


@pytest.mark.parametrize("name", list(generate.DASHBOARDS))
def test_layout_is_valid(name: str) -> None:
    dash = dashboards()[name]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["description"], panel["title"]


def test_reader_rejects_unknown_and_misused_metrics() -> None:
    assert check_expr("rate(ckptc_snapshots_total[5m])") == []
    assert check_expr('sum by (le) (rate(ckptc_snapshot_phase_seconds_bucket{phase="gym_parked"}[5m]))') == []
    assert any("not a series" in p for p in check_expr("rate(ckptc_snapshots_totall[5m])"))
    # _bucket only exists for histograms, _total only for counters.
    assert any("not a series" in p for p in check_expr("rate(ckptc_snapshots_bucket[5m])"))
    assert any("not a series" in p for p in check_expr("ckptc_outbox_pending_total"))
    assert any("no label 'phase'" in p for p in check_expr('ckptc_snapshots_total{phase="gate"}'))
    assert any("closed set" in p for p in check_expr('ckptc_snapshot_phase_seconds_count{phase="parked"}'))
    assert any("by le" in p for p in check_expr("histogram_quantile(0.9, rate(ckptc_http_request_seconds_sum[5m]))"))
    assert metric_names('sum by (le, op) (rate(x_bucket{a="b"}[5m] offset 1h)) / 1e-9 > bool 0 or vector(1)') == {"x_bucket"}


def test_queries_parse_with_promtool(tmp_path: Path) -> None:
    promtool = which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    rules = []
    for name, dash in dashboards().items():
        for i, (_, expr) in enumerate(generate.all_queries(dash)):
            rules.append({"record": f"dashboard:{name.split('.')[0].replace('-', '_')}:q{i}", "expr": generate.substitute(expr)})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
