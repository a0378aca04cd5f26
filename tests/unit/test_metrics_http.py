"""HTTP request metrics: recorded by route template, never by raw path."""

from __future__ import annotations

import warnings

import pytest
from fastapi import APIRouter, FastAPI, HTTPException
from fastapi.responses import PlainTextResponse, StreamingResponse

from checkpoint_coordinator.observability import metrics as m
from checkpoint_coordinator.observability.http import install_http_metrics, metrics_endpoint

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def count(route: str, method: str, status: int) -> float:
    value = m.REGISTRY.get_sample_value(
        "ckptc_http_request_seconds_count", {"route": route, "method": method, "status": str(status)}
    )
    return 0.0 if value is None else value


def all_routes_recorded() -> set[str]:
    return {
        s.labels["route"]
        for f in m.REGISTRY.collect()
        if f.name == "ckptc_http_request_seconds"
        for s in f.samples
        if s.name.endswith("_count")
    }


@pytest.fixture()
def client() -> TestClient:
    app = FastAPI()
    router = APIRouter(prefix="/v1")
    ready = {"ok": True}

    @router.get("/runs/{run_id}")
    def get_run(run_id: str) -> dict[str, str]:
        return {"run_id": run_id}

    @router.post("/runs/{run_id}/snapshots/{snapshot_id}")
    def request_snapshot(run_id: str, snapshot_id: str) -> dict[str, str]:
        if snapshot_id == "conflict":
            raise HTTPException(status_code=409, detail="another snapshot is open")
        return {"snapshot_id": snapshot_id}

    @router.get("/runs/{run_id}/boom")
    def boom(run_id: str) -> None:
        raise RuntimeError("handler bug")

    @router.get("/runs/{run_id}/stream")
    def stream(run_id: str) -> StreamingResponse:
        return StreamingResponse(iter([b"a", b"b"]), media_type="text/plain")

    @app.get("/healthz")
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/readyz")
    def readyz() -> PlainTextResponse:
        return PlainTextResponse("ok" if ready["ok"] else "not ready", status_code=200 if ready["ok"] else 503)

    sub = FastAPI()

    @sub.get("/items/{item_id}")
    def item(item_id: int) -> dict[str, int]:
        return {"item_id": item_id}

    app.include_router(router)
    app.mount("/sub", sub)
    app.add_route("/metrics", metrics_endpoint, include_in_schema=False)
    install_http_metrics(app)
    test_client = TestClient(app, raise_server_exceptions=False)
    test_client.ready = ready  # type: ignore[attr-defined]
    return test_client


def test_route_template_not_raw_path(client: TestClient) -> None:
    before = count("/v1/runs/{run_id}", "GET", 200)
    assert client.get("/v1/runs/run-1").status_code == 200
    assert client.get("/v1/runs/run-2").status_code == 200
    assert count("/v1/runs/{run_id}", "GET", 200) == before + 2
    routes = all_routes_recorded()
    assert not any("run-1" in r or "run-2" in r for r in routes), routes


def test_error_statuses_are_labelled(client: TestClient) -> None:
    tmpl = "/v1/runs/{run_id}/snapshots/{snapshot_id}"
    before = count(tmpl, "POST", 409)
    assert client.post("/v1/runs/r/snapshots/conflict").status_code == 409
    assert count(tmpl, "POST", 409) == before + 1


def test_unhandled_exception_is_a_500_on_its_template(client: TestClient) -> None:
    before = count("/v1/runs/{run_id}/boom", "GET", 500)
    assert client.get("/v1/runs/r/boom").status_code == 500
    assert count("/v1/runs/{run_id}/boom", "GET", 500) == before + 1


def test_unknown_paths_are_unmatched(client: TestClient) -> None:
    before = count("unmatched", "GET", 404)
    assert client.get("/v1/runs/r/nothing/here/abc123").status_code == 404
    assert client.get("/wp-admin/secret-probe").status_code == 404
    assert count("unmatched", "GET", 404) == before + 2
    assert not any("abc123" in r or "wp-admin" in r for r in all_routes_recorded())


def test_method_not_allowed_keeps_the_template(client: TestClient) -> None:
    before = count("/v1/runs/{run_id}", "DELETE", 405)
    assert client.delete("/v1/runs/r").status_code == 405
    assert count("/v1/runs/{run_id}", "DELETE", 405) == before + 1


def test_mounted_app_and_plain_routes(client: TestClient) -> None:
    before = count("/sub/items/{item_id}", "GET", 200)
    assert client.get("/sub/items/7").status_code == 200
    assert count("/sub/items/{item_id}", "GET", 200) == before + 1
    before = count("unmatched", "GET", 404)
    assert client.get("/sub/nothing").status_code == 404
    assert count("unmatched", "GET", 404) == before + 1
    before = count("/openapi.json", "GET", 200)
    assert client.get("/openapi.json").status_code == 200
    assert count("/openapi.json", "GET", 200) == before + 1


def test_streaming_response_is_recorded_once(client: TestClient) -> None:
    before = count("/v1/runs/{run_id}/stream", "GET", 200)
    assert client.get("/v1/runs/r/stream").text == "ab"
    assert count("/v1/runs/{run_id}/stream", "GET", 200) == before + 1


def test_readiness_answers_feed_the_ready_gauge(client: TestClient) -> None:
    client.ready["ok"] = False  # type: ignore[attr-defined]
    assert client.get("/readyz").status_code == 503
    assert m.REGISTRY.get_sample_value("ckptc_ready") == 0
    client.ready["ok"] = True  # type: ignore[attr-defined]
    assert client.get("/readyz").status_code == 200
    assert m.REGISTRY.get_sample_value("ckptc_ready") == 1


def test_metrics_endpoint_serves_the_registry(client: TestClient) -> None:
    client.get("/healthz")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert 'ckptc_http_request_seconds_count{method="GET",route="/healthz",status="200"}' in response.text
    assert "ckptc_build_info{" in response.text
    om = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")


def test_a_metrics_failure_never_breaks_the_request(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(m, "observe_http_request", broken)
    response = client.get("/v1/runs/r")
    assert response.status_code == 200 and response.json() == {"run_id": "r"}
