"""``DirectRoute`` (api/common.py) validates a hot route's path ids and body itself: every bad
input must be refused exactly as the same endpoint on an ordinary route refuses it, and an
endpoint it cannot serve must be refused when the app is built, not at the first request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, BackgroundTasks, Depends, Query, Request, Response

from checkpoint_coordinator.api import effects
from checkpoint_coordinator.api.auth import Caller, require_run_access
from checkpoint_coordinator.api.common import DirectRoute, FastJSONRoute
from checkpoint_coordinator.api.effect_schemas import CompleteIn
from checkpoint_coordinator.app import create_app

DIRECT, PLAIN = "/v1/runs", "/plain/runs"
GOOD = {"rollout_id": "r-0", "gym_attempt": 0, "seq": 0, "effect": "send_mail", "digest": "sha256:a"}

# (path after the prefix, raw body) of inputs refused before the endpoint runs.
BAD: list[tuple[str, bytes]] = [
    ("/run-a/effects/begin", b"{}"),
    ("/run-a/effects/begin", b'{"rollout_id": "r-0"'),
    ("/run-a/effects/begin", b""),
    ("/run-a/effects/begin", b"[1, 2]"),
    ("/run-a/effects/begin", b'{"rollout_id": 5, "gym_attempt": "x", "seq": -1, "effect": "", "digest": "sha256:a"}'),
    ("/run-a/effects/begin", b'{"rollout_id": "r-0", "gym_attempt": 0, "seq": 0, "effect": "m", "digest": "d", "extra": 1}'),
    ("/run-a/effects/begin", b'{"rollout_id": "r\\u00000", "gym_attempt": 0, "seq": 0, "effect": "m", "digest": "d"}'),
    ("/run-a/effects/begin", b"\xff\xfe"),
    ("/-bad-run/effects/begin", b'{"rollout_id": "r-0", "gym_attempt": 0, "seq": 0, "effect": "m", "digest": "d"}'),
    ("/run-a/effects/abc/complete", b'{"result": 1}'),
    ("/run-a/effects/1/complete", b"{}"),
    ("/run-a/effects/1/complete", b'{"result": 1, "more": 2}'),
    ("/-bad-run/effects/x/complete", b"nope"),
    ("/-bad-run/effects/x/complete", b'{"more": 1}'),
    ("/run-a/effects/begin", b"[" * 100_000),
]
# (content type, body) of a complete: a body is JSON only under a JSON content type.
CONTENT_TYPES: list[tuple[str | None, bytes]] = [
    (None, b'{"result": 1}'),
    ("text/plain", b'{"result": 1}'),
    ("application/x-www-form-urlencoded", b"result=1"),
    ("application/problem+json", b'{"result": 1, "x": 2}'),
    ("application/json; charset=utf-8", b'{"more": 1}'),
]


@pytest.fixture
async def both(settings, database_url: str) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    """The app, with the journal's two hot endpoints also served by an ordinary route."""
    app = create_app(settings, database_url=database_url)
    plain = APIRouter(prefix="/plain/runs/{run_id}/effects", route_class=FastJSONRoute)
    plain.post("/begin")(effects.begin_effect)
    plain.post("/{effect_id}/complete")(effects.complete_effect)
    app.include_router(plain)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as c:
            yield c


def _comparable(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "instance"}


@pytest.mark.parametrize(("path", "body"), BAD, ids=[f"{i}" for i in range(len(BAD))])
async def test_bad_input_is_refused_as_an_ordinary_route_refuses_it(both, admin, path: str, body: bytes) -> None:  # type: ignore[no-untyped-def]
    headers = {**admin, "content-type": "application/json"}
    direct = await both.post(DIRECT + path, content=body, headers=headers)
    plain = await both.post(PLAIN + path, content=body, headers=headers)
    assert direct.status_code == plain.status_code and direct.status_code in (400, 422), (direct.text, plain.text)
    assert direct.headers["content-type"] == "application/problem+json"
    assert _comparable(direct.json()) == _comparable(plain.json())


@pytest.mark.parametrize(("content_type", "body"), CONTENT_TYPES, ids=[str(c) for c, _ in CONTENT_TYPES])
async def test_a_body_is_json_only_under_a_json_content_type(both, admin, content_type: str | None, body: bytes) -> None:  # type: ignore[no-untyped-def]
    headers = {**admin, **({"content-type": content_type} if content_type else {})}
    direct = await both.post(f"{DIRECT}/run-a/effects/1/complete", content=body, headers=headers)
    plain = await both.post(f"{PLAIN}/run-a/effects/1/complete", content=body, headers=headers)
    assert direct.status_code == plain.status_code == 422, (direct.text, plain.text)
    assert _comparable(direct.json()) == _comparable(plain.json())


async def test_the_caller_is_checked_before_the_body_is_read(both) -> None:  # type: ignore[no-untyped-def]
    for headers, status in (({}, 401), ({"authorization": "Bearer not-a-token"}, 403)):
        r = await both.post(f"{DIRECT}/run-a/effects/begin", content=b"not json", headers=headers)
        assert r.status_code == status and r.headers["content-type"] == "application/problem+json", r.text


async def test_a_valid_call_reaches_the_endpoint(both, admin) -> None:  # type: ignore[no-untyped-def]
    # A run that does not exist: the endpoint ran (the admin token reaches any run id) and refused.
    r = await both.post(f"{DIRECT}/no-such-run/effects/begin", json=GOOD, headers=admin)
    assert r.status_code == 409 and r.json()["code"] == "run_closed", r.text


async def _with_query(request: Request, body: CompleteIn, q: int = Query(0), caller: Caller = Depends(require_run_access)) -> Response:
    return Response()


def _not_a_coroutine(request: Request, body: CompleteIn, caller: Caller = Depends(require_run_access)) -> Response:
    return Response()


async def _answers_a_dict(request: Request, body: CompleteIn, caller: Caller = Depends(require_run_access)) -> dict[str, Any]:
    return {}


async def _with_background(request: Request, body: CompleteIn, tasks: BackgroundTasks, caller: Caller = Depends(require_run_access)) -> Response:
    return Response()


@pytest.mark.parametrize("endpoint", [_with_query, _not_a_coroutine, _answers_a_dict, _with_background])
def test_an_endpoint_it_cannot_serve_is_refused_when_built(endpoint: Any) -> None:
    router = APIRouter(prefix="/v1/runs/{run_id}/x", route_class=DirectRoute)
    with pytest.raises(TypeError, match="DirectRoute"):
        router.post("/y")(endpoint)
    assert router.routes == []
    router.post("/z")(_fine)  # the shape of the journal's endpoints is taken
    assert [r.path for r in router.routes] == ["/v1/runs/{run_id}/x/z"]


async def _fine(request: Request, body: CompleteIn, caller: Caller = Depends(require_run_access)) -> Response:
    return Response()
