"""The ledger rewind of a restore (docs/ledger.md#rewind) at the level of
``ledger.rewind.apply_restore``: all or nothing, and looking only at what changed since the cut
gives the same ledger as comparing every row of the cut."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from checkpoint_coordinator.errors import Conflict
from checkpoint_coordinator.restore.store import records
from checkpoint_coordinator.restore.store import rewind
from checkpoint_coordinator.restore.planning import rollout_minter
from checkpoint_coordinator.restore.answer import rewind_of
from checkpoint_coordinator.restore.service import load_and_plan

from .ledger_helpers import RunApi, group_body, new_run
from .test_restore_support import fetch, manifest_doc, publish_snapshot

INSTANCE = "math/replica-0"


async def _scenario(
    client: Any, admin: dict[str, str], app: Any, run_id: str, edges: bool = False
) -> tuple[RunApi, dict[str, list[dict[str, Any]]]]:
    """Every disposition at every level, a snapshot with Gym state, then what happens after the
    cut: a new group, a seal, a transport failure replaced and re-sent, a never-sent row sent,
    and a continued row's group touched (T gets a row sent after the cut)."""
    api = await new_run(
        client, admin, run_id=run_id, target_level="turn", agent_target_level_overrides={"sib_agent": "sibling", "pg_agent": "prompt_group"}
    )
    groups = (
        await api.admit(
            group_body("T", 5),
            group_body("U", 3),
            group_body("S", 3, agent_name="sib_agent"),
            group_body("P1", 2, agent_name="pg_agent"),
            group_body("P2", 2, agent_name="pg_agent"),
            group_body("P3", 2, agent_name="pg_agent"),
        )
    )["groups"]
    rows = {g["group_id"]: g["rows"] for g in groups}
    T, U, S = rows["T"], rows["U"], rows["S"]
    await api.dispatch([r["rollout_id"] for r in T[:4] + U[:2] + S[:2] + rows["P1"] + rows["P2"]], INSTANCE)
    await api.seal([T[0], S[0]] + rows["P1"] + rows["P2"][:1])
    manifest = manifest_doc({INSTANCE: {"episodes": [(T[1]["rollout_id"], 0), (U[0]["rollout_id"], 0)], "restarts": [(T[2]["rollout_id"], 0)]}})
    if edges:
        await _edge_rows_before_cut(app, api, rows)
    await publish_snapshot(app.state.engine, run_id, "s1", 3, manifest=manifest, snapshot_dir="/tmp/s1")
    if edges:
        # E was finalized before the cut (so not in it) and is live again after it, its attempt rows
        # untouched since before the cut (as after a restore of an older snapshot that reopened it).
        await _sql(app, "UPDATE prompt_groups SET status = 'generating', ended_at = NULL WHERE run_id = :r AND group_id = 'E'", r=run_id)
        # P1 (sealed whole, ready in the cut) is consumed after it: its group row changes and the
        # restore brings it back as it was.
        await api.post("/groups/finalize", {"group_ids": ["P1"]})
    late = (await api.admit(group_body("LATE", 1)))["groups"][0]["rows"]
    await api.dispatch([late[0]["rollout_id"]], INSTANCE)
    await api.seal([T[3]])
    failed = await api.fail([S[1]], "transport")
    await api.dispatch([failed["groups"][0]["rows_to_send"][0]["rollout_id"]], INSTANCE)
    await api.dispatch([T[4]["rollout_id"], rows["P3"][0]["rollout_id"]], INSTANCE)
    return api, rows


async def _sql(app: Any, sql: str, **params: Any) -> None:
    async with app.state.engine.begin() as conn:
        await conn.execute(text(sql), params)


async def _edge_rows_before_cut(app: Any, api: RunApi, rows: dict[str, list[dict[str, Any]]]) -> None:
    """Rows written before the cut that the cut does not know although their group is live at
    the restore: a current attempt (dispatched) of a group that was finalized at the cut, and an
    attempt that is no longer current but still dispatched. The restore must retire both (and
    delete the group, admitted again as far as the cut can tell)."""
    e = (await api.admit(group_body("E", 1)))["groups"][0]["rows"]
    await api.dispatch([e[0]["rollout_id"]], INSTANCE)
    await _sql(app, "UPDATE prompt_groups SET status = 'finalized', ended_at = now() WHERE run_id = :r AND group_id = 'E'", r=api.run_id)
    await _sql(
        app,
        "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, gym_instance_id, status, is_current, dispatched_at) "
        "VALUES (:r, 'S', 2, :ro, :i, 'dispatched', false, now())",
        r=api.run_id, ro=rows["S"][2]["rollout_id"].rsplit("_a", 1)[0] + "_a0ddba11", i=INSTANCE,
    )


