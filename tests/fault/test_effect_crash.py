"""A crash between an effect's begin and its complete (docs/effects.md#begin-and-complete): the
coordinator or the participant is SIGKILLed after the journal said proceed; the next call of the
same tool gets ``unknown`` and its reconcile hook decides, with the outside world, whether the
effect happened. Either way the world sees it once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from ckpt_client import CoordinatorClient, EffectJournal, EffectUnguarded, EffectUnknown, GroupSpec, Reconciled, args_digest

from ..conftest import ADMIN_TOKEN
from ..gym_placeholders import register_placeholders_sync
from .coordinator_process import CoordinatorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN = "fx-crash"
INSTANCE = "math/replica-0"


def _mails(world: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in world.read_text().splitlines()] if world.exists() else []


def _reconcile_from(world: Path):  # type: ignore[no-untyped-def]
    """The hook a real tool would write: ask the outside system whether the call happened."""

    def reconcile(record: Any) -> Reconciled:
        sent = [m for m in _mails(world) if (m["rollout_id"], m["seq"]) == (record.rollout_id, record.seq)]
        return Reconciled(True, {"message_id": sent[0]["message_id"]}) if sent else Reconciled(False)

    return reconcile


def _open_run(coord: CoordinatorProcess, database_url: str, tmp_path: Path) -> tuple[CoordinatorClient, str, str]:
    admin = CoordinatorClient(coord.url, ADMIN_TOKEN)
    token = admin.create_run(RUN, str(tmp_path / "ckpt"), {"target_level": "turn"}).run_token
    register_placeholders_sync(database_url, RUN, INSTANCE)
    client = CoordinatorClient(coord.url, token, run_id=RUN, retries=2, backoff=0.05, max_backoff=0.1, timeout=5)
    rows = client.admit_groups([GroupSpec("G", "G", "math", "sha256:G", 1)])
    client.dispatch([rows.groups[0].rows[0].rollout_id], instance_id=INSTANCE)
    return client, token, rows.groups[0].rows[0].rollout_id


def _send(world: Path, rollout_id: str, seq: int) -> dict[str, Any]:
    mail = {"rollout_id": rollout_id, "seq": seq, "message_id": f"m-{rollout_id[-6:]}-{seq}"}
    with world.open("a") as f:
        f.write(json.dumps(mail) + "\n")
    return {"message_id": mail["message_id"]}


def test_the_coordinator_killed_between_begin_and_complete(database_url: str, tmp_path: Path) -> None:
    world = tmp_path / "mails.jsonl"
    coord = CoordinatorProcess(database_url, tmp_path, coordinator_id="fx-a")
    coord.start()
    try:
        client, _, ro = _open_run(coord, database_url, tmp_path)
        journal = EffectJournal(client)
        key = {"rollout_id": ro, "gym_attempt": 0, "effect": "send_mail", "args": {"to": "a@x"}}

        # seq 0: the mail goes out, then the coordinator dies before the complete arrives.
        def send_then_crash() -> dict[str, Any]:
            sent = _send(world, ro, 0)
            coord.kill()
            return sent

        # It acted: the tool gets its result; the record stays begun.
        assert journal.call(seq=0, act=send_then_crash, **key) == {"message_id": f"m-{ro[-6:]}-0"}
        # Down, the journal will not act unguarded (unless told to).
        with pytest.raises(EffectUnguarded):
            journal.call(seq=5, act=lambda: _send(world, ro, 5), **key)
        coord.start()
        # Without a hook the journal will not guess; with one, the outside world decides.
        with pytest.raises(EffectUnknown):
            journal.call(seq=0, act=lambda: _send(world, ro, 0), **key)
        decided = EffectJournal(client, reconcile=_reconcile_from(world))
        assert decided.call(seq=0, act=lambda: _send(world, ro, 0), **key) == {"message_id": f"m-{ro[-6:]}-0"}

        # seq 1: begun (proceed), and the coordinator dies before the tool acted.
        assert client.begin_effect(ro, 0, 1, "send_mail", args_digest("send_mail", {"to": "b@x"}), call_id="c-1").answer == "proceed"
        coord.kill()
        coord.start()
        assert decided.call(seq=1, act=lambda: _send(world, ro, 1), **{**key, "args": {"to": "b@x"}}) == {"message_id": f"m-{ro[-6:]}-1"}
        assert [e.state for e in client.effects() if e.seq == 1] == ["abandoned", "completed"]  # the hook found nothing: acted once

        assert sorted((m["rollout_id"], m["seq"]) for m in _mails(world)) == [(ro, 0), (ro, 1)]  # each once
        assert all(e.state == "completed" and e.orphaned_at is None for e in client.effects() if e.seq == 0)
        assert client.effects(orphaned=True) == []
    finally:
        coord.stop()


_PARTICIPANT = textwrap.dedent(
    """
    import json, os, signal, sys
    from ckpt_client import CoordinatorClient, EffectJournal
    url, token, run, ro, world = sys.argv[1:]
    def act():
        with open(world, "a") as f:
            f.write(json.dumps({"rollout_id": ro, "seq": 0, "message_id": "m-child"}) + "\\n")
        os.kill(os.getpid(), signal.SIGKILL)  # the participant dies after acting, before completing
    EffectJournal(CoordinatorClient(url, token, run_id=run)).call(
        rollout_id=ro, gym_attempt=0, seq=0, effect="send_mail", args={"to": "a@x"}, act=act)
    """
)


def test_the_participant_killed_between_begin_and_complete(database_url: str, tmp_path: Path) -> None:
    world = tmp_path / "mails.jsonl"
    coord = CoordinatorProcess(database_url, tmp_path, coordinator_id="fx-b")
    coord.start()
    try:
        client, token, ro = _open_run(coord, database_url, tmp_path)
        child = subprocess.run(
            [sys.executable, "-c", _PARTICIPANT, coord.url, token, RUN, ro, str(world)], capture_output=True, text=True, timeout=60,
            env={**os.environ},
        )
        assert child.returncode == -9, child.stderr  # killed mid-call
        (rec,) = client.effects()
        assert rec.state == "in_progress" and rec.seq == 0
        # The restarted participant calls the tool again: unknown, and the world says it happened.
        journal = EffectJournal(client, reconcile=_reconcile_from(world))
        out = journal.call(rollout_id=ro, gym_attempt=0, seq=0, effect="send_mail", args={"to": "a@x"}, act=lambda: _send(world, ro, 0))
        assert out == {"message_id": "m-child"}
        assert len(_mails(world)) == 1
        (rec,) = client.effects()
        assert rec.state == "completed" and rec.result == {"message_id": "m-child"}
    finally:
        coord.stop()
