"""Fixtures of the participant (P) conformance checks: gymsim instances over real HTTP."""

from __future__ import annotations

import pytest

from gymsim.conformance import HarnessPool, checkpoint_dirs


@pytest.fixture
async def start():
    """Factory: `await start(**config_overrides)` or `await start(config=dict)` gives a Harness."""
    pool = HarnessPool()
    yield pool.start
    await pool.close()


@pytest.fixture
def ckdir(tmp_path):
    return checkpoint_dirs(tmp_path)
