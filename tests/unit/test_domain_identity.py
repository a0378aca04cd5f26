"""Identifiers: patterns, limits, rollout ids, sibling ids and capture keys."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpoint_coordinator.domain.errors import IdentityError
from checkpoint_coordinator.domain.identity import (
    CHECKPOINT_ID,
    GROUP_ID,
    ID_PATTERNS,
    INSTANCE_ID,
    MAX_GENERATIONS,
    ROLLOUT_ID,
    RUN_ID,
    SERVER_NAME,
    SNAPSHOT_ID,
    capture_key,
    format_rollout_id,
    is_valid_rollout_id,
    mint_rollout_id,
    parse_capture_key,
    parse_rollout_id,
    parse_sibling_id,
    rollout_id_minter,
    sibling_id,
)

NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}", fullmatch=True)
ROLLOUT = NAME.filter(lambda s: re.search(r"-a[0-9]+$", s) is None)


def hex_source(seed: int = 0):  # type: ignore[no-untyped-def]
    rnd = random.Random(seed)
    return lambda n: rnd.randbytes(n).hex()


def test_patterns_are_exposed_for_the_api() -> None:
    assert set(ID_PATTERNS) >= {
        "run_id",
        "group_id",
        "snapshot_id",
        "checkpoint_id",
        "instance_id",
        "server_name",
        "rollout_id",
    }
    for rule in ID_PATTERNS.values():
        re.compile(rule.pattern)  # usable elsewhere
        # no look-around, so pydantic's Rust regex engine and OpenAPI tools accept it
        assert not any(x in rule.pattern for x in ("(?=", "(?!", "(?<"))


@pytest.mark.parametrize(
    "rule, good, bad",
    [
        (RUN_ID, ["run7", "R.1_x-2"], ["", "-run", "run 7", "run/7", "x" * 129]),
        (GROUP_ID, ["g41"], ["", ".g", "g/1", "x" * 181]),
        (SNAPSHOT_ID, ["000123"], ["", "a b", "x" * 101]),
        (CHECKPOINT_ID, ["snap-000123-7f3a9c01", "retire"], ["", "x" * 129, "a/b"]),
        (INSTANCE_ID, ["math/replica-0", "a", "a/b/c"], ["", "/a", "a/", "a//b", "a b", "x" * 257]),
        (SERVER_NAME, ["policy_model"], ["", "a/b", "-x"]),
        (ROLLOUT_ID, ["r", "g41_g0_a" + "0" * 32, "r-a", "r-ab1", "r_a12"], ["", "r-a1", "r-a0123", "x-a9", "r\n", "x" * 257]),
    ],
)
def test_rules(rule, good, bad) -> None:  # type: ignore[no-untyped-def]
    for value in good:
        assert rule.validate(value) == value
    for value in bad:
        with pytest.raises(IdentityError) as info:
            rule.validate(value, ("body", "field"))
        assert info.value.path == "body.field"
        assert not rule.is_valid(value)


def test_non_strings_are_refused() -> None:
    for rule in ID_PATTERNS.values():
        assert rule.problem(5) is not None
        assert rule.problem(None) is not None


@given(ROLLOUT)
def test_fast_rollout_check_agrees_with_the_rule(value: str) -> None:
    assert is_valid_rollout_id(value) == ROLLOUT_ID.is_valid(value)
    assert not is_valid_rollout_id(value + "-a7")


def test_sibling_ids() -> None:
    assert sibling_id("g41", 3) == "g41_g3"
    assert parse_sibling_id("g41_g3") == ("g41", 3)
    assert parse_sibling_id("g_g2_g3") == ("g_g2", 3)
    with pytest.raises(IdentityError):
        sibling_id("g41", -1)
    with pytest.raises(IdentityError):
        sibling_id("g41", True)  # type: ignore[arg-type]
    with pytest.raises(IdentityError):
        parse_sibling_id("g41")


def test_rollout_id_format() -> None:
    rid = mint_rollout_id("g41", 0, lambda n: "ab" * n)
    assert rid == "g41_g0_a" + "ab" * 16
    assert parse_rollout_id(rid) == ("g41", 0, "ab" * 16)
    assert parse_rollout_id("imported-rollout") is None
    with pytest.raises(IdentityError) as info:
        format_rollout_id("g41", 0, "XYZ")
    assert info.value.path == "token_hex"
    with pytest.raises(IdentityError):
        format_rollout_id("bad group", 0, "0" * 32)


@given(NAME.filter(lambda s: len(s) <= 180), st.integers(0, MAX_GENERATIONS - 1), st.integers(0, 2**32))
def test_minted_ids_are_valid_and_parse_back(group_id: str, index: int, seed: int) -> None:
    mint = rollout_id_minter(hex_source(seed), batch=3)
    ids = [mint(group_id, index) for _ in range(7)]
    assert len(set(ids)) == 7
    for rid in ids:
        assert ROLLOUT_ID.is_valid(rid)
        g, i, h = parse_rollout_id(rid)  # type: ignore[misc]
        assert (g, i) == (group_id, index) and len(h) == 32
    assert getattr(mint, "random_bits") == 128


def test_minter_refuses_a_bad_random_source_and_bad_inputs() -> None:
    with pytest.raises(IdentityError):
        rollout_id_minter(lambda n: "zz" * n)("g", 0)
    with pytest.raises(IdentityError):
        rollout_id_minter(lambda n: "ab")("g", 0)  # too short
    mint = rollout_id_minter(hex_source())
    with pytest.raises(IdentityError):
        mint("bad group", 0)
    with pytest.raises(IdentityError):
        mint("g", MAX_GENERATIONS)


def test_capture_keys() -> None:
    assert capture_key("r1", 0) == "r1"
    assert capture_key("r1", 3) == "r1-a3"
    assert parse_capture_key("r1-a3") == ("r1", 3)
    assert parse_capture_key("r1") == ("r1", 0)
    assert parse_capture_key("r1-a0") == ("r1-a0", 0)  # no leading zeros: not a suffix
    assert parse_capture_key("r1-a03") == ("r1-a03", 0)
    with pytest.raises(IdentityError):
        capture_key("r1", -1)
    with pytest.raises(IdentityError):
        capture_key("r1", True)  # type: ignore[arg-type]


@given(ROLLOUT, st.integers(0, 10**6))
def test_capture_key_round_trip(rid: str, attempt: int) -> None:
    assert parse_capture_key(capture_key(rid, attempt)) == (rid, attempt)
