"""Stragglers (docs/ledger.md#stragglers) on a real PostgreSQL: what a snapshot's end records
as its blockers, the consecutive rule, the replacement at each level at the next gate, and what
the trainer is told about the row afterwards.

Snapshots are driven through the store's own writers (the gate's close, the end) under a lease
this test holds; the live ledger through the API, Gym stood in for by placeholders.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from checkpoint_coordinator.domain.snapshot_state import SnapshotPhase
from checkpoint_coordinator.ledger import leases
from checkpoint_coordinator.snapshots import store as repo

from .ledger_helpers import RunApi, group_body, new_run

RUN = "run-1"
INST = "math/replica-0"
OWNER = "test"


@pytest.fixture
def settings(settings):  # type: ignore[no-untyped-def]
    # No background worker: this test holds the run's lease and drives every snapshot itself.
    return settings.model_copy(update={"background_workers": False})


@pytest.fixture
def engine(app):  # type: ignore[no-untyped-def]
    return app.state.engine


async def _fence(engine: Any) -> leases.Fence:
    epoch = await leases.acquire(engine, RUN, OWNER, 600)
    assert epoch is not None
    return leases.Fence(OWNER, epoch)


async def _snapshot(engine: Any, sid: str, blocked: list[str] = (), *, outcome: str = "failed", prepared: bool = False) -> repo.GateClosure:  # type: ignore[assignment]
    """A snapshot from its request to its end: the gate's close (the straggler rule), then the
    end, recording ``blocked`` (rollout ids, or any other name Gym gives) as its blockers;
    ``prepared``: Gym's prepare answered ready before it ended."""
    fence = await _fence(engine)
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) VALUES (:r, :s, 0, 'requested', :o)"),
                           {"r": RUN, "s": sid, "o": OWNER})
    closed = await repo.close_gate(engine, RUN, sid, fence)
    reason = {"published": "ok", "aborted": "train_step_committed"}.get(outcome, "gym_not_ready")
    await repo.end(engine, RUN, sid, outcome, reason, fence=fence, expected=SnapshotPhase.gate, blockers=[(INST, b) for b in blocked],
                   timings={"gate": 0.01, **({"prepare": 0.2} if prepared else {})})
    return closed


async def _sent(api: RunApi, gid: str, n: int) -> list[dict[str, Any]]:
    rows = (await api.admit(group_body(gid, n)))["groups"][0]["rows"]
    return (await api.dispatch([r["rollout_id"] for r in rows], INST))["rows"]


async def _attempts(engine: Any, gid: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT rollout_id, generation_index, group_attempt, status, is_current, end_reason, failure_class, retirement, gym_instance_id "
                 "FROM attempts WHERE run_id = :r AND group_id = :g ORDER BY attempt_id"), {"r": RUN, "g": gid})
        return [dict(r._mapping) for r in rows]


async def _retires(engine: Any) -> list[tuple[str, str, int]]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT instance_id, rollout_id, gym_attempt FROM outbox_items WHERE run_id = :r AND op = 'retire' ORDER BY 2"), {"r": RUN})
        return [tuple(r) for r in rows]


async def test_an_episode_that_blocked_three_snapshots_in_a_row_is_replaced_at_the_next_gate(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="turn")
    stuck, other = await _sent(api, "g0", 2)
    for sid in ("s1", "s2"):
        closed = await _snapshot(engine, sid, [stuck["rollout_id"], "policy-worker-lost"])
        assert closed.stragglers == ()
    assert (await _snapshot(engine, "s3", [stuck["rollout_id"]])).stragglers == ()  # two before it: not yet
    assert await _retires(engine) == []

    closed = await _snapshot(engine, "s4", [])
    assert closed.stragglers == (stuck["rollout_id"],)
    assert (INST, "retire") in closed.owed  # delivered before this snapshot's prepare
    atts = await _attempts(engine, "g0")
    old = next(a for a in atts if a["rollout_id"] == stuck["rollout_id"])
    assert (old["status"], old["is_current"], old["end_reason"], old["failure_class"], old["retirement"]) == (
        "abandoned", False, "straggler", None, "retire_pending")
    new = [a for a in atts if a["generation_index"] == 0 and a["is_current"]]
    assert len(new) == 1 and new[0]["status"] == "reserved" and new[0]["rollout_id"] != stuck["rollout_id"] and new[0]["group_attempt"] == 0
    assert [a for a in atts if a["rollout_id"] == other["rollout_id"]][0]["status"] == "dispatched"  # its sibling keeps running
    assert await _retires(engine) == [(INST, stuck["rollout_id"], 0)]
    group = await api.group("g0")
    assert group["siblings"][0]["row_attempts_used"] == 1  # the replacement spends a row attempt

    # Each of the three names it (a Gym worker's blocker names no attempt and is left out); the
    # fourth was blocked by nothing.
    history = {s["snapshot_id"]: s["blockers"] for s in (await api.get("/snapshots"))["snapshots"]}
    assert history == {sid: {"count": 1, "rollout_ids": [stuck["rollout_id"]]} for sid in ("s1", "s2", "s3")} | {"s4": {"count": 0, "rollout_ids": []}}
    # Once given up, it is nobody's straggler any more.
    assert (await _snapshot(engine, "s5", [])).stragglers == ()


