"""Every conformance check runs against gymsim under both Gym profiles (spec section 13).

The profile reaches the checks through `gymsim.testing.DEFAULT_GYM_PROFILE`, which
`default_instance_config` reads on every call, so each check's instances follow the test's id
(`...[published]` or `...[strict]`) unless the check pins a profile itself. A check whose rule reads
differently under the published profile asks for the `gym_profile` fixture and branches on it.
"""

from __future__ import annotations

import pytest

import gymsim.testing

GYM_PROFILES = ["published", "strict"]


@pytest.fixture(autouse=True, params=GYM_PROFILES)
def gym_profile(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(gymsim.testing, "DEFAULT_GYM_PROFILE", request.param)
    return request.param
