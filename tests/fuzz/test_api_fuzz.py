"""Property-based fuzz of the whole API, generated from the coordinator's own OpenAPI document.

A real coordinator process on a real PostgreSQL answers every case. Each answer must not be a
server error, must use a status code and content type the document declares for that operation,
must match the declared response schema, and every error must be `application/problem+json`.
Cases carry the admin token on the admin routes and the run token elsewhere, so they reach past
authentication into the ledger. The budget is fixed and derandomized (``CKPTC_FUZZ_EXAMPLES``
per operation, default 25); a local run may raise it and set ``CKPTC_FUZZ_SEED``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from ..conftest import ADMIN_TOKEN
from ..fault.coordinator_process import CoordinatorProcess

EXAMPLES = int(os.environ.get("CKPTC_FUZZ_EXAMPLES", "25"))
RUN_ID = "fuzz-run"
# Routes that would end the fuzz's own access (close the run, rotate its token). Each has its own
# tests. Gym registration is fuzzed: the coordinator's egress allows 127.0.0.1 only, so an invented
# host is refused before any connection, and a loopback one finds a closed port (or the
# coordinator's own, refused too).
EXCLUDED = {
    ("POST", "/v1/runs/{run_id}/close"),
    ("POST", "/v1/runs/{run_id}/token"),
}
ADMIN_ROUTES = {("POST", "/v1/runs"), ("GET", "/v1/runs")}
STATUSES: Counter[int] = Counter()


@pytest.fixture(scope="module")
def coordinator(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    # The fuzz sends malformed tokens on purpose: no throttle, or its later cases would all be 429s.
    proc = CoordinatorProcess(
        database_url, tmp_path_factory.mktemp("fuzz"), coordinator_id="fuzz",
        CKPTC_AUTH_FAILURES_PER_MINUTE="1000000", CKPTC_GYM_ALLOWED_NETWORKS="127.0.0.1/32",
    )
    proc.start()
    try:
        body = {"run_id": RUN_ID, "checkpoint_root": "/tmp/ckptc-fuzz", "recovery": {"target_level": "turn"}}
        created = httpx.post(f"{proc.url}/v1/runs", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        created.raise_for_status()
        yield {"url": proc.url, "run_token": created.json()["run_token"]}
    finally:
        proc.stop()
        print(f"\nAPI fuzz: {sum(STATUSES.values())} requests, statuses {dict(sorted(STATUSES.items()))}")


@pytest.fixture(scope="module")
def database_url(pg_server_url: str, template_db: str) -> Iterator[str]:
    # One database for the whole module: the fuzz builds up ledger state across cases.
    from ..conftest import _drop_database, _new_database, _with_db

    name = _new_database(pg_server_url, template_db)
    try:
        yield _with_db(pg_server_url, name)
    finally:
        _drop_database(pg_server_url, name)


def _openapi() -> dict[str, Any]:
    """The document the service serves at /openapi.json (building the app opens no connection)."""
    from checkpoint_coordinator.app import create_app
    from checkpoint_coordinator.config import Settings

    return create_app(Settings(_env_file=None), database_url="postgresql://unused/unused").openapi()


schema = schemathesis.openapi.from_dict(_openapi()).exclude(
    func=lambda ctx: (ctx.operation.method.upper(), ctx.operation.path) in EXCLUDED
)


def problem_json_errors(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error answer is a problem document with a stable code."""
    if response.status_code >= 400:
        media = response.headers.get("content-type", [""])
        media = media[0] if isinstance(media, list) else media
        assert media.startswith("application/problem+json"), f"{response.status_code} answered as {media!r}"
        body = response.json()
        assert isinstance(body.get("code"), str) and body["code"], body
    return None


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=os.environ.get("CKPTC_FUZZ_SEED") is None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_api_fuzz(case: Any, coordinator: dict[str, str]) -> None:
    key = (case.method.upper(), case.operation.path)
    token = ADMIN_TOKEN if key in ADMIN_ROUTES else coordinator["run_token"]
    if case.path_parameters and "run_id" in case.path_parameters:
        case.path_parameters["run_id"] = RUN_ID
    response = case.call(base_url=coordinator["url"], headers={"Authorization": f"Bearer {token}"}, timeout=60)
    STATUSES[response.status_code] += 1
    case.validate_response(
        response,
        checks=[
            checks.not_a_server_error,
            checks.status_code_conformance,
            checks.content_type_conformance,
            checks.response_schema_conformance,
        ],
    )
    problem_json_errors(None, response, case)
