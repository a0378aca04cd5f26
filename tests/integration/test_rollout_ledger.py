"""Live rollouts (docs/ledger.md#live-rollouts) over HTTP, for sibling and prompt_group recovery."""

from __future__ import annotations

import re

import pytest

from .ledger_helpers import group_body, new_run

ROLLOUT_RE = re.compile(r"^(?P<g>.+)_g(?P<i>\d+)_a[0-9a-f]{32}$")


async def test_admit_mints_identities_and_repeat_is_identical(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    first = (await run.admit(group_body("g1", 3)))["groups"][0]
    assert first["admitted"] and first["granularity"] == "sibling" and first["group_attempt"] == 0
    ids = [r["rollout_id"] for r in first["rows"]]
    for i, r in enumerate(first["rows"]):
        m = ROLLOUT_RE.match(r["rollout_id"])
        assert m and m["g"] == "g1" and int(m["i"]) == i == r["generation_index"]
        assert r["capture_key"] == r["rollout_id"] and r["status"] == "reserved"
    again = (await run.admit(group_body("g1", 3)))["groups"][0]
    assert not again["admitted"] and [r["rollout_id"] for r in again["rows"]] == ids
    conflict = await run.admit(group_body("g1", 4), expect=409)
    assert conflict["code"] == "group_conflict" and conflict["rows"][0]["group_id"] == "g1"


async def test_levels_resolve_agent_then_source_then_target(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(
        client, admin, target_level="turn", allow_restart_only_gym_servers=False,
        agent_target_level_overrides={"genrm_agent": "prompt_group"}, task_source_target_level_overrides={"web": "sibling"},
    )
    res = (await run.admit(
        group_body("a", 2, agent_name="genrm_agent", task_source="web"), group_body("b", 2, task_source="web"), group_body("c", 2)
    ))["groups"]
    assert [g["restore_level"] for g in res] == ["prompt_group", "sibling", "turn"]
    assert [g["granularity"] for g in res] == ["prompt_group", "sibling", "sibling"]


async def test_sibling_seal_each_row_then_group_ready_and_finalize(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 2)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows])
    one = await run.seal(rows[:1])
    assert one["rows"][0]["result"] == "sealed" and one["ready_groups"] == []
    assert (await run.post("/groups/finalize", {"group_ids": ["g1"]}, 409))["code"] == "group_not_ready"
    two = await run.seal(rows[1:])
    assert two["ready_groups"] == ["g1"]
    # identical repeat is a no-op; a different receipt is a typed conflict
    dup = await run.seal(rows[:1])
    assert dup["rows"][0]["result"] == "unchanged"
    conflict = await run.seal(rows[:1], expect=409, reward=0.5)
    assert conflict["code"] == "seal_conflict"
    fin = await run.post("/groups/finalize", {"group_ids": ["g1"]})
    assert fin["groups"] == [{"group_id": "g1", "result": "finalized"}]
    assert (await run.post("/groups/finalize", {"group_ids": ["g1"]}))["groups"][0]["result"] == "unchanged"
    counts = await run.get("/counts")
    assert counts["groups"] == {"finalized": 1} and counts["live_attempts"] == {}


async def test_seal_receipt_must_name_capture_key(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 1)))["groups"][0]["rows"]
    await run.dispatch([rows[0]["rollout_id"]])
    bad = {"rows": [{"rollout_id": rows[0]["rollout_id"], "receipt": {"rollout_id": "someone-else"}}]}
    assert (await run.post("/attempts/sealed", bad, 409))["code"] == "receipt_mismatch"
    assert (await run.group("g1"))["siblings"][0]["attempts"][0]["status"] == "dispatched"


async def test_a_seal_of_a_row_never_dispatched_says_to_dispatch_it_first(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 2)))["groups"][0]["rows"]
    refused = await run.seal(rows, 409)
    assert refused["code"] == "attempt_not_dispatched" and len(refused["rows"]) == 2
    assert all(r["code"] == "attempt_not_dispatched" and "dispatch it first" in r["detail"] for r in refused["rows"])
    g = await run.group("g1")  # nothing written
    assert [s["attempts"][0]["status"] for s in g["siblings"]] == ["reserved", "reserved"]
    await run.dispatch([r["rollout_id"] for r in rows])
    assert [r["result"] for r in (await run.seal(rows))["rows"]] == ["sealed", "sealed"]


