"""The client's pure parts: batching, backoff bounds, Retry-After, error decoding, lenient
parsing, and that both flavours expose the same API. No server needed."""

from __future__ import annotations

import inspect
import json
import random

import pytest

import ckpt_client as cc
from ckpt_client._core import RawResponse, RequestSpec, RetryPolicy, Send, Sleep, TransportFailure, call, decode, parse_retry_after


def test_batched_splits_and_keeps_order() -> None:
    assert list(cc.batched(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(cc.batched([], 3)) == []
    assert list(cc.batched(iter("ab"), 5)) == [["a", "b"]]
    with pytest.raises(ValueError):
        list(cc.batched([1], 0))


def test_backoff_is_exponential_jittered_and_bounded() -> None:
    p = RetryPolicy(retries=10, backoff=0.5, max_backoff=4.0, rng=random.Random(7))
    for n in range(12):
        d = min(4.0, 0.5 * 2**n)
        for _ in range(50):
            w = p.delay(n)
            assert d / 2 <= w <= d  # half guaranteed, half jitter, never above the cap
    # Retry-After raises the wait to at least its value, still capped.
    assert p.delay(0, retry_after=3.0) >= 3.0
    assert p.delay(0, retry_after=100.0) <= 4.0
    # The gate wait honours Retry-After as a floor and doubles up to max_wait.
    assert 0.2 <= p.gate_delay(0, 0.2, 5.0) <= 0.22
    assert 5.0 <= p.gate_delay(10, 0.2, 5.0) <= 5.5
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)


def test_retry_after_header_forms() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=lambda: 1445412470.0) == pytest.approx(10.0)


def _resp(status: int, body: object = None, headers: dict[str, str] | None = None) -> RawResponse:
    raw = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    return RawResponse(status, headers or {}, raw)


def _problem(status: int, code: str, **extra: object) -> RawResponse:
    return _resp(status, {"type": f"x/{code}", "title": "t", "status": status, "code": code, "detail": f"d-{code}", **extra})


@pytest.mark.parametrize(
    ("status", "code", "extra", "cls"),
    [
        (401, "unauthorized", {}, cc.Unauthorized),
        (403, "forbidden", {}, cc.Forbidden),
        (404, "group_not_found", {}, cc.NotFound),
        (404, "unknown_dispatch", {}, cc.NotFound),
        (422, "invalid_request", {"errors": [{"field": "groups.0.group_id", "message": "bad"}]}, cc.InvalidRequest),
        (422, "invalid_config", {}, cc.InvalidRequest),
        (409, "gate_closed", {"snapshot_id": "s1", "retry_after_s": 0.25}, cc.GateClosed),
        (409, "seal_conflict", {"rows": [{"rollout_id": "r1", "code": "seal_conflict", "detail": "x"}], "refused_count": 1}, cc.BatchRefused),
        (409, "batch_refused", {"rows": [{"group_id": "g", "code": "unknown_group", "detail": "x"}]}, cc.BatchRefused),
        (409, "run_closed", {}, cc.RunClosed),
        (409, "fenced", {"epoch": 3}, cc.Fenced),
        (409, "snapshot_not_awaiting_barrier", {"phase": "prepare"}, cc.NotAwaitingBarrier),
        (409, "run_exists", {}, cc.Conflict),
        (413, "payload_too_large", {}, cc.TooLarge),
        (503, "unavailable", {}, cc.Unavailable),
        (500, "internal_error", {}, cc.CoordinatorError),
        (418, "teapot", {}, cc.CoordinatorError),
        (409, "a_code_from_the_future", {}, cc.Conflict),
        (404, "a_code_from_the_future", {}, cc.NotFound),
    ],
)
def test_problem_maps_to_typed_error(status: int, code: str, extra: dict[str, object], cls: type[cc.CoordinatorError]) -> None:
    with pytest.raises(cc.CoordinatorError) as info:
        decode(_problem(status, code, **extra))
    err = info.value
    assert type(err) is cls
    assert err.code == code and err.status == status and err.detail == f"d-{code}" and err.problem["code"] == code


