"""bench/prometheus_check.py: a clean skip without Prometheus, a full run with it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _deploy_helpers import ROOT, which

SCRIPT = ROOT / "bench" / "prometheus_check.py"


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_missing_prometheus_is_a_clear_skip() -> None:
    result = run("--prometheus", "/nonexistent/prometheus")
    assert result.returncode == 0
    assert "SKIP" in result.stdout and "apt-get install prometheus" in result.stdout
    assert run("--prometheus", "/nonexistent/prometheus", "--require").returncode == 2


def test_only_loopback_targets() -> None:
    if which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    result = run("--url", "http://192.0.2.1:8080")
    assert result.returncode == 1 and "not a loopback address" in result.stdout


def test_unreachable_coordinator_fails_with_a_hint() -> None:
    if which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    result = run("--url", "http://127.0.0.1:9")
    assert result.returncode == 1 and "--stand-in" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_dashboard_query_and_alert_evaluates_in_real_prometheus() -> None:
    if which("prometheus") is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    result = run("--stand-in", timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ", 0 failed" in result.stdout
    assert "ERR" not in result.stdout
    assert "alert rules loaded and evaluated by prometheus" in result.stdout