async def test_dispatch_to_an_instance_the_run_never_registered_is_refused_naming_it(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 1)))["groups"][0]["rows"]
    await run.register_placeholders("math/replica-0")
    refused = await run.dispatch([rows[0]["rollout_id"]], instance_id="math/replica-9", placeholder=False, expect=404)
    assert refused["code"] == "unknown_instance" and refused["instance_id"] == "math/replica-9"
    assert "'math/replica-9' is not registered" in refused["detail"] and "(registered: math/replica-0)" in refused["detail"]
    assert "register it first" in refused["detail"]
    assert (await run.group("g1"))["siblings"][0]["attempts"][0]["status"] == "reserved"


async def test_refused_keeps_identity_and_spends_nothing(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 2)))["groups"][0]["rows"]
    ids = [r["rollout_id"] for r in rows]
    await run.dispatch(ids)
    back = await run.post("/attempts/refused", {"rollout_ids": ids[:1]})
    assert back["rows"][0]["rollout_id"] == ids[0] and back["rows"][0]["status"] == "reserved"
    g = await run.group("g1")
    s0 = g["siblings"][0]
    assert s0["row_attempts_used"] == 0 and len(s0["attempts"]) == 1 and s0["attempts"][0]["refusals"] == 1
    redo = await run.dispatch(ids[:1])
    assert redo["rows"][0]["rollout_id"] == ids[0]
    counts = await run.get("/counts")
    assert counts["outbox_pending"] == {}


async def test_transport_failure_sibling_replaces_row_and_queues_retire(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin, max_row_attempts=3)
    rows = (await run.admit(group_body("g1", 2)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows], dispatch_id="d-x")
    res = await run.fail(rows[:1], "transport")
    grp = res["groups"][0]
    assert grp["status"] == "generating" and grp["group_attempt"] == 0
    (new,) = grp["rows_to_send"]
    assert new["generation_index"] == 0 and new["rollout_id"] != rows[0]["rollout_id"]
    g = await run.group("g1")
    assert g["siblings"][0]["row_attempts_used"] == 1
    assert g["siblings"][1]["attempts"][0]["status"] == "dispatched"  # the sibling keeps streaming
    old = g["siblings"][0]["attempts"][0]
    assert old["status"] == "abandoned" and old["retirement"] == "retire_pending"
    outbox = (await run.get("/outbox"))["items"]
    assert [(i["op"], i["rollout_id"]) for i in outbox] == [("retire", rows[0]["rollout_id"])]
    # repeat of the same failure is idempotent: no second replacement, no second retire
    again = await run.fail(rows[:1], "transport")
    assert again["rows"][0]["result"] == "unchanged"
    assert len((await run.get("/outbox"))["items"]) == 1
    # a seal arriving after the attempt was replaced is refused, typed, and changes nothing
    late = await run.seal(rows[:1], expect=409)
    assert late["code"] == "attempt_replaced"


async def test_row_budget_spent_retries_whole_group_then_abandons(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin, max_row_attempts=2, max_group_attempts=2)
    rows = (await run.admit(group_body("g1", 2)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows])
    r1 = (await run.fail(rows[:1], "transport"))["groups"][0]["rows_to_send"]
    await run.dispatch([r1[0]["rollout_id"]])
    whole = (await run.fail(r1, "transport"))["groups"][0]
    assert whole["group_attempt"] == 1 and len(whole["rows_to_send"]) == 2
    assert all(r["group_attempt"] == 1 for r in whole["rows_to_send"])
    # the sibling that was still running is retired too
    retired = {i["rollout_id"] for i in (await run.get("/outbox"))["items"]}
    assert rows[1]["rollout_id"] in retired and rows[0]["rollout_id"] in retired and r1[0]["rollout_id"] in retired
    cohort = whole["rows_to_send"]
    await run.dispatch([r["rollout_id"] for r in cohort])
    a = (await run.fail(cohort[:1], "transport"))["groups"][0]["rows_to_send"]
    await run.dispatch([a[0]["rollout_id"]])
    last = (await run.fail(a, "transport"))["groups"][0]
    # failure on the last allowed attempt: the group is abandoned and its running rows retired
    assert last["status"] == "abandoned" and last["rows_to_send"] == []
    retired = {i["rollout_id"] for i in (await run.get("/outbox", ))["items"]}
    assert cohort[1]["rollout_id"] in retired and a[0]["rollout_id"] in retired


