"""What the ingest schema relies on since it lost its per-row checks (a large part of the
ingest's cost):

- no foreign keys ``siblings -> prompt_groups`` and ``attempts -> siblings``: a deleted group takes
  its siblings and attempts with it through the statement-level trigger
  ``prompt_groups_drop_children`` (a restore removing groups, a run deleted), so no path leaves
  orphans;
- no index on ``attempts.dispatch_id``: "stream ended" finds a dispatch's rows through
  ``dispatch_calls`` and the attempt's own ``dispatch_id`` decides;
- dispatch, seal, refusal and failure lock the groups their rollout ids name and read the attempts
  once; a rollout id of another form (an imported ledger) falls back to finding the groups
  through the attempts.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any

from sqlalchemy import text

from checkpoint_coordinator.ledger import models

from .ledger_helpers import group_body, new_run
from .test_restore_rewind import _rewind, _scenario

ORPHANS = {
    "siblings without their group": (
        "SELECT count(*) FROM siblings s WHERE NOT EXISTS "
        "(SELECT 1 FROM prompt_groups g WHERE g.run_id = s.run_id AND g.group_id = s.group_id)"
    ),
    "attempts without their sibling": (
        "SELECT count(*) FROM attempts a WHERE NOT EXISTS (SELECT 1 FROM siblings s "
        "WHERE s.run_id = a.run_id AND s.group_id = a.group_id AND s.generation_index = a.generation_index)"
    ),
}


async def _scalar(app: Any, sql: str, **p: Any) -> Any:
    async with app.state.engine.connect() as conn:
        return (await conn.execute(text(sql), p)).scalar()


async def _orphans(app: Any) -> dict[str, int]:
    return {what: await _scalar(app, sql) for what, sql in ORPHANS.items()}


async def _counts(app: Any, run_id: str) -> tuple[int, int, int]:
    return tuple(  # type: ignore[return-value]
        [await _scalar(app, f"SELECT count(*) FROM {t} WHERE run_id = :r", r=run_id) for t in ("prompt_groups", "siblings", "attempts")]
    )


def test_migration_carries_the_trigger_the_models_document() -> None:
    """The trigger is written into the migration by hand (autogenerate does not see it): it must
    be the statements ``ledger.models`` documents, both ways."""
    path = Path(__file__).resolve().parents[2] / "migrations" / "versions" / "0001_initial_ledger_schema.py"
    spec = importlib.util.spec_from_file_location("mig0001", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    executed: list[str] = []

    class _Op:
        def __getattr__(self, name: str) -> Any:
            if name == "execute":
                return executed.append
            if name == "f":
                return lambda s: s
            return lambda *a, **k: None

    spec.loader.exec_module(mod)
    mod.op = _Op()  # type: ignore[attr-defined]
    # The migration executes other hand-written statements too (the cut's type and views): compare
    # the ones about this trigger, in order.
    def ours() -> list[str]:
        return [sql for sql in executed if "prompt_groups_drop_children" in sql]

    mod.upgrade()
    assert ours() == list(models.GROUP_CHILDREN_TRIGGER_UP)
    executed.clear()
    mod.downgrade()
    assert ours() == list(models.GROUP_CHILDREN_TRIGGER_DOWN)


async def test_deleting_groups_or_a_run_leaves_no_orphans(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    other = await new_run(client, admin, run_id="run-2")
    rows = (await run.admit(group_body("g1", 3), group_body("g2", 2)))["groups"]
    await other.admit(group_body("g1", 2))
    g1 = rows[0]["rows"]
    await run.dispatch([r["rollout_id"] for r in g1[:2]])
    await run.fail(g1[:1], "transport")  # g1 gets a second attempt on sibling 0
    assert await _counts(app, "run-1") == (2, 5, 6)
    async with app.state.engine.begin() as conn:
        await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = 'run-1' AND group_id = 'g1'"))
    assert await _counts(app, "run-1") == (1, 2, 2)
    assert await _counts(app, "run-2") == (1, 2, 2)  # same group id in another run: untouched
    assert await _orphans(app) == dict.fromkeys(ORPHANS, 0)
    # A statement deleting nothing is harmless.
    async with app.state.engine.begin() as conn:
        await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = 'run-1' AND group_id = 'nope'"))
    assert await _counts(app, "run-1") == (1, 2, 2)
    # A run's deletion cascades to its groups, whose trigger takes siblings and attempts.
    async with app.state.engine.begin() as conn:
        await conn.execute(text("DELETE FROM runs WHERE run_id = 'run-1'"))
    assert await _counts(app, "run-1") == (0, 0, 0)
    assert await _scalar(app, "SELECT count(*) FROM dispatch_calls WHERE run_id = 'run-1'") == 0
    assert await _counts(app, "run-2") == (1, 2, 2)
    assert await _orphans(app) == dict.fromkeys(ORPHANS, 0)


async def test_restore_removing_groups_leaves_no_orphans(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    await _scenario(client, admin, app, "run-r")
    assert await _scalar(app, "SELECT count(*) FROM attempts WHERE run_id = 'run-r' AND group_id = 'LATE'") == 1
    report = await _rewind(app, "run-r")
    assert report.groups_removed == 1
    for table in ("prompt_groups", "siblings", "attempts"):
        assert await _scalar(app, f"SELECT count(*) FROM {table} WHERE run_id = 'run-r' AND group_id = 'LATE'") == 0, table
    assert await _orphans(app) == dict.fromkeys(ORPHANS, 0)


async def test_stream_ended_finds_a_dispatch_sent_in_several_calls_without_an_index(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 4)))["groups"][0]["rows"]
    ids = [r["rollout_id"] for r in rows]
    await run.dispatch(ids[:2], dispatch_id="d")
    await run.dispatch(ids[2:3], dispatch_id="d")  # the same stream, reported in a second call
    await run.post("/attempts/refused", {"rollout_ids": ids[1:2]})  # back to reserved: no longer in "d"
    await run.dispatch(ids[1:2], dispatch_id="e")
    await run.seal(rows[:1])
    ended = await run.post("/dispatches/d/ended", {"returned": []})
    assert ended["missing"] == [ids[2]]  # not the sealed row 0, not row 1 (now in "e"), not the never-sent row 3
    g = await run.group("g1")
    assert [a["status"] for a in g["siblings"][2]["attempts"]] == ["abandoned", "reserved"]
    assert [a["status"] for a in g["siblings"][1]["attempts"]] == ["dispatched"]
    assert (await run.post("/dispatches/e/ended", {"missing": ids[1:2]}))["missing"] == [ids[1]]
    # There is no index on dispatch_id (so that a dispatch is a heap-only update).
    assert await _scalar(app, "SELECT count(*) FROM pg_indexes WHERE tablename = 'attempts' AND indexdef LIKE '%dispatch_id%'") == 0


async def _imported_group(app: Any, run_id: str, group_id: str, rollout_ids: list[str]) -> None:
    """A group whose rollout ids are not of the minted form (as an imported ledger's may be)."""
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, restore_level, expected_generations) "
                "VALUES (:r, :g, '{\"sample_id\": 1, \"task_name\": \"t\"}', 'd', 'sibling', :n)"
            ),
            {"r": run_id, "g": group_id, "n": len(rollout_ids)},
        )
        for i, rid in enumerate(rollout_ids):
            await conn.execute(text("INSERT INTO siblings (run_id, group_id, generation_index) VALUES (:r, :g, :i)"), {"r": run_id, "g": group_id, "i": i})
            await conn.execute(
                text("INSERT INTO attempts (run_id, group_id, generation_index, rollout_id) VALUES (:r, :g, :i, :ro)"),
                {"r": run_id, "g": group_id, "i": i, "ro": rid},
            )


