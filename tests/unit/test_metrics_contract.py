"""The metrics contract: the registry is the table, and the code records exactly the table.

Two directions are checked against the real source tree under ``service/``:

* code must not record a metric outside the table: no prometheus_client metric is
  constructed outside ``observability/metrics.py``, no name is imported or read
  from the metrics module that it does not define, and ``.labels()`` on a table
  metric uses its label names and, for constant values, its closed value sets;
* every metric of the table must be recorded somewhere (a helper of
  ``HELPER_METRICS`` or the metric object itself is used outside metrics.py).

The second direction is expected to fail while the choreographies are being
written. ``NOT_YET_RECORDED`` lists the metrics nothing records yet; their
checks are xfail(strict=False). The integrator removes names from it as code
lands and empties it at the end: from then on an unused metric fails the build.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from checkpoint_coordinator.observability import metrics as m

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "service"
METRICS_FILE = SERVICE / "checkpoint_coordinator" / "observability" / "metrics.py"

# Metrics of the table that no code outside metrics.py records yet. EMPTY THIS
# when the snapshot, restore, outbox, gym and ledger code records them.
NOT_YET_RECORDED: frozenset[str] = frozenset()

PROMETHEUS_CONSTRUCTORS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
METRICS_MODULE_NAMES = {
    "checkpoint_coordinator.observability.metrics",
    ".observability.metrics",
    "..observability.metrics",
    "...observability.metrics",
    ".metrics",  # from inside observability/
}
OBSERVABILITY_PACKAGES = {"checkpoint_coordinator.observability", ".observability", "..observability", "...observability", "."}


# --------------------------------------------------------------------------- scanner


@dataclass
class ScanResult:
    recorded: dict[str, set[str]] = field(default_factory=dict)  # metric -> files recording it
    violations: list[str] = field(default_factory=list)

    def record(self, metric: str, where: str) -> None:
        self.recorded.setdefault(metric, set()).add(where)


def _metric_for_name(name: str) -> tuple[str, ...]:
    by_attr = {spec.attr: (spec.name,) for spec in m.METRIC_SPECS}
    return by_attr.get(name) or tuple(m.HELPER_METRICS.get(name, ()))


def _is_metrics_module(module: str | None, level: int) -> bool:
    full = "." * level + (module or "")
    return full in METRICS_MODULE_NAMES or full.endswith("observability.metrics")


def _is_observability_package(module: str | None, level: int, in_observability: bool) -> bool:
    full = "." * level + (module or "")
    if full == ".":
        return in_observability
    return full in OBSERVABILITY_PACKAGES or full.endswith(".observability")


def scan_file(path: Path, rel: str, result: ScanResult) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    in_observability = path.parent.name == "observability"
    defined = set(dir(m))
    spec_by_attr = {spec.attr: spec for spec in m.METRIC_SPECS}
    module_aliases: set[str] = set()  # names bound to the metrics module itself
    prom_aliases: set[str] = set()  # names bound to prometheus_client constructors
    prom_modules: set[str] = set()  # names bound to the prometheus_client module

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if _is_metrics_module(node.module, node.level):
                for alias in node.names:
                    if alias.name == "*":
                        result.violations.append(f"{rel}:{node.lineno}: star import from the metrics module")
                    elif alias.name not in defined:
                        result.violations.append(
                            f"{rel}:{node.lineno}: imports {alias.name!r} from the metrics module, which does not "
                            "define it (metrics must be in the table; use the names in observability/metrics.py)"
                        )
                    else:
                        for metric in _metric_for_name(alias.name):
                            result.record(metric, rel)
            elif _is_observability_package(node.module, node.level, in_observability):
                for alias in node.names:
                    if alias.name == "metrics":
                        module_aliases.add(alias.asname or alias.name)
            elif (node.module or "").startswith("prometheus_client") and node.level == 0:
                for alias in node.names:
                    if alias.name in PROMETHEUS_CONSTRUCTORS:
                        prom_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "checkpoint_coordinator.observability.metrics" and alias.asname:
                    module_aliases.add(alias.asname)
                if alias.name.startswith("prometheus_client"):
                    prom_modules.add(alias.asname or alias.name.split(".")[0])

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases:
            if node.attr not in defined:
                result.violations.append(
                    f"{rel}:{node.lineno}: {node.value.id}.{node.attr} is not defined by the metrics module"
                )
            for metric in _metric_for_name(node.attr):
                result.record(metric, rel)
        if isinstance(node, ast.Call):
            func = node.func
            constructed = (isinstance(func, ast.Name) and func.id in prom_aliases) or (
                isinstance(func, ast.Attribute)
                and func.attr in PROMETHEUS_CONSTRUCTORS
                and isinstance(func.value, ast.Name)
                and func.value.id in prom_modules
            )
            if constructed:
                result.violations.append(
                    f"{rel}:{node.lineno}: constructs a prometheus_client metric outside the table "
                    "(add it to METRIC_SPECS in observability/metrics.py instead)"
                )
            # METRIC.labels(...) / metrics.METRIC.labels(...): label names and constant values.
            if isinstance(func, ast.Attribute) and func.attr == "labels":
                target = func.value
                attr = (
                    target.id
                    if isinstance(target, ast.Name)
                    else target.attr
                    if isinstance(target, ast.Attribute)
                    else None
                )
                spec = spec_by_attr.get(attr or "")
                if spec is not None:
                    for kw in node.keywords:
                        if kw.arg is None:
                            continue
                        if kw.arg not in spec.labels:
                            result.violations.append(
                                f"{rel}:{node.lineno}: {spec.name} has no label {kw.arg!r} (labels: {list(spec.labels)})"
                            )
                            continue
                        allowed = spec.labels[kw.arg]
                        if (
                            allowed is not None
                            and isinstance(kw.value, ast.Constant)
                            and isinstance(kw.value.value, str)
                            and kw.value.value not in allowed
                        ):
                            result.violations.append(
                                f"{rel}:{node.lineno}: {spec.name}{{{kw.arg}={kw.value.value!r}}} is outside its closed set"
                            )


def scan_tree(root: Path, skip: Path | None = METRICS_FILE) -> ScanResult:
    result = ScanResult()
    for path in sorted(root.rglob("*.py")):
        if skip is not None and path.resolve() == skip.resolve():
            continue
        if any(part in {"__pycache__", "build"} or part.endswith(".egg-info") for part in path.parts):
            continue
        scan_file(path, str(path.relative_to(root)), result)
    return result


@pytest.fixture(scope="module")
def service_scan() -> ScanResult:
    return scan_tree(SERVICE)


# --------------------------------------------------------------------------- (a) registry == table


def exposed_families() -> dict[str, str]:
    """Family name as the metrics table writes it (docs/ledger.md#metrics; counters with
    ``_total``) -> type."""
    out = {}
    for family in m.REGISTRY.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = family.type
    return out


def test_registry_holds_exactly_the_table() -> None:
    assert set(exposed_families()) == m.metrics_in_table()
    for spec in m.METRIC_SPECS:
        assert exposed_families()[spec.name] == spec.type.value


def test_every_recording_helper_is_indexed() -> None:
    prefixes = ("observe_", "record_", "set_", "snapshot_in_progress", "snapshot_phase_timer")
    helpers = {name for name in dir(m) if name.startswith(prefixes) and callable(getattr(m, name))}
    assert helpers == set(m.HELPER_METRICS), "add new helpers to HELPER_METRICS"
    for helper, names in m.HELPER_METRICS.items():
        assert names and set(names) <= m.metrics_in_table(), helper


def test_not_yet_recorded_names_are_table_metrics() -> None:
    assert NOT_YET_RECORDED <= m.metrics_in_table(), NOT_YET_RECORDED - m.metrics_in_table()


# --------------------------------------------------------------------------- (b) code <-> table


def test_code_records_no_metric_outside_the_table(service_scan: ScanResult) -> None:
    assert service_scan.violations == []


@pytest.mark.parametrize(
    "metric",
    [
        pytest.param(
            spec.name,
            marks=[pytest.mark.xfail(strict=False, reason="listed in NOT_YET_RECORDED")]
            if spec.name in NOT_YET_RECORDED
            else [],
        )
        for spec in m.METRIC_SPECS
    ],
)
def test_every_table_metric_is_recorded_by_code(metric: str, service_scan: ScanResult) -> None:
    assert metric in service_scan.recorded, (
        f"{metric} is in the table but nothing under service/ records it; record it through "
        f"{[h for h, ms in m.HELPER_METRICS.items() if metric in ms]} or drop it from the table"
    )


# --------------------------------------------------------------------------- the scanner itself can fail


def test_scanner_catches_each_kind_of_violation(tmp_path: Path) -> None:
    pkg = tmp_path / "checkpoint_coordinator"
    (pkg / "snapshots").mkdir(parents=True)
    (pkg / "snapshots" / "bad.py").write_text(
        "from prometheus_client import Counter as C\n"
        "import prometheus_client\n"
        "from ..observability.metrics import LEDGER_TRANSITIONS, observe_snapshot_phase\n"
        "from ..observability import metrics as mx\n"
        "ROGUE = C('ckptc_rogue_total', 'x')\n"
        "OTHER = prometheus_client.Gauge('ckptc_other', 'x')\n"
        "mx.NOT_A_METRIC.inc()\n"
        "mx.LEDGER_TRANSITIONS_TOTAL.labels(state='sealed').inc()\n"
        "mx.SNAPSHOT_PHASE_SECONDS.labels(phase='parking').observe(1)\n"
        "def f():\n"
        "    observe_snapshot_phase('gate', 1.0)\n"
    )
    (pkg / "restore").mkdir()
    (pkg / "restore" / "good.py").write_text(
        "from checkpoint_coordinator.observability import metrics\n"
        "metrics.record_restore_plan({'reused': 1})\n"
        "metrics.OUTBOX_PENDING.labels(op='retire').set(1)\n"
    )
    result = scan_tree(tmp_path, skip=None)
    text = "\n".join(result.violations)
    assert "imports 'LEDGER_TRANSITIONS'" in text
    assert text.count("constructs a prometheus_client metric") == 2
    assert "mx.NOT_A_METRIC is not defined" in text
    assert "has no label 'state'" in text
    assert "{phase='parking'} is outside its closed set" in text
    assert len(result.violations) == 6, text
    assert set(result.recorded) == {
        "ckptc_snapshot_phase_seconds",
        "ckptc_run_snapshot_phase_seconds",  # a helper that takes a run_id writes both
        "ckptc_ledger_transitions_total",
        "ckptc_restore_siblings_total",
        "ckptc_run_restore_siblings_total",
        "ckptc_outbox_pending",
    }


def test_scanner_sees_the_http_middleware(service_scan: ScanResult) -> None:
    # observability/http.py records the HTTP histogram, readiness and build info.
    for metric in ("ckptc_http_request_seconds", "ckptc_ready", "ckptc_build_info"):
        assert any("http.py" in f for f in service_scan.recorded.get(metric, ())), metric


# --------------------------------------------------------------------------- label sets agree with the domain


def _optional(module: str, attr: str):  # type: ignore[no-untyped-def]
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        pytest.skip(f"{module}.{attr} is not there yet")


def test_snapshot_reasons_match_the_domain_enum() -> None:
    domain_reasons = _optional("checkpoint_coordinator.domain.snapshot_state", "SnapshotReason")
    assert {r.value for r in domain_reasons} == {r.value for r in m.SnapshotReason}


def test_reason_outcome_pairs_match_the_domain() -> None:
    pairs = _optional("checkpoint_coordinator.domain.snapshot_state", "REASON_OUTCOME")
    assert {str(k.value): str(v.value) for k, v in pairs.items()} == {str(k): str(v) for k, v in m.REASON_OUTCOME.items()}


def test_metric_phases_match_the_domain() -> None:
    phases = _optional("checkpoint_coordinator.domain.snapshot_state", "METRIC_PHASES")
    assert set(phases) == {p.value for p in m.SnapshotTiming}


def test_gym_failure_classes_are_call_outcomes() -> None:
    classes = _optional("checkpoint_coordinator.gym.errors", "FailureClass")
    assert {c.value for c in classes} | {"ok"} == {o.value for o in m.GymCallOutcome}


def test_ledger_states_cover_the_domain_statuses() -> None:
    attempt = _optional("checkpoint_coordinator.domain.snapshot_state", "AttemptStatus")
    group = _optional("checkpoint_coordinator.domain.snapshot_state", "GroupStatus")
    retirement = _optional("checkpoint_coordinator.domain.snapshot_state", "RetirementState")
    wanted = {a.value for a in attempt} | {r.value for r in retirement if r.value != "none"}
    wanted |= {("group_" + g.value) if g.value == "abandoned" else g.value for g in group}
    assert wanted <= {s.value for s in m.LedgerState}, wanted - {s.value for s in m.LedgerState}
