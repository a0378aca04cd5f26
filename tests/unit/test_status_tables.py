"""The attempt, group and retirement transition tables agree with the rules production decides by.

``rollout_rules`` decides every report (fail, seal, finalize, abandon); the tables in
``domain/snapshot_state.py`` document the same machines. Every move a rule can make, from every
status, must be a move of its table, and every rule table must cover every status.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from checkpoint_coordinator.domain import rollout_rules as rules
from checkpoint_coordinator.domain.levels import RestoreLevel
from checkpoint_coordinator.domain.snapshot_state import (
    ATTEMPT_STATUS,
    GROUP_STATUS,
    RETIREMENT,
    AttemptStatus,
    GroupStatus,
    RetirementState,
)


def _attempt(status: str, *, current: bool = True) -> rules.AttemptRow:
    return rules.AttemptRow(1, "g", 0, "r", "math", 1, 0, status, current, 0, {"rollout_id": "r#1"}, None, None, [], True, None,
                            RetirementState.none.value)


def _group(status: str, level: RestoreLevel) -> rules.GroupRow:
    return rules.GroupRow("g", level.value, 2, 0, 0, status)


LEVELS = list(RestoreLevel)


def test_every_status_has_a_fail_and_a_seal_rule() -> None:
    every = {s.value for s in AttemptStatus}
    assert set(rules.FAIL_RULES) == every
    assert set(rules.SEAL_RULES) == every


@pytest.mark.parametrize("level", LEVELS)
def test_the_fail_and_seal_rules_move_attempts_only_along_the_table(level: RestoreLevel) -> None:
    report = SimpleNamespace(rollout_id="r", receipt={"rollout_id": "r#1"}, staging_keys=[], reward=None, mask_sample=None)
    for status in AttemptStatus:
        for group_status in GroupStatus:
            for current in (True, False):
                a, g = _attempt(status.value, current=current), _group(group_status.value, level)
                verdict = rules.FAIL_RULES[status.value](a, rules.GroupState(g, [a]))
                if verdict == "fail":
                    for ended in rules._FAIL_RESULT.values():
                        assert AttemptStatus(ended) in ATTEMPT_STATUS.allowed[status], (status, ended)
                seal = rules.SEAL_RULES[status.value](a, report, g)  # type: ignore[arg-type]
                if isinstance(seal, str) and seal != "unchanged":
                    assert AttemptStatus(seal) in ATTEMPT_STATUS.allowed[status], (status, seal)


def test_the_group_rules_move_groups_only_along_the_table() -> None:
    for status in GroupStatus:
        g = _group(status.value, RestoreLevel(LEVELS[0]))
        for rule in (rules._finalize_rule, rules._abandon_rule):
            verdict = rule(g)
            if isinstance(verdict, str) and verdict != "unchanged":
                assert GroupStatus(verdict) in GROUP_STATUS.allowed[status], (status, verdict)
            elif verdict == "unchanged":
                assert GROUP_STATUS.terminal(status), f"{rule.__name__}: a repeat on {status} should only come once it ended"


def test_retirement_moves_production_makes_are_in_the_table() -> None:
    """Production's retirement writes: a failed or replaced attempt is marked retire_pending
    (rollout_rules), a restore's unknown attempts too (rewind), a delivered retire goes
    straight to forget_pending (outbox worker), an ended attempt's forget is queued (rollouts store)."""
    made = [
        (RetirementState.none, RetirementState.retire_pending),
        (RetirementState.retire_pending, RetirementState.forget_pending),  # outbox worker, retire delivered
        (RetirementState.retired, RetirementState.forget_pending),
        (RetirementState.none, RetirementState.forget_pending),
    ]
    for before, after in made:
        assert after in RETIREMENT.allowed[before], (before, after)
