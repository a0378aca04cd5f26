"""The run's recovery config (docs/ledger.md#recovery-configuration): every refusal names its key."""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_coordinator.domain.config import (
    REMOVED_KEYS,
    RecoveryConfig,
    check_restart_only_servers,
    gym_checkpoint_settings,
    lease_grace_verdict,
    load_recovery_config,
    min_stall_timeout_s,
    renew_interval_s,
    reply_grace_s,
    resume_budget_s,
)
from checkpoint_coordinator.domain.errors import ConfigError
from checkpoint_coordinator.domain.levels import RestoreLevel


def refused(doc: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_recovery_config(doc)
    return info.value


def paths(err: ConfigError) -> set[str]:
    return {i.path for i in err.issues}


def test_defaults() -> None:
    cfg = load_recovery_config({})
    assert cfg.target_level is RestoreLevel.sibling
    assert cfg.allow_restart_only_gym_servers is False
    assert cfg.control_timeout_s == 60
    assert cfg.prepare_timeout_s == 300
    assert cfg.max_row_attempts == 3
    assert cfg.stall_timeout_s > cfg.min_stall_timeout_s
    assert cfg.task_source_target_level_overrides == {}
    assert cfg.agent_target_level_overrides == {}
    assert set(cfg.public_dict()) == set(RecoveryConfig.model_fields)


def test_every_key_of_section_3_exists() -> None:
    assert {
        "target_level",
        "task_source_target_level_overrides",
        "agent_target_level_overrides",
        "allow_restart_only_gym_servers",
        "control_timeout_s",
        "prepare_timeout_s",
        "drain_timeout_s",
        "data_plane_timeout_s",
        "stall_timeout_s",
        "max_row_attempts",
        "max_group_attempts",
        "max_data_attempts",
        "keep_latest_k",
        "snapshot_loss_warn_after",
    } <= set(RecoveryConfig.model_fields)


def test_unknown_key_is_refused_by_name() -> None:
    err = refused({"control_timout_s": 30})
    assert paths(err) == {"control_timout_s"}
    assert "unknown key" in err.issues[0].message


@pytest.mark.parametrize("key, replacement", sorted(REMOVED_KEYS.items()))
def test_removed_keys_name_their_replacement(key: str, replacement: str) -> None:
    err = refused({key: "sibling" if key == "default_granularity" else {}})
    assert paths(err) == {key}
    assert replacement in err.issues[0].message
    assert "removed" in err.issues[0].message


def test_prefix_is_refused_with_the_reason_wherever_it_appears() -> None:
    err = refused(
        {
            "target_level": "prefix",
            "agent_target_level_overrides": {"a": "prefix"},
            "task_source_target_level_overrides": {"math": "prefix"},
        }
    )
    assert paths(err) == {
        "target_level",
        "agent_target_level_overrides.a",
        "task_source_target_level_overrides.math",
    }
    assert all("generation cuts" in i.message for i in err.issues)


@pytest.mark.parametrize("target", ["sibling", "prompt_group"])
@pytest.mark.parametrize("key", ["agent_target_level_overrides", "task_source_target_level_overrides"])
def test_an_override_finer_than_the_target_is_refused_naming_the_key(target: str, key: str) -> None:
    err = refused({"target_level": target, key: {"ok": "prompt_group", "too_fine": "turn"}})
    assert paths(err) == {f"{key}.too_fine"}
    assert "finer than target_level" in err.issues[0].message


def test_an_override_equal_or_coarser_is_accepted() -> None:
    cfg = load_recovery_config(
        {
            "target_level": "sibling",
            "agent_target_level_overrides": {"a": "sibling", "b": "prompt_group"},
            "task_source_target_level_overrides": {"math/gsm8k": "prompt_group"},
        }
    )
    assert cfg.agent_target_level_overrides["b"] is RestoreLevel.prompt_group


def test_override_names_must_be_valid() -> None:
    err = refused({"agent_target_level_overrides": {"bad name": "sibling"}})
    assert paths(err) == {'agent_target_level_overrides["bad name"]'}


def test_overrides_must_be_maps() -> None:
    err = refused({"agent_target_level_overrides": ["sibling"]})
    assert paths(err) == {"agent_target_level_overrides"}


@pytest.mark.parametrize("target", ["sibling", "prompt_group"])
def test_restart_only_flag_with_a_coarser_target_is_refused(target: str) -> None:
    err = refused({"target_level": target, "allow_restart_only_gym_servers": True})
    assert paths(err) == {"allow_restart_only_gym_servers"}


def test_restart_only_flag_with_turn_is_accepted() -> None:
    cfg = load_recovery_config({"target_level": "turn", "allow_restart_only_gym_servers": True})
    assert cfg.allow_restart_only_gym_servers


@pytest.mark.parametrize(
    "key",
    ["control_timeout_s", "prepare_timeout_s", "drain_timeout_s", "data_plane_timeout_s", "stall_timeout_s", "resume_timeout_s"],
)
@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, True, "60", 10**9])
def test_timeouts_are_positive_finite_bounded_numbers(key: str, value: Any) -> None:
    err = refused({key: value})
    assert key in paths(err)


@pytest.mark.parametrize(
    "key", ["max_row_attempts", "max_group_attempts", "max_data_attempts", "keep_latest_k", "snapshot_loss_warn_after"]
)
@pytest.mark.parametrize("value", [0, -3, 2.0, True, "3", 10**7])
def test_budgets_are_bounded_positive_ints(key: str, value: Any) -> None:
    assert key in paths(refused({key: value}))