async def _rewind(app: Any, run_id: str, snapshot_id: str = "s1", **kw: Any) -> rewind.RewindReport:
    engine = app.state.engine
    planned = await load_and_plan(engine, run_id, snapshot_id=snapshot_id, step=None, with_gym_state=True)
    rw = rewind_of(planned, planned.plan, planned.retire, installed=True)
    tamper = kw.pop("tamper", None)
    if tamper is not None:
        tamper(rw)
    return await rewind.apply_restore(
        engine, run_id, rw, after_cut_minter=rollout_minter(run_id, snapshot_id, planned.run.epoch, "after-cut"), expect_epoch=planned.run.epoch, **kw
    )


async def _ledger(app: Any, run_id: str) -> dict[str, Any]:
    """The run's ledger in full, every table the rewind may write."""
    q = {
        "attempts": "SELECT * FROM attempts WHERE run_id = :r ORDER BY attempt_id",
        "siblings": "SELECT * FROM siblings WHERE run_id = :r ORDER BY group_id, generation_index",
        "groups": "SELECT * FROM prompt_groups WHERE run_id = :r ORDER BY group_id",
        "outbox": "SELECT * FROM outbox_items WHERE run_id = :r ORDER BY item_id",
        "run": "SELECT * FROM runs WHERE run_id = :r",
        "restores": "SELECT * FROM restores WHERE run_id = :r ORDER BY restore_id",
        "answer_rows": "SELECT * FROM restore_row_chunks WHERE run_id = :r ORDER BY restore_id, chunk",
    }
    return {k: await fetch(app.state.engine, sql, r=run_id) for k, sql in q.items()}


async def test_a_failing_rewind_leaves_the_ledger_untouched(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _scenario(client, admin, app, "run-fail")
    before = await _ledger(app, api.run_id)
    kept = rows["T"][0]["rollout_id"]  # sealed in the cut: reused, stays in the ledger

    def collide(rw: rewind.Rewind) -> None:
        # The last statement of the rewind (the new attempts) breaks a constraint, after every
        # other step has written its rows.
        rw.new_rollouts[-1] = kept

    with pytest.raises(Conflict) as info:
        await _rewind(app, api.run_id, tamper=collide)
    assert info.value.code == "restore_ledger_conflict"
    assert await _ledger(app, api.run_id) == before
    # ... and the same restore without the collision applies.
    report = await _rewind(app, api.run_id)
    assert report.epoch == before["run"][0]["epoch"] + 1 and report.attempts_inserted > 0


async def test_the_answer_rows_commit_with_the_rewind_or_not_at_all(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, _ = await _scenario(client, admin, app, "run-rows")
    before = await _ledger(app, api.run_id)
    rows = records.AnswerRows()
    rows.append("T", 1, "restarted", "T_g1_a" + "e" * 32, 0, 0, None, "T_g1_a" + "f" * 32, "no_gym_state")

    def result_of(report: rewind.RewindReport) -> tuple[dict[str, Any], records.AnswerRows]:
        return {"answer": {"rows_total": len(rows)}}, rows

    # The record (its work, then its rows) is written in the rewind's transaction: when it cannot
    # be (here: no restore record was claimed under that id), nothing of the rewind stays.
    with pytest.raises((IntegrityError, psycopg.errors.IntegrityError, Conflict)):
        await _rewind(app, api.run_id, record=("never-claimed", result_of))
    assert await _ledger(app, api.run_id) == before
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state) VALUES (:r, 'claimed', 's1', 'running', true)"),
            {"r": api.run_id},
        )
    # A value the chunk encoding cannot carry is refused before anything is sent.
    bad = records.AnswerRows()
    bad.append("T", 1, "restarted", "T_g1_a\x1f", 0, 0, None, None, "no_gym_state")
    async with app.state.engine.begin() as conn:
        with pytest.raises(ValueError, match="rollout_ids"):
            await records.store_answer_rows(conn, api.run_id, "claimed", bad)
    report = await _rewind(app, api.run_id, record=("claimed", result_of))
    stored = await fetch(app.state.engine, "SELECT chunk, rollout_ids, replaces_rollout_ids FROM restore_row_chunks WHERE run_id = :r", r=api.run_id)
    assert stored == [{"chunk": 0, "rollout_ids": rows.rollout_ids, "replaces_rollout_ids": rows.replaces_rollout_ids}]
    assert report.epoch == before["run"][0]["epoch"] + 1


def _normalized(ledger: dict[str, Any], old_ids: set[str]) -> dict[str, Any]:
    """A ledger with what differs between two runs of the same story (run id, attempt ids, new
    rollout ids, timestamps) replaced by what it means."""

    def ro(x: str | None) -> str | None:
        return x if x is None else ("old:" if x in old_ids else "new:") + x.rsplit("_a", 1)[0]

    drop = {"run_id", "attempt_id", "created_at", "ended_at", "dispatched_at", "next_attempt_at", "item_id", "replaced_by_attempt_id"}
    out: dict[str, Any] = {}
    for table in ("attempts", "siblings", "groups", "outbox"):
        norm = []
        for row in ledger[table]:
            r = {k: v for k, v in row.items() if k not in drop}
            if "rollout_id" in r:
                r["rollout_id"] = ro(r["rollout_id"])
            if r.get("receipt"):
                r["receipt"] = "receipt"
            if r.get("staging_keys"):
                r["staging_keys"] = len(r["staging_keys"])
            if "dispatch_id" in r:
                r["dispatch_id"] = r["dispatch_id"] is not None
            norm.append(r)
        out[table] = sorted(norm, key=repr)
    return out


