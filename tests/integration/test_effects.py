"""The effect journal (docs/effects.md) against the ledger: each answer of ``begin``, the fence on
the attempt, and the orphans a restore and a continuation's seal leave."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from checkpoint_coordinator.observability import metrics as m
from checkpoint_coordinator.restore.store import records

from .ledger_helpers import RunApi, group_body, new_run
from .test_restore_rewind import _rewind, _scenario

INSTANCE = "math/replica-0"


def _begin(rollout_id: str, seq: int, digest: str = "sha256:a", gym_attempt: int = 0, **kw: Any) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "gym_attempt": gym_attempt, "seq": seq, "effect": "send_mail", "digest": digest, **kw}


async def _done(api: RunApi, rollout_id: str, seq: int, result: Any, **kw: Any) -> int:
    ans = await api.post("/effects/begin", _begin(rollout_id, seq, **kw))
    assert ans["answer"] == "proceed", ans
    await api.post(f"/effects/{ans['effect_id']}/complete", {"result": result})
    return int(ans["effect_id"])


async def _live_run(client: Any, admin: dict[str, str], run_id: str) -> tuple[RunApi, list[dict[str, Any]]]:
    api = await new_run(client, admin, run_id=run_id)
    rows = (await api.admit(group_body("G", 2)))["groups"][0]["rows"]
    await api.dispatch([r["rollout_id"] for r in rows], INSTANCE)
    return api, rows


async def test_each_answer_of_begin(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _live_run(client, admin, "fx-answers")
    ro = rows[0]["rollout_id"]
    first = await api.post("/effects/begin", _begin(ro, 0, call_id="c1"))
    assert first["answer"] == "proceed"
    # The same begin again (its reply was lost) may act; another begin of the key may not know.
    assert (await api.post("/effects/begin", _begin(ro, 0, call_id="c1")))["answer"] == "proceed"
    unknown = await api.post("/effects/begin", _begin(ro, 0, call_id="c2"))
    assert unknown["answer"] == "unknown" and unknown["record"]["state"] == "in_progress"
    done = await api.post(f"/effects/{first['effect_id']}/complete", {"result": {"id": "m1"}})
    assert done["state"] == "completed" and done["result"] == {"id": "m1"}
    # Completed with the same digest: done, with the recorded result (the tool does not act).
    again = await api.post("/effects/begin", _begin(ro, 0))
    assert again["answer"] == "done" and again["result"] == {"id": "m1"} and again["effect_id"] == first["effect_id"]
    # A repeat of complete with the same result answers the same; another result is refused.
    assert (await api.post(f"/effects/{first['effect_id']}/complete", {"result": {"id": "m1"}}))["state"] == "completed"
    assert (await api.post(f"/effects/{first['effect_id']}/complete", {"result": {"id": "m2"}}, 409))["code"] == "effect_completed"
    # Another digest at the same place: diverged, act anew; the old one is an orphan.
    div = await api.post("/effects/begin", _begin(ro, 0, "sha256:b"))
    assert div["answer"] == "diverged" and div["orphaned"]["effect_id"] == first["effect_id"]
    assert div["orphaned"]["orphan_reason"] == "diverged" and div["orphaned"]["orphaned_at"] is not None
    orphans = await api.get("/effects?orphaned=true")
    assert [(e["effect_id"], e["orphan_reason"], e["result"]) for e in orphans["effects"]] == [(first["effect_id"], "diverged", {"id": "m1"})]
    # Abandoned (the reconcile hook found it did not happen): the key is free again.
    await api.post(f"/effects/{div['effect_id']}/abandon", {})
    assert (await api.post("/effects/begin", _begin(ro, 0, "sha256:b")))["answer"] == "proceed"
    # A result is bounded; an unknown effect is 404; every refusal is problem+json.
    big = await api.post(f"/effects/{first['effect_id']}/complete", {"result": "x" * 70_000}, 413)
    assert big["code"] == "effect_result_too_large"
    assert (await api.post("/effects/424242/complete", {"result": None}, 404))["code"] == "effect_not_found"
    assert (await api.post("/effects/begin", _begin(ro, -1), 422))["code"] == "invalid_request"


async def test_only_the_current_attempt_may_begin(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _live_run(client, admin, "fx-stale")
    ro = rows[0]["rollout_id"]
    # Another Gym attempt of the rollout than its current one (a straggler of an older attempt).
    stale = await api.post("/effects/begin", _begin(ro, 0, gym_attempt=1), 409)
    assert stale["code"] == "stale_attempt" and "do not act" in stale["detail"]
    # A retired attempt: its answer never came, it was replaced.
    await api.fail([rows[0]], "transport")
    assert (await api.post("/effects/begin", _begin(ro, 0), 409))["code"] == "stale_attempt"
    assert (await api.post("/effects/begin", _begin("never_admitted_g0_a0", 0), 409))["code"] == "stale_attempt"
    async with app.state.engine.begin() as conn:
        n = (await conn.execute(text("SELECT count(*) FROM effects WHERE run_id = 'fx-stale'"))).scalar()
    assert n == 0  # nothing was written for a refused begin


def _orphans_counted(reason: str) -> float:
    return m.REGISTRY.get_sample_value("ckptc_effect_orphans_total", {"reason": reason}) or 0.0


async def test_a_restore_orphans_discarded_timelines_and_a_seal_the_unrepeated(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _scenario(client, admin, app, "fx-restore")
    T, S = rows["T"], rows["S"]
    # Every effect here is made after the scenario's cut. T[1] continues from Gym state (turn
    # level); T[2] restarts (Gym listed it as a restart); S[1] failed after the cut and its
    # replacement (unknown to the cut) is discarded; LATE was admitted after the cut (rewound).
    t1_kept = await _done(api, T[1]["rollout_id"], 0, "mail-0")
    t1_gone = await _done(api, T[1]["rollout_id"], 1, "mail-1")
    t2 = await _done(api, T[2]["rollout_id"], 0, "charge")
    s1_next = next(a for a in (await api.group("S"))["siblings"][1]["attempts"] if a["is_current"])
    s1 = await _done(api, s1_next["rollout_id"], 0, "refund")
    late_rows = (await api.group("LATE"))["siblings"][0]["attempts"]
    late = await _done(api, late_rows[-1]["rollout_id"], 0, "ticket")
    before = _orphans_counted("not_repeated")
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state) VALUES ('fx-restore', 'r1', 's1', 'running', true)")
        )
    report = await _rewind(app, api.run_id, record=("r1", lambda rep: ({"answer": {}}, records.AnswerRows())))
    assert report.effects_orphaned == {"restarted": 1, "retired_by_restore": 2}, report.effects_orphaned
    assert report.effects_pending == 2
    orphans = {e["effect_id"]: e for e in (await api.get("/effects?orphaned=true"))["effects"]}
    assert {k: v["orphan_reason"] for k, v in orphans.items()} == {t2: "restarted", s1: "retired_by_restore", late: "retired_by_restore"}
    assert {v["orphaned_by"] for v in orphans.values()} == {"r1"}
    # The continuation (Gym attempt 1) makes its first mail again: done, not acted; kept.
    await api.dispatch([T[1]["rollout_id"]], INSTANCE)
    again = await api.post("/effects/begin", _begin(T[1]["rollout_id"], 0, gym_attempt=1))
    assert again["answer"] == "done" and again["result"] == "mail-0" and again["effect_id"] == t1_kept
    # The attempt the restore replaced cannot act any more.
    assert (await api.post("/effects/begin", _begin(T[2]["rollout_id"], 1), 409))["code"] == "stale_attempt"
    # It seals without making the second again: that one belongs to the discarded timeline.
    await api.seal([{**T[1], "capture_key": T[1]["rollout_id"] + "-a1"}])
    gone = (await api.get(f"/effects?rollout_id={T[1]['rollout_id']}"))["effects"]
    by_id = {e["effect_id"]: e for e in gone}
    assert by_id[t1_gone]["orphan_reason"] == "not_repeated" and by_id[t1_gone]["orphaned_by"] == "r1"
    assert by_id[t1_kept]["orphaned_at"] is None and by_id[t1_kept]["pending_restore"] is None
    assert _orphans_counted("not_repeated") == before + 1
    # The run's deletion removes its journal.
    async with app.state.engine.begin() as conn:
        await conn.execute(text("DELETE FROM runs WHERE run_id = 'fx-restore'"))
        assert (await conn.execute(text("SELECT count(*) FROM effects WHERE run_id = 'fx-restore'"))).scalar() == 0


async def test_the_async_journal_acts_once_and_reconciles(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    import httpx
    from ckpt_client import AsyncCoordinatorClient, AsyncEffectJournal, Conflict, EffectUnknown, Reconciled, Unavailable, args_digest

    api, rows = await _live_run(client, admin, "fx-async")
    ro = rows[0]["rollout_id"]
    acted: list[int] = []

    async def act() -> dict[str, int]:
        acted.append(1)
        return {"n": len(acted)}

    async with AsyncCoordinatorClient("http://coordinator", api.h["Authorization"].split()[1], run_id="fx-async", transport=httpx.ASGITransport(app=app)) as c:
        journal = AsyncEffectJournal(c)
        call = {"rollout_id": ro, "gym_attempt": 0, "effect": "send_mail", "args": {"to": "a@x"}}
        assert await journal.call(seq=0, act=act, **call) == {"n": 1}
        assert await journal.call(seq=0, act=act, **call) == {"n": 1} and len(acted) == 1  # done: not acted again
        # seq 1 begun by a participant that died before completing: unknown.
        await c.begin_effect(ro, 0, 1, "send_mail", args_digest("send_mail", {"to": "a@x"}))
        try:
            await journal.call(seq=1, act=act, **call)
            raise AssertionError("an unknown effect needs a reconcile hook")
        except EffectUnknown:
            pass

        async def found(record):  # type: ignore[no-untyped-def]
            return Reconciled(True, {"n": 99})

        assert await AsyncEffectJournal(c, reconcile=found).call(seq=1, act=act, **call) == {"n": 99} and len(acted) == 1
        # seq 3 unknown, and it did not happen: abandoned, begun again, acted. An act that fails
        # with the client's own Unavailable is the caller's error, not an unreachable coordinator:
        # even a journal told to act when unreachable does not act again.
        await c.begin_effect(ro, 0, 3, "send_mail", args_digest("send_mail", {"to": "a@x"}))

        async def nothing(record):  # type: ignore[no-untyped-def]
            return Reconciled(False)

        async def act_fails() -> None:
            acted.append(1)
            raise Unavailable("the mail server is away")

        try:
            await AsyncEffectJournal(c, reconcile=nothing, act_when_unreachable=True).call(seq=3, act=act_fails, **call)
            raise AssertionError("the act's own error must reach the caller")
        except Unavailable as e:
            assert "mail server" in str(e) and len(acted) == 2
        # A stale attempt never acts.
        await api.fail([rows[0]], "transport")
        try:
            await journal.call(seq=2, act=act, **call)
            raise AssertionError("a retired attempt must not act")
        except Conflict as e:
            assert e.code == "stale_attempt" and len(acted) == 2


async def test_listing_the_journal_of_a_run_that_does_not_exist_is_404(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    # The admin token reaches any run id: a missing run is not an empty journal.
    r = await client.get("/v1/runs/fx-no-such-run/effects", headers=admin)
    assert r.status_code == 404 and r.json()["code"] == "run_not_found", r.text
    await _live_run(client, admin, "fx-empty")
    r = await client.get("/v1/runs/fx-empty/effects", headers=admin)
    assert r.status_code == 200 and r.json()["effects"] == [] and r.json()["orphans_total"] == 0, r.text
