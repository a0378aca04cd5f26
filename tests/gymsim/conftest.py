"""Fixtures of the gymsim tests: in-process instances driven through the conformance harness."""

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
