"""gymsim's mail tool: a resources-server effect outside anything Gym checkpoints.

A mutation may "send a mail": one JSON line appended to the configured outbox file, which no
checkpoint saves and no restore rolls back, like a real mail server. The episode's mail counter
(the effect's ``seq``) lives in the resources session, which is checkpointed, so a restored
continuation counts on from the cut. Without a journal the continuation re-runs the turns after
the cut and sends their mails again; with one, it asks the coordinator's effect journal first
(the thin client's ``AsyncEffectJournal``, docs/effects.md#for-participants) and does not.

This is gymsim's own diagnostic tool, not a model of anything NeMo Gym does.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from ckpt_client import (
    AsyncCoordinatorClient,
    AsyncEffectJournal,
    Conflict,
    CoordinatorError,
    EffectRecord,
    EffectUnguarded,
    Reconciled,
    args_digest,
)

from .config import MailConfig
from .wire import ProtocolError

EFFECT = "send_mail"


def read_outbox(path: str | Path) -> list[dict[str, Any]]:
    """Every mail of an outbox file, in the order sent (a line a killed process left half
    written is skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    mails = []
    for line in text.splitlines():
        try:
            mail = json.loads(line)
        except ValueError:
            continue
        if isinstance(mail, dict):
            mails.append(mail)
    return mails


class Mailer:
    """One resources server's mail tool. ``send`` is called by a mutation with the session's
    mail counter; it returns ``None`` when this call sends nothing, else ``{seq, sent}`` where
    ``sent`` is false when the journal said the mail had gone out before."""

    def __init__(self, config: MailConfig) -> None:
        self.config = config
        self._client: AsyncCoordinatorClient | None = None
        self._journal: AsyncEffectJournal | None = None
        self.stats = {"sent": 0, "done_before": 0, "reconciled": 0, "refused": 0}

    def wants(self, attempt: int, mutations: int) -> bool:
        """Whether the session's next mutation (``mutations`` done so far) sends a mail."""
        if self.config.variant == "first_attempt_only" and attempt > 0:
            return False
        return mutations % self.config.every == 0

    def args(self, rollout_id: str, attempt: int, turn: int) -> dict[str, Any]:
        body = f"{rollout_id}: turn {turn} done"
        if self.config.variant == "names_attempt":
            body += f" (Gym attempt {attempt})"
        return {"to": self.config.to, "body": body}

    async def send(self, rollout_id: str, attempt: int, seq: int, turn: int) -> dict[str, Any]:
        args = self.args(rollout_id, attempt, turn)
        acted = False

        async def act() -> dict[str, Any]:
            nonlocal acted
            acted = True
            return self._deliver(rollout_id, attempt, seq, args)

        if self.config.journal is None:
            await act()
            return {"seq": seq, "sent": True}
        try:
            await self._guard().call(rollout_id=rollout_id, gym_attempt=attempt, seq=seq, effect=EFFECT, args=args, act=act)
        except Conflict as e:
            self.stats["refused"] += 1
            if e.code == "stale_attempt":
                raise ProtocolError("stale_attempt", f"the effect journal refused {rollout_id} attempt {attempt}: {e.detail}") from e
            raise ProtocolError("upstream_error", f"the effect journal refused mail {seq} of {rollout_id}: {e}", status=502) from e
        except EffectUnguarded as e:
            raise ProtocolError("upstream_unreachable", f"mail {seq} of {rollout_id} not sent: {e}", status=502) from e
        except CoordinatorError as e:
            raise ProtocolError("upstream_error", f"mail {seq} of {rollout_id}: {e}", status=502) from e
        if not acted:
            self.stats["done_before"] += 1
        return {"seq": seq, "sent": acted}

    def _deliver(self, rollout_id: str, attempt: int, seq: int, args: dict[str, Any]) -> dict[str, Any]:
        message_id = f"<{rollout_id}.a{attempt}.m{seq}@gymsim>"
        line = {"rollout_id": rollout_id, "attempt": attempt, "seq": seq, **args, "message_id": message_id}
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        # One O_APPEND write per line: instances sharing an outbox never interleave their lines.
        fd = os.open(self.config.outbox, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a line a killed process left half written stays apart
            os.write(fd, data)
        finally:
            os.close(fd)
        self.stats["sent"] += 1
        return {"message_id": message_id}

    async def _reconcile(self, record: EffectRecord) -> Reconciled:
        """A mail begun and never completed (the process died in between): the outbox says
        whether it went out, as a mail server's sent folder would."""
        self.stats["reconciled"] += 1
        for mail in reversed(await asyncio.to_thread(read_outbox, self.config.outbox)):
            same = (mail.get("rollout_id"), mail.get("seq"), mail.get("attempt")) == (record.rollout_id, record.seq, record.gym_attempt)
            if same and args_digest(EFFECT, {"to": mail.get("to"), "body": mail.get("body")}) == record.digest:
                return Reconciled(True, {"message_id": mail.get("message_id")})
        return Reconciled(False)

    def _guard(self) -> AsyncEffectJournal:
        if self._journal is None:
            j = self.config.journal
            assert j is not None
            self._client = AsyncCoordinatorClient(j.url, j.token, run_id=j.run_id, timeout=10.0)
            self._journal = AsyncEffectJournal(self._client, reconcile=self._reconcile)
        return self._journal

    def close_soon(self) -> None:
        """Close the journal's connections (the participant is going away; called from sync code
        inside the instance's event loop)."""
        client, self._client, self._journal = self._client, None, None
        if client is None:
            return
        try:
            asyncio.get_running_loop().create_task(client.close())
        except RuntimeError:
            pass  # no loop left: the process is ending and takes its sockets with it
