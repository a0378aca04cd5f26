"""Capture keys, episode objects, reply parsing, the commit scope and the restart-only rule
(pure parts)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from checkpoint_coordinator.gym.errors import FailureClass, GymControlError
from checkpoint_coordinator.gym.models import (
    CommitReply,
    Episode,
    InstanceSpec,
    StatusReply,
    episodes_to_wire,
    format_capture_key,
    instance_checkpoint_dir,
    is_valid_rollout_id,
    parse_capture_key,
)
from checkpoint_coordinator.domain.config import check_restart_only_servers, load_recovery_config
from checkpoint_coordinator.gym.commit import _sorted_unique
from checkpoint_coordinator.gym.policy import compute_scope
from checkpoint_coordinator.ledger.gym_registry import ParticipantRecord
from checkpoint_coordinator.restore.registration import restart_only_servers

rollout_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}", fullmatch=True).filter(is_valid_rollout_id)
attempts = st.integers(min_value=0, max_value=10_000)


@settings(max_examples=60, deadline=None)
@given(rollout_ids, attempts)
def test_c63_capture_key_round_trip(rollout_id: str, attempt: int) -> None:
    key = format_capture_key(rollout_id, attempt)
    assert parse_capture_key(key) == (rollout_id, attempt)
    assert (key == rollout_id) == (attempt == 0)


def test_capture_key_examples() -> None:
    assert format_capture_key("r1", 0) == "r1"
    assert format_capture_key("r1", 3) == "r1-a3"
    assert parse_capture_key("r1-a12") == ("r1", 12)
    # Leading zero and a0 are not capture-key suffixes.
    assert parse_capture_key("r1-a012") == ("r1-a012", 0)
    assert parse_capture_key("r1-a0") == ("r1-a0", 0)


def test_rollout_id_rule_reserves_the_suffix() -> None:
    assert not is_valid_rollout_id("r1-a3")
    assert not is_valid_rollout_id("-r")
    assert not is_valid_rollout_id("x" * 257)
    assert is_valid_rollout_id("g41_g0_a5d1e9c0")
    with pytest.raises(ValueError):
        Episode.checked("r1-a2", 0)
    with pytest.raises(ValueError):
        Episode.checked("r1", True)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(rollout_ids, attempts), max_size=30))
def test_c63_scope_is_sorted_unique_objects(pairs: list[tuple[str, int]]) -> None:
    wire = episodes_to_wire(Episode(r, a) for r, a in pairs + pairs)
    assert [tuple(o.values()) for o in wire] == sorted(set(pairs))
    assert all(set(o) == {"rollout_id", "attempt"} for o in wire)


def test_checkpoint_dir_layout() -> None:
    assert instance_checkpoint_dir("/ckpt/snap-1/", "math/replica-0") == "/ckpt/snap-1/gym-instances/math/replica-0"


def test_instance_spec_hides_its_token() -> None:
    spec = InstanceSpec("math/replica-0", "s3cr3t-token", {"policy_model": "http://h:1"})
    assert "s3cr3t-token" not in repr(spec)
    assert "s3cr3t-token" not in str(spec)
    assert spec.token.get_secret_value() == "s3cr3t-token"
    with pytest.raises(ValueError):
        InstanceSpec("bad//id", "t", {})


def test_c64_unknown_reply_fields_are_ignored_and_types_strict() -> None:
    status = StatusReply.model_validate_json(
        b'{"kind":"model","instance":"m","phase":"idle","mode":"exported","checkpoint_id":null,'
        b'"lease_expires_at":null,"retired_rollouts":0,"report":{"ready":true,"blockers":[],'
        b'"blocker_count":0,"counts":{},"restarts":[]},"workers":3,"brand_new_field":{"x":1}}'
    )
    assert status.kind == "model" and status.mode == "exported"
    # Older Gym: no mode at all.
    assert StatusReply.model_validate_json(b'{"kind":"agent","instance":"a","phase":"idle"}').mode is None
    with pytest.raises(ValidationError):
        # A boolean is not an int.
        StatusReply.model_validate_json(b'{"kind":"agent","instance":"a","phase":"idle","retired_rollouts":true}')
    with pytest.raises(ValidationError):
        CommitReply.model_validate_json(b'{"phase":"committed","episode_ids":[]}')


def _p(name: str, kind: str, mode: str | None) -> ParticipantRecord:
    return ParticipantRecord(name, "http://x", kind, name, mode, {"model": 1, "agent": 2, "resources": 3}[kind])


TOPO = {
    "a/0": [_p("policy", "model", "exported"), _p("tools", "resources", "restart_only")],
    "b/0": [_p("policy", "model", "exported"), _p("agent", "agent", "restart_only"), _p("old", "resources", None)],
}


def test_c38_restart_only_fails_setup_naming_every_server() -> None:
    found = restart_only_servers(TOPO)
    # A status without a mode (old Gym) is never flagged.
    assert found == {"a/0": ["tools"], "b/0": ["agent"]}
    verdict = check_restart_only_servers(load_recovery_config({"target_level": "turn"}), found)
    assert verdict.error is not None
    assert "a/0:tools" in verdict.error and "b/0:agent" in verdict.error and "old" not in verdict.error


def test_c38_restart_only_allowed_warns_naming_them() -> None:
    cfg = load_recovery_config({"target_level": "turn", "allow_restart_only_gym_servers": True})
    verdict = check_restart_only_servers(cfg, restart_only_servers(TOPO))
    assert verdict.accepted and len(verdict.warnings) == 1
    assert "a/0:tools" in verdict.warnings[0] and "b/0:agent" in verdict.warnings[0]


def test_c38_flag_without_restart_only_servers_warns_no_effect() -> None:
    clean = {"a/0": [_p("policy", "model", "exported"), _p("old", "agent", None)]}
    assert restart_only_servers(clean) == {}
    cfg = load_recovery_config({"target_level": "turn", "allow_restart_only_gym_servers": True})
    verdict = check_restart_only_servers(cfg, restart_only_servers(clean))
    assert verdict.accepted and len(verdict.warnings) == 1 and "no effect" in verdict.warnings[0]


def test_c44_scope_excludes_restarts_and_refuses_wrong_attempt() -> None:
    cands = [Episode("r1", 0), Episode("r2", 1), Episode("r3", 0)]
    scope, restarted = compute_scope("a/0", cands, [Episode("r2", 1), Episode("zz", 0)])
    assert scope == [Episode("r1", 0), Episode("r3", 0)]
    assert restarted == [Episode("r2", 1)]
    with pytest.raises(GymControlError) as info:
        compute_scope("a/0", cands, [Episode("r3", 2)])
    assert info.value.failure_class is FailureClass.PROTOCOL_ERROR and not info.value.transient


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 2)), max_size=10), st.booleans())
def test_a_scope_is_sorted_and_unique_and_one_already_so_is_taken_as_it_is(pairs: list[tuple[str, int]], as_list: bool) -> None:
    episodes = [Episode(r, a) for r, a in pairs]
    given_in = episodes if as_list else tuple(episodes)
    out = _sorted_unique(given_in)
    assert out == sorted(set(episodes))
    if as_list and episodes == sorted(set(episodes)):
        assert out is given_in  # compute_scope's output: no second sort while Gym waits
