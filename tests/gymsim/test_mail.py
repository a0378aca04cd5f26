"""gymsim's mail tool (gymsim/mail.py): an effect outside what Gym checkpoints, its counter in the
checkpointed session, and its sends guarded by the effect journal when the run asks for it.

The journal here is a small fake on a loopback port that answers as the coordinator's does
(docs/effects.md#begin-and-complete), so that each answer can be arranged; the end-to-end test
with the real coordinator is tests/e2e/test_effects_e2e.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ckpt_client import args_digest
from gymsim.conformance import AGENT, RESOURCES
from gymsim.config import InstanceConfig
from gymsim.mail import EFFECT, read_outbox
from gymsim.testing import default_instance_config, server_config


def _config(outbox: Path, **mail: Any) -> dict[str, Any]:
    return server_config(default_instance_config(turn_seconds=0.02), RESOURCES, mail={"outbox": str(outbox), **mail})


def _keys(mails: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    return [(m["rollout_id"], m["attempt"], m["seq"]) for m in mails]


# --------------------------------------------------------------------------------------------
# Without a journal


async def test_each_mutation_sends_a_mail_counted_in_the_session(start, tmp_path):
    outbox = tmp_path / "mails.jsonl"
    h = await start(config=_config(outbox))
    reply = await h.run("r1", turns=3, task={"rollout": "r1"})
    assert reply.status_code == 200, reply.text
    mails = read_outbox(outbox)
    assert _keys(mails) == [("r1", 0, 0), ("r1", 0, 1), ("r1", 0, 2)]
    assert mails[1]["to"] == "ops@example.com" and mails[1]["body"] == "r1: turn 1 done" and mails[1]["message_id"]
    assert h.sessions()["r1"]["mails"] == 3
    assert h.state(RESOURCES)["mail"]["sent"] == 3
    # A direct mutation says what its mail did.
    direct = (await h.mutate("r2")).json()
    assert direct["mail"] == {"seq": 0, "sent": True}


async def test_every_and_the_variants_choose_which_mutations_mail_and_what(start, tmp_path):
    h = await start(config=_config(tmp_path / "a.jsonl", every=2, variant="names_attempt"))
    assert (await h.run("r1", 0, turns=5, task={"rollout": "r1"})).status_code == 200
    mails = read_outbox(tmp_path / "a.jsonl")
    assert [m["seq"] for m in mails] == [0, 1, 2] and mails[2]["body"] == "r1: turn 4 done (Gym attempt 0)"

    h = await start(config=_config(tmp_path / "b.jsonl", variant="first_attempt_only"))
    await h.mutate("r1")
    later = (await h.mutate("r1-a1")).json()
    assert "mail" not in later and _keys(read_outbox(tmp_path / "b.jsonl")) == [("r1", 0, 0)]


def test_only_a_resources_server_has_the_mail_tool(tmp_path):
    bad = server_config(default_instance_config(), AGENT, mail={"outbox": str(tmp_path / "m")})
    with pytest.raises(ValueError, match="only a resources server"):
        InstanceConfig.model_validate(bad)
    with pytest.raises(ValueError):
        InstanceConfig.model_validate(_config(tmp_path / "m", variant="sometimes"))


async def test_a_restored_session_counts_on_from_the_cut_and_without_a_journal_mails_twice(start, ckdir, tmp_path):
    outbox = tmp_path / "mails.jsonl"
    config = _config(outbox)
    a = await start(config=config)
    saved = await a.save("snap-1", ckdir(), ["r1"], turns=8)
    cut = saved.saved_turns["r1"]
    await a.resume_all("snap-1")  # the old timeline runs on past the cut, then "dies"
    assert (await saved.runs["r1"]).status_code == 200

    b = await start(config=config)  # a fresh Gym process, the same mail server outside it
    await b.restore_all("restore-1", saved)
    await b.resume_all("restore-1")
    reply = (await b.run("r1", 1, task={"rollout": "r1"}, turns=8)).json()
    assert reply["resumed_from_turn"] == cut and b.sessions()["r1-a1"]["mails"] == 8
    seqs = [m["seq"] for m in read_outbox(outbox)]
    # The continuation counted on from the cut's counter and sent again what came after it.
    assert seqs == [*range(8), *range(cut, 8)]


# --------------------------------------------------------------------------------------------
# With a journal (a fake coordinator)


class FakeJournal:
    """The coordinator's effect journal, in memory: a key's record, its answers, and the
    attempts it holds stale."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        self.stale: set[tuple[str, int]] = set()
        self.calls: list[str] = []
        self.app = FastAPI()
        self.app.post("/v1/runs/{run}/effects/begin")(self._begin)
        self.app.post("/v1/runs/{run}/effects/{effect_id}/{what}")(self._end)

    def put(self, rollout_id: str, seq: int, digest: str, *, state: str = "in_progress", attempt: int = 0) -> None:
        n = len(self.records) + 100
        self.records[(rollout_id, seq)] = {
            "effect_id": n, "rollout_id": rollout_id, "seq": seq, "effect": EFFECT, "digest": digest, "state": state,
            "result": {"message_id": "earlier"} if state == "completed" else None, "gym_attempt": attempt, "call_id": None,
        }

    async def _begin(self, run: str, body: dict[str, Any]) -> Any:
        self.calls.append(f"begin {body['rollout_id']} {body['seq']}")
        if (body["rollout_id"], body["gym_attempt"]) in self.stale:
            problem = {"type": "about:blank", "title": "Conflict", "status": 409, "code": "stale_attempt", "detail": "not current"}
            return JSONResponse(problem, status_code=409, media_type="application/problem+json")
        key = (body["rollout_id"], body["seq"])
        rec = self.records.get(key)
        if rec is None or rec["state"] == "abandoned":
            self.put(*key, body["digest"], attempt=body["gym_attempt"])
            return {"answer": "proceed", "effect_id": self.records[key]["effect_id"]}
        assert rec["digest"] == body["digest"], "these tests never diverge"
        answer = "done" if rec["state"] == "completed" else "unknown"
        return {"answer": answer, "effect_id": rec["effect_id"], "result": rec["result"], "record": rec}

    async def _end(self, run: str, effect_id: int, what: str, body: dict[str, Any] | None = None) -> Any:
        self.calls.append(f"{what} {effect_id}")
        (rec,) = [r for r in self.records.values() if r["effect_id"] == effect_id]
        rec.update(state="completed", result=(body or {}).get("result")) if what == "complete" else rec.update(state="abandoned")
        return rec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def journal() -> Iterator[tuple[FakeJournal, str]]:
    fake, port = FakeJournal(), _free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake journal did not start"
        time.sleep(0.02)
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _digest(rollout_id: str, turn: int) -> str:
    return args_digest(EFFECT, {"to": "ops@example.com", "body": f"{rollout_id}: turn {turn} done"})


