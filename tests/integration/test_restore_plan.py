"""Restore plans (docs/ledger.md#restore-plans-and-dispositions): every row of the disposition
table, snapshot selection, and the rewind of the live ledger without Gym state
(docs/ledger.md#without-gym-state), on a real Postgres."""

from __future__ import annotations

import re
from typing import Any

import pytest

from .ledger_helpers import RunApi, group_body, new_run
from .test_restore_support import fetch, manifest_doc, publish_snapshot

INSTANCE = "math/replica-0"
NEW_ID = re.compile(r"^(?P<g>.+)_g(?P<i>\d+)_a[0-9a-f]{32}$")


async def _table_run(client: Any, admin: dict[str, str]) -> tuple[RunApi, dict[str, list[dict[str, Any]]]]:
    """One run holding every state of the table in docs/ledger.md#restore-plans-and-dispositions, at
    every level."""
    api = await new_run(
        client,
        admin,
        target_level="turn",
        agent_target_level_overrides={"sib_agent": "sibling", "pg_agent": "prompt_group"},
    )
    groups = (
        await api.admit(
            group_body("T", 5),
            group_body("S", 3, agent_name="sib_agent"),
            group_body("P1", 2, agent_name="pg_agent"),
            group_body("P2", 2, agent_name="pg_agent"),
            group_body("P3", 2, agent_name="pg_agent"),
            group_body("P4", 2, agent_name="pg_agent"),
        )
    )["groups"]
    rows = {g["group_id"]: g["rows"] for g in groups}
    assert [g["restore_level"] for g in groups] == ["turn", "sibling", "prompt_group", "prompt_group", "prompt_group", "prompt_group"]
    T, S = rows["T"], rows["S"]
    await api.dispatch([r["rollout_id"] for r in T[:4] + S[:2] + rows["P1"] + rows["P2"] + rows["P4"]], INSTANCE)
    await api.seal([T[0], S[0]] + rows["P1"] + rows["P2"][:1])
    return api, rows


def _by_sibling(plan_rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["group_id"], r["generation_index"]): r for r in plan_rows}


