"""The restore plan (docs/ledger.md#restore-plans-and-dispositions), its checks
(docs/ledger.md#checks-before-gym) and the Gym-less variant (docs/ledger.md#without-gym-state)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_coordinator.domain.cut import Cut, CutAttempt, CutGroup, PromptRef
from checkpoint_coordinator.domain.errors import (
    CutError,
    ManifestLedgerMismatch,
    PlanError,
    TopologyMismatch,
)
from checkpoint_coordinator.domain.gym_manifest import GymManifest, build_gym_manifest
from checkpoint_coordinator.domain.identity import rollout_id_minter
from checkpoint_coordinator.domain.cut_checks import check_manifest_against_cut, manifest_disagreements, validate_cut
from checkpoint_coordinator.domain.restore_plan import (
    Disposition,
    GroupDisposition,
    PlanColumns,
    RestorePlan,
    demote_continuations,
    retire_items,
)
from checkpoint_coordinator.domain.restore_topology import compare_instance_sets, missing_participants, require_restorable_topology
from tests.oracles.restore_plan import plan_restore, restore_without_gym_state

R0, R1 = "math/replica-0", "math/replica-1"
D = Disposition


def group(gid: str, level: str, n: int, ga: int = 0, status: str = "generating") -> CutGroup:
    return CutGroup(gid, level, n, ga, status, f"sha256:{gid}", PromptRef(gid, "math"))  # type: ignore[arg-type]


def att(
    gid: str,
    i: int,
    status: str,
    *,
    inst: str | None = None,
    gatt: int = 0,
    ga: int = 0,
    rid: str | None = None,
    keys: tuple[str, ...] = (),
) -> CutAttempt:
    return CutAttempt(gid, i, f"{gid}/{i}", rid or f"{gid}_g{i}_old", inst, gatt, ga, status, keys)  # type: ignore[arg-type]


def per_sibling_ids() -> Callable[[str, int], str]:
    return lambda g, i: f"{g}_g{i}_new"


def counter_ids() -> Callable[[str, int], str]:
    c = itertools.count()
    return lambda g, i: f"{g}_g{i}_n{next(c)}"


def manifest(episodes: dict[str, list[tuple[str, int]]], restarts: dict[str, list[tuple[str, int]]] | None = None) -> GymManifest:
    restarts = restarts or {}
    iids = sorted(set(episodes) | set(restarts)) or [R0]
    return build_gym_manifest(
        "snap-1-0000abcd",
        {
            iid: {
                "episodes": episodes.get(iid, []),
                "restarts": restarts.get(iid, []),
                "staging_keys": ["k"],
                "participants": ["policy_model"],
            }
            for iid in iids
        },
    )


def rows_by_sibling(plan: RestorePlan) -> dict[tuple[str, int], Any]:
    return {(r.group_id, r.generation_index): r for r in plan.rows}


# -- the table, row by row ------------------------------------------------------------------------


def test_table_turn_and_sibling_levels() -> None:
    cut = Cut(
        [group("t", "turn", 5), group("s", "sibling", 3)],
        [
            att("t", 0, "sealed", inst=R0, keys=("k0",)),
            att("t", 1, "dispatched", inst=R0),  # exported -> continued
            att("t", 2, "dispatched", inst=R1, gatt=2),  # restart -> gym_restarted
            att("t", 3, "dispatched", inst=R1),  # no Gym state -> restarted
            att("t", 4, "reserved"),  # never sent -> dispatch
            att("s", 0, "sealed", keys=("ks",)),
            att("s", 1, "dispatched", inst=R0),  # -> rerun
            att("s", 2, "reserved"),  # -> dispatch
        ],
    )
    m = manifest({R0: [("t_g1_old", 0)]}, {R1: [("t_g2_old", 2)]})
    plan = plan_restore(cut, m, per_sibling_ids())
    rows = rows_by_sibling(plan)

    assert rows["t", 0].disposition is D.reused and rows["t", 0].staging_keys == ("k0",)
    assert rows["t", 0].rollout_id == "t_g0_old"

    cont = rows["t", 1]
    assert cont.disposition is D.continued
    assert (cont.rollout_id, cont.gym_attempt, cont.capture_key, cont.instance_id) == ("t_g1_old", 1, "t_g1_old-a1", R0)

    gr = rows["t", 2]
    assert gr.disposition is D.gym_restarted
    assert gr.rollout_id == "t_g2_new" and gr.gym_attempt == 0 and gr.capture_key == "t_g2_new"
    assert gr.instance_id is None and gr.replaces_rollout_id == "t_g2_old" and gr.attempt_id == "t/2"

    assert rows["t", 3].disposition is D.restarted and rows["t", 3].rollout_id == "t_g3_new"
    assert rows["t", 4].disposition is D.dispatch and rows["t", 4].rollout_id == "t_g4_old"

    assert rows["s", 0].disposition is D.reused
    assert rows["s", 1].disposition is D.rerun and rows["s", 1].rollout_id == "s_g1_new"
    assert rows["s", 1].group_attempt == 0  # sibling reruns keep the group attempt
    assert rows["s", 2].disposition is D.dispatch

    assert dict(plan.counts) == {
        D.reused: 2,
        D.continued: 1,
        D.restarted: 1,
        D.gym_restarted: 1,
        D.rerun: 1,
        D.dispatch: 2,
    }
    assert plan.continued_by_instance() == {R0: [("t_g1_old", 1)]}
    assert plan.retire == () or len(plan.retire) == 0


def test_table_prompt_group_level() -> None:
    cut = Cut(
        [
            group("sealed", "prompt_group", 2, ga=1),
            group("half", "prompt_group", 3, ga=1),
            group("fresh", "prompt_group", 2, ga=4),
            group("sent", "prompt_group", 2),
        ],
        [
            att("sealed", 0, "sealed", ga=1),
            att("sealed", 1, "sealed", ga=1),
            att("half", 0, "returned", ga=1),
            att("half", 1, "dispatched", ga=1),
            att("half", 2, "reserved", ga=1),
            att("fresh", 0, "reserved", ga=4),
            att("fresh", 1, "reserved", ga=4),
            att("sent", 0, "dispatched"),
            att("sent", 1, "dispatched"),
        ],
    )
    plan = plan_restore(cut, None, per_sibling_ids())
    rows = rows_by_sibling(plan)
    assert {rows["sealed", i].disposition for i in range(2)} == {D.reused}
    assert {rows["half", i].disposition for i in range(3)} == {D.rerun}
    assert {rows["half", i].group_attempt for i in range(3)} == {2}
    assert {rows["fresh", i].disposition for i in range(2)} == {D.dispatch}
    assert {rows["fresh", i].group_attempt for i in range(2)} == {4}
    assert {rows["sent", i].disposition for i in range(2)} == {D.rerun}
    assert sorted(plan.cohort_reruns) == ["half", "sent"]
    outcomes = {o.group_id: o for o in plan.group_outcomes()}
    assert outcomes["sealed"].disposition is GroupDisposition.reused
    assert outcomes["half"].disposition is GroupDisposition.rerun
    assert (outcomes["half"].previous_group_attempt, outcomes["half"].group_attempt) == (1, 2)
    assert outcomes["fresh"].disposition is GroupDisposition.dispatch


def test_finalized_and_abandoned_groups_are_skipped() -> None:
    cut = Cut(
        [group("done", "sibling", 1, status="finalized"), group("gone", "turn", 1, status="abandoned"), group("live", "sibling", 1)],
        [att("done", 0, "sealed"), att("gone", 0, "dispatched", inst=R0), att("live", 0, "dispatched")],
    )
    plan = plan_restore(cut, None, per_sibling_ids())
    assert [(r.group_id, r.disposition) for r in plan.rows] == [("live", D.rerun)]
    assert plan.skipped_groups == ("done", "gone")
    assert len(plan) == 1 and plan.rows[-1].group_id == "live"
    assert {o.group_id: o.disposition for o in plan.group_outcomes()}["gone"] is GroupDisposition.skipped


def test_failed_or_abandoned_current_attempts_get_new_attempts() -> None:
    cut = Cut(
        [group("t", "turn", 2), group("s", "sibling", 1)],
        [att("t", 0, "failed", inst=R0), att("t", 1, "abandoned", inst=R0), att("s", 0, "failed")],
    )
    plan = plan_restore(cut, None, per_sibling_ids())
    assert [r.disposition for r in plan.rows] == [D.restarted, D.restarted, D.rerun]


def test_reserved_continuation_is_continued_again_or_restarted() -> None:
    cut = Cut(
        [group("t", "turn", 2)],
        [att("t", 0, "reserved", inst=R0, gatt=1), att("t", 1, "reserved", inst=R0, gatt=3)],
    )
    plan = plan_restore(cut, manifest({R0: [("t_g0_old", 1)]}), per_sibling_ids())
    rows = rows_by_sibling(plan)
    assert rows["t", 0].disposition is D.continued and rows["t", 0].gym_attempt == 2
    assert rows["t", 0].capture_key == "t_g0_old-a2"
    assert rows["t", 1].disposition is D.restarted  # Gym-owned, but its state was not saved


def test_plain_tuples_work_like_cut_attempts() -> None:
    cut = Cut([group("s", "sibling", 2)], [tuple(att("s", 0, "sealed")), tuple(att("s", 1, "dispatched"))])  # type: ignore[list-item]
    plan = plan_restore(cut, None, per_sibling_ids())
    assert [r.disposition for r in plan.rows] == [D.reused, D.rerun]


# -- without Gym state, and after a failed Gym restore ----------------------------------------


def test_restore_without_gym_state_restarts_continuations_and_lists_retires() -> None:
    cut = Cut(
        [group("t", "turn", 4), group("s", "sibling", 2), group("old", "sibling", 1, status="abandoned")],
        [
            att("t", 0, "dispatched", inst=R0),
            att("t", 1, "reserved", inst=R1, gatt=2),
            att("t", 2, "reserved"),
            att("t", 3, "sealed", inst=R0),
            att("s", 0, "dispatched"),
            att("s", 1, "failed"),
            att("old", 0, "dispatched", inst=R0),
        ],
    )
    plan = restore_without_gym_state(cut, per_sibling_ids())
    assert not plan.with_gym_state
    rows = rows_by_sibling(plan)
    assert rows["t", 0].disposition is D.restarted
    assert rows["t", 1].disposition is D.restarted
    assert rows["t", 2].disposition is D.dispatch
    assert rows["t", 3].disposition is D.reused
    assert plan.counts[D.continued] == 0 and plan.counts[D.gym_restarted] == 0
    retire = sorted(plan.retire, key=repr)
    assert retire == sorted(
        [(R0, "t_g0_old", 0, "t/0"), (R1, "t_g1_old", 2, "t/1"), (None, "s_g0_old", 0, "s/0")], key=repr
    )
    assert sorted(retire_items(cut), key=repr) == retire
    assert plan.retire.by_instance()[R1] == [("t_g1_old", 2)]  # type: ignore[attr-defined]


def test_demote_continuations() -> None:
    cut = Cut([group("t", "turn", 2)], [att("t", 0, "dispatched", inst=R0), att("t", 1, "sealed", inst=R0)])
    plan = plan_restore(cut, manifest({R0: [("t_g0_old", 0)]}), per_sibling_ids())
    demoted = demote_continuations(plan, lambda g, i: f"{g}_g{i}_demoted")
    rows = rows_by_sibling(demoted)
    assert rows["t", 0].disposition is D.restarted and rows["t", 0].rollout_id == "t_g0_demoted"
    assert rows["t", 1].disposition is D.reused
    assert demoted.counts[D.continued] == 0 and demoted.counts[D.restarted] == 1
    assert rows_by_sibling(plan)["t", 0].disposition is D.continued  # original untouched
    with pytest.raises(PlanError):
        demote_continuations(plan, lambda g, i: "t_g1_old")


# -- checks before Gym is touched ----------------------------------------------------------------


def turn_cut() -> Cut:
    return Cut(
        [group("t", "turn", 3), group("s", "sibling", 1)],
        [
            att("t", 0, "dispatched", inst=R0),
            att("t", 1, "dispatched", inst=R1, gatt=1),
            att("t", 2, "sealed", inst=R1),
            att("s", 0, "dispatched", inst=R0),
        ],
    )


def test_agreeing_manifest() -> None:
    m = manifest({R0: [("t_g0_old", 0)], R1: [("t_g1_old", 1)]}, {R1: [("t_g2_old", 0)]})
    assert check_manifest_against_cut(m, turn_cut()) == []
    plan = plan_restore(turn_cut(), m, per_sibling_ids())
    assert rows_by_sibling(plan)["t", 2].disposition is D.reused  # a sealed restart is reused


@pytest.mark.parametrize(
    "episodes, restarts, bad, words",
    [
        ({R1: [("t_g0_old", 0)], R0: []}, {}, [R1], "owned by instance"),  # wrong instance
        ({R0: [("t_g0_old", 3)]}, {}, [R0], "Gym attempt 3"),  # wrong attempt
        ({R0: [("nobody", 0)]}, {}, [R0], "not a current attempt"),  # unknown rollout
        ({R0: [("s_g0_old", 0)]}, {}, [R0], "not a live turn-level group"),  # not turn level
        ({R1: [("t_g2_old", 0)]}, {}, [R1], "sealed in the ledger"),  # saved but sealed
        ({R0: [("t_g0_old", 0)]}, {R0: [("t_g1_old", 1)]}, [R0], "owned by instance"),
    ],
)
def test_disagreeing_manifest_is_refused_naming_instances(
    episodes: dict[str, list[tuple[str, int]]], restarts: dict[str, list[tuple[str, int]]], bad: list[str], words: str
) -> None:
    m = manifest(episodes, restarts)
    assert check_manifest_against_cut(m, turn_cut()) == bad
    reasons = manifest_disagreements(m, turn_cut())
    assert any(words in r for r in reasons[bad[0]])
    with pytest.raises(ManifestLedgerMismatch) as info:
        plan_restore(turn_cut(), m, per_sibling_ids())
    assert list(info.value.instance_ids) == bad
    assert {i.loc for i in info.value.issues} == {("instances", b) for b in bad}


def test_topology_checks() -> None:
    m = manifest({R0: [], R1: []})
    assert compare_instance_sets(m, [R0, R1]).equal
    diff = compare_instance_sets(m, [R0, "math/replica-2"])
    assert diff.missing == (R1,) and diff.unknown == ("math/replica-2",)
    assert missing_participants(m, {R0: ["policy_model", "extra"], R1: []}) == {R1: ["policy_model"]}
    require_restorable_topology(m, {R0: ["policy_model"], R1: ["policy_model", "judge"]})
    with pytest.raises(TopologyMismatch) as info:
        require_restorable_topology(m, {R0: ["policy_model"], "math/replica-2": []})
    text = str(info.value)
    assert R1 in text and "math/replica-2" in text
    with pytest.raises(TopologyMismatch) as info:
        require_restorable_topology(m, {R0: ["policy_model"], R1: []})
    assert info.value.issues[0].loc == ("instances", R1, "participants")


# -- inconsistent cuts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "groups, attempts, path",
    [
        ([group("g", "sibling", 2)], [att("g", 0, "sealed")], "groups[0].expected_generations"),
        ([group("g", "sibling", 1)], [att("g", 0, "sealed"), att("g", 0, "sealed", rid="x")], "attempts[1].generation_index"),
        ([group("g", "sibling", 1)], [att("g", 1, "sealed")], "attempts[0].generation_index"),
        ([group("g", "sibling", 1)], [att("h", 0, "sealed")], "attempts[0].group_id"),
        ([group("g", "sibling", 2)], [att("g", 0, "sealed", rid="x"), att("g", 1, "sealed", rid="x")], "attempts[1].rollout_id"),
        ([group("g", "sibling", 1)], [att("g", 0, "dispatched", inst=R0, gatt=1)], "attempts[0].gym_attempt"),
        ([group("g", "turn", 1)], [att("g", 0, "reserved", gatt=1)], "attempts[0].gym_instance_id"),
        ([group("g", "turn", 1)], [att("g", 0, "reserved", inst=R0, gatt=True)], "attempts[0].gym_attempt"),  # type: ignore[arg-type]
        ([group("g", "sibling", 1)], [att("g", 0, "returned")], "attempts[0].status"),
        ([group("g", "sibling", 1)], [att("g", 0, "running")], "attempts[0].status"),
        ([group("g", "sibling", 1, ga=2)], [att("g", 0, "sealed", ga=1)], "attempts[0].group_attempt"),
        ([group("g", "sibling", 1), group("g", "sibling", 1)], [att("g", 0, "sealed")], "groups[1].group_id"),
        ([group("g", "prefix", 1)], [att("g", 0, "sealed")], "groups[0].restore_level"),
        ([group("g", "sibling", 0)], [], "groups[0].expected_generations"),
        ([group("g", "sibling", 1, status="gone")], [att("g", 0, "sealed")], "groups[0].status"),
    ],
)
def test_inconsistent_cuts_are_refused_naming_the_field(groups: list[CutGroup], attempts: list[CutAttempt], path: str) -> None:
    cut = Cut(groups, attempts)
    with pytest.raises(CutError) as info:
        plan_restore(cut, None, per_sibling_ids())
    assert path in info.value.paths
    with pytest.raises(CutError):
        validate_cut(cut)


def test_generator_collisions_are_refused() -> None:
    cut = Cut([group("g", "sibling", 2)], [att("g", 0, "dispatched"), att("g", 1, "sealed")])
    with pytest.raises(PlanError) as info:
        plan_restore(cut, None, lambda g, i: "g_g1_old")  # an id the cut already uses
    assert info.value.loc[-1] == "rollout_id"
    cut2 = Cut([group("g", "sibling", 2)], [att("g", 0, "dispatched"), att("g", 1, "dispatched")])
    with pytest.raises(PlanError):
        plan_restore(cut2, None, lambda g, i: "same")


def test_errors_of_the_generator_propagate() -> None:
    cut = Cut([group("g", "sibling", 1)], [att("g", 0, "dispatched")])

    def broken(g: str, i: int) -> str:
        raise ValueError("entropy source down")

    with pytest.raises(ValueError, match="entropy"):
        plan_restore(cut, None, broken)


# -- properties ----------------------------------------------------------------------------------

LEVELS = ["turn", "sibling", "prompt_group"]
INSTANCES = [R0, R1, "code/replica-0"]


@st.composite
def cuts_with_manifest(draw: st.DrawFn) -> tuple[Cut, GymManifest | None]:
    groups: list[CutGroup] = []
    attempts: list[CutAttempt] = []
    saved: dict[str, list[tuple[str, int]]] = {}
    restarts: dict[str, list[tuple[str, int]]] = {}
    for k in range(draw(st.integers(0, 7))):
        gid = f"g{k}"
        level = draw(st.sampled_from(LEVELS))
        n = draw(st.integers(1, 5))
        ga = draw(st.integers(0, 3))
        status = draw(st.sampled_from(["generating"] * 6 + ["ready", "finalized", "abandoned"]))
        groups.append(group(gid, level, n, ga, status))
        cohort = draw(st.sampled_from(["sealed", "reserved", "mixed"]))
        for i in range(n):
            rid = f"{gid}_g{i}_old{draw(st.integers(0, 2))}"
            inst = draw(st.sampled_from(INSTANCES + [None]))
            gatt = 0
            if level == "sibling":
                st_ = draw(st.sampled_from(["reserved", "dispatched", "sealed", "failed", "abandoned"]))
            elif level == "prompt_group":
                st_ = cohort if cohort != "mixed" else draw(
                    st.sampled_from(["reserved", "dispatched", "returned", "sealed", "failed", "abandoned"])
                )
            else:
                st_ = draw(st.sampled_from(["reserved", "dispatched", "sealed", "failed", "abandoned", "continuation"]))
                if st_ == "continuation":
                    st_, gatt, inst = "reserved", draw(st.integers(1, 4)), inst or R0
                elif st_ in ("dispatched", "sealed", "failed", "abandoned") and inst is not None:
                    gatt = draw(st.integers(0, 3))
                live = status in ("generating", "ready")
                candidate = st_ == "dispatched" or (st_ == "reserved" and gatt > 0)
                if live and inst is not None:
                    where = draw(st.sampled_from(["saved", "restart", "none"]))
                    if where == "saved" and candidate:
                        saved.setdefault(inst, []).append((rid, gatt))
                    elif where == "restart" and (candidate or st_ != "reserved"):
                        restarts.setdefault(inst, []).append((rid, gatt))
            attempts.append(att(gid, i, st_, inst=inst, gatt=gatt, ga=ga, rid=rid))
    draw(st.randoms()).shuffle(attempts)
    m = None
    if draw(st.booleans()):
        iids = sorted(set(saved) | set(restarts) | {R0})
        m = manifest({i: saved.get(i, []) for i in iids}, {i: restarts.get(i, []) for i in iids})
    return Cut(groups, attempts), m


def expected_disposition(cut: Cut, m: GymManifest | None, gym: bool) -> dict[tuple[str, int], Disposition]:
    """The table of docs/ledger.md#restore-plans-and-dispositions, written as plainly as possible."""
    levels = {g.group_id: g.restore_level for g in cut.groups}
    live = {g.group_id for g in cut.groups if g.status in ("generating", "ready")}
    by_group: dict[str, list[CutAttempt]] = {}
    for a in cut.attempts:
        by_group.setdefault(a.group_id, []).append(a)
    index = m.rollout_index() if (m is not None and gym) else {}
    out: dict[tuple[str, int], Disposition] = {}
    for gid, rows in by_group.items():
        if gid not in live:
            continue
        if levels[gid] == "prompt_group":
            statuses = {a.status for a in rows}
            whole = D.reused if statuses == {"sealed"} else D.dispatch if statuses == {"reserved"} else D.rerun
            for a in rows:
                out[gid, a.generation_index] = whole
            continue
        for a in rows:
            own = index.get(a.rollout_id)
            if levels[gid] == "turn" and own is not None and own.saved:
                d = D.continued
            elif a.status == "sealed":
                d = D.reused
            elif a.status == "reserved" and a.gym_attempt == 0:
                d = D.dispatch
            elif levels[gid] == "turn":
                d = D.gym_restarted if own is not None else D.restarted
            else:
                d = D.rerun
            out[gid, a.generation_index] = d
    return out


