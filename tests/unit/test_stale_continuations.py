"""Stale continuations (docs/ledger.md#stale-continuations), the pure parts: the limit and its
boundary, the plan's rule (on the reference planner the ledger's is compared with), and the Gym
manifest a restore installs."""

from __future__ import annotations

import itertools
from typing import Callable

import pytest

from checkpoint_coordinator.domain.cut import Cut, CutAttempt, CutGroup, PromptRef
from checkpoint_coordinator.domain.gym_manifest import GymManifest, build_gym_manifest
from checkpoint_coordinator.domain.restore_plan import (
    Disposition,
    PlanRow,
    RestorePlan,
    demote_continuations,
    oldest_continuable_version,
    too_stale,
)
from checkpoint_coordinator.domain.restore_topology import only_continued
from checkpoint_coordinator.domain.vocabulary import REASON_DISPOSITIONS, RowReason
from tests.oracles.restore_plan import plan_restore

D = Disposition
R0, R1 = "math/replica-0", "math/replica-1"


def group(gid: str, level: str, n: int) -> CutGroup:
    return CutGroup(gid, level, n, 0, "generating", f"sha256:{gid}", PromptRef(gid, "math"))  # type: ignore[arg-type]


def att(gid: str, i: int, status: str, *, inst: str | None = None) -> CutAttempt:
    return CutAttempt(gid, i, 100 + i, f"{gid}_g{i}_old", inst, 0, 0, status, ())  # type: ignore[arg-type]


def counter_ids() -> Callable[[str, int], str]:
    c = itertools.count()
    return lambda g, i: f"{g}_g{i}_n{next(c)}"


def manifest(episodes: dict[str, list[tuple[str, int]]]) -> GymManifest:
    return build_gym_manifest(
        "snap-1-0000abcd",
        {iid: {"episodes": eps, "restarts": [], "staging_keys": ["k"], "participants": ["policy_model"]} for iid, eps in episodes.items()},
    )


def rows_by_sibling(plan: RestorePlan) -> dict[tuple[str, int], PlanRow]:
    return {(r.group_id, r.generation_index): r for r in plan.rows}


@pytest.mark.parametrize(
    "version, anchor, limit, stale",
    [
        (4, 6, 2, False),  # exactly anchor - limit: continues
        (3, 6, 2, True),  # one older: restarts
        (6, 6, 0, False),
        (5, 6, 0, True),
        (0, 6, None, False),  # unset: no limit
        (None, 6, 0, False),  # no version recorded: never stale
        (7, 6, 0, False),  # a version past the anchor (a discarded lineage's step) is not stale
        (0, 2, 5, False),  # a limit reaching before step 0
    ],
)
def test_the_limit_and_its_boundary(version: int | None, anchor: int, limit: int | None, stale: bool) -> None:
    assert too_stale(version, oldest_continuable_version(anchor, limit)) is stale


def test_oldest_continuable_version() -> None:
    assert oldest_continuable_version(10, 3) == 7
    assert oldest_continuable_version(10, 0) == 10
    assert oldest_continuable_version(10, None) is None


def test_a_stale_continuation_restarts_like_one_without_gym_state() -> None:
    groups = [group("t", "turn", 3)]
    attempts = [att("t", i, "dispatched", inst=R0) for i in range(3)]
    cut = Cut(groups, attempts)
    m = manifest({R0: [(a.rollout_id, 0) for a in attempts]})
    plan = plan_restore(cut, m, counter_ids(), too_stale=frozenset({attempts[1].attempt_id}))
    by = rows_by_sibling(plan)
    assert [by[("t", i)].disposition for i in range(3)] == [D.continued, D.restarted, D.continued]
    stale = by[("t", 1)]
    # A new attempt under a new rollout id at Gym attempt 0, sent to any instance, as any restart.
    assert stale.reason is RowReason.too_stale and stale.disposition in REASON_DISPOSITIONS[RowReason.too_stale]
    assert stale.rollout_id != attempts[1].rollout_id and stale.replaces_rollout_id == attempts[1].rollout_id
    assert (stale.gym_attempt, stale.instance_id, stale.capture_key) == (0, None, stale.rollout_id)
    assert plan.reasons() == {"continued": {"exported_by_gym": 2}, "restarted": {"too_stale": 1}}
    assert plan.continued_by_instance() == {R0: sorted([(attempts[0].rollout_id, 1), (attempts[2].rollout_id, 1)])}
    # A Gym restore that fails afterwards demotes only the continuations; the stale row keeps its reason.
    demoted = demote_continuations(plan, counter_ids())
    assert demoted.reasons() == {"restarted": {"gym_restore_failed": 2, "too_stale": 1}}


def test_an_unmapped_instance_is_the_reason_before_staleness() -> None:
    attempts = [att("t", 0, "dispatched", inst=R0), att("t", 1, "dispatched", inst=R1)]
    cut = Cut([group("t", "turn", 2)], attempts)
    m = manifest({R0: [(attempts[0].rollout_id, 0)], R1: [(attempts[1].rollout_id, 0)]})
    plan = plan_restore(cut, m, counter_ids(), mapped=frozenset({R0}), too_stale=frozenset(a.attempt_id for a in attempts))
    assert [r.reason for r in plan.rows] == [RowReason.too_stale, RowReason.instance_not_mapped]


def test_gym_installs_only_what_the_plan_continues() -> None:
    m = build_gym_manifest(
        "snap-1-0000abcd",
        {
            R0: {"episodes": [("a", 0), ("b", 2)], "restarts": [("c", 0)], "staging_keys": ["k"], "participants": ["policy_model"]},
            R1: {"episodes": [("d", 0)], "restarts": [], "staging_keys": [], "participants": ["policy_model"]},
        },
    )
    assert only_continued(m, ["a", "b", "d"]) is m  # nothing dropped: the manifest as it is
    kept = only_continued(m, ["b"])
    assert [e.rollout_id for e in kept.instances[R0].episodes] == ["b"] and kept.instances[R1].episodes == ()
    # Restarts, staging keys and participants stay: each instance is still restored (empty).
    assert kept.instances[R0].restarts == m.instances[R0].restarts and kept.instances[R0].participants == m.instances[R0].participants
    assert set(kept.instances) == {R0, R1} and kept.checkpoint_id == m.checkpoint_id