@pytest.mark.parametrize("broken", ["published", "not_named", "restored", "sealed", "disabled", "fewer"])
async def test_only_consecutive_snapshots_naming_a_live_attempt_make_it_a_straggler(client, admin, engine, broken: str) -> None:  # type: ignore[no-untyped-def]
    cfg = {"max_blocking_snapshots": 0} if broken == "disabled" else {}
    api = await new_run(client, admin, target_level="sibling", **cfg)
    stuck, _ = await _sent(api, "g0", 2)
    rid = stuck["rollout_id"]
    await _snapshot(engine, "s1", [rid])
    if broken == "published":
        await _snapshot(engine, "s2", [], outcome="published")
    elif broken == "not_named":
        await _snapshot(engine, "s2", ["something-else"])
    else:
        await _snapshot(engine, "s2", [rid])
    if broken != "fewer":
        await _snapshot(engine, "s3", [rid])
    if broken == "restored":  # a restore starts the count again
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state, ended_at) "
                                    "VALUES (:r, 'x1', 's0', 'applied', false, clock_timestamp())"), {"r": RUN})
    if broken == "sealed":
        await api.seal([stuck])
    assert (await _snapshot(engine, "s4", [])).stragglers == ()
    assert await _retires(engine) == []


async def test_one_snapshot_is_enough_with_max_blocking_snapshots_1_and_a_sibling_without_instance(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="sibling", max_blocking_snapshots=1)
    rows = (await api.admit(group_body("g0", 1)))["groups"][0]["rows"]
    await api.register_placeholders(INST)
    await api.dispatch([rows[0]["rollout_id"]], None)  # sibling level: sent without naming its instance
    await _snapshot(engine, "s1", [rows[0]["rollout_id"]])
    closed = await _snapshot(engine, "s2", [])
    assert closed.stragglers == (rows[0]["rollout_id"],)
    # The retire goes to the instance whose Gym named it.
    assert await _retires(engine) == [(INST, rows[0]["rollout_id"], 0)]


async def test_a_prompt_group_straggler_reruns_its_whole_cohort(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="prompt_group", max_blocking_snapshots=2)
    rows = await _sent(api, "g0", 3)
    await api.seal([rows[2]])  # returned, waiting for its cohort
    for sid in ("s1", "s2"):
        await _snapshot(engine, sid, [rows[0]["rollout_id"], rows[1]["rollout_id"]])
    closed = await _snapshot(engine, "s3", [])
    assert closed.stragglers == (rows[0]["rollout_id"], rows[1]["rollout_id"])
    atts = await _attempts(engine, "g0")
    old = {a["rollout_id"]: a for a in atts if a["group_attempt"] == 0}
    assert all(not a["is_current"] for a in old.values())
    assert [old[r["rollout_id"]]["end_reason"] for r in rows] == ["straggler", "straggler", None]
    assert [old[r["rollout_id"]]["status"] for r in rows] == ["abandoned"] * 3  # the returned row goes with its cohort
    fresh = sorted((a["generation_index"], a["status"]) for a in atts if a["is_current"])
    assert fresh == [(0, "reserved"), (1, "reserved"), (2, "reserved")]
    assert {a["group_attempt"] for a in atts if a["is_current"]} == {1}
    assert (await api.group("g0"))["group_attempt"] == 1
    # Both dispatched rows of the cohort are retired; the returned one ended in Gym already.
    assert await _retires(engine) == sorted([(INST, rows[0]["rollout_id"], 0), (INST, rows[1]["rollout_id"], 0)], key=lambda x: x[1])


async def test_a_straggler_on_its_last_attempt_leaves_its_group_abandoned(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="sibling", max_blocking_snapshots=1, max_row_attempts=1, max_group_attempts=1)
    stuck, _ = await _sent(api, "g0", 2)
    await _snapshot(engine, "s1", [stuck["rollout_id"]])
    assert (await _snapshot(engine, "s2", [])).stragglers == (stuck["rollout_id"],)
    group = await api.group("g0")
    assert group["status"] == "abandoned"
    assert len(await _retires(engine)) == 2  # both dispatched rows of the group


