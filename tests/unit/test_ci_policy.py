"""tests/ci_policy.py: under CKPTC_CI a skip for a missing tool fails the run; other skips and
runs without CKPTC_CI are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TESTS = '''
import pytest

def test_needs_a_tool():
    pytest.skip("frobnicator is not installed")

@pytest.mark.skipif(True, reason="promtool is not installed")
def test_marked_for_a_tool():
    pass

def test_skipped_for_another_reason():
    pytest.skip("only on Tuesdays")
'''


def _pytest(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text("from tests.ci_policy import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_tools.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CKPTC_CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci:
        env["CKPTC_CI"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_missing_tool_skips_fail_in_ci(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout
    # A skip in the call fails the test; a skipif mark acts in setup, so it becomes an error.
    assert "1 failed, 1 skipped, 1 error" in proc.stdout
    assert "FAILED test_tools.py::test_needs_a_tool" in proc.stdout
    assert "ERROR test_tools.py::test_marked_for_a_tool" in proc.stdout
    assert "SKIPPED [1] test_tools.py:12: only on Tuesdays" in proc.stdout
    assert "frobnicator is not installed" in proc.stdout and "CKPTC_CI is set" in proc.stdout


def test_outside_ci_they_stay_skips(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "3 skipped" in proc.stdout