async def test_data_failure_fails_prompt_at_once(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin, max_data_attempts=2)
    rows = (await run.admit(group_body("g1", 3)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows])
    await run.seal(rows[2:])
    res = (await run.fail(rows[:1], "data"))["groups"][0]
    assert res["group_attempt"] == 1 and len(res["rows_to_send"]) == 3
    g = await run.group("g1")
    assert g["data_attempts_used"] == 1
    first = {s["generation_index"]: s["attempts"][0] for s in g["siblings"]}
    assert first[0]["status"] == "failed" and first[0]["retirement"] == "none"  # it replied: no retire
    assert first[1]["status"] == "abandoned" and first[1]["retirement"] == "retire_pending"
    assert first[2]["status"] == "sealed" and not first[2]["is_current"]
    new = res["rows_to_send"]
    await run.dispatch([r["rollout_id"] for r in new])
    final = (await run.fail(new[:1], "data"))["groups"][0]
    assert final["status"] == "abandoned"


async def test_stream_ended_short_spends_attempt_for_missing_rows_only(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 3)))["groups"][0]["rows"]
    ids = [r["rollout_id"] for r in rows]
    await run.dispatch(ids[:2], dispatch_id="stream-1")  # row 2 never reached Gym
    await run.seal(rows[:1])
    ended = await run.post("/dispatches/stream-1/ended", {"returned": [ids[0]]})
    assert ended["missing"] == [ids[1]]
    g = await run.group("g1")
    s1 = g["siblings"][1]
    assert [a["status"] for a in s1["attempts"]] == ["abandoned", "reserved"] and s1["row_attempts_used"] == 1
    s2 = g["siblings"][2]
    assert s2["attempts"][0]["rollout_id"] == ids[2] and s2["attempts"][0]["status"] == "reserved"  # identity kept
    assert (await run.post("/dispatches/nope/ended", {"returned": []}, 404))["code"] == "unknown_dispatch"


async def test_prompt_group_cohort_seals_atomically(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin, target_level="prompt_group")
    rows = (await run.admit(group_body("g1", 3)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows])
    part = await run.seal(rows[:2])
    assert {r["status"] for r in part["rows"]} == {"returned"} and part["cohorts_sealed"] == []
    counts = await run.get("/counts")
    assert counts["live_attempts"].get("sealed", 0) == 0 and counts["live_attempts"]["returned"] == 2
    last = await run.seal(rows[2:])
    assert last["cohorts_sealed"] == ["g1"] and last["ready_groups"] == ["g1"]
    assert (await run.get("/counts"))["live_attempts"] == {"sealed": 3}


async def test_prompt_group_genrm_cohort_replaced_as_whole(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin, target_level="prompt_group", max_group_attempts=3)
    rows = (await run.admit(group_body("genrm", 4)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows], dispatch_id="s1")
    await run.seal(rows[:2])  # two rows returned, not sealed
    res = (await run.fail(rows[2:3], "transport"))["groups"][0]
    assert res["group_attempt"] == 1 and len(res["rows_to_send"]) == 4
    assert {r["rollout_id"] for r in res["rows_to_send"]}.isdisjoint({r["rollout_id"] for r in rows})
    g = await run.group("genrm")
    old = [s["attempts"][0] for s in g["siblings"]]
    assert [a["status"] for a in old] == ["abandoned", "abandoned", "abandoned", "abandoned"]
    # returned rows replied already, only the two still on the wire are retired
    assert [a["retirement"] for a in old] == ["none", "none", "retire_pending", "retire_pending"]
    # a late seal of the failed cohort is refused
    assert (await run.seal(rows[3:], expect=409))["code"] == "attempt_replaced"
    # a stream where no row came back moves the whole cohort on
    new = res["rows_to_send"]
    await run.dispatch([r["rollout_id"] for r in new], dispatch_id="s2")
    ended = await run.post("/dispatches/s2/ended", {"returned": []})
    assert ended["groups"][0]["group_attempt"] == 2 and len(ended["missing"]) >= 1