def test_typed_error_fields() -> None:
    gate = decode_error(_problem(409, "gate_closed", snapshot_id="snap-9", retry_after_s=0.25))
    assert isinstance(gate, cc.GateClosed) and isinstance(gate, cc.Conflict)
    assert gate.snapshot_id == "snap-9" and gate.retry_after_s == 0.25
    # Without a body value, the Retry-After header is used.
    gate2 = decode_error(_resp(409, {"code": "gate_closed", "snapshot_id": "s"}, {"Retry-After": "3"}))
    assert isinstance(gate2, cc.GateClosed) and gate2.retry_after_s == 3.0
    refused = decode_error(
        _problem(409, "batch_refused", rows=[{"rollout_id": "r1", "code": "unknown_rollout", "detail": "a"}, {"group_id": "g2", "code": "group_not_ready", "detail": "b"}], refused_count=5)
    )
    assert isinstance(refused, cc.BatchRefused)
    assert refused.rows == [
        cc.RefusedRow("r1", "unknown_rollout", "a", rollout_id="r1"),
        cc.RefusedRow("g2", "group_not_ready", "b", group_id="g2"),
    ]
    assert refused.codes() == {"r1": "unknown_rollout", "g2": "group_not_ready"} and refused.refused_count == 5
    # Its message says each refused row's code and detail, then how many more were refused.
    assert str(refused).endswith("[5 refused: r1: unknown_rollout (a); g2: group_not_ready (b); and 3 more]"), str(refused)
    many = decode_error(_problem(409, "attempt_not_dispatched", rows=[
        {"rollout_id": f"r{i}", "code": "attempt_not_dispatched", "detail": "dispatch it first"} for i in range(12)], refused_count=12))
    text = str(many)
    assert text.count("attempt_not_dispatched (dispatch it first)") == 10 and text.endswith("and 2 more]"), text
    invalid = decode_error(_problem(422, "invalid_request", errors=[{"field": "rows.0.reward", "message": "m", "type": "t"}]))
    assert isinstance(invalid, cc.InvalidRequest) and invalid.errors == [{"field": "rows.0.reward", "message": "m", "type": "t"}]


def test_non_problem_error_bodies_still_map_by_status() -> None:
    err = decode_error(_resp(502, b"<html>Bad gateway</html>"))
    assert isinstance(err, cc.Unavailable) and err.status == 502 and "Bad gateway" in err.detail
    assert isinstance(decode_error(_resp(504)), cc.Unavailable)
    with pytest.raises(cc.ProtocolError):
        decode(_resp(200, b"not json"))
    assert decode(_resp(204)) is None


def decode_error(resp: RawResponse) -> cc.CoordinatorError:
    with pytest.raises(cc.CoordinatorError) as info:
        decode(resp)
    return info.value


def _drive(flow, outcomes):  # type: ignore[no-untyped-def]
    """Run a flow against scripted outcomes; answer each Sleep; return (value, sleeps, sends)."""
    sleeps, sends = [], 0
    value, error = None, None
    it = iter(outcomes)
    while True:
        try:
            eff = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            return stop.value, sleeps, sends
        value, error = None, None
        if isinstance(eff, Sleep):
            sleeps.append(eff.seconds)
        elif isinstance(eff, Send):
            sends += 1
            nxt = next(it)
            if isinstance(nxt, BaseException):
                error = nxt
            else:
                value = nxt


def test_call_retries_transport_and_5xx_then_succeeds() -> None:
    p = RetryPolicy(retries=4, backoff=0.1, max_backoff=1.0, rng=random.Random(1))
    out = [TransportFailure(OSError("refused"), unsent=True), _resp(503, {"code": "unavailable"}, {"Retry-After": "0.5"}), _resp(502, b""), _resp(200, {"ok": 1})]
    value, sleeps, sends = _drive(call(RequestSpec("POST", "/x", {}), p), out)
    assert value == {"ok": 1} and sends == 4 and len(sleeps) == 3
    assert sleeps[1] >= 0.5  # Retry-After honoured


def test_call_never_retries_other_4xx_or_500() -> None:
    p = RetryPolicy(retries=4, backoff=0.1)
    for resp in (_problem(409, "seal_conflict", rows=[]), _problem(422, "invalid_request"), _problem(500, "internal_error"), _problem(429, "slow_down")):
        with pytest.raises(cc.CoordinatorError):
            _drive(call(RequestSpec("POST", "/x", {}), p), [resp])