async def test_the_trainer_learns_the_replacement_from_its_reports_and_the_pending_read(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    import ckpt_client.models as cm

    api = await new_run(client, admin, target_level="turn", max_blocking_snapshots=1)
    stuck, other = await _sent(api, "g0", 2)
    await _snapshot(engine, "s1", [stuck["rollout_id"]])
    await _snapshot(engine, "s2", [])
    new = next(a for a in await _attempts(engine, "g0") if a["generation_index"] == 0 and a["is_current"])["rollout_id"]

    # A late seal of its reply: refused, saying what to do and naming the replacement.
    refused = await api.seal([stuck, other], expect=409)
    assert refused["code"] == "retired_straggler"
    assert refused["rows"] == [{"rollout_id": stuck["rollout_id"], "code": "retired_straggler", "detail": refused["rows"][0]["detail"], "replaced_by": new}]
    assert "straggler" in refused["rows"][0]["detail"] and "replaced_by" in refused["rows"][0]["detail"]
    # A failure report of it: nothing changes; the answer says why and what to send instead.
    failed = await api.fail([stuck], "transport")
    assert failed["rows"] == [{"rollout_id": stuck["rollout_id"], "result": "unchanged", "end_reason": "straggler", "replaced_by": new}]
    assert [r["rollout_id"] for g in failed["groups"] for r in g["rows_to_send"]] == [new]
    parsed = cm.FailResult.parse(failed)
    assert (parsed.rows[0].end_reason, parsed.rows[0].replaced_by) == ("straggler", new)
    # The pending read: no longer pending, given up as a straggler, with its group's rows to send.
    read = await api.post("/attempts/pending", {"rollout_ids": [stuck["rollout_id"], other["rollout_id"]]})
    assert read["pending"] == [other["rollout_id"]]
    assert [(s["rollout_id"], s["group"]["group_id"], [r["rollout_id"] for r in s["group"]["rows_to_send"]]) for s in read["stragglers"]] == [
        (stuck["rollout_id"], "g0", [new])]
    assert [r.rollout_id for r in cm.PendingResult.parse(read).rows_to_send] == [new]
    # Nothing asked about is a straggler: the answer is as before.
    assert await api.post("/attempts/pending", {"rollout_ids": [other["rollout_id"]]}) == {"pending": [other["rollout_id"]]}
    # The other row seals as usual; the replacement is sent and seals; the group is ready once.
    await api.seal([other])
    sent = (await api.dispatch([new], INST))["rows"]
    assert (await api.seal(sent))["ready_groups"] == ["g0"]


async def test_a_snapshot_names_at_most_ten_of_its_blockers_and_none_while_it_runs(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="turn")
    rows = await _sent(api, "g0", 12)
    await _snapshot(engine, "s1", [r["rollout_id"] for r in rows])
    s1 = await api.get("/snapshots/s1")
    assert s1["blockers"] == {"count": 12, "rollout_ids": sorted(r["rollout_id"] for r in rows)[:10]}
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) VALUES (:r, 's2', 0, 'requested', :o)"),
                           {"r": RUN, "o": OWNER})
    assert (await api.get("/snapshots/s2"))["blockers"] is None
    import ckpt_client.models as cm

    assert cm.Snapshot.parse(s1).blockers == cm.SnapshotBlockers(12, s1["blockers"]["rollout_ids"])


async def test_snapshots_aborted_while_gym_waited_neither_count_nor_break_the_streak(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    """Train steps that win before Gym's prepare answers, between the blocked snapshots, must
    not keep a straggler alive for ever (they name nobody: they used to break the streak)."""
    api = await new_run(client, admin, target_level="sibling")
    stuck, _ = await _sent(api, "g0", 2)
    rid = stuck["rollout_id"]
    for sid, blocked, outcome in (("s1", [rid], "failed"), ("a1", [], "aborted"), ("s2", [rid], "failed"), ("a2", [], "aborted"), ("a3", [], "aborted")):
        assert (await _snapshot(engine, sid, blocked, outcome=outcome)).stragglers == ()
    # Two blocked snapshots and three aborted ones: not yet. The third blocked one makes it one.
    assert (await _snapshot(engine, "s3", [rid])).stragglers == ()
    assert (await _snapshot(engine, "s4", [])).stragglers == (rid,)
    assert await _retires(engine) == [(INST, rid, 0)]


async def test_a_snapshot_aborted_after_gym_answered_ready_breaks_the_streak(client, admin, engine) -> None:  # type: ignore[no-untyped-def]
    """Gym's prepare answered ready, so every episode had reached a boundary: the episode is no
    straggler, whatever the snapshot's end."""
    api = await new_run(client, admin, target_level="sibling")
    stuck, _ = await _sent(api, "g0", 2)
    rid = stuck["rollout_id"]
    for sid, blocked, outcome, prepared in (("s1", [rid], "failed", False), ("a1", [], "aborted", True), ("s2", [rid], "failed", False), ("s3", [rid], "failed", False)):
        await _snapshot(engine, sid, blocked, outcome=outcome, prepared=prepared)
    assert (await _snapshot(engine, "s4", [])).stragglers == ()
    assert await _retires(engine) == []