async def test_abandon_queues_retire_for_dispatched_only(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 3)))["groups"][0]["rows"]
    await run.dispatch([rows[0]["rollout_id"], rows[1]["rollout_id"]], instance_id=None)
    await run.seal(rows[:1])
    res = await run.post("/groups/abandon", {"group_ids": ["g1"]})
    assert res["groups"] == [{"group_id": "g1", "result": "abandoned"}]
    items = (await run.get("/outbox"))["items"]
    # Without an instance there is nobody to retire on; with one (below) there is.
    assert items == []
    rows2 = (await run.admit(group_body("g2", 2)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows2], instance_id="math/replica-0")
    await run.post("/groups/abandon", {"group_ids": ["g2"]})
    items = (await run.get("/outbox"))["items"]
    assert sorted(i["rollout_id"] for i in items) == sorted(r["rollout_id"] for r in rows2)
    assert all(i["instance_id"] == "math/replica-0" and i["checkpoint_id"] == "retire" for i in items)
    assert (await run.post("/groups/abandon", {"group_ids": ["g2"]}))["groups"][0]["result"] == "unchanged"


async def test_turn_level_needs_instance(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin, target_level="turn")
    rows = (await run.admit(group_body("g1", 1)))["groups"][0]["rows"]
    assert (await run.dispatch([rows[0]["rollout_id"]], instance_id=None, expect=409))["code"] == "instance_required"
    ok = await run.dispatch([rows[0]["rollout_id"]], instance_id="math/replica-0", dispatch_id="dd")
    assert ok["rows"][0]["instance_id"] == "math/replica-0"
    same = await run.dispatch([rows[0]["rollout_id"]], instance_id="math/replica-0", dispatch_id="dd")
    assert same == ok  # identical repeat answers the same
    other = await run.dispatch([rows[0]["rollout_id"]], instance_id="math/replica-1", expect=409)
    assert other["code"] == "already_dispatched"


async def test_gate_closed_refuses_dispatch_with_snapshot_and_retry_after(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    from checkpoint_coordinator.ledger import runs as gate

    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 1)))["groups"][0]["rows"]
    async with app.state.engine.begin() as conn:
        await gate.close_gate(conn, "run-1", "snap-7")
    r = await client.post("/v1/runs/run-1/attempts/dispatch", json={"dispatch_id": "d", "rollout_ids": [rows[0]["rollout_id"]]}, headers=run.h)
    assert r.status_code == 409 and r.json()["code"] == "gate_closed"
    assert r.json()["snapshot_id"] == "snap-7" and int(r.headers["retry-after"]) >= 1
    async with app.state.engine.begin() as conn:
        await gate.open_gate(conn, "run-1", "snap-7")
    await run.dispatch([rows[0]["rollout_id"]])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/attempts/dispatch", {"dispatch_id": "d", "rollout_ids": ["bad id"]}),
        ("/attempts/dispatch", {"dispatch_id": "d", "rollout_ids": []}),
        ("/attempts/dispatch", {"dispatch_id": "d", "rollout_ids": ["a", "a"]}),
        ("/attempts/sealed", {"rows": [{"rollout_id": "x", "receipt": {}, "reward": "high"}]}),
        ("/attempts/failed", {"rows": [{"rollout_id": "x", "failure_class": "cosmic"}]}),
        ("/groups/admit", {"groups": [{"group_id": "g-a1", "prompt_ref": {"sample_id": 1, "task_name": "t"}, "task_digest": "d", "expected_generations": 1}]}),
        ("/groups/admit", {"groups": [{"group_id": "g", "prompt_ref": {"sample_id": 1, "task_name": "t"}, "task_digest": "d", "expected_generations": 0}]}),
        ("/groups/admit", {"groups": [], "extra": 1}),
    ],
)
async def test_bad_reports_are_422_problems(client, admin, path, body) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    r = await client.post(f"/v1/runs/run-1{path}", json=body, headers=run.h)
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_request" and r.json()["errors"]


