#!/usr/bin/env python3
"""Check the dashboards and alerts against a real Prometheus scraping a coordinator.

    python bench/prometheus_check.py                          # coordinator on 127.0.0.1:8080
    python bench/prometheus_check.py --url http://127.0.0.1:9000
    python bench/prometheus_check.py --stand-in               # no coordinator: serve REGISTRY itself

It starts a throw-away Prometheus (Debian's `prometheus` package: `apt-get install
prometheus`) on a free loopback port with a temporary config that scrapes the
coordinator's /metrics every second and loads deploy/prometheus/alerts.yml, waits
for a few scrapes, then evaluates through the HTTP API (/api/v1/query):

* every Grafana dashboard query and template-variable query, with the template
  variables substituted (deploy/grafana/generate.py: DEFAULT_VARIABLES),
* every alert expression,

prints each with its result size, checks that every loaded rule evaluated with
health "ok", and runs `promtool check rules` on the alert file. It exits 1 on any
error, and 0 with a SKIP message when prometheus is not installed (2 with
--require). `--stand-in` exposes the coordinator's metrics REGISTRY on loopback and
keeps recording sample values into it, to check the queries before a real
coordinator exists; the report says when it was used. A coordinator's /metrics is read with
`CKPTC_METRICS_TOKEN` (or `CKPTC_ADMIN_TOKEN`) from the environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
GRAFANA = ROOT / "deploy" / "grafana"
JOB = "ckpt-coordinator"


def log(message: str) -> None:
    print(message, flush=True)


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("ckptc_grafana_generate", GRAFANA / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 10.0, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# --------------------------------------------------------------------------- stand-in coordinator


class StandIn:
    """Serves the coordinator's REGISTRY on loopback and keeps recording into it."""

    def __init__(self) -> None:
        from prometheus_client import start_http_server

        from checkpoint_coordinator.observability import metrics as m

        self.m = m
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=m.REGISTRY)
        self.stop_event = threading.Event()
        self.rng = random.Random(7)
        self.recorder = threading.Thread(target=self._record_loop, daemon=True)
        self.record_once()
        self.recorder.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record_once(self) -> None:
        m, rng = self.m, self.rng
        m.set_build_info()
        m.set_ready(True)
        m.set_run_leases_held(2)
        m.set_snapshots_in_progress(rng.randint(0, 2))
        for phase in m.SnapshotTiming:
            m.observe_snapshot_phase(phase, rng.uniform(0.01, 200.0))
        m.record_snapshot_outcome("published", "ok")
        m.record_snapshot_outcome("failed", rng.choice(["gym_not_ready", "drain_timeout", "gym_unavailable"]))
        m.record_snapshot_outcome("aborted", "train_step_committed")
        m.set_snapshot_losses("run-demo-a", rng.randint(0, 3), warn_threshold=3)
        m.set_snapshot_losses("run-demo-b", 0, warn_threshold=3)
        m.observe_gym_restarted_episodes(rng.randint(0, 20))
        m.record_restore_plan({d: rng.randint(0, 50) for d in m.RestoreDisposition})
        m.observe_restore_duration(rng.uniform(1, 60), "succeeded")
        for op in ("prepare", "commit", "resume", "renew"):
            for kind in ("model", "agent", "resources"):
                m.observe_gym_control(op, kind, "ok", rng.uniform(0.005, 3.0))
        m.observe_gym_control("prepare", "agent", "not_ready", 30.0)
        m.observe_gym_control("retire", "agent", "unavailable", 5.0)
        m.set_outbox_backlog("retire", rng.randint(0, 40), rng.uniform(0, 30))
        m.set_outbox_backlog("forget", rng.randint(0, 5), rng.uniform(0, 10))
        for state, n in (("reserved", 64), ("dispatched", 64), ("sealed", 60), ("failed", 4), ("retire_pending", 4)):
            m.record_ledger_transition(state, n)
        if rng.random() < 0.1:
            m.record_snapshot_resume_failure()
        for route, status in (("/v1/runs/{run_id}", 200), ("/v1/runs/{run_id}/rollouts/seal", 200),
                              ("/v1/runs/{run_id}/snapshots", 409), ("/readyz", 200), ("unmatched", 404)):
            m.observe_http_request(route, "POST" if "seal" in route else "GET", status, rng.uniform(0.001, 0.2))
        if rng.random() < 0.2:
            m.observe_http_request("/v1/runs/{run_id}", "GET", 500, 0.01)

    def _record_loop(self) -> None:
        while not self.stop_event.wait(0.5):
            self.record_once()

    def close(self) -> None:
        self.stop_event.set()
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- prometheus