async def test_plan_covers_every_row_of_the_disposition_table(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _table_run(client, admin)
    T = rows["T"]
    manifest = manifest_doc({INSTANCE: {"episodes": [(T[1]["rollout_id"], 0)], "restarts": [(T[2]["rollout_id"], 0)], "staging_keys": ["tq/x/0"]}})
    await publish_snapshot(app.state.engine, api.run_id, "s1", 7, manifest=manifest, snapshot_dir="/tmp/ckptc-s1")
    plan = await api.get("/restore-plan?step=7&include_reused=true")
    assert plan["snapshot_id"] == "s1" and plan["anchor_step"] == 7 and plan["data_plane_ref"]["path"] == "/data/s1"
    assert plan["gym_checkpoint_id"] == "snap-s1-0badc0de" and plan["gym_state"]["installs"] is True
    assert plan["counts"] == {"reused": 4, "continued": 1, "restarted": 1, "gym_restarted": 1, "rerun": 5, "dispatch": 4}
    assert plan["total"] == 16 and plan["cohort_reruns"] == ["P2", "P4"]
    by = _by_sibling(plan["rows"])
    disp = {k: v["disposition"] for k, v in by.items()}
    assert disp == {
        ("T", 0): "reused", ("T", 1): "continued", ("T", 2): "gym_restarted", ("T", 3): "restarted", ("T", 4): "dispatch",
        ("S", 0): "reused", ("S", 1): "rerun", ("S", 2): "dispatch",
        ("P1", 0): "reused", ("P1", 1): "reused",
        ("P2", 0): "rerun", ("P2", 1): "rerun",
        ("P3", 0): "dispatch", ("P3", 1): "dispatch",
        ("P4", 0): "rerun", ("P4", 1): "rerun",
    }
    # Continued: same rollout id, Gym attempt N+1, on the instance that owns the state.
    cont = by[("T", 1)]
    assert cont["rollout_id"] == T[1]["rollout_id"] and cont["gym_attempt"] == 1
    assert cont["capture_key"] == T[1]["rollout_id"] + "-a1" and cont["instance_id"] == INSTANCE
    # Reused keeps its attempt and staging keys.
    assert by[("T", 0)]["rollout_id"] == T[0]["rollout_id"] and by[("T", 0)]["staging_keys"] == [f"tq/{T[0]['capture_key']}/0"]
    # Restarts and reruns: a new rollout id naming the sibling, Gym attempt 0, any instance.
    for key in [("T", 2), ("T", 3), ("S", 1), ("P2", 0), ("P2", 1), ("P4", 0), ("P4", 1)]:
        r = by[key]
        m = NEW_ID.match(r["rollout_id"])
        assert m and (m["g"], int(m["i"])) == key, r
        assert r["rollout_id"] != r["replaces_rollout_id"] and r["gym_attempt"] == 0 and r["capture_key"] == r["rollout_id"]
        assert r["instance_id"] is None
    # A cohort that reruns moves to the next group attempt; never-sent rows keep their identity.
    assert {by[("P2", i)]["group_attempt"] for i in (0, 1)} == {1} and by[("S", 1)]["group_attempt"] == 0
    assert by[("P3", 0)]["rollout_id"] == rows["P3"][0]["rollout_id"] and by[("T", 4)]["rollout_id"] == T[4]["rollout_id"]
    # By default reused rows are left out: they are not sent.
    plain = await api.get("/restore-plan?snapshot_id=s1")
    assert len(plain["rows"]) == 12 and all(r["disposition"] != "reused" for r in plain["rows"])
    # The preview is stable: the same new rollout ids every time (until a restore bumps the epoch).
    assert _by_sibling(plain["rows"]) == {k: {x: y for x, y in v.items() if x != "staging_keys"} for k, v in by.items() if v["disposition"] != "reused"}


async def test_plan_without_gym_state_and_pages(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _table_run(client, admin)
    T = rows["T"]
    manifest = manifest_doc({INSTANCE: {"episodes": [(T[1]["rollout_id"], 0)], "restarts": [(T[2]["rollout_id"], 0)]}})
    await publish_snapshot(app.state.engine, api.run_id, "s1", 3, manifest=manifest, snapshot_dir="/tmp/s1")
    plan = await api.get("/restore-plan?with_gym_state=false")
    assert plan["gym_state"] == {"installs": False, "reason": "with_gym_state is false"}
    assert plan["counts"] == {"reused": 4, "continued": 0, "restarted": 3, "gym_restarted": 0, "rerun": 5, "dispatch": 4}
    # Every attempt the cut knows as running in Gym: T1-T3, S1, P2's dispatched row, P4's two.
    assert plan["retires"] == 7
    first = await api.get("/restore-plan?with_gym_state=false&limit=5")
    second = await api.get(f"/restore-plan?with_gym_state=false&limit=5&cursor={first['next_cursor']}")
    third = await api.get(f"/restore-plan?with_gym_state=false&limit=5&cursor={second['next_cursor']}")
    assert third["next_cursor"] is None and first["rows"] + second["rows"] + third["rows"] == plan["rows"]
    only = await api.get("/restore-plan?with_gym_state=false&disposition=rerun")
    assert {r["disposition"] for r in only["rows"]} == {"rerun"} and len(only["rows"]) == 5


async def test_plan_picks_the_newest_snapshot_compatible_with_the_step(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    g = (await api.admit(group_body("g1", 2)))["groups"][0]["rows"]
    await publish_snapshot(app.state.engine, api.run_id, "at5", 5)
    await api.dispatch([g[0]["rollout_id"]])
    await publish_snapshot(app.state.engine, api.run_id, "at9", 9)
    assert (await api.get("/restore-plan?step=8"))["snapshot_id"] == "at5"
    assert (await api.get("/restore-plan?step=9"))["snapshot_id"] == "at9"
    assert (await api.get("/restore-plan"))["snapshot_id"] == "at9"
    assert (await api.get("/restore-plan?step=5"))["counts"]["dispatch"] == 2
    assert (await api.get("/restore-plan?step=9"))["counts"]["rerun"] == 1
    r = await client.get(f"/v1/runs/{api.run_id}/restore-plan?step=4", headers=api.h)
    assert r.status_code == 404 and r.json()["code"] == "no_compatible_snapshot"
    r = await client.get(f"/v1/runs/{api.run_id}/restore-plan?snapshot_id=nope", headers=api.h)
    assert r.status_code == 404 and r.json()["code"] == "snapshot_not_found"
    r = await client.get(f"/v1/runs/{api.run_id}/restore-plan?snapshot_id=at9&step=5", headers=api.h)
    assert r.status_code == 409 and r.json()["code"] == "snapshot_after_step"
    r = await client.get(f"/v1/runs/{api.run_id}/restore-plan?step=-1", headers=api.h)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "step"
    r = await client.get(f"/v1/runs/{api.run_id}/restore-plan?disposition=bogus", headers=api.h)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "disposition"


async def test_plan_refuses_a_manifest_that_disagrees_with_the_cut_naming_the_instance(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="turn")
    rows = (await api.admit(group_body("T", 2)))["groups"][0]["rows"]
    await api.dispatch([r["rollout_id"] for r in rows], INSTANCE)
    manifest = manifest_doc(
        {
            INSTANCE: {"episodes": [(rows[0]["rollout_id"], 0)]},
            "math/replica-1": {"episodes": [(rows[1]["rollout_id"], 0)]},  # the ledger says replica-0 owns it
        }
    )
    await publish_snapshot(app.state.engine, api.run_id, "s1", manifest=manifest, snapshot_dir="/tmp/s1")
    r = await client.get(f"/v1/runs/{api.run_id}/restore-plan", headers=api.h)
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["code"] == "gym_manifest_disagrees_with_ledger" and body["instances"] == ["math/replica-1"]
    assert "math/replica-1" in body["detail"] and "owned by instance 'math/replica-0'" in body["detail"]
    r = await client.post(f"/v1/runs/{api.run_id}/restores", json={"restore_id": "r1"}, headers=api.h)
    assert r.status_code == 409 and r.json()["code"] == "gym_manifest_disagrees_with_ledger"
    assert (await fetch(app.state.engine, "SELECT count(*) AS n FROM restores"))[0]["n"] == 0


async def _after_cut_changes(api: RunApi, rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What happens after the snapshot, before the crash."""
    T, S = rows["T"], rows["S"]
    late = (await api.admit(group_body("LATE", 1)))["groups"][0]["rows"]
    await api.dispatch([late[0]["rollout_id"]], INSTANCE)
    await api.seal([T[3]])  # dispatched in the cut, sealed after it
    failed = await api.fail([S[1]], "transport")  # replaced by a new attempt, dispatched again
    s1_new = failed["groups"][0]["rows_to_send"][0]
    await api.dispatch([s1_new["rollout_id"]], INSTANCE)
    await api.dispatch([T[4]["rollout_id"]], INSTANCE)  # reserved in the cut, sent after it
    return {"late": late[0], "s1_new": s1_new}


@pytest.mark.parametrize("with_manifest", [True, False])
async def test_restore_without_gym_state_rewinds_the_ledger(client, admin, app, with_manifest: bool) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _table_run(client, admin)
    T, S = rows["T"], rows["S"]
    manifest = manifest_doc({INSTANCE: {"episodes": [(T[1]["rollout_id"], 0)], "restarts": [(T[2]["rollout_id"], 0)]}}) if with_manifest else None
    await publish_snapshot(app.state.engine, api.run_id, "s1", 3, manifest=manifest, snapshot_dir="/tmp/s1")
    preview = await api.get("/restore-plan?with_gym_state=false")
    after = await _after_cut_changes(api, rows)
    engine = app.state.engine
    run_before = (await client.get(f"/v1/runs/{api.run_id}", headers=api.h)).json()

    ans = await api.post("/restores", {"restore_id": "r1", "with_gym_state": False})
    assert ans["state"] == "applied" and ans["gym"]["installed"] is False and ans["snapshot_id"] == "s1"
    assert ans["epoch"] == run_before["epoch"] + 1
    # T4 went out after the cut: it is restarted under a new id instead of sent as it was.
    assert ans["dispatched_after_cut"] == 1
    assert ans["counts"] == {"reused": 4, "continued": 0, "restarted": 4, "gym_restarted": 0, "rerun": 5, "dispatch": 3}
    by = _by_sibling(ans["rows"])
    t4 = by[("T", 4)]
    assert t4["disposition"] == "restarted" and t4["replaces_rollout_id"] == T[4]["rollout_id"] and NEW_ID.match(t4["rollout_id"])
    # ... and says why; the summary counts it there, not as never sent.
    assert t4["reason"] == "sent_after_cut" and ans["reasons"]["restarted"]["sent_after_cut"] == 1
    assert sum(ans["reasons"]["dispatch"].values()) == ans["counts"]["dispatch"] == 3
    assert all(r["reason"] == "gym_not_restored" for r in ans["rows"] if r["disposition"] == "restarted" and r is not t4)
    # Everything else is exactly the preview.
    prev = _by_sibling(preview["rows"])
    assert {k: v for k, v in by.items() if k != ("T", 4)} == {k: v for k, v in prev.items() if k != ("T", 4)}

    run = (await client.get(f"/v1/runs/{api.run_id}", headers=api.h)).json()
    assert run["restored_from_rollout_snapshot"] == "s1" and run["epoch"] == ans["epoch"] and run["dispatch_gate"]["open"]
    # The live ledger is the cut with the plan applied.
    live = await fetch(
        engine,
        "SELECT group_id, generation_index, rollout_id, status, gym_attempt, group_attempt, gym_owned FROM attempts "
        "WHERE run_id = :r AND is_current ORDER BY group_id, generation_index",
        r=api.run_id,
    )
    cur = {(x["group_id"], x["generation_index"]): x for x in live}
    assert set(cur) == set(by) | {("T", 0), ("S", 0), ("P1", 0), ("P1", 1)}  # LATE is gone
    for k, r in by.items():
        assert cur[k]["rollout_id"] == r["rollout_id"] and cur[k]["status"] == "reserved" and cur[k]["group_attempt"] == r["group_attempt"]
    assert cur[("T", 0)]["status"] == "sealed" and cur[("T", 0)]["rollout_id"] == T[0]["rollout_id"]
    groups = {g["group_id"]: g for g in await fetch(engine, "SELECT group_id, status, group_attempt FROM prompt_groups WHERE run_id = :r", r=api.run_id)}
    assert "LATE" not in groups and groups["P2"]["group_attempt"] == 1 and groups["P1"]["status"] == "ready"
    assert groups["T"]["status"] == "generating"
    # Retires: every attempt the cut knows as running (7), plus the stragglers it does not know:
    # the replacement of S1 and LATE's attempt, and T4 dispatched after the cut.
    retired = await fetch(
        engine, "SELECT rollout_id, gym_attempt, instance_id, checkpoint_id FROM outbox_items WHERE run_id = :r AND op = 'retire' AND state = 'pending'", r=api.run_id
    )
    retired_ids = {x["rollout_id"] for x in retired}
    expected = {T[1]["rollout_id"], T[2]["rollout_id"], T[3]["rollout_id"], S[1]["rollout_id"], rows["P2"][1]["rollout_id"]}
    expected |= {r["rollout_id"] for r in rows["P4"]} | {after["late"]["rollout_id"], after["s1_new"]["rollout_id"], T[4]["rollout_id"]}
    # S1 was already queued for retirement by its transport failure; it is not queued twice.
    assert retired_ids == expected and len(retired) == len(expected)
    assert {x["instance_id"] for x in retired} == {INSTANCE} and {x["checkpoint_id"] for x in retired} == {"retire"}
    # Stragglers can no longer seal into the rerun.
    r = await api.seal([after["s1_new"]], expect=409)
    assert r["rows"][0]["code"] in ("attempt_replaced", "attempt_not_current", "unknown_rollout")

    # Idempotent per restore id; another body under the same id is a conflict.
    again = await api.post("/restores", {"restore_id": "r1", "with_gym_state": False})
    assert again == ans
    conflict = await api.post("/restores", {"restore_id": "r1", "with_gym_state": True}, expect=409)
    assert conflict["code"] == "restore_conflict" and conflict["errors"][0]["field"] == "with_gym_state"
    rec = await api.get("/restores/r1")
    assert rec["state"] == "applied" and rec["answer"] == ans
    # A second restore from the same snapshot mints other rollout ids (the epoch moved on).
    second = await api.post("/restores", {"restore_id": "r2", "snapshot_id": "s1", "with_gym_state": False})
    assert _by_sibling(second["rows"])[("S", 1)]["rollout_id"] != by[("S", 1)]["rollout_id"]


async def test_restore_keeps_groups_that_ended_before_the_cut(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    done = (await api.admit(group_body("done", 1)))["groups"][0]["rows"]
    await api.dispatch([done[0]["rollout_id"]])
    await api.seal(done)
    await api.post("/groups/finalize", {"group_ids": ["done"]})
    live = (await api.admit(group_body("live", 1)))["groups"][0]["rows"]
    await publish_snapshot(app.state.engine, api.run_id, "s1")
    await api.dispatch([live[0]["rollout_id"]])
    await api.seal(live)
    await api.post("/groups/finalize", {"group_ids": ["live"]})  # consumed after the cut: comes back
    ans = await api.post("/restores", {"restore_id": "r1"})
    assert ans["gym"]["reason"] == "the snapshot holds no Gym state" and ans["groups_removed"] == 0
    assert ans["dispatched_after_cut"] == 1 and ans["rows"][0]["disposition"] == "rerun"
    g = {x["group_id"]: x for x in await fetch(app.state.engine, "SELECT group_id, status FROM prompt_groups WHERE run_id = :r", r=api.run_id)}
    assert g["done"]["status"] == "finalized" and g["live"]["status"] == "generating"
    hist = await api.group("done")
    assert hist["siblings"][0]["attempts"][0]["status"] == "sealed" and hist["siblings"][0]["attempts"][0]["is_current"]


async def test_restore_refusals_before_anything_is_written(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    r = await client.post(f"/v1/runs/{api.run_id}/restores", json={"restore_id": "r1"}, headers=api.h)
    assert r.status_code == 404 and r.json()["code"] == "no_compatible_snapshot"
    r = await client.post(f"/v1/runs/{api.run_id}/restores", json={"restore_id": "r1", "extra": 1}, headers=api.h)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "extra"
    r = await client.post(f"/v1/runs/{api.run_id}/restores", json={"restore_id": "bad id"}, headers=api.h)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "restore_id"
    r = await client.post(f"/v1/runs/{api.run_id}/restores", json={"restore_id": "r1", "with_gym_state": "maybe"}, headers=api.h)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "with_gym_state"
    assert (await fetch(app.state.engine, "SELECT count(*) AS n FROM restores"))[0]["n"] == 0
    r = await client.get(f"/v1/runs/{api.run_id}/restores/r1", headers=api.h)
    assert r.status_code == 404 and r.json()["code"] == "restore_not_found"


async def test_forget_restored_on_seal_queues_one_forget_per_sealed_continuation(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    from checkpoint_coordinator.rollouts.store import forget_restored_on_seal

    api = await new_run(client, admin, target_level="turn")
    rows = (await api.admit(group_body("T", 3)))["groups"][0]["rows"]
    engine = app.state.engine
    # T0 and T1 are restored continuations (Gym-owned, at Gym attempt 1); T2 is not.
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE attempts SET gym_owned = true, gym_attempt = 1, gym_instance_id = :i WHERE run_id = :r AND generation_index < 2"),
            {"r": api.run_id, "i": INSTANCE},
        )
    cont = [dict(r, gym_attempt=1, capture_key=r["rollout_id"] + "-a1") for r in rows[:2]]
    await api.dispatch([r["rollout_id"] for r in rows], INSTANCE)
    await api.seal(cont + [rows[2]])
    ids = [x["attempt_id"] for x in await fetch(engine, "SELECT attempt_id FROM attempts WHERE run_id = :r ORDER BY generation_index", r=api.run_id)]
    # The seal path already called it, in the seal's transaction.
    queued = await fetch(engine, "SELECT rollout_id FROM outbox_items WHERE run_id = :r AND op = 'forget' ORDER BY rollout_id", r=api.run_id)
    assert [q["rollout_id"] for q in queued] == sorted(r["rollout_id"] for r in rows[:2])
    # Called directly (as if the seal had not), it queues one forget per sealed continuation.
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM outbox_items WHERE run_id = :r"), {"r": api.run_id})
        await conn.execute(text("UPDATE attempts SET retirement = 'none' WHERE run_id = :r"), {"r": api.run_id})
    async with engine.begin() as conn:
        assert await forget_restored_on_seal(conn, api.run_id, ids) == 2
    async with engine.begin() as conn:
        assert await forget_restored_on_seal(conn, api.run_id, ids) == 0  # idempotent
        assert await forget_restored_on_seal(conn, api.run_id, []) == 0
    items = await fetch(engine, "SELECT op, rollout_id, gym_attempt, instance_id, checkpoint_id, state FROM outbox_items WHERE run_id = :r ORDER BY rollout_id", r=api.run_id)
    assert items == sorted(
        [{"op": "forget", "rollout_id": r["rollout_id"], "gym_attempt": 1, "instance_id": INSTANCE, "checkpoint_id": "forget", "state": "pending"} for r in rows[:2]],
        key=lambda x: x["rollout_id"],
    )
    states = await fetch(engine, "SELECT generation_index, retirement FROM attempts WHERE run_id = :r ORDER BY generation_index", r=api.run_id)
    assert [s["retirement"] for s in states] == ["forget_pending", "forget_pending", "none"]


async def test_restore_after_an_earlier_restore_rewrites_every_row_that_differs(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """Once a restore was applied after a snapshot's cut, the live ledger may differ from that cut
    anywhere (a continuation keeps its attempt id), so a later restore from it compares every row."""
    from sqlalchemy import text

    api = await new_run(client, admin)
    rows = (await api.admit(group_body("g1", 2), group_body("g2", 1)))["groups"]
    g1, g2 = rows[0]["rows"], rows[1]["rows"]
    await api.dispatch([g1[0]["rollout_id"], g2[0]["rollout_id"]])
    await api.seal([g1[0], g2[0]])
    await publish_snapshot(app.state.engine, api.run_id, "s1")
    await api.post("/restores", {"restore_id": "r1", "with_gym_state": False})
    # What another restore could leave behind without minting an attempt or touching the group.
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text("UPDATE attempts SET status = 'reserved', receipt = NULL, gym_attempt = 0, gym_owned = true WHERE rollout_id = :r"),
            {"r": g2[0]["rollout_id"]},
        )
    ans = await api.post("/restores", {"restore_id": "r2", "with_gym_state": False})
    assert ans["counts"]["reused"] == 2
    live = await fetch(app.state.engine, "SELECT status, receipt, gym_owned FROM attempts WHERE rollout_id = :r", r=g2[0]["rollout_id"])
    assert live == [{"status": "sealed", "receipt": {"rollout_id": g2[0]["capture_key"]}, "gym_owned": False}]


async def test_a_large_restore_answer_comes_in_pages(client, admin, app, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from checkpoint_coordinator.restore.store import records
    from checkpoint_coordinator.restore import service

    # Pages of 3 rows over stored chunks of 4: pages and chunks do not line up.
    monkeypatch.setattr(service, "ANSWER_PAGE_ROWS", 3)
    monkeypatch.setattr(records, "RESTORE_ROWS_PER_CHUNK", 4)
    api, rows = await _table_run(client, admin)
    await publish_snapshot(app.state.engine, api.run_id, "s1", 3, snapshot_dir="/tmp/s1")
    await _after_cut_changes(api, rows)
    engine = app.state.engine

    ans = await api.post("/restores", {"restore_id": "r1", "with_gym_state": False})
    total = sum(n for d, n in ans["counts"].items() if d != "reused")
    assert ans["rows_total"] == total == 12 and len(ans["rows"]) == 3 and ans["next_cursor"] == 3
    chunks = await fetch(engine, "SELECT chunk FROM restore_row_chunks WHERE run_id = :r AND restore_id = 'r1' ORDER BY chunk", r=api.run_id)
    assert [c["chunk"] for c in chunks] == [0, 1, 2]
    # Every page, by the cursor each one names, equals the whole answer read as one page.
    whole = await api.get("/restores/r1/rows?limit=100000")
    assert whole["rows_total"] == 12 and whole["next_cursor"] is None and len(whole["rows"]) == 12
    joined, cursor = list(ans["rows"]), ans["next_cursor"]
    while cursor is not None:
        page = await api.get(f"/restores/r1/rows?cursor={cursor}")
        assert page["cursor"] == cursor and len(page["rows"]) <= 3
        joined += page["rows"]
        cursor = page["next_cursor"]
    assert joined == whole["rows"]
    by = _by_sibling(joined)
    assert len(by) == 12 and by[("T", 4)]["disposition"] == "restarted"  # the after-cut adjustment is stored too
    assert all(r["capture_key"] == r["rollout_id"] for r in joined if r["gym_attempt"] == 0)
    assert [r["disposition"] for r in joined].count("rerun") == ans["counts"]["rerun"]
    # A repeat and the record answer the same first page; past the end a page is empty.
    assert await api.post("/restores", {"restore_id": "r1", "with_gym_state": False}) == ans
    assert (await api.get("/restores/r1"))["answer"] == ans
    for past in (12, 10**30):
        end = await api.get(f"/restores/r1/rows?cursor={past}")
        assert end["rows"] == [] and end["next_cursor"] is None and end["rows_total"] == 12
    # Refusals are typed: an unknown restore, one that has no rows (not applied), a bad cursor.
    assert (await api.get("/restores/nope/rows", expect=404))["code"] == "restore_not_found"
    async with engine.begin() as conn:
        from sqlalchemy import text

        await conn.execute(
            text("INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state) VALUES (:r, 'r-run', 's1', 'running', false)"),
            {"r": api.run_id},
        )
    running = await api.get("/restores/r-run/rows", expect=409)
    assert running["code"] == "restore_not_applied" and running["state"] == "running"
    assert (await api.get("/restores/r1/rows?cursor=-1", expect=422))["status"] == 422


async def test_an_answer_stored_whole_before_the_chunks_still_pages(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    # Restores applied before migration 0002 hold every row in restores.result.
    import json

    from sqlalchemy import text

    api = await new_run(client, admin)
    rows = [
        {"group_id": "g", "generation_index": i, "disposition": "rerun", "rollout_id": f"g_g{i}_a{i:032x}", "capture_key": f"g_g{i}_a{i:032x}",
         "gym_attempt": 0, "group_attempt": 1, "instance_id": None, "replaces_rollout_id": None}
        for i in range(3)
    ]
    answer = {"restore_id": "old", "state": "applied", "counts": {"rerun": 3}, "rows": rows}
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state, result) "
                "VALUES (:r, 'old', 's1', 'applied', false, CAST(:res AS jsonb))"
            ),
            {"r": api.run_id, "res": json.dumps({"request": {"snapshot_id": None, "step": None, "with_gym_state": False}, "answer": answer})},
        )
    assert (await api.post("/restores", {"restore_id": "old", "with_gym_state": False}))["rows"] == rows
    assert (await api.get("/restores/old"))["answer"]["rows"] == rows
    page = await api.get("/restores/old/rows?cursor=1&limit=1")
    assert page["rows"] == rows[1:2] and page["rows_total"] == 3 and page["next_cursor"] == 2