async def test_rollout_ids_that_do_not_name_their_group_still_lock_it(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """A batch mixing minted rollout ids with ids of another form: one that names no group, and
    one that looks minted but names another (existing) group. Every row is handled, under the
    lock of its real group, and the batch stays all or nothing."""
    run = await new_run(client, admin)
    minted = (await run.admit(group_body("g1", 2)))["groups"][0]["rows"]
    odd = ["legacy-0001", "g1_g0_a" + "0" * 32]  # the second names group g1, but lives in group imp
    await _imported_group(app, "run-1", "imp", odd)
    ids = [r["rollout_id"] for r in minted] + odd
    sent = await run.dispatch(ids, dispatch_id="mix")
    assert [r["rollout_id"] for r in sent["rows"]] == ids and {r["group_id"] for r in sent["rows"]} == {"g1", "imp"}
    # A refused batch writes nothing, on the fallback path too.
    bad = await run.post("/attempts/sealed", {"rows": [
        {"rollout_id": odd[0], "receipt": {"rollout_id": odd[0]}},
        {"rollout_id": odd[1], "receipt": {"rollout_id": "wrong"}},
    ]}, 409)
    assert bad["code"] == "receipt_mismatch"
    assert await _scalar(app, "SELECT count(*) FROM attempts WHERE group_id = 'imp' AND status = 'sealed'") == 0
    sealed = await run.post("/attempts/sealed", {"rows": [{"rollout_id": r, "receipt": {"rollout_id": r}} for r in ids]})
    assert sealed["ready_groups"] == ["g1", "imp"]
    assert [r["result"] for r in sealed["rows"]] == ["sealed"] * 4


async def test_batch_bodies_parse_as_before(client, admin) -> None:  # type: ignore[no-untyped-def]
    """The batch endpoints parse JSON with pydantic-core: malformed JSON is still FastAPI's 422
    problem, a non-finite reward is still refused, and a lone surrogate escape (valid JSON that no
    PostgreSQL text can hold; it used to fail with a 500 when the batch was written) is a 422 too,
    with nothing written."""
    run = await new_run(client, admin)
    rows = (await run.admit(group_body("g1", 2)))["groups"][0]["rows"]
    await run.dispatch([r["rollout_id"] for r in rows])
    h = {**run.h, "Content-Type": "application/json"}
    broken = await client.post("/v1/runs/run-1/attempts/sealed", content=b'{"rows": [', headers=h)
    assert broken.status_code == 422 and broken.json()["code"] == "invalid_request", broken.text
    nan = ('{"rows": [{"rollout_id": "%s", "receipt": {"rollout_id": "%s"}, "reward": NaN}]}' % (rows[0]["rollout_id"], rows[0]["capture_key"])).encode()
    refused = await client.post("/v1/runs/run-1/attempts/sealed", content=nan, headers=h)
    assert refused.status_code == 422 and refused.json()["code"] == "invalid_request", refused.text
    odd = ('{"rows": [{"rollout_id": "%s", "receipt": {"rollout_id": "%s", "note": "\\ud800"}}]}' % (rows[0]["rollout_id"], rows[0]["capture_key"])).encode()
    surrogate = await client.post("/v1/runs/run-1/attempts/sealed", content=odd, headers=h)
    assert surrogate.status_code == 422 and surrogate.json()["code"] == "invalid_request", surrogate.text
    assert (await run.group("g1"))["siblings"][0]["attempts"][0]["status"] == "dispatched"
    fine = await run.seal(rows)
    assert [r["result"] for r in fine["rows"]] == ["sealed", "sealed"] and fine["ready_groups"] == ["g1"]


async def test_a_wrong_guess_releases_its_locks_and_locks_the_real_group(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """A rollout id that names group g1 but lives in group imp: the guessed lock on g1 is rolled
    back to the savepoint (another transaction can take g1 at once) and imp is locked instead."""
    import psycopg

    from checkpoint_coordinator.rollouts import locks as rollout_locks

    run = await new_run(client, admin)
    await run.admit(group_body("g1", 1))
    odd = "g1_g0_a" + "f" * 32
    await _imported_group(app, "run-1", "imp", [odd])
    engine = app.state.engine
    async with engine.begin() as conn:
        groups, atts = await rollout_locks.lock_and_read(conn, "run-1", [odd])
        assert sorted(groups) == ["imp"] and atts[odd].group_id == "imp"
        other = await psycopg.AsyncConnection.connect(engine.url.render_as_string(hide_password=False).replace("postgresql+psycopg", "postgresql"))
        try:
            async with other.transaction():
                got = await (await other.execute("SELECT group_id FROM prompt_groups WHERE run_id = 'run-1' AND group_id = 'g1' FOR UPDATE NOWAIT")).fetchall()
                assert got == [("g1",)]  # the guessed lock is gone
            try:
                async with other.transaction():
                    await other.execute("SELECT group_id FROM prompt_groups WHERE run_id = 'run-1' AND group_id = 'imp' FOR UPDATE NOWAIT")
                raise AssertionError("imp should be locked by the batch")
            except psycopg.errors.LockNotAvailable:
                pass
        finally:
            await other.close()



async def test_ingest_statements_are_never_prepared(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    """psycopg prepares a statement on its fifth run on a connection, and PostgreSQL may then keep
    a generic plan in which a ``= ANY($n)`` array is neither known in size nor hashed (the ready
    check over 1 000 groups then becomes many times slower). The batch statements of admit, dispatch and
    seal are therefore planned on every call: after more rounds than the threshold, no pooled
    connection holds one of them prepared."""
    run = await new_run(client, admin)
    for i in range(8):
        rows = (await run.admit(group_body(f"g{i}", 2)))["groups"][0]["rows"]
        await run.dispatch([r["rollout_id"] for r in rows])
        await run.seal(rows)
    engine = app.state.engine
    held = []
    async with contextlib.AsyncExitStack() as stack:
        # Check out every pooled connection at once (and one more), so each is asked.
        for _ in range(engine.sync_engine.pool.checkedin() + 1):
            conn = await stack.enter_async_context(engine.connect())
            held += [r[0] for r in (await conn.execute(text("SELECT statement FROM pg_prepared_statements"))).all()]
    ingest = [s for s in held if any(t in s for t in ("INSERT INTO attempts", "UPDATE attempts", "FROM attempts", "prompt_groups"))]
    assert ingest == []
