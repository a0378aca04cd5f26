"""The effect journal end to end (docs/effects.md): gymsim's mail tool across a crash and a restore.

Episodes run on gymsim with the mail tool (a mail per turn, appended to a file outside Gym); a
snapshot saves them mid-way; they run on past the cut, mailing; the Gym process dies, the trainer
reports its calls as transport failures; a fresh Gym is registered, the restore continues every
episode from its saved turn, and the continuations run to the end. Without the journal the turns
after the cut mail twice (the test would see it). With it every mail goes out once, and the
journal's orphans are what the variant makes of the discarded timeline: none when the
continuation asks for the same mails (#begin-and-complete), `diverged` ones when its mails name
its attempt, `not_repeated` ones when it sends none (#orphans).

The coordinator runs in this process; gymsim, a separate process, reaches its journal over a
loopback port served from the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from ckpt_client import AsyncCoordinatorClient, EffectRecord, args_digest
from gymsim.mail import EFFECT, read_outbox
from gymsim.testing import GymsimInstance, default_instance_config, server_config

from ..integration.ledger_helpers import group_body, new_run
from .harness import ReportingTrainer, drive_snapshot, kill_all, turns_done, until_every_episode_has

pytestmark = pytest.mark.timeout(240)

IID = "math/replica-0"
TURN_S = 0.1
TURNS = 14
SAVED_AFTER = 4  # turns every episode has done before the snapshot is requested
LOST_AFTER = 3  # turns every episode does after the snapshot before its Gym dies



@contextlib.asynccontextmanager
async def served_over_tcp(app: Any) -> AsyncIterator[str]:
    """The in-process coordinator on a loopback port too (its lifespan already runs), for gymsim."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(20):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
        sock.close()


def _gym_config(outbox: Path, variant: str, journal: dict[str, str] | None) -> dict[str, Any]:
    config = default_instance_config(IID, token="tok-0", turn_seconds=TURN_S, lease_grace_seconds=10)
    return server_config(config, "calendar_resources", mail={"outbox": str(outbox), "variant": variant, "journal": journal})


async def _crash_and_restore(client, admin, app, tmp_path: Path, variant: str, journal: bool) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The story of the module docstring; returns what it left behind: the mails, each rollout's
    saved turn, and (with the journal) every effect and the orphans."""
    api = await new_run(client, admin, target_level="turn", control_timeout_s=10, drain_timeout_s=20, data_plane_timeout_s=20)
    token = api.h["Authorization"].removeprefix("Bearer ")
    outbox = tmp_path / "mails.jsonl"
    gyms: list[GymsimInstance] = []
    trainer: ReportingTrainer | None = None
    async with served_over_tcp(app) as url:
        config = _gym_config(outbox, variant, {"url": url, "run_id": api.run_id, "token": token} if journal else None)
        try:
            gyms.append(await asyncio.to_thread(GymsimInstance.start, config, subprocess=True))
            await api.post("/gym-instances", {"instances": [{"instance_id": IID, "control_token": "tok-0", "servers": gyms[0].servers}]})
            trainer = ReportingTrainer(api, {IID: gyms[0]}, turns=TURNS)
            rows = await trainer.admit_and_dispatch([group_body(f"g{k}", 2) for k in range(2)], IID)
            keys = [r["capture_key"] for r in rows]
            await until_every_episode_has(gyms[0], keys, SAVED_AFTER)
            snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
            assert snap["outcome"] == "published", snap
            done = await turns_done(gyms[0])
            await until_every_episode_has(gyms[0], keys, max(done[k] for k in keys) + LOST_AFTER)

            # The Gym process dies mid-turn; the trainer's calls fail and it reports each one.
            await asyncio.to_thread(gyms[0].kill)
            await trainer.wait_idle(60)
            gyms.append(await asyncio.to_thread(GymsimInstance.start, config, subprocess=True))
            await api.post("/gym-instances", {"instances": [{"instance_id": IID, "control_token": "tok-0", "servers": gyms[1].servers}]})
            ans = await api.post("/restores", {"restore_id": "r1", "step": 0})
            assert ans["counts"]["continued"] == len(rows), ans["counts"]
            trainer.instances = {IID: gyms[1]}
            await trainer.dispatch(ans["rows"], IID)
            await trainer.wait_idle(120)
            replies = {r["rollout_id"]: trainer.replies[r["capture_key"]] for r in ans["rows"]}
            assert all(x["turns_completed"] == TURNS for x in replies.values()), replies
            await api.post("/groups/finalize", {"group_ids": ["g0", "g1"]})
            async with AsyncCoordinatorClient(url, token, run_id=api.run_id) as c:
                effects = await c.effects()
                orphans = await c.effects(orphaned=True)
        finally:
            if trainer is not None:
                await trainer.aclose()
            await kill_all(*gyms)
    return {
        "mails": read_outbox(outbox),
        "cut": {rid: int(x["resumed_from_turn"]) for rid, x in replies.items()},
        "effects": effects,
        "orphans": orphans,
    }


def _sent_by_attempt_0(mails: list[dict[str, Any]]) -> dict[str, int]:
    """How many mails each rollout's first timeline sent before its Gym died."""
    out: Counter[str] = Counter(m["rollout_id"] for m in mails if m["attempt"] == 0)
    return dict(out)