async def test_the_journal_decides_whether_a_mail_goes_out(start, tmp_path, journal):
    fake, url = journal
    outbox = tmp_path / "mails.jsonl"
    h = await start(config=_config(outbox, journal={"url": url, "run_id": "run-1", "token": "run-token"}))
    # First time: proceed, sent, completed with the message id.
    first = (await h.mutate("r1")).json()
    assert first["mail"] == {"seq": 0, "sent": True}
    assert fake.records[("r1", 0)]["state"] == "completed" and fake.records[("r1", 0)]["result"]["message_id"]
    # Done before (another timeline completed it): not sent again, the session counts it all the same.
    fake.put("r1", 1, _digest("r1", 1), state="completed")
    assert (await h.mutate("r1")).json()["mail"] == {"seq": 1, "sent": False}
    assert h.sessions()["r1"]["mails"] == 2
    assert _keys(read_outbox(outbox)) == [("r1", 0, 0)]
    assert h.state(RESOURCES)["mail"] == {"sent": 1, "done_before": 1, "reconciled": 0, "refused": 0}


async def test_an_unknown_mail_is_reconciled_with_the_outbox(start, tmp_path, journal):
    fake, url = journal
    outbox = tmp_path / "mails.jsonl"
    h = await start(config=_config(outbox, journal={"url": url, "run_id": "run-1", "token": "run-token"}))
    # Begun by attempt 0 and sent, then the process died before completing it: the outbox has it.
    outbox.write_text('{"rollout_id": "r1", "attempt": 0, "seq": 0, "to": "ops@example.com", "body": "r1: turn 0 done", '
                      '"message_id": "<sent-before-the-crash>"}\n{"half a line')
    fake.put("r1", 0, _digest("r1", 0))
    assert (await h.mutate("r1")).json()["mail"] == {"seq": 0, "sent": False}
    assert fake.records[("r1", 0)]["result"] == {"message_id": "<sent-before-the-crash>"}
    # Begun and never sent: abandoned, begun again, sent.
    fake.put("r2", 0, _digest("r2", 0))
    assert (await h.mutate("r2")).json()["mail"] == {"seq": 0, "sent": True}
    assert [c.split()[0] for c in fake.calls[-4:]] == ["begin", "abandon", "begin", "complete"]
    assert _keys(read_outbox(outbox)) == [("r1", 0, 0), ("r2", 0, 0)]
    assert h.state(RESOURCES)["mail"]["reconciled"] == 2


async def test_a_stale_attempt_sends_nothing_and_changes_nothing(start, tmp_path, journal):
    fake, url = journal
    outbox = tmp_path / "mails.jsonl"
    h = await start(config=_config(outbox, journal={"url": url, "run_id": "run-1", "token": "run-token"}))
    fake.stale.add(("r1", 0))
    refused = await h.mutate("r1")
    h.assert_error(refused, "stale_attempt")
    assert not outbox.exists() and h.sessions().get("r1", {}).get("counter", 0) == 0
    assert h.state(RESOURCES)["mail"]["refused"] == 1


async def test_an_unreachable_journal_sends_nothing(start, tmp_path):
    outbox = tmp_path / "mails.jsonl"
    gone = f"http://127.0.0.1:{_free_port()}"
    h = await start(config=_config(outbox, journal={"url": gone, "run_id": "run-1", "token": "run-token"}))
    failed = await h.mutate("r1")
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "upstream_unreachable", failed.text
    assert not outbox.exists()