def check_plan(cut: Cut, m: GymManifest | None, plan: RestorePlan, gym: bool) -> None:
    expected = expected_disposition(cut, m, gym)
    rows = list(plan.rows)
    # every live sibling exactly once, with the disposition of the table
    keys = [(r.group_id, r.generation_index) for r in rows]
    assert len(keys) == len(set(keys))
    assert {k: r.disposition for k, r in zip(keys, rows)} == expected
    # counts
    assert sum(plan.counts.values()) == len(rows) == len(plan)
    assert Counter(r.disposition for r in rows) == Counter({d: n for d, n in plan.counts.items() if n})
    old = {a.rollout_id for a in cut.attempts}
    by_key = {(a.group_id, a.generation_index): a for a in cut.attempts}
    new_ids = [r.rollout_id for r in rows if r.disposition.new_attempt]
    assert len(new_ids) == len(set(new_ids))
    assert not set(new_ids) & old
    for r in rows:
        a = by_key[r.group_id, r.generation_index]
        assert r.attempt_id == a.attempt_id
        if r.disposition is D.continued:
            assert (r.rollout_id, r.instance_id) == (a.rollout_id, a.gym_instance_id)
            assert r.gym_attempt == a.gym_attempt + 1
            assert r.capture_key == f"{a.rollout_id}-a{a.gym_attempt + 1}"
        elif r.disposition.new_attempt:
            assert r.gym_attempt == 0 and r.capture_key == r.rollout_id and r.instance_id is None
            assert r.replaces_rollout_id == a.rollout_id
        else:
            assert r.rollout_id == a.rollout_id and r.gym_attempt == a.gym_attempt
            assert r.replaces_rollout_id is None
    # prompt_group cohorts move together
    groups = {g.group_id: g for g in cut.groups}
    for gid, g in groups.items():
        if g.restore_level != "prompt_group":
            continue
        mine = [r for r in rows if r.group_id == gid]
        assert len({r.disposition for r in mine}) <= 1
        for r in mine:
            assert r.disposition in (D.reused, D.rerun, D.dispatch)
            bump = 1 if r.disposition is D.rerun else 0
            assert r.group_attempt == g.group_attempt + bump
        assert (gid in plan.cohort_reruns) == any(r.disposition is D.rerun for r in mine)
    for r in rows:
        if groups[r.group_id].restore_level != "prompt_group":
            assert r.group_attempt == groups[r.group_id].group_attempt


