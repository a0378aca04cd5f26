"""Stale continuations (docs/ledger.md#stale-continuations) on a real Postgres: every dispatch
records the policy version it went out under, and a restore plan under ``max_continue_staleness``
restarts a continuation whose version is too far behind the snapshot's anchor (reason
``too_stale``), at the boundary and not one step before."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from checkpoint_coordinator.domain.change_plan import ChangePlan
from checkpoint_coordinator.domain.vocabulary import AttemptStatus
from checkpoint_coordinator.rollouts.plan_writes import apply_plan

from .ledger_helpers import RunApi, group_body, new_run
from .test_restore_plan import NEW_ID
from .test_restore_support import fetch, manifest_doc, publish_snapshot

INSTANCE = "math/replica-0"


async def _announce(api: RunApi, *steps: int) -> None:
    for step in steps:
        await api.post("/train-steps", {"step": step})


async def _versions(api: RunApi, group_id: str) -> dict[str, int | None]:
    """The policy version of every attempt of a group, by rollout id, as the group read shows it."""
    g = await api.group(group_id)
    return {a["rollout_id"]: a["policy_version"] for s in g["siblings"] for a in s["attempts"]}


async def test_dispatch_records_the_newest_train_step_not_retired(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    rows = (await api.admit(group_body("g", 5)))["groups"][0]["rows"]
    ids = [r["rollout_id"] for r in rows]
    await api.dispatch(ids[:1])  # before any announce: no version
    await _announce(api, 0)
    await api.dispatch(ids[1:2])
    await _announce(api, 3, 5)
    await api.dispatch(ids[2:3])  # the newest step, not the last announced in some other order
    # A restore retires the steps of the discarded lineage (docs/ledger.md#the-discarded-lineage):
    # they no longer count.
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text("UPDATE train_steps SET retired_at = now(), retired_by_restore = 'r0' WHERE run_id = :r AND step = 5"), {"r": api.run_id}
        )
    await api.dispatch(ids[3:4])
    assert await _versions(api, "g") == {ids[0]: None, ids[1]: 0, ids[2]: 5, ids[3]: 3, ids[4]: None}
    # A refusal puts the row back to reserved and keeps the version; its next dispatch takes the
    # newest step of then.
    await api.post("/attempts/refused", {"rollout_ids": [ids[1]]})
    assert (await _versions(api, "g"))[ids[1]] == 0
    await _announce(api, 4)
    await api.dispatch(ids[1:2])
    assert (await _versions(api, "g"))[ids[1]] == 4


async def test_a_change_plan_that_dispatches_records_the_version_too(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """The set-based writer of decided reports (``rollouts/plan_writes.py``) sets the version in the
    statement that moves attempts to dispatched, as the dispatch itself does."""
    api = await new_run(client, admin)
    await api.admit(group_body("g", 3))
    await _announce(api, 2, 7)
    atts = await fetch(app.state.engine, "SELECT attempt_id FROM attempts WHERE run_id = :r ORDER BY generation_index", r=api.run_id)
    plan = ChangePlan(lambda gid, i: f"{gid}_{i}")
    for a in atts[:2]:
        plan.status_updates[a["attempt_id"]] = {"status": AttemptStatus.dispatched.value, "gym_instance_id": INSTANCE}
    plan.status_updates[atts[2]["attempt_id"]] = {"refusals": 1}  # another shape: no status, no version
    async with app.state.engine.begin() as conn:
        await apply_plan(conn, api.run_id, plan)
    got = await fetch(app.state.engine, "SELECT policy_version, dispatched_at IS NOT NULL AS d FROM attempts WHERE run_id = :r ORDER BY generation_index", r=api.run_id)
    assert got == [{"policy_version": 7, "d": True}, {"policy_version": 7, "d": True}, {"policy_version": None, "d": False}]


async def test_a_continuation_keeps_the_version_of_its_first_dispatch(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """Its saved turns were sampled under that version: dispatching the continuation (Gym attempt
    N+1) after a restore does not make them fresher."""
    api = await new_run(client, admin, target_level="turn")
    row = (await api.admit(group_body("t", 1)))["groups"][0]["rows"][0]
    await _announce(api, 1)
    await api.dispatch([row["rollout_id"]], INSTANCE)
    # As a restore leaves a continued row: reserved, Gym-owned, at Gym attempt N+1.
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE attempts SET status = 'reserved', gym_attempt = 1, gym_owned = true, dispatch_id = NULL "
                "WHERE run_id = :r AND rollout_id = :ro"
            ),
            {"r": api.run_id, "ro": row["rollout_id"]},
        )
    await _announce(api, 6)
    await api.dispatch([row["rollout_id"]], INSTANCE)
    assert await _versions(api, "t") == {row["rollout_id"]: 1}


async def _stale_run(client: Any, admin: Any, app: Any, staleness: int | None) -> tuple[RunApi, dict[str, str]]:
    """A turn-level run whose snapshot ``s1`` (anchored at step 6) saved four episodes on Gym,
    dispatched under no version, and under steps 3, 4 and 6; answers their rollout ids by name."""
    recovery: dict[str, Any] = {} if staleness is None else {"max_continue_staleness": staleness}
    api = await new_run(client, admin, target_level="turn", **recovery)
    rows = (await api.admit(group_body("T", 4)))["groups"][0]["rows"]
    names = dict(zip(("none", "v3", "v4", "v6"), (r["rollout_id"] for r in rows)))
    await api.dispatch([names["none"]], INSTANCE)
    await _announce(api, 3)
    await api.dispatch([names["v3"]], INSTANCE)
    await _announce(api, 4)
    await api.dispatch([names["v4"]], INSTANCE)
    await _announce(api, 5, 6)
    await api.dispatch([names["v6"]], INSTANCE)
    manifest = manifest_doc({INSTANCE: {"episodes": [(rid, 0) for rid in names.values()], "staging_keys": ["tq/x/0"]}})
    await publish_snapshot(app.state.engine, api.run_id, "s1", 6, manifest=manifest, snapshot_dir="/tmp/ckptc-s1")
    return api, names


@pytest.mark.parametrize(
    "staleness, stale",
    [
        (None, set()),  # unset: no limit
        (2, {"v3"}),  # oldest that continues: 6 - 2 = 4 (the boundary), 3 is one older
        (3, set()),  # 3 = 6 - 3 continues
        (0, {"v3", "v4"}),  # only the anchor's own version (and no version) continues
    ],
)
async def test_plan_restarts_a_continuation_older_than_the_limit(client, admin, app, staleness: int | None, stale: set[str]) -> None:  # type: ignore[no-untyped-def]
    api, names = await _stale_run(client, admin, app, staleness)
    plan = await api.get("/restore-plan?step=6")
    assert plan["anchor_step"] == 6 and plan["gym_state"]["installs"] is True
    by = {r["replaces_rollout_id"] or r["rollout_id"]: r for r in plan["rows"]}
    for name, rid in names.items():
        r = by[rid]
        if name in stale:
            # A restart, exactly as one without Gym state: a new attempt under a new rollout id.
            assert (r["disposition"], r["reason"], r["gym_attempt"], r["instance_id"]) == ("restarted", "too_stale", 0, None), r
            assert r["rollout_id"] != rid and NEW_ID.match(r["rollout_id"]) and r["capture_key"] == r["rollout_id"]
        else:
            # The others continue, "none" always: no version recorded (none announced at its
            # dispatch) is never stale.
            assert (r["disposition"], r["reason"], r["gym_attempt"], r["instance_id"]) == ("continued", "exported_by_gym", 1, INSTANCE), r
    assert plan["counts"]["continued"] == 4 - len(stale) and plan["counts"]["restarted"] == len(stale)
    expected = {"continued": {"exported_by_gym": 4 - len(stale)}}
    if stale:
        expected["restarted"] = {"too_stale": len(stale)}
    assert plan["reasons"] == expected
    assert plan["continued_by_instance"] == {INSTANCE: 4 - len(stale)}


async def test_the_limit_follows_the_snapshot_anchor(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """A limit of 2 from a snapshot anchored at step 8: version 6 continues, version 4 no longer."""
    api, names = await _stale_run(client, admin, app, 2)
    saved = [(names["v4"], 0), (names["v6"], 0)]
    await publish_snapshot(
        app.state.engine, api.run_id, "s2", 8, manifest=manifest_doc({INSTANCE: {"episodes": saved}}, "snap-s2-0badc0de"),
        snapshot_dir="/tmp/ckptc-s2",
    )
    plan = await api.get("/restore-plan?snapshot_id=s2")
    rows = {r["replaces_rollout_id"] or r["rollout_id"]: (r["disposition"], r["reason"]) for r in plan["rows"]}
    assert rows[names["v6"]] == ("continued", "exported_by_gym") and rows[names["v4"]] == ("restarted", "too_stale")
    # The two this manifest does not list have no Gym state here at all.
    assert plan["reasons"] == {"continued": {"exported_by_gym": 1}, "restarted": {"no_gym_state": 2, "too_stale": 1}}


async def test_under_an_instance_map_the_fresh_continue_on_their_live_instance(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """Into another topology (docs/ledger.md#another-gym-topology) the rule is the same: the stale
    restart, the others continue on the mapped instance."""
    api, names = await _stale_run(client, admin, app, 0)
    await api.register_placeholders("next/replica-a")
    plan = await api.get("/restore-plan?step=6&instance_map=math/replica-0=next/replica-a")
    assert plan["reasons"] == {"continued": {"exported_by_gym": 2}, "restarted": {"too_stale": 2}}
    rows = {r["replaces_rollout_id"] or r["rollout_id"]: r for r in plan["rows"]}
    assert {n for n, rid in names.items() if rows[rid]["reason"] == "too_stale"} == {"v3", "v4"}
    assert {r["instance_id"] for r in plan["rows"] if r["disposition"] == "continued"} == {"next/replica-a"}


async def test_without_gym_state_nothing_is_too_stale(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """Without Gym state nothing continues, so the restarts say so, not ``too_stale``."""
    api, _names = await _stale_run(client, admin, app, 0)
    plan = await api.get("/restore-plan?step=6&with_gym_state=false")
    assert plan["reasons"] == {"restarted": {"gym_not_restored": 4}}