def _assert_every_mail_is_journalled(mails: list[dict[str, Any]], effects: list[EffectRecord]) -> None:
    """Each mail has the record of its own call (same rollout, seq, attempt and arguments), and
    no call mailed twice. The record is completed with the mail's id, unless the Gym died between
    the mail and its completion and the continuation then asked for another mail (or none): it
    stays begun, an orphan."""
    calls = Counter((m["rollout_id"], m["attempt"], m["seq"]) for m in mails)
    assert [k for k, n in calls.items() if n > 1] == []
    by_call = {(e.rollout_id, e.gym_attempt, e.seq): e for e in effects}
    for m in mails:
        rec = by_call.get((m["rollout_id"], m["attempt"], m["seq"]))
        assert rec is not None and rec.digest == args_digest(EFFECT, {"to": m["to"], "body": m["body"]}), (m, rec)
        assert rec.result == {"message_id": m["message_id"]} if rec.state == "completed" else rec.orphaned_at is not None, (m, rec)


async def test_without_the_journal_the_turns_after_the_cut_mail_twice(client, admin, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    got = await _crash_and_restore(client, admin, app, tmp_path, "same", journal=False)
    mails, cut = got["mails"], got["cut"]
    first = _sent_by_attempt_0(mails)
    sent = Counter((m["rollout_id"], m["seq"]) for m in mails)
    twice = {k for k, n in sent.items() if n > 1}
    # Exactly the mails the first timeline sent after the cut went out again from the continuation.
    assert twice and twice == {(r, s) for r in cut for s in range(cut[r], first[r])}, (twice, cut, first)
    assert all(n <= 2 for n in sent.values())
    assert {k[0] for k in sent} == set(cut) and all(sorted(s for r2, s in sent if r2 == r) == list(range(TURNS)) for r in cut)
    assert got["effects"] == [] and got["orphans"] == []  # nobody asked the journal


async def test_with_the_journal_every_mail_goes_out_once(client, admin, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    got = await _crash_and_restore(client, admin, app, tmp_path, "same", journal=True)
    mails, cut = got["mails"], got["cut"]
    sent = Counter((m["rollout_id"], m["seq"]) for m in mails)
    assert sorted(sent) == sorted((r, s) for r in cut for s in range(TURNS)) and set(sent.values()) == {1}
    assert all(cut[r] < _sent_by_attempt_0(mails)[r] for r in cut)  # mails after the cut were at stake
    _assert_every_mail_is_journalled(mails, got["effects"])
    # The continuation asked for the very mails the discarded timeline sent: they are kept, none orphaned.
    assert got["orphans"] == []
    live = [e for e in got["effects"] if e.orphaned_at is None and e.state != "abandoned"]
    assert sorted((e.rollout_id, e.seq) for e in live) == sorted(sent) and all(e.pending_restore is None for e in live)


@pytest.mark.parametrize("variant, reason", [("names_attempt", "diverged"), ("first_attempt_only", "not_repeated")])
async def test_the_discarded_timelines_mails_become_orphans(client, admin, app, tmp_path: Path, variant: str, reason: str) -> None:  # type: ignore[no-untyped-def]
    got = await _crash_and_restore(client, admin, app, tmp_path, variant, journal=True)
    mails, cut, orphans = got["mails"], got["cut"], got["orphans"]
    _assert_every_mail_is_journalled(mails, got["effects"])
    after_cut = {(m["rollout_id"], m["seq"]) for m in mails if m["attempt"] == 0 and m["seq"] >= cut[m["rollout_id"]]}
    assert after_cut, (cut, mails)
    # Every mail the first timeline sent after the cut is an orphan (a call begun when the Gym died
    # may be one too, sent or not); nothing from before the cut, nothing of the continuation.
    assert all(o.orphan_reason == reason and o.gym_attempt == 0 and o.seq >= cut[o.rollout_id] for o in orphans), orphans
    assert after_cut <= {(o.rollout_id, o.seq) for o in orphans}
    assert {(o.rollout_id, o.seq) for o in orphans if o.state == "completed"} <= after_cut
    if reason == "not_repeated":
        assert all(o.orphaned_by == "r1" for o in orphans)
        assert {m["attempt"] for m in mails} == {0}  # the continuation mailed nothing
    else:
        # The continuation sent its own mail at each place after the cut: one live record per place.
        live = [e for e in got["effects"] if e.orphaned_at is None and e.state == "completed"]
        assert sorted((e.rollout_id, e.seq) for e in live) == sorted((r, s) for r in cut for s in range(TURNS))
        assert all(e.gym_attempt == (1 if e.seq >= cut[e.rollout_id] else 0) for e in live)