@settings(max_examples=300, deadline=None)
@given(cuts_with_manifest())
def test_plan_properties(case: tuple[Cut, GymManifest | None]) -> None:
    cut, m = case
    plan = plan_restore(cut, m, counter_ids())
    check_plan(cut, m, plan, gym=True)
    assert len(plan.retire) == 0


@settings(max_examples=200, deadline=None)
@given(cuts_with_manifest())
def test_without_gym_state_properties(case: tuple[Cut, GymManifest | None]) -> None:
    cut, _m = case
    plan = restore_without_gym_state(cut, counter_ids())
    check_plan(cut, None, plan, gym=False)
    assert plan.counts[D.continued] == 0 and plan.counts[D.gym_restarted] == 0
    assert sorted(plan.retire, key=repr) == sorted(retire_items(cut), key=repr)
    same = plan_restore(cut, None, counter_ids())
    assert [r.disposition for r in same.rows] == [r.disposition for r in plan.rows]


@settings(max_examples=100, deadline=None)
@given(cuts_with_manifest(), st.randoms())
def test_the_plan_does_not_depend_on_row_order(case: tuple[Cut, GymManifest | None], rnd: random.Random) -> None:
    cut, m = case
    shuffled = list(cut.attempts)
    rnd.shuffle(shuffled)
    a = plan_restore(cut, m, per_sibling_ids())
    b = plan_restore(replace(cut, attempts=shuffled), m, per_sibling_ids())
    assert sorted(a.rows, key=repr) == sorted(b.rows, key=repr)
    assert dict(a.counts) == dict(b.counts)


