"""Code normalisation and failure classification of the Gym control client
(docs/gym-protocol.md#error-codes, docs/gym-protocol.md#failure-classes)."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_coordinator.gym.errors import (
    DETAIL_LIMIT_BYTES,
    LEGACY_CODES,
    FailureClass,
    GymControlError,
    classify,
    normalize_code,
    server_failure,
    truncate_detail,
)

# (legacy, current, also accepted) exactly as the table of docs/gym-protocol.md#error-codes lists them.
TABLE = [
    ("checkpoint_error", "checkpoint_error", []),
    ("stale_checkpoint", "checkpoint_stale_checkpoint", ["checkpoint_stale"]),
    ("checkpoint_conflict", "checkpoint_conflict", []),
    ("invalid_phase", "checkpoint_invalid_phase", []),
    ("deadline_exceeded", "checkpoint_deadline_exceeded", []),
    ("restart_in_scope", "checkpoint_restart_in_scope", []),
    ("invalid_checkpoint_state", "checkpoint_invalid_checkpoint_state", ["checkpoint_invalid_state"]),
    ("unauthorized", "checkpoint_unauthorized", []),
    ("checkpoint_coordinator_unavailable", "checkpoint_coordinator_unavailable", []),
    ("admission_closed", "checkpoint_parked", ["checkpoint_admission_closed", "agent_admission_closed"]),
    ("stale_attempt", "checkpoint_stale_attempt", []),
    ("rollout_id_required", "checkpoint_rollout_id_required", []),
]


@pytest.mark.parametrize("legacy,current,aliases", TABLE)
def test_c62_every_code_in_both_spellings_and_aliases(legacy: str, current: str, aliases: list[str]) -> None:
    assert normalize_code(legacy) == legacy
    assert normalize_code(current) == legacy
    for alias in aliases:
        assert normalize_code(alias) == legacy
    # Prefix rule: any `checkpoint_` + legacy form is recognised, whatever the current column says.
    assert normalize_code("checkpoint_" + legacy) == legacy


def test_table_covers_every_legacy_code() -> None:
    assert {row[0] for row in TABLE} == set(LEGACY_CODES)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_unknown_codes_are_kept_as_they_are(code: str) -> None:
    known = {row[0] for row in TABLE} | {row[1] for row in TABLE} | {a for row in TABLE for a in row[2]}
    if code in known or (code.startswith("checkpoint_") and code[len("checkpoint_"):] in LEGACY_CODES):
        return
    assert normalize_code(code) == code


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=20).filter(lambda c: normalize_code(c) == c and c not in LEGACY_CODES),
       st.integers(min_value=400, max_value=599))
def test_c62_unknown_code_classified_by_status(code: str, status: int) -> None:
    cls = classify(code, status)
    if status == 401:
        assert cls is FailureClass.CONFIG_ERROR
    elif status in (408, 429) or status >= 500:
        assert cls is FailureClass.UNAVAILABLE
    else:
        assert cls is FailureClass.PROTOCOL_ERROR


@pytest.mark.parametrize(
    "code,status,expected",
    [
        ("checkpoint_error", 500, FailureClass.UNAVAILABLE),
        ("checkpoint_error", 409, FailureClass.PROTOCOL_ERROR),
        ("invalid_phase", 409, FailureClass.UNAVAILABLE),
        ("deadline_exceeded", 409, FailureClass.UNAVAILABLE),
        ("checkpoint_coordinator_unavailable", 503, FailureClass.UNAVAILABLE),
        ("checkpoint_conflict", 409, FailureClass.CONFLICT),
        ("invalid_checkpoint_state", 422, FailureClass.CHECKPOINT_STATE),
        ("unauthorized", 401, FailureClass.CONFIG_ERROR),
        ("restart_in_scope", 409, FailureClass.PROTOCOL_ERROR),
        ("stale_checkpoint", 409, FailureClass.PROTOCOL_ERROR),
        (None, 502, FailureClass.UNAVAILABLE),
        (None, 504, FailureClass.UNAVAILABLE),
        (None, 422, FailureClass.PROTOCOL_ERROR),
        (None, 404, FailureClass.PROTOCOL_ERROR),
    ],
)
def test_known_code_classes(code: str | None, status: int, expected: FailureClass) -> None:
    assert classify(code, status) is expected


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=3000))
def test_detail_truncated_to_4kib_utf8(text: str) -> None:
    cut = truncate_detail(text)
    assert len(cut.encode("utf-8")) <= DETAIL_LIMIT_BYTES
    assert text.startswith(cut)


def test_long_detail_is_cut_in_failure_parts() -> None:
    part = server_failure(FailureClass.PROTOCOL_ERROR, "commit", "é" * 10_000, http_status=409)
    assert len(part["detail"].encode()) <= DETAIL_LIMIT_BYTES


def _part(cls: FailureClass, op: str = "prepare") -> dict:
    return server_failure(cls, op, f"{cls} happened", http_status=409, code="x")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list(FailureClass)), min_size=1, max_size=6))
def test_c64_multi_instance_failure_transient_only_if_all_parts_are(classes: list[FailureClass]) -> None:
    parts = {f"inst-{i}": {"srv": _part(c)} for i, c in enumerate(classes)}
    err = GymControlError.from_parts(parts, "combined")
    transient = {FailureClass.NOT_READY, FailureClass.UNAVAILABLE, FailureClass.LEASE_LOST, FailureClass.DRAIN_TIMEOUT}
    assert err.transient == all(c in transient for c in classes)
    # A mixed set takes a non-transient class, never a transient one.
    if not err.transient:
        assert err.failure_class not in transient
    # combine() over single-instance errors agrees with from_parts.
    errs = [GymControlError.from_parts({k: v}, k) for k, v in parts.items()]
    merged = GymControlError.combine(errs)
    assert merged.transient == err.transient
    assert merged.failure_class == err.failure_class
    assert set(merged.instances) == set(parts)


def test_c64_failure_serialises_to_plain_data_and_pickles() -> None:
    resume = GymControlError.from_parts({"a/0": {"model": _part(FailureClass.UNAVAILABLE, "resume")}}, "resume failed")
    err = GymControlError.from_parts(
        {"a/0": {"agent": _part(FailureClass.NOT_READY)}, "b/1": {"model": _part(FailureClass.UNAVAILABLE)}},
        "prepare failed",
        extra={"timings": {"prepare": 1.5}},
    )
    err.resume_failure = resume
    data = err.to_dict()
    # Plain JSON data, in the shape docs/gym-protocol.md#failure-classes gives.
    assert json.loads(json.dumps(data)) == data
    assert data["class"] == "not_ready" and data["transient"] is True
    assert data["instances"]["a/0"]["agent"]["op"] == "prepare"
    assert set(data["instances"]["a/0"]["agent"]) >= {"op", "http_status", "code", "detail"}
    assert data["resume_failure"]["class"] == "unavailable"
    assert data["timings"] == {"prepare": 1.5}
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, GymControlError)
    assert clone.to_dict() == data
    assert GymControlError.from_dict(data).to_dict() == data
