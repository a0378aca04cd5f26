"""Helpers for the deploy tests: a light PromQL reader and paths.

The reader is not a PromQL parser; it extracts what the tests need to check
against the metrics registry: the metric names an expression reads, and the
label matchers written on each metric selector. Real syntax is checked by
promtool when it is installed.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from checkpoint_coordinator.observability import metrics as m

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Series Prometheus itself produces for every target.
BUILTIN_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Labels Prometheus attaches to every scraped series (target labels).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}

_FUNCTIONS = {
    # aggregations
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # functions used in dashboards and alerts (anything followed by "(" counts as a function too)
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "count_over_time", "delta", "deriv", "exp", "floor", "histogram_quantile", "idelta", "increase", "irate",
    "label_replace", "label_join", "last_over_time", "ln", "log2", "log10", "max_over_time", "min_over_time",
    "predict_linear", "quantile_over_time", "rate", "resets", "round", "scalar", "sort", "sort_desc", "sqrt",
    "stddev_over_time", "sum_over_time", "time", "timestamp", "vector", "label_values",
}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
             "unless", "atan2", "inf", "nan", "Inf", "NaN"}

_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGE_RE = re.compile(r"\[[^\]]*\]")
_OFFSET_RE = re.compile(r"\boffset\s+-?[0-9a-zA-Z$_]+")
_NUMBER_RE = re.compile(r"(?<![A-Za-z0-9_:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)")
_IDENT_RE = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_SELECTOR_RE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")')


def metric_names(expr: str) -> set[str]:
    """The metric (series) names an expression reads."""
    text = _STRING_RE.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = _GROUPING_RE.sub(" ", text)
    text = _RANGE_RE.sub(" ", text)
    text = _OFFSET_RE.sub(" ", text)
    text = _NUMBER_RE.sub(" ", text)
    names = set()
    for match in _IDENT_RE.finditer(text):
        word = match.group(0)
        rest = text[match.end():].lstrip()
        if word in _KEYWORDS or word in _FUNCTIONS or rest.startswith("("):
            continue
        names.add(word)
    return names


@dataclass(frozen=True)
class Matcher:
    metric: str
    label: str
    op: str
    value: str


def selector_matchers(expr: str) -> list[Matcher]:
    """Label matchers written inside ``metric{...}``."""
    out = []
    for sel in _SELECTOR_RE.finditer(expr):
        for mt in _MATCHER_RE.finditer(sel.group(2)):
            out.append(Matcher(sel.group(1), mt.group(1), mt.group(2), mt.group(3)[1:-1]))
    return out


def series_index() -> dict[str, tuple[m.MetricSpec, str]]:
    """Every series name the registry can expose -> (spec, suffix)."""
    index: dict[str, tuple[m.MetricSpec, str]] = {}
    for spec in m.METRIC_SPECS:
        if spec.type is m.MetricType.HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count", "_created"):
                index[spec.name + suffix] = (spec, suffix)
        elif spec.type is m.MetricType.COUNTER:
            family = spec.name.removesuffix("_total")
            index[spec.name] = (spec, "_total")
            index[family + "_created"] = (spec, "_created")
        else:
            index[spec.name] = (spec, "")
    return index


def check_expr(expr: str) -> list[str]:
    """Problems of one expression against the registry (empty when it is fine)."""
    problems = []
    index = series_index()
    names = metric_names(expr)
    if not names:
        problems.append(f"reads no metric: {expr}")
    for name in sorted(names - BUILTIN_SERIES):
        if name not in index:
            problems.append(f"{name} is not a series of the registry (expr: {expr})")
    for matcher in selector_matchers(expr):
        if matcher.metric in BUILTIN_SERIES or matcher.metric not in index:
            continue
        spec, suffix = index[matcher.metric]
        allowed = set(spec.labels) | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
        if matcher.label not in allowed:
            problems.append(f"{matcher.metric} has no label {matcher.label!r} (expr: {expr})")
            continue
        values = spec.labels.get(matcher.label)
        if values is not None and matcher.op in ("=", "!=") and "$" not in matcher.value and matcher.value not in values:
            problems.append(f"{matcher.metric}{{{matcher.label}{matcher.op}{matcher.value!r}}} is outside its closed set")
    for call in re.finditer(r"histogram_quantile\(", expr):
        argument = _balanced(expr, call.end() - 1)
        if not re.match(r"\s*[0-9.]+\s*,\s*sum by \(le\b", argument) or not any(
            n.endswith("_bucket") for n in metric_names(argument)
        ):
            problems.append(f"histogram_quantile must aggregate _bucket series by le: {expr}")
    return problems


def _balanced(text: str, open_index: int) -> str:
    """The text inside the parenthesis that opens at ``open_index``."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
    raise ValueError(f"unbalanced parentheses in {text!r}")


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def which(binary: str) -> str | None:
    return shutil.which(binary)