@settings(max_examples=100, deadline=None)
@given(cuts_with_manifest())
def test_demoted_plan_properties(case: tuple[Cut, GymManifest | None]) -> None:
    cut, m = case
    plan = plan_restore(cut, m, counter_ids())
    fresh = itertools.count()
    demoted = demote_continuations(plan, lambda g, i: f"{g}_g{i}_d{next(fresh)}")
    before = rows_by_sibling(plan)
    after = rows_by_sibling(demoted)
    assert before.keys() == after.keys()
    for k, r in after.items():
        if before[k].disposition is D.continued:
            assert r.disposition is D.restarted and r.replaces_rollout_id == before[k].rollout_id
        else:
            assert r == before[k]
    ids = [r.rollout_id for r in demoted.rows]
    assert len(ids) == len(set(ids))


@settings(max_examples=100, deadline=None)
@given(cuts_with_manifest(), st.data())
def test_a_manifest_episode_the_cut_does_not_own_is_named(case: tuple[Cut, GymManifest | None], data: st.DataObject) -> None:
    cut, m = case
    if m is None:
        return
    iid = data.draw(st.sampled_from(list(m.instances)))
    inst = m.instances[iid]
    doc = {
        i: {"episodes": list(x.episodes), "restarts": list(x.restarts), "staging_keys": x.staging_keys, "participants": x.participants}
        for i, x in m.instances.items()
    }
    doc[iid]["episodes"].append(("stranger", data.draw(st.integers(0, 3))))
    bad = build_gym_manifest(m.checkpoint_id, doc)
    assert iid in check_manifest_against_cut(bad, cut)
    with pytest.raises(ManifestLedgerMismatch) as info:
        plan_restore(cut, bad, counter_ids())
    assert iid in info.value.instance_ids
    assert inst is not None