def test_call_gives_up_after_retries_with_unreachable() -> None:
    p = RetryPolicy(retries=2, backoff=0.01)
    fails = [TransportFailure(OSError("reset"), unsent=False)] * 3
    with pytest.raises(cc.Unreachable) as info:
        _drive(call(RequestSpec("GET", "/x"), p), fails)
    assert isinstance(info.value, cc.Unavailable) and "retries exhausted" in str(info.value)
    # Exhausted 503s surface as the server's own Unavailable.
    with pytest.raises(cc.Unavailable):
        _drive(call(RequestSpec("GET", "/x"), p), [_problem(503, "unavailable")] * 3)


def test_run_creation_is_repeated_only_when_provably_unsent() -> None:
    p = RetryPolicy(retries=3, backoff=0.01)
    req = RequestSpec("POST", "/v1/runs", {}, retry="unsent")
    value, _, sends = _drive(call(req, p), [TransportFailure(OSError("refused"), unsent=True), _resp(201, {"run_id": "r"})])
    assert value == {"run_id": "r"} and sends == 2
    with pytest.raises(cc.Unreachable, match="not safe to repeat"):
        _drive(call(req, p), [TransportFailure(OSError("reset"), unsent=False)])
    with pytest.raises(cc.Unavailable):
        _drive(call(req, p), [_problem(503, "unavailable")])


def test_lenient_parsing_ignores_unknown_and_derives_capture_key() -> None:
    row = cc.SendRow.parse({"rollout_id": "g_g0_a1", "gym_attempt": 2, "group_id": "g", "generation_index": 0, "future_field": [1]})
    assert row.capture_key == "g_g0_a1-a2" and row.raw["future_field"] == [1]
    snap = cc.Snapshot.parse({"snapshot_id": "s", "phase": "drain", "outcome": None, "extra": 1})
    assert not snap.terminal and snap.awaiting is None and snap.staging_keys is None and snap.counts == {}
    assert cc.Snapshot.parse({"snapshot_id": "s", "phase": "published", "outcome": "published"}).published
    plan = cc.RestorePlan.parse(
        {"snapshot_id": "s", "data_plane_ref": {"path": "/p", "digest": "d"}, "counts": {"reused": 1, "rerun": 1},
         "rows": [{"group_id": "g", "generation_index": 0, "disposition": "reused"}, {"group_id": "g", "generation_index": 1, "disposition": "rerun", "rollout_id": "x"}]}
    )
    assert plan.data_plane_ref == cc.DataPlaneRef("/p", "d") and [r.generation_index for r in plan.rows_to_send] == [1]
    with pytest.raises(cc.ProtocolError):
        cc.SendRow.parse({"group_id": "g"})
    assert cc.DataPlaneRef.coerce(("/a", "sha")) == cc.DataPlaneRef.coerce({"path": "/a", "digest": "sha"})
    with pytest.raises(TypeError):
        cc.DataPlaneRef.coerce("/just/a/path")


def test_inputs_serialise_without_nulls() -> None:
    g = cc.GroupSpec("g1", 7, "math", "sha256:x", 4, agent_name="a")
    assert g.to_json() == {"group_id": "g1", "prompt_ref": {"sample_id": 7, "task_name": "math"}, "task_digest": "sha256:x", "expected_generations": 4, "agent_name": "a"}
    assert cc.SealedRow("r", {"rollout_id": "r"}, ["k"], 1.0).to_json() == {"rollout_id": "r", "receipt": {"rollout_id": "r"}, "staging_keys": ["k"], "reward": 1.0}
    assert cc.FailedRow("r", "transport").to_json() == {"rollout_id": "r", "failure_class": "transport"}


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}


def test_sync_and_async_flavours_expose_the_same_api() -> None:
    sync, aio = _public(cc.CoordinatorClient), _public(cc.AsyncCoordinatorClient)
    assert sync.keys() == aio.keys()
    for name, sig in sync.items():
        other = aio[name]
        assert list(sig.parameters) == list(other.parameters), name
        for p in sig.parameters:
            if p not in ("transport", "sleep"):  # flavour-specific types
                assert sig.parameters[p].default == other.parameters[p].default, (name, p)
        assert inspect.iscoroutinefunction(getattr(cc.AsyncCoordinatorClient, name)), name