class Prometheus:
    def __init__(self, binary: str, target_url: str, workdir: Path, token: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(target_url)
        if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit(f"refusing to scrape {parsed.hostname}: this check runs on loopback only")
        base_path = parsed.path.rstrip("/")
        shutil.copy(ALERTS, workdir / "alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "metrics_path": f"{base_path}/metrics",
                    "scheme": parsed.scheme or "http",
                    "static_configs": [{"targets": [parsed.netloc]}],
                    # /metrics is read with the metrics (or admin) token: its labels name the runs.
                    **({"authorization": {"type": "Bearer", "credentials": token}} if token else {}),
                }
            ],
        }
        # JSON is YAML: no YAML library needed.
        (workdir / "prometheus.yml").write_text(json.dumps(config, indent=2))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                status, _ = http_get(f"{self.base}/-/ready", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log_path.read_text()}")

    def query(self, expr: str) -> dict[str, Any]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        status, body = http_get(url)
        try:
            payload = json.loads(body)
        except ValueError:
            return {"status": "error", "error": f"HTTP {status}: {body[:200]!r}"}
        return payload

    def api(self, path: str) -> dict[str, Any]:
        status, body = http_get(f"{self.base}{path}")
        return json.loads(body)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()


def wait_for_scrapes(prom: Prometheus, scrapes: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    seen = 0.0
    while time.monotonic() < deadline:
        result = prom.query(f'count_over_time(up{{job="{JOB}"}}[10m])')
        values = result.get("data", {}).get("result", [])
        seen = float(values[0]["value"][1]) if values else 0.0
        if seen >= scrapes:
            up = prom.query(f'up{{job="{JOB}"}}')["data"]["result"]
            if up and up[0]["value"][1] == "1":
                return
            targets = prom.api("/api/v1/targets")["data"]["activeTargets"]
            errors = "; ".join(t.get("lastError", "") for t in targets)
            raise RuntimeError(f"the coordinator target is down: {errors}")
        time.sleep(0.5)
    raise RuntimeError(f"only {seen:.0f} scrapes of {scrapes} after {timeout}s")


def wait_for_rule_evaluation(prom: Prometheus, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    rules: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        groups = prom.api("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("0001") is False for r in rules):
            return rules
        time.sleep(0.5)
    return rules


def label_values_query(definition: str, generate: Any) -> tuple[str, str] | None:
    """label_values(selector, label) -> (selector, label) with variables substituted."""
    inner = definition.strip()
    if not (inner.startswith("label_values(") and inner.endswith(")")):
        return None
    selector, _, label = inner[len("label_values(") : -1].rpartition(",")
    return generate.substitute(selector.strip()), label.strip()


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    binary = args.prometheus or shutil.which("prometheus")
    if not binary or not Path(binary).exists():
        message = (
            "prometheus_check: SKIP: the prometheus binary is not installed "
            "(apt-get install prometheus, or pass --prometheus PATH); nothing was checked."
        )
        log(message)
        return 2 if args.require else 0
    promtool = args.promtool or shutil.which("promtool")

    generate = load_generator()
    stand_in = StandIn() if args.stand_in else None
    # A coordinator's /metrics wants its metrics token (or the admin token); the stand-in none.
    token = None if stand_in else (os.environ.get("CKPTC_METRICS_TOKEN") or os.environ.get("CKPTC_ADMIN_TOKEN") or None)
    target = stand_in.url if stand_in else args.url.rstrip("/")
    failures: list[str] = []
    checked = 0
    workdir = Path(tempfile.mkdtemp(prefix="ckptc-promcheck-"))
    prom: Prometheus | None = None
    try:
        log(f"target: {target}/metrics" + ("  (stand-in serving the coordinator's REGISTRY)" if stand_in else ""))
        host = urllib.parse.urlsplit(target).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            log(f"FAIL: {target} is not a loopback address; this check only scrapes this machine")
            return 1
        try:
            status, body = http_get(f"{target}/metrics", token=token)
        except OSError as e:
            log(f"FAIL: cannot reach {target}/metrics ({e}); start the coordinator "
                "(ckpt-coordinator serve) or pass --stand-in")
            return 1
        if status != 200:
            log(f"FAIL: {target}/metrics answered HTTP {status}")
            return 1
        from checkpoint_coordinator.observability import metrics as m

        exposed = body.decode(errors="replace")
        # Counters appear as "# TYPE x_total counter" in the text format, as "x" in OpenMetrics.
        missing = sorted(
            n for n in m.metrics_in_table()
            if f"# TYPE {n} " not in exposed and f"# TYPE {n.removesuffix('_total')} " not in exposed
        )
        if missing:
            failures.append(f"/metrics lacks table metrics: {', '.join(missing)}")
            log(f"FAIL: /metrics lacks table metrics: {', '.join(missing)}")

        prom = Prometheus(binary, target, workdir, token)
        prom.wait_ready(args.timeout)
        log(f"prometheus: {prom.base} (pid {prom.process.pid}), waiting for {args.scrapes} scrapes")
        wait_for_scrapes(prom, args.scrapes, args.timeout)

        queries: list[tuple[str, str]] = []
        variable_queries: list[tuple[str, str]] = []
        for name in sorted(generate.DASHBOARDS):
            dashboard = json.loads((GRAFANA / name).read_text())
            queries += [
                (f"{name} / {title} [{i}]", generate.substitute(expr))
                for i, (title, expr) in enumerate(generate.all_queries(dashboard))
            ]
            for var in dashboard["templating"]["list"]:
                if var.get("type") == "query":
                    variable_queries.append((f"{name} / ${var['name']}", var["definition"]))
        import yaml  # the test extras provide it; the alert file is YAML with block strings

        alert_doc = yaml.safe_load(ALERTS.read_text())
        queries += [(f"alert {r['alert']}", r["expr"]) for g in alert_doc["groups"] for r in g["rules"]]

        for label, expr in queries:
            checked += 1
            result = prom.query(expr)
            if result.get("status") != "success":
                failures.append(f"{label}: {result.get('error')}")
                log(f"ERR   {label}\n      {expr}\n      {result.get('errorType')}: {result.get('error')}")
                continue
            series = result["data"]["result"]
            size = len(series) if isinstance(series, list) else 1
            log(f"ok    {size:3d} series  {label}")

        for label, definition in variable_queries:
            checked += 1
            parsed = label_values_query(definition, generate)
            if parsed is None:
                failures.append(f"{label}: not a label_values() query: {definition}")
                continue
            selector, label_name = parsed
            path = f"/api/v1/label/{label_name}/values?" + urllib.parse.urlencode({"match[]": selector})
            payload = prom.api(path)
            if payload.get("status") != "success":
                failures.append(f"{label}: {payload.get('error')}")
                log(f"ERR   {label}: {payload.get('error')}")
            else:
                log(f"ok    {len(payload['data']):3d} values  {label}: {payload['data'][:5]}")

        rules = wait_for_rule_evaluation(prom, args.timeout)
        for rule in rules:
            checked += 1
            if rule.get("health") != "ok":
                failures.append(f"rule {rule.get('name')}: health {rule.get('health')}: {rule.get('lastError')}")
                log(f"ERR   rule {rule.get('name')}: {rule.get('health')} {rule.get('lastError')}")
        log(f"ok    {len(rules)} alert rules loaded and evaluated by prometheus, states: "
            + ", ".join(sorted({f"{r['name']}={r.get('state')}" for r in rules})))

        if promtool:
            checked += 1
            result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
            output = (result.stdout + result.stderr).strip().replace("\n", " | ")
            if result.returncode != 0:
                failures.append(f"promtool check rules: {output}")
                log(f"ERR   promtool check rules: {output}")
            else:
                log(f"ok    promtool check rules: {output}")
        else:
            log("skip  promtool not found: rules were still loaded and evaluated by prometheus")
    except RuntimeError as e:
        failures.append(str(e))
        log(f"FAIL: {e}")
    finally:
        if prom is not None:
            prom.close()
        if stand_in is not None:
            stand_in.close()
        shutil.rmtree(workdir, ignore_errors=True)

    log(f"{checked - len(failures)} passed, {len(failures)} failed")
    for failure in failures:
        log(f"  - {failure}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="coordinator base URL (loopback only)")
    parser.add_argument("--prometheus", help="prometheus binary (default: on PATH)")
    parser.add_argument("--promtool", help="promtool binary (default: on PATH)")
    parser.add_argument("--stand-in", action="store_true", help="serve the metrics REGISTRY here instead of a coordinator")
    parser.add_argument("--scrapes", type=int, default=5, help="scrapes to wait for before querying (default 5)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each stage (default 60)")
    parser.add_argument("--require", action="store_true", help="exit 2 instead of 0 when prometheus is missing")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