def test_production_minter_is_trusted_and_ids_stay_unique() -> None:
    rnd = random.Random(7)
    cut = Cut(
        [group(f"g{k}", "sibling", 4) for k in range(50)],
        [att(f"g{k}", i, "dispatched") for k in range(50) for i in range(4)],
    )
    plan = plan_restore(cut, None, rollout_id_minter(lambda n: rnd.randbytes(n).hex()))
    ids = [r.rollout_id for r in plan.rows]
    assert len(set(ids)) == 200 and plan.counts[D.rerun] == 200
    assert all(r.rollout_id.startswith(f"{r.group_id}_g{r.generation_index}_a") for r in plan.rows)


def test_skipping_the_rollout_id_check_for_ledger_cuts() -> None:
    cut = Cut([group("g", "sibling", 2)], [att("g", 0, "sealed", rid="x"), att("g", 1, "sealed", rid="x")])
    with pytest.raises(CutError):
        plan_restore(cut, None, per_sibling_ids())
    # The ledger's unique constraint makes this impossible for a stored cut; the check can go.
    plan = plan_restore(cut, None, per_sibling_ids(), verify_unique_rollout_ids=False)
    assert plan.counts[D.reused] == 2


def test_summary_and_slicing() -> None:
    cut = Cut([group("s", "sibling", 3)], [att("s", i, "sealed") for i in range(3)])
    plan = plan_restore(cut, None, per_sibling_ids())
    assert plan.summary()["counts"]["reused"] == 3  # type: ignore[index]
    assert [r.generation_index for r in plan.rows[1:]] == [1, 2]
    assert plan.rows[-1].generation_index == 2
    with pytest.raises(IndexError):
        plan.rows[3]
    assert [r.generation_index for r in plan.rows.with_disposition(D.reused)] == [0, 1, 2]


