"""The straggler rule alone (docs/ledger.md#stragglers): what giving up an episode plans at each
level, and what a late report of it is answered. Pure rules over rows built here."""

from __future__ import annotations

from typing import Any

from checkpoint_coordinator.domain.change_plan import AttemptRow, Budgets, GroupRow, GroupState
from checkpoint_coordinator.domain.stragglers import STRAGGLER, decide_stragglers, name_replacements
from checkpoint_coordinator.domain.vocabulary import RetirementState

BUDGETS = Budgets(max_row_attempts=3, max_group_attempts=3, max_data_attempts=2)


def _mint(group_id: str, generation_index: int) -> str:
    return f"{group_id}_g{generation_index}_new"


def _attempt(i: int, status: str = "dispatched", *, instance: str | None = "math/0", used: int = 0) -> AttemptRow:
    return AttemptRow(i + 1, "g", i, f"g_g{i}_a", instance, 0, 0, status, True, 0, None, None, None, None, False, "d1",
                      RetirementState.none.value, row_attempts_used=used)


def _state(level: str, *atts: AttemptRow) -> dict[str, GroupState]:
    return {"g": GroupState(GroupRow("g", level, len(atts), 0, 0, "generating"), atts)}


def _changes(d: Any, a: AttemptRow) -> dict[str, Any]:
    return d.plan.status_updates[a.attempt_id]


def test_a_sibling_is_replaced_alone_and_spends_a_row_attempt() -> None:
    stuck, other = _attempt(0), _attempt(1)
    d = decide_stragglers(_state("turn", stuck, other), {stuck.rollout_id: "math/0"}, BUDGETS, _mint)
    assert d.extra == [stuck.rollout_id]
    assert _changes(d, stuck) == {"status": "abandoned", "is_current": False, "failure_class": None, "retirement": "retire_pending",
                                  "end_reason": STRAGGLER}
    assert other.attempt_id not in d.plan.status_updates
    assert list(d.plan.new_attempts) == ["g_g0_new"] and d.plan.row_attempts == {("g", 0): 1}
    assert [a.rollout_id for a in d.plan.retires] == [stuck.rollout_id]


def test_a_cohort_reruns_whole_and_two_stragglers_of_it_are_both_named() -> None:
    a, b, c = _attempt(0), _attempt(1), _attempt(2, "returned")
    d = decide_stragglers(_state("prompt_group", a, b, c), {a.rollout_id: "math/0", b.rollout_id: "math/0"}, BUDGETS, _mint)
    assert d.extra == [a.rollout_id, b.rollout_id]
    assert [_changes(d, x).get("end_reason") for x in (a, b, c)] == [STRAGGLER, STRAGGLER, None]
    assert all(_changes(d, x)["is_current"] is False for x in (a, b, c))
    assert d.plan.group_updates["g"] == {"group_attempt": 1}
    assert sorted(r["generation_index"] for r in d.plan.new_attempts.values()) == [0, 1, 2]


def test_the_last_row_attempt_reruns_the_cohort_and_the_last_group_attempt_abandons_it() -> None:
    stuck = _attempt(0, used=2)
    d = decide_stragglers(_state("sibling", stuck, _attempt(1)), {stuck.rollout_id: "math/0"}, BUDGETS, _mint)
    assert d.plan.group_updates["g"]["group_attempt"] == 1
    spent = Budgets(max_row_attempts=1, max_group_attempts=1, max_data_attempts=1)
    d = decide_stragglers(_state("sibling", _attempt(0), _attempt(1)), {"g_g0_a": "math/0"}, spent, _mint)
    assert d.plan.group_updates["g"]["status"] == "abandoned" and not d.plan.new_attempts


def test_an_attempt_sent_without_an_instance_is_retired_where_gym_named_it() -> None:
    stuck = _attempt(0, instance=None)
    d = decide_stragglers(_state("sibling", stuck), {stuck.rollout_id: "math/1"}, BUDGETS, _mint)
    assert _changes(d, stuck)["gym_instance_id"] == "math/1"
    assert [(a.rollout_id, a.gym_instance_id) for a in d.plan.retires] == [(stuck.rollout_id, "math/1")]


def test_only_a_dispatched_current_attempt_of_a_generating_group_is_given_up() -> None:
    for stuck in (_attempt(0, "reserved"), _attempt(0, "returned")):
        assert decide_stragglers(_state("turn", stuck), {stuck.rollout_id: "math/0"}, BUDGETS, _mint).extra == []
    ready = {"g": GroupState(GroupRow("g", "turn", 1, 0, 0, "ready"), [_attempt(0)])}
    assert decide_stragglers(ready, {"g_g0_a": "math/0"}, BUDGETS, _mint).extra == []


def test_a_late_report_of_a_replaced_row_names_why_and_its_replacement() -> None:
    old = _attempt(0, "abandoned")
    old.is_current, old.end_reason = False, STRAGGLER
    new = AttemptRow(9, "g", 0, "g_g0_new", None, 0, 0, "reserved", True, 0, None, None, None, None, False, None, "none")
    results = [{"rollout_id": old.rollout_id, "result": "unchanged"}, {"rollout_id": "other", "result": "failed"}]
    name_replacements(results, {old.rollout_id: old}, _state("sibling", new))
    assert results[0] == {"rollout_id": old.rollout_id, "result": "unchanged", "end_reason": STRAGGLER, "replaced_by": "g_g0_new"}
    assert results[1] == {"rollout_id": "other", "result": "failed"}
