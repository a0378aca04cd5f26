"""Restore levels: rank, the prefix refusal, live granularity and level resolution."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpoint_coordinator.domain.config import RecoveryConfig
from checkpoint_coordinator.domain.errors import LevelError
from checkpoint_coordinator.domain.levels import (
    LiveGranularity,
    RestoreLevel,
    live_granularity,
    parse_level,
    resolve_level,
)

LEVELS = list(RestoreLevel)


def test_rank_orders_finer_first() -> None:
    assert [lvl.rank for lvl in LEVELS] == [0, 1, 2]
    assert RestoreLevel.turn < RestoreLevel.sibling < RestoreLevel.prompt_group
    assert sorted([RestoreLevel.prompt_group, RestoreLevel.turn, RestoreLevel.sibling]) == LEVELS
    assert RestoreLevel.prompt_group.is_coarser_than(RestoreLevel.sibling)
    assert not RestoreLevel.turn.is_coarser_than(RestoreLevel.turn)


@given(st.sampled_from(LEVELS), st.sampled_from(LEVELS))
def test_comparisons_follow_rank_not_spelling(a: RestoreLevel, b: RestoreLevel) -> None:
    assert (a < b) == (a.rank < b.rank)
    assert (a <= b) == (a.rank <= b.rank)
    assert (a > b) == (a.rank > b.rank)
    assert (a >= b) == (a.rank >= b.rank)


def test_members_are_interchangeable_with_their_strings() -> None:
    assert RestoreLevel.turn == "turn"
    assert {"turn": 1}[RestoreLevel.turn] == 1
    assert {RestoreLevel.sibling: 1}["sibling"] == 1
    assert str(RestoreLevel.prompt_group) == "prompt_group"


def test_prefix_is_refused_because_it_needs_generation_cuts() -> None:
    with pytest.raises(LevelError) as info:
        parse_level("prefix", ("target_level",))
    assert info.value.path == "target_level"
    assert "generation cuts" in info.value.message
    assert "out of scope" in info.value.message


@pytest.mark.parametrize("value", ["Turn", "group", "", 1, None])
def test_unknown_levels_are_refused(value: object) -> None:
    with pytest.raises(LevelError):
        parse_level(value)


def test_live_granularity() -> None:
    assert live_granularity(RestoreLevel.prompt_group) is LiveGranularity.prompt_group
    assert live_granularity(RestoreLevel.sibling) is LiveGranularity.sibling
    assert live_granularity(RestoreLevel.turn) is LiveGranularity.sibling


def test_resolution_agent_then_task_source_then_target() -> None:
    cfg = RecoveryConfig(
        target_level="turn",
        agent_target_level_overrides={"genrm_agent": "prompt_group"},
        task_source_target_level_overrides={"math": "sibling", "code": "prompt_group"},
    )
    assert resolve_level(cfg, "genrm_agent", "math") is RestoreLevel.prompt_group
    assert resolve_level(cfg, "other_agent", "math") is RestoreLevel.sibling
    assert resolve_level(cfg, None, "code") is RestoreLevel.prompt_group
    assert resolve_level(cfg, "other_agent", "unknown") is RestoreLevel.turn
    assert resolve_level(cfg, None, None) is RestoreLevel.turn


@given(
    st.sampled_from(LEVELS),
    st.dictionaries(st.sampled_from(["a1", "a2"]), st.sampled_from(LEVELS)),
    st.dictionaries(st.sampled_from(["t1", "t2"]), st.sampled_from(LEVELS)),
    st.sampled_from(["a1", "a2", "a3", None]),
    st.sampled_from(["t1", "t2", "t3", None]),
)
def test_resolved_level_is_never_finer_than_the_target(
    target: RestoreLevel,
    agents: dict[str, RestoreLevel],
    sources: dict[str, RestoreLevel],
    agent: str | None,
    source: str | None,
) -> None:
    agents = {k: v for k, v in agents.items() if v >= target}
    sources = {k: v for k, v in sources.items() if v >= target}
    cfg = RecoveryConfig(
        target_level=target,
        agent_target_level_overrides=agents,
        task_source_target_level_overrides=sources,
    )
    got = resolve_level(cfg, agent, source)
    assert got >= target
    if agent in agents:
        assert got is agents[agent]
    elif source in sources:
        assert got is sources[source]
    else:
        assert got is target