@settings(max_examples=150, deadline=None)
@given(cuts_with_manifest(), st.booleans())
def test_columns_are_the_rows_of_a_disposition(case: tuple[Cut, GymManifest | None], gym: bool) -> None:
    cut, m = case
    plan = plan_restore(cut, m, counter_ids()) if gym else restore_without_gym_state(cut, counter_ids())
    for d in D:
        rows = list(plan.rows.with_disposition(d))
        cols = plan.rows.columns(d)
        assert [plan.rows._attempts[p][2] for p in plan.rows.positions(d)] == [r.attempt_id for r in rows]
        for name in PlanColumns._fields:
            assert list(getattr(cols, name)) == [getattr(r, name) for r in rows], (d, name)


@settings(max_examples=150, deadline=None)
@given(cuts_with_manifest(), st.booleans())
def test_sent_columns_are_the_rows_that_are_not_reused(case: tuple[Cut, GymManifest | None], gym: bool) -> None:
    cut, m = case
    plan = plan_restore(cut, m, counter_ids()) if gym else restore_without_gym_state(cut, counter_ids())
    plan = demote_continuations(plan, counter_ids()) if gym and plan.counts[D.continued] % 2 else plan
    sent = [r for r in plan.rows if r.disposition is not D.reused]
    cols = plan.rows.sent_columns()
    assert cols.disposition == [r.disposition.value for r in sent]
    assert cols.instance_id == [r.instance_id if r.disposition is D.continued else None for r in sent]
    for name in ("group_id", "generation_index", "rollout_id", "gym_attempt", "group_attempt", "replaces_rollout_id", "attempt_id"):
        assert getattr(cols, name) == [getattr(r, name) for r in sent], name
    # The capture key the answer derives is the row's.
    assert [rid if n == 0 else f"{rid}-a{n}" for rid, n in zip(cols.rollout_id, cols.gym_attempt)] == [r.capture_key for r in sent]