async def test_looking_only_at_what_changed_gives_the_ledger_of_a_full_comparison(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    def by_ids(rw: rewind.Rewind) -> None:
        # A rewind that does not know its continued rows' groups finds them by id in the whole cut.
        assert rw.continued_groups
        rw.continued_groups = []

    ledgers = []
    for run_id, every, tamper in (("run-fast", False, None), ("run-full", True, None), ("run-ids", False, by_ids)):
        api, _rows = await _scenario(client, admin, app, run_id)
        old_ids = {x["rollout_id"] for x in await fetch(app.state.engine, "SELECT rollout_id FROM attempts WHERE run_id = :r", r=run_id)}
        report = await _rewind(app, run_id, compare_every_row=every, tamper=tamper)
        assert report.after_cut and report.groups_removed == 1
        # The fast paths compare only the attempts written since the cut's xmin.
        assert report.diff_by_xmin is not every
        ledgers.append(_normalized(await _ledger(app, run_id), old_ids))
    fast, full, ids = ledgers
    for table in fast:
        assert fast[table] == full[table] == ids[table], table


async def test_rows_older_than_the_cut_that_it_does_not_know_are_found_without_a_full_comparison(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    ledgers, retired = [], []
    for run_id, every in (("run-edge-fast", False), ("run-edge-full", True)):
        await _scenario(client, admin, app, run_id, edges=True)
        old_ids = {x["rollout_id"] for x in await fetch(app.state.engine, "SELECT rollout_id FROM attempts WHERE run_id = :r", r=run_id)}
        report = await _rewind(app, run_id, compare_every_row=every)
        assert report.diff_by_xmin is not every
        ledgers.append(_normalized(await _ledger(app, run_id), old_ids))
        outbox = await fetch(app.state.engine, "SELECT rollout_id FROM outbox_items WHERE run_id = :r AND op = 'retire'", r=run_id)
        retired.append({x["rollout_id"].split("_g")[0] + ("/stale" if x["rollout_id"].endswith("_a0ddba11") else "") for x in outbox})
    fast, full = ledgers
    for table in fast:
        assert fast[table] == full[table], table
    # Both edge rows were retired by either path.
    assert {"E", "S/stale"} <= retired[0] == retired[1]
    groups = {g["group_id"]: g for g in fast["groups"]}
    assert "E" not in groups and groups["P1"]["status"] == "ready"
    # The continued rows are Gym-owned continuations at gym_attempt 1, whatever path wrote them.
    cont = [r for r in fast["attempts"] if r["gym_owned"] and r["status"] == "reserved"]
    assert len(cont) == 2 and {r["gym_attempt"] for r in cont} == {1}


async def test_a_group_an_earlier_restore_removed_comes_back_with_the_cut_that_holds_it(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    ledgers = []
    for run_id, every in (("run-back-fast", False), ("run-back-full", True)):
        api = await new_run(client, admin, run_id=run_id, target_level="turn")
        await api.admit(group_body("A", 2))
        await publish_snapshot(app.state.engine, run_id, "s0", 1)
        b = (await api.admit(group_body("B", 2)))["groups"][0]["rows"]
        await api.dispatch([b[0]["rollout_id"]], INSTANCE)
        await api.seal([b[0]])
        await publish_snapshot(app.state.engine, run_id, "s1", 2)
        # Back to s0: B did not exist then and leaves the ledger.
        first = await _rewind(app, run_id, "s0")
        assert first.groups_removed == 1
        # Forward to s1 (a later cut): B is missing from the live ledger and comes back as cut.
        old_ids = {x["rollout_id"] for x in await fetch(app.state.engine, "SELECT rollout_id FROM attempts WHERE run_id = :r", r=run_id)}
        old_ids |= {b[0]["rollout_id"], b[1]["rollout_id"]}
        second = await _rewind(app, run_id, "s1", compare_every_row=every)
        assert second.diff_by_xmin is not every
        ledger = _normalized(await _ledger(app, run_id), old_ids)
        groups = {g["group_id"]: g for g in ledger["groups"]}
        assert set(groups) == {"A", "B"} and groups["B"]["status"] == "generating"
        sealed = [a for a in ledger["attempts"] if a["group_id"] == "B" and a["status"] == "sealed" and a["is_current"]]
        assert [a["rollout_id"] for a in sealed] == ["old:" + b[0]["rollout_id"].rsplit("_a", 1)[0]]
        ledgers.append(ledger)
    for table in ledgers[0]:
        assert ledgers[0][table] == ledgers[1][table], table
