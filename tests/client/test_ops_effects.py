"""``ckpt-coordinator effects`` as an operator runs it (the console script against a live
coordinator): a run's orphaned effects by default, every effect with ``--all``, one rollout's with
``--rollout-id``, ``--json``, and the failures every operator command shares; then its tables on
records made up here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from ckpt_client import CoordinatorClient, GymInstance, args_digest
from ckpt_client.effects import EffectRecord
from ckpt_client.ops_effects import render_effects, short_result

from tests.conftest import ADMIN_TOKEN

from .conftest import LiveServer, free_port, group, sealed
from .test_ops_cli import INSTANCE, cli

pytestmark = pytest.mark.timeout(180)

RUN = "ops-fx"
LONG = {"message_id": "m-1", "body": "x" * 100}


def _journalled_run(coordinator: LiveServer, gym: Any, tmp_path: Path) -> tuple[str, str, str]:
    """A run whose journal holds four effects: rollout A sent a mail (completed, a long result),
    charged a card, then at the same place charged another amount (``diverged``: the first charge
    is an orphan, the second completed); rollout B began a write and never completed it, and a
    restore of the snapshot taken while B was in flight reran B (its write: an orphan of
    ``rst-1``). Answers (token, rollout A, rollout B)."""
    with CoordinatorClient(coordinator.url, ADMIN_TOKEN, retries=2, backoff=0.05) as admin:
        run = admin.create_run(RUN, str(coordinator.checkpoint_root), {"target_level": "sibling"})
    assert run.run_token
    with CoordinatorClient(coordinator.url, run.run_token, run_id=RUN, retries=2, backoff=0.05) as c:
        c.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
        admitted = c.admit_groups([group("g0"), group("g1")])
        rows = {g.group_id: g.rows for g in admitted.groups}
        sent = c.dispatch([r.rollout_id for g in ("g0", "g1") for r in rows[g]], dispatch_id="d-1", instance_id=INSTANCE).rows
        a, b = (next(s for s in sent if s.rollout_id == r.rollout_id) for r in (rows["g0"][0], rows["g1"][1]))

        mail = c.begin_effect(a.rollout_id, a.gym_attempt, 0, "send_mail", args_digest("send_mail", {"to": "x"}), call_id="c-1")
        assert mail.answer == "proceed"
        c.complete_effect(mail.effect_id, LONG)
        first = c.begin_effect(a.rollout_id, a.gym_attempt, 1, "charge_card", args_digest("charge_card", {"amount": 5}), call_id="c-2")
        c.complete_effect(first.effect_id, {"charge": "ch-1"})
        other = c.begin_effect(a.rollout_id, a.gym_attempt, 1, "charge_card", args_digest("charge_card", {"amount": 7}), call_id="c-3")
        assert other.answer == "diverged" and other.orphaned is not None and other.orphaned.effect_id == first.effect_id
        c.complete_effect(other.effect_id, {"charge": "ch-2"})
        write = c.begin_effect(b.rollout_id, b.gym_attempt, 0, "write_db", args_digest("write_db", {"k": 1}), call_id="c-4")
        assert write.answer == "proceed"

        c.report_sealed([sealed(r) for r in sent if r.rollout_id != b.rollout_id])

        def capture(keys: list[str]) -> dict[str, str]:
            path = tmp_path / "dp.json"
            path.write_text(json.dumps(sorted(keys)))
            return {"path": str(path), "digest": "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()}

        assert c.snapshot(0, capture, snapshot_id="snap-1", poll_interval=0.05, timeout=60).published
        c.restore("rst-1", snapshot_id="snap-1", with_gym_state=False, timeout=60, poll_interval=0.05)
    return run.run_token, a.rollout_id, b.rollout_id


def _table(out: str) -> dict[str, list[str]]:
    """The effect table's lines by effect id, split on the column rule's widths."""
    lines = out.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("effect id"))
    widths = [len(w) for w in lines[k + 1].split()]
    rows = {}
    for ln in lines[k + 2:]:
        if not ln.startswith("  ") or ln.lstrip().startswith("…"):
            break
        cells, at = [], 2
        for w in widths:
            cells.append(ln[at:at + w].strip())
            at += w + 2
        rows[cells[0]] = cells
    return rows


def test_effects_of_a_live_run(coordinator: LiveServer, gym: Any, tmp_path: Path) -> None:
    token, a, b = _journalled_run(coordinator, gym, tmp_path)
    url = coordinator.url
    with CoordinatorClient(url, token, run_id=RUN) as c:
        every = {(r.rollout_id, r.seq, r.digest): r for r in c.effects()}
    assert len(every) == 4
    mail, charge1, charge2, write = sorted(every.values(), key=lambda r: r.effect_id)

    # By default: the orphans, the summary by reason, by state and by restore.
    p = cli("effects", "--url", url, "--run", RUN, token=token)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    out = p.stdout
    assert out.startswith(f"orphaned effects of run {RUN} (--all lists every effect)\n")
    why = write.orphan_reason
    assert why in ("rerun", "retired_by_restore"), write
    assert f"  2 orphans in all, by reason: {', '.join(sorted(['diverged 1', f'{why} 1']))}\n" in out
    assert "orphans by state: completed 1 (happened in a discarded timeline: compensate if needed), in_progress 1 (begun, never " \
        "completed: may have happened)" in out
    assert "orphaned by restore: rst-1 1" in out
    rows = _table(out)
    assert set(rows) == {str(charge1.effect_id), str(write.effect_id)}
    assert rows[str(charge1.effect_id)][1:] == [a, "1", "charge_card", "completed", "diverged", "-", charge1.orphaned_at[:19], '{"charge":"ch-1"}']
    assert rows[str(write.effect_id)][1:7] == [b, "0", "write_db", "in_progress", why, "rst-1"]
    assert rows[str(write.effect_id)][8] == "-"

    # --all: every effect, oldest first, the states counted; a long result cut short.
    p = cli("effects", "--url", url, "--run", RUN, "--all", token=token)
    assert p.returncode == 0, p.stderr
    assert "  4 effects in all: completed 3, in_progress 1\n  2 orphans in all" in p.stdout
    rows = _table(p.stdout)
    assert list(rows) == [str(r.effect_id) for r in (mail, charge1, charge2, write)]
    assert rows[str(charge2.effect_id)][4:7] == ["completed", "-", "-"]
    assert rows[str(mail.effect_id)][8] == short_result(mail) and rows[str(mail.effect_id)][8].endswith("…")
    assert len(rows[str(mail.effect_id)][8]) == 40

    # --rollout-id, --rows.
    p = cli("effects", "--url", url, "--run", RUN, "--all", "--rollout-id", a, "--rows", "1", token=token)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"effects of run {RUN}, rollout {a}\n") and "3 effects in all" in p.stdout
    assert list(_table(p.stdout)) == [str(mail.effect_id)] and "… 2 more (--rows N shows more, --json all)" in p.stdout
    p = cli("effects", "--url", url, "--run", RUN, "--rollout-id", b, "--rows", "0", token=token)
    assert p.returncode == 0 and "1 orphan in all" in p.stdout and "effect id" not in p.stdout

    # --json: the records as the coordinator answered them.
    pj = cli("effects", "--url", url, "--run", RUN, "--json", token=token)
    assert pj.returncode == 0, pj.stderr
    doc = json.loads(pj.stdout)
    assert doc["run_id"] == RUN and doc["orphaned_only"] is True and doc["rollout_id"] is None
    assert [e["effect_id"] for e in doc["effects"]] == [charge1.effect_id, write.effect_id]
    assert doc["effects"][0] == charge1.raw and doc["effects"][0]["result"] == {"charge": "ch-1"}
    pj = cli("effects", "--url", url, "--run", RUN, "--json", "--all", token=token)
    assert len(json.loads(pj.stdout)["effects"]) == 4 and json.loads(pj.stdout)["effects"][0]["result"] == LONG


def test_effects_fails_like_the_other_operator_commands(coordinator: LiveServer) -> None:
    url = coordinator.url
    with CoordinatorClient(url, ADMIN_TOKEN, retries=2, backoff=0.05) as admin:
        run = admin.create_run("ops-fx-empty", str(coordinator.checkpoint_root), {"target_level": "sibling"})
    empty = cli("effects", "--run", "ops-fx-empty", token=run.run_token, url=url)  # the URL from CKPTC_URL
    assert empty.returncode == 0, empty.stderr
    assert "0 orphans in all\n" in empty.stdout and "orphaned effects: none" in empty.stdout
    everything = cli("effects", "--run", "ops-fx-empty", "--all", token=ADMIN_TOKEN, url=url)  # the admin token reads any run
    assert everything.returncode == 0 and "0 effects in all" in everything.stdout and "effects: none" in everything.stdout

    for args, tok, words in [
        (("effects", "--url", url, "--run", "ops-fx-empty"), "not-the-token", "forbidden"),
        (("effects", "--url", url, "--run", "ops-fx-empty", "--rollout-id", "no spaces/here"), run.run_token, "rollout_id"),
    ]:
        p = cli(*args, token=tok)
        assert p.returncode == 1 and p.stdout == "", (args, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and words in p.stderr and "the coordinator refused" in p.stderr, p.stderr
    missing = cli("effects", "--url", url, "--run", "ops-fx-empty")
    assert missing.returncode == 2 and "CKPTC_RUN_TOKEN" in missing.stderr and missing.stdout == ""
    bad = cli("effects", "--url", url, "--run", "ops-fx-empty", "--rows", "-1", token=run.run_token)
    assert bad.returncode == 2 and "--rows" in bad.stderr
    nowhere = f"http://127.0.0.1:{free_port()}"
    down = cli("effects", "--url", nowhere, "--run", "ops-fx-empty", token="t")
    assert down.returncode == 3 and nowhere in down.stderr and "Traceback" not in down.stderr
    assert len(down.stderr.splitlines()) == 1


def test_effects_help() -> None:
    top = cli("--help")
    assert top.returncode == 0 and "effects" in top.stdout
    h = cli("effects", "--help")
    assert h.returncode == 0
    text = " ".join(h.stdout.split())
    for flag in ("--url", "--run", "--json", "--all", "--rollout-id", "--rows", "CKPTC_RUN_TOKEN", "orphans", "Exit status"):
        assert flag in text, flag
    assert "--token" not in text


def _rec(effect_id: int, **kw: Any) -> EffectRecord:
    doc = {
        "effect_id": effect_id, "rollout_id": "r-1", "seq": effect_id, "effect": "send_mail", "digest": "sha256:x", "state": "completed",
        "result": None, "gym_attempt": 0, "begun_at": "2026-12-06T03:59:20.1+00:00", "completed_at": "2026-12-06T03:59:21.2+00:00",
        "pending_restore": None, "orphaned_at": None, "orphan_reason": None, "orphaned_by": None, **kw,
    }
    return EffectRecord.parse(doc)


def test_tables_read_in_plain_words() -> None:
    recs = [
        _rec(1, result={"ok": True}),
        _rec(2, state="in_progress", completed_at=None, pending_restore="rst-9"),
        _rec(3, orphaned_at="2026-12-06T04:00:00+00:00", orphan_reason="not_repeated", orphaned_by="rst-9", result=[1, 2]),
        _rec(4, state="abandoned", completed_at=None, orphaned_at="2026-12-06T04:00:01+00:00", orphan_reason="rerun", orphaned_by="rst-8"),
    ]
    text = render_effects("run-x", recs, every=True)
    assert "  4 effects in all: completed 2, in_progress 1, abandoned 1" in text
    assert "  2 orphans in all, by reason: not_repeated 1, rerun 1" in text
    assert "orphans by state: completed 1 (happened in a discarded timeline: compensate if needed), abandoned 1 (did not happen)" in text
    assert "orphaned by restore: rst-8 1, rst-9 1" in text
    rows = _table(text)
    assert rows["1"][4:] == ["completed", "-", "-", "2026-12-06T03:59:21", '{"ok":true}']
    assert rows["2"][4:] == ["in_progress, pending rst-9", "-", "-", "2026-12-06T03:59:20", "-"]
    assert rows["3"][5:] == ["not_repeated", "rst-9", "2026-12-06T04:00:00", "[1,2]"]
    assert rows["4"][8] == "-"
    # A completed effect whose result is JSON null shows it; the cut keeps 40 characters.
    assert short_result(_rec(5)) == "null" and len(short_result(_rec(6, result="y" * 99))) == 40
    none = render_effects("run-x", [])
    assert none.splitlines() == ["orphaned effects of run run-x (--all lists every effect)", "  0 orphans in all", "", "orphaned effects: none"]


def test_the_journals_act_unguarded_only_when_told() -> None:
    """The coordinator cannot be reached: both journals refuse to act (``EffectUnguarded``)
    unless ``act_when_unreachable``; then they act once and answer the act's result. A coroutine
    ``act`` under the blocking journal is refused rather than left un-awaited."""
    import asyncio

    from ckpt_client import AsyncCoordinatorClient, AsyncEffectJournal, EffectJournal, EffectUnguarded

    nowhere = f"http://127.0.0.1:{free_port()}"
    call = {"rollout_id": "r-0", "gym_attempt": 0, "seq": 0, "effect": "send_mail", "args": {"to": "a@x"}}
    acted: list[int] = []

    def act() -> dict[str, int]:
        acted.append(1)
        return {"n": len(acted)}

    with CoordinatorClient(nowhere, "t", run_id=RUN, retries=0) as c:
        with pytest.raises(EffectUnguarded, match="act_when_unreachable"):
            EffectJournal(c).call(act=act, **call)
        assert acted == []
        assert EffectJournal(c, act_when_unreachable=True).call(act=act, **call) == {"n": 1}

        async def coroutine_act() -> None:
            return None

        pending = coroutine_act()
        with pytest.raises(TypeError, match="AsyncCoordinatorClient"):
            EffectJournal(c, act_when_unreachable=True).call(act=lambda: pending, **call)
        pending.close()

    async def go() -> Any:
        async def aact() -> dict[str, int]:
            return act()

        async with AsyncCoordinatorClient(nowhere, "t", run_id=RUN, retries=0) as c:
            with pytest.raises(EffectUnguarded):
                await AsyncEffectJournal(c).call(act=aact, **call)
            return await AsyncEffectJournal(c, act_when_unreachable=True).call(act=aact, **call)

    assert asyncio.run(go()) == {"n": 2} and len(acted) == 2