# -- a plan assembled from dispositions decided elsewhere (the ledger's SQL) -------------------


def test_assemble_plan_equals_the_pure_plan_without_its_reused_rows() -> None:
    from checkpoint_coordinator.domain.restore_plan import DISPOSITION_CODES, REASON_CODES, assemble_plan

    cut = Cut(
        groups=[group("t", "turn", 3), group("s", "sibling", 2), group("p", "prompt_group", 2, ga=1)],
        attempts=[
            att("t", 0, "dispatched", inst=R0),
            att("t", 1, "sealed", inst=R0, keys=("k",)),
            att("t", 2, "reserved"),
            att("s", 0, "failed", inst=R1),
            att("s", 1, "sealed", inst=R1),
            att("p", 0, "sealed", inst=R1, ga=1),
            att("p", 1, "dispatched", inst=R1, ga=1),
        ],
    )
    rnd = random.Random(6)
    mint = _same_ids(rollout_id_minter(lambda n: rnd.randbytes(n).hex()))
    ref = plan_restore(cut, manifest({R0: [("t_g0_old", 0)]}), mint)
    sent = [r for r in ref.rows if r.disposition is not D.reused]
    rows = [a for a in cut.attempts if (a.group_id, a.generation_index) in {(r.group_id, r.generation_index) for r in sent}]
    codes = bytes(DISPOSITION_CODES[r.disposition] for r in sent)
    why = bytes(REASON_CODES[r.reason] for r in sent)
    got = assemble_plan(
        rows, codes, mint, cohort_reruns=ref.cohort_reruns, skipped_groups=(), reused=ref.counts[D.reused], with_gym_state=True,
        reasons=why,
    )
    assert list(got.rows) == sent
    assert dict(got.counts) == dict(ref.counts) and got.total == ref.total == 7
    assert got.rows.columns(D.rerun) == ref.rows.columns(D.rerun)  # the cohort reruns at group_attempt + 1
    # Demoting continuations keeps the reused rows counted.
    demoted = demote_continuations(got, mint)
    assert demoted.total == 7 and demoted.counts[D.reused] == ref.counts[D.reused] and demoted.counts[D.continued] == 0
    with pytest.raises(ValueError):
        assemble_plan(rows, b"\x00" * len(rows), mint, cohort_reruns=(), skipped_groups=(), reused=0, with_gym_state=True)
    # With the reused rows carried (a preview that lists them): the whole plan, row for row.
    whole = assemble_plan(
        list(cut.attempts), bytes(DISPOSITION_CODES[r.disposition] for r in ref.rows), mint,
        cohort_reruns=ref.cohort_reruns, skipped_groups=(), reused=0, with_gym_state=True,
        reasons=bytes(REASON_CODES[r.reason] for r in ref.rows),
    )
    assert list(whole.rows) == list(ref.rows) and dict(whole.counts) == dict(ref.counts)


