"""Fixtures of the participant (P) conformance checks: gymsim instances over real HTTP."""

from __future__ import annotations

import pytest

from gymsim.conformance import HarnessPool, InstanceCache, checkpoint_dirs


@pytest.fixture(scope="session")
def instance_cache():
    cache = InstanceCache()
    yield cache
    cache.close()


@pytest.fixture
async def start(instance_cache):
    """Factory: `await start(**config_overrides)` or `await start(config=dict)` gives a Harness.

    Instances are reused across tests (reset between them), so a test never sees another's state."""
    pool = HarnessPool(instance_cache)
    yield pool.start
    await pool.close()


@pytest.fixture
def ckdir(tmp_path):
    return checkpoint_dirs(tmp_path)
