"""Fixtures of the conformance checks, and every check run against gymsim under both Gym profiles
(docs/gym-protocol.md#gym-variants; the checks: docs/gym-protocol.md#conformance).

The profile reaches the checks through `gymsim.testing.DEFAULT_GYM_PROFILE`, which
`default_instance_config` reads on every call, so each check's instances follow the test's id
(`...[published]` or `...[strict]`, and `...[pinned]` for the checks marked `pinned_too`) unless
the check pins a profile itself. A check whose rule reads
differently under the published profile asks for the `gym_profile` fixture and branches on it.

A test module that uses `client` declares the client's timeouts as `CLIENT_TIMEOUTS`; `rows` sends
`ROW_TURNS` turns per row unless the module says otherwise (default 100: rows outlast the test).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import gymsim.testing
from checkpoint_coordinator.gym import GymControlClient
from gymsim.testing import GymsimInstance, default_instance_config

from .helpers import Rows, StartGym
from .recording import RecordingTransport

GYM_PROFILES = ["published", "strict"]
# Checks marked ``pinned_too`` (items 18, 45 and 46, which read differently for agents that name
# their /run sessions among every export: P8, docs/gym-protocol.md#what-differs-rule-by-rule) run
# under `pinned` as well.
PINNED = "pinned"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pinned_too: also run the check against gymsim's `pinned` profile")


_ABSENT = object()


def pytest_assertrepr_compare(op: str, left: Any, right: Any) -> list[str] | None:
    """Two dicts compared with ``==`` (a participant's state before and after a refused call,
    among others): name every member that differs, however deep, so a rare failure says what
    moved (pytest's own diff elides it). Anything else, or a comparison this cannot walk, keeps
    pytest's explanation."""
    if op != "==" or not (isinstance(left, dict) and isinstance(right, dict)):
        return None
    lines: list[str] = []

    def walk(a: Any, b: Any, at: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(a.keys() | b.keys(), key=str):
                walk(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{at}.{k}" if at else str(k))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{at}[{i}]")
        elif a is _ABSENT or b is _ABSENT or a != b:
            lines.append(f"  {at}: {'<absent>' if a is _ABSENT else repr(a)} != {'<absent>' if b is _ABSENT else repr(b)}")

    try:
        walk(left, right, "")
    except Exception:  # noqa: BLE001 - a value whose comparison raises: pytest explains it
        return None
    return ["the dicts differ at:", *lines] if lines else None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gym_profile" in metafunc.fixturenames:
        profiles = GYM_PROFILES + ([PINNED] if metafunc.definition.get_closest_marker("pinned_too") else [])
        metafunc.parametrize("gym_profile", profiles, indirect=True)


@pytest.fixture(autouse=True)
def gym_profile(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(gymsim.testing, "DEFAULT_GYM_PROFILE", request.param)
    return request.param


@pytest.fixture
def start_gym() -> Iterator[StartGym]:
    """Start in-process gymsim instances; every one is killed when the test ends."""
    started: list[GymsimInstance] = []

    def start(config: dict[str, Any] | None = None, **kwargs: Any) -> GymsimInstance:
        # Long turns: an episode is almost always working (not mid model call) when prepare
        # starts, so readiness cannot regress between prepare and commit by a reply in flight.
        kwargs.setdefault("turn_seconds", 0.3)
        inst = GymsimInstance.start(config or default_instance_config(**kwargs))
        started.append(inst)
        return inst

    yield start
    for inst in started:
        inst.kill()


@pytest.fixture
def recorder() -> RecordingTransport:
    return RecordingTransport()


@pytest.fixture
async def client(request: pytest.FixtureRequest, recorder: RecordingTransport) -> AsyncIterator[GymControlClient]:
    timeouts = getattr(request.module, "CLIENT_TIMEOUTS", None)
    assert timeouts is not None, f"{request.module.__name__} uses `client`: declare CLIENT_TIMEOUTS"
    async with GymControlClient(**timeouts, transport=recorder) as c:
        yield c


@pytest.fixture
async def rows(request: pytest.FixtureRequest) -> AsyncIterator[Rows]:
    r = Rows(turns=getattr(request.module, "ROW_TURNS", 100))
    yield r
    await r.aclose()