def _same_ids(minter: Callable[[str, int], str]) -> Callable[[str, int], str]:
    """A deterministic generator (the same id for the same sibling), like the service's."""
    seen: dict[tuple[str, int], str] = {}

    def mint(gid: str, i: int) -> str:
        return seen.setdefault((gid, i), minter(gid, i))

    mint.random_bits = 128  # type: ignore[attr-defined]
    return mint


# -- reasons (docs/ledger.md#row-reasons) -----------------------------------------------------


@given(cuts_with_manifest(), st.booleans(), st.data())
def test_every_row_has_a_reason_that_agrees_with_its_disposition(case: tuple[Cut, GymManifest | None], with_gym: bool, data: st.DataObject) -> None:
    from checkpoint_coordinator.domain.vocabulary import REASON_DISPOSITIONS, RowReason

    cut, m = case
    instances = sorted(m.instances) if m is not None else []
    mapped = frozenset(data.draw(st.sets(st.sampled_from(instances)) if instances else st.just(set()))) if data.draw(st.booleans()) else None
    plan = plan_restore(cut, m, counter_ids(), mapped=mapped) if with_gym else restore_without_gym_state(cut, counter_ids())
    level = {g.group_id: str(g.restore_level) for g in cut.groups}
    by_reason: dict[str, dict[str, int]] = {}
    for r in plan.rows:
        assert r.reason is not None, r
        assert r.disposition in REASON_DISPOSITIONS[r.reason], r
        by_reason.setdefault(r.disposition.value, {}).setdefault(r.reason.value, 0)
        by_reason[r.disposition.value][r.reason.value] += 1
        # The reasons that only Gym state can give never appear without it.
        if not with_gym:
            assert r.reason not in (RowReason.exported_by_gym, RowReason.restart_only_server, RowReason.instance_not_mapped), r
        if r.reason is RowReason.instance_not_mapped:
            assert mapped is not None and level[r.group_id] == "turn"
        if r.reason is RowReason.cohort_incomplete:
            assert level[r.group_id] == "prompt_group" and r.group_id in plan.cohort_reruns
    # The summary counts rows per disposition and reason, and sums to the plan.
    assert plan.reasons() == by_reason
    assert sum(n for per in plan.reasons().values() for n in per.values()) == plan.total
    if mapped is not None and m is not None:
        # An exported episode continues only on a mapped instance; elsewhere it restarts.
        for r in plan.rows:
            if r.disposition is D.continued:
                assert r.instance_id in mapped
