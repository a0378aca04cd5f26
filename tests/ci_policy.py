"""In CI (``CKPTC_CI`` set, as ``.ci/run`` does) a test skipped because a tool is not installed is
a failure: CI installs every tool the suite uses, so such a skip means a test silently stopped
running. On a developer's machine the skip stays a skip."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

MISSING_TOOL = "not installed"


def in_ci() -> bool:
    return bool(os.environ.get("CKPTC_CI"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if MISSING_TOOL in reason:
        report.outcome = "failed"
        report.longrepr = f"CKPTC_CI is set, and CI installs every tool the tests use; skipped: {reason}"