async def test_closed_run_refuses_writes(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    await client.post("/v1/runs/run-1/close", headers=admin)
    assert (await run.admit(group_body("g1"), expect=409))["code"] == "run_closed"


async def test_stream_ended_by_missing_rows_in_parts(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 4)))["groups"][0]["rows"]
    ids = [r["rollout_id"] for r in rows]
    await run.dispatch(ids, dispatch_id="big")
    first = await run.post("/dispatches/big/ended", {"missing": ids[:1]})
    second = await run.post("/dispatches/big/ended", {"missing": ids[1:2]})
    assert first["missing"] == ids[:1] and second["missing"] == ids[1:2]
    g = await run.group("g1")
    assert [s["attempts"][0]["status"] for s in g["siblings"]] == ["abandoned", "abandoned", "dispatched", "dispatched"]
    both = await client.post("/v1/runs/run-1/dispatches/big/ended", json={"missing": [], "returned": []}, headers=run.h)
    assert both.status_code == 422


async def test_admin_rotates_a_lost_run_token(client, admin) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    assert (await client.post("/v1/runs/run-1/token", headers=run.h)).status_code == 403  # not with the run token
    r = await client.post("/v1/runs/run-1/token", headers=admin)
    assert r.status_code == 200
    new = {"Authorization": f"Bearer {r.json()['run_token']}"}
    assert (await client.get("/v1/runs/run-1", headers=new)).status_code == 200
    assert (await client.get("/v1/runs/run-1", headers=run.h)).status_code == 403


async def test_seal_payload_with_awkward_values_is_stored_as_sent(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """Seal rows reach PostgreSQL as one JSON document (jsonb_to_recordset): staging keys with
    array and JSON metacharacters, non-ASCII, an empty list, nested receipts, null reward and
    mask flags all land as sent, and an identical repeat is recognised as unchanged."""
    from sqlalchemy import text

    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 3)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows])
    keys = ["a,b", 'q"uote', "{braces}", "back\\slash", "ünïcødé ✓", " spaced ", "NULL", ""]
    body = {"rows": [
        {"rollout_id": rows[0]["rollout_id"], "receipt": {"rollout_id": rows[0]["capture_key"], "nested": {"k": [1, 2.5, None, "x,y"]}},
         "staging_keys": keys, "reward": -0.125, "mask_sample": True},
        {"rollout_id": rows[1]["rollout_id"], "receipt": {"rollout_id": rows[1]["capture_key"]}, "staging_keys": [], "reward": None},
        {"rollout_id": rows[2]["rollout_id"], "receipt": {"rollout_id": rows[2]["capture_key"], "z": 1, "a": "é"}, "mask_sample": False},
    ]}
    first = await run.post("/attempts/sealed", body)
    assert [r["result"] for r in first["rows"]] == ["sealed"] * 3 and first["ready_groups"] == ["g1"]
    again = await run.post("/attempts/sealed", body)
    assert [r["result"] for r in again["rows"]] == ["unchanged"] * 3
    async with app.state.engine.connect() as conn:
        got = {
            r.rollout_id: r
            for r in (await conn.execute(text("SELECT rollout_id, receipt, staging_keys, reward, mask_sample, status, ended_at FROM attempts"))).all()
        }
    for sent in body["rows"]:
        row = got[sent["rollout_id"]]
        assert row.receipt == sent["receipt"] and row.status == "sealed" and row.ended_at is not None
        assert row.staging_keys == sent.get("staging_keys", [])
        assert row.reward == sent.get("reward") and row.mask_sample == sent.get("mask_sample")
    changed = {"rows": [{**body["rows"][0], "staging_keys": keys[:-1]}]}
    assert (await run.post("/attempts/sealed", changed, 409))["code"] == "seal_conflict"