def test_stall_timeout_must_outlast_the_longest_park_and_the_error_gives_the_minimum() -> None:
    doc = {
        "control_timeout_s": 30,
        "prepare_timeout_s": 100,
        "drain_timeout_s": 50,
        "data_plane_timeout_s": 200,
        "resume_timeout_s": 40,
    }
    # park = (100 + 5) + (30 + 5) + 50 + 200 + 40 = 430
    err = refused({**doc, "stall_timeout_s": 430})
    assert paths(err) == {"stall_timeout_s"}
    assert "430 s" in err.issues[0].message
    cfg = load_recovery_config({**doc, "stall_timeout_s": 430.5})
    assert cfg.min_stall_timeout_s == 430


def test_default_resume_budget_is_two_control_calls() -> None:
    cfg = load_recovery_config({"control_timeout_s": 2, "stall_timeout_s": 2000})
    assert reply_grace_s(cfg) == 2
    assert resume_budget_s(cfg) == 8


def test_resume_timeout_must_fit_one_control_call() -> None:
    err = refused({"control_timeout_s": 60, "resume_timeout_s": 64})
    assert paths(err) == {"resume_timeout_s"}


def test_all_problems_are_reported_at_once() -> None:
    err = refused(
        {
            "default_granularity": "sibling",
            "target_level": "sibling",
            "agent_target_level_overrides": {"a": "turn"},
            "control_timeout_s": -1,
            "nonsense": 1,
        }
    )
    assert paths(err) == {
        "default_granularity",
        "agent_target_level_overrides.a",
        "control_timeout_s",
        "nonsense",
    }


def test_constructor_and_model_validate_raise_config_error_too() -> None:
    with pytest.raises(ConfigError):
        RecoveryConfig(target_level="prefix")
    with pytest.raises(ConfigError):
        RecoveryConfig.model_validate({"bogus": 1})
    with pytest.raises(ConfigError):
        RecoveryConfig.model_validate_json('{"stall_timeout_s": 1}')
    with pytest.raises(ConfigError) as info:
        load_recovery_config(["not", "a", "map"])
    assert info.value.issues[0].path == ""


def test_config_error_is_picklable_and_names_the_code() -> None:
    err = refused({"nonsense": 1})
    again = pickle.loads(pickle.dumps(err))
    assert again.issues == err.issues
    assert err.code == "invalid_recovery_config"
    assert err.issues[0].pointer == "/nonsense"


def test_config_is_immutable() -> None:
    cfg = load_recovery_config({})
    with pytest.raises(Exception):
        cfg.control_timeout_s = 1  # type: ignore[misc]


def test_gym_checkpoint_settings_derive_lease_grace_and_exclude_the_token() -> None:
    cfg = load_recovery_config({"control_timeout_s": 45})
    settings_ = gym_checkpoint_settings(cfg)
    assert settings_ == {"lease_grace_seconds": 45}
    assert not any("token" in k for k in settings_)


def test_lease_grace_verdict_and_renew_interval() -> None:
    cfg = load_recovery_config({"control_timeout_s": 60})
    assert lease_grace_verdict(cfg, 59) == "too_short"
    assert lease_grace_verdict(cfg, 60) == "ok"
    assert lease_grace_verdict(cfg, 240) == "ok"
    assert lease_grace_verdict(cfg, 241) == "too_long"
    assert renew_interval_s(cfg) == 10
    fast = load_recovery_config({"control_timeout_s": 0.003, "stall_timeout_s": 2000})
    assert renew_interval_s(fast) == 0.01


def test_restart_only_policy() -> None:
    turn = load_recovery_config({"target_level": "turn"})
    allowed = load_recovery_config({"target_level": "turn", "allow_restart_only_gym_servers": True})
    found = {"math/replica-1": ["tools"], "math/replica-0": ["calendar", "agent"]}

    refused_ = check_restart_only_servers(turn, found)
    assert not refused_.accepted
    for name in ("math/replica-0:agent", "math/replica-0:calendar", "math/replica-1:tools"):
        assert name in refused_.error  # type: ignore[operator]

    warned = check_restart_only_servers(allowed, found)
    assert warned.accepted and "math/replica-1:tools" in warned.warnings[0]

    no_effect = check_restart_only_servers(allowed, {})
    assert no_effect.accepted and "no effect" in no_effect.warnings[0]

    assert check_restart_only_servers(turn, {}).accepted
    sibling = load_recovery_config({})
    quiet = check_restart_only_servers(sibling, found)
    assert quiet.accepted and not quiet.warnings


positive = st.floats(min_value=0.001, max_value=3000, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(positive, positive, positive, positive, st.floats(min_value=0.01, max_value=600000))
def test_stall_rule_matches_the_stated_formula(
    control: float, prepare: float, drain: float, data_plane: float, stall: float
) -> None:
    doc = {
        "control_timeout_s": min(control, 3600),
        "prepare_timeout_s": prepare,
        "drain_timeout_s": drain,
        "data_plane_timeout_s": data_plane,
        "stall_timeout_s": stall,
    }
    grace = min(doc["control_timeout_s"], 5)
    minimum = (
        prepare + grace + doc["control_timeout_s"] + grace + drain + data_plane
        + 2 * (doc["control_timeout_s"] + grace)
    )
    try:
        cfg = load_recovery_config(doc)
    except ConfigError as err:
        assert stall <= minimum + 1e-6
        assert paths(err) == {"stall_timeout_s"}
    else:
        assert stall > minimum - 1e-6
        assert math.isclose(min_stall_timeout_s(cfg), minimum)
