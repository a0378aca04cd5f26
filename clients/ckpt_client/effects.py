"""The effect journal from the participant's side (the coordinator's docs/effects.md): a tool
whose call acts on the world outside Gym (sends a mail, charges a card, writes a shared
database) asks the coordinator before acting, so that a restore, which rolls Gym back but not the
world, never makes it act twice.

Wrap the tool once::

    journal = EffectJournal(client)                       # a CoordinatorClient of the run

    def send_mail(session, to, body):
        return journal.call(
            rollout_id=session.rollout_id, gym_attempt=session.attempt, seq=session.next_effect_seq(),
            effect="send_mail", args={"to": to, "body": body},
            act=lambda: smtp.send(to, body),               # runs at most once per (rollout, seq)
        )

``seq`` must count the episode's effectful calls in its checkpointed session state, so that a
continuation counts on from where the cut left it. ``AsyncEffectJournal`` is the same for
``AsyncCoordinatorClient`` and coroutine tools.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ._core import Flow, Invoke
from .errors import CoordinatorError, Unavailable
from .models import Json, _int, _list, _obj, _str

log = logging.getLogger("ckpt_client.effects")

PROCEED, DONE, UNKNOWN, DIVERGED = "proceed", "done", "unknown", "diverged"


def args_digest(effect: str, args: Any) -> str:
    """``sha256:<hex>`` of the effect's name and its arguments as canonical JSON."""
    blob = json.dumps([effect, args], sort_keys=True, separators=(",", ":"), default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True)
class EffectRecord:
    """One journalled effect: ``state`` in_progress, completed or abandoned; an orphan (its
    timeline discarded by a restore, or replaced by another call) when ``orphan_reason`` is set."""

    effect_id: int
    rollout_id: str
    seq: int
    effect: str
    digest: str
    state: str
    result: Any
    gym_attempt: int
    begun_at: str | None
    completed_at: str | None
    pending_restore: str | None
    orphaned_at: str | None
    orphan_reason: str | None
    orphaned_by: str | None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> EffectRecord:
        d = _obj(doc, "effect")
        return cls(
            _int(d.get("effect_id")), str(d.get("rollout_id") or ""), _int(d.get("seq")), str(d.get("effect") or ""),
            str(d.get("digest") or ""), str(d.get("state") or ""), d.get("result"), _int(d.get("gym_attempt")),
            _str(d.get("begun_at")), _str(d.get("completed_at")), _str(d.get("pending_restore")), _str(d.get("orphaned_at")),
            _str(d.get("orphan_reason")), _str(d.get("orphaned_by")), d,
        )


@dataclass(frozen=True)
class BeginAnswer:
    """``begin``'s answer: ``proceed`` (act, then complete), ``done`` (``result``: do not act),
    ``unknown`` (``record`` begun and never completed: reconcile), ``diverged`` (act anew;
    ``orphaned`` is the earlier effect)."""

    answer: str
    effect_id: int
    begun_at: str | None = None
    result: Any = None
    record: EffectRecord | None = None
    orphaned: EffectRecord | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> BeginAnswer:
        d = _obj(doc, "begin answer")
        rec, orph = d.get("record"), d.get("orphaned")
        return cls(
            str(d.get("answer") or ""), _int(d.get("effect_id")), _str(d.get("begun_at")), d.get("result"),
            EffectRecord.parse(rec) if isinstance(rec, dict) else None, EffectRecord.parse(orph) if isinstance(orph, dict) else None, d,
        )


@dataclass(frozen=True)
class EffectPage:
    effects: list[EffectRecord]
    orphans_total: int
    next_cursor: int | None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> EffectPage:
        d = _obj(doc, "effects page")
        nxt = d.get("next_cursor")
        return cls([EffectRecord.parse(e) for e in _list(d.get("effects"))], _int(d.get("orphans_total")), _int(nxt) if nxt is not None else None, d)


@dataclass(frozen=True)
class Reconciled:
    """What a reconcile hook found for an ``unknown`` effect: it happened (``result``: recorded
    and returned, the tool does not act), or it did not (``happened=False``: the record is
    abandoned and the tool acts)."""

    happened: bool
    result: Any = None


class EffectUnknown(CoordinatorError):
    """An effect was begun and never completed, and no reconcile hook decided whether it
    happened: acting could do it twice, not acting could lose it."""

    default_code = "effect_unknown"


class EffectUnguarded(CoordinatorError):
    """The coordinator could not be reached, and the journal was not told to act anyway."""

    default_code = "effect_unguarded"


Reconcile = Callable[[EffectRecord], Reconciled]
AsyncReconcile = Callable[[EffectRecord], Awaitable[Reconciled]]


def _unknown(rec: EffectRecord | None, effect_id: int) -> EffectUnknown:
    return EffectUnknown(
        f"effect {effect_id} ({rec.effect if rec else '?'} seq {rec.seq if rec else '?'}) was begun and never completed: "
        "pass reconcile= to decide with the outside system whether it happened"
    )


def _unguarded(e: BaseException) -> EffectUnguarded:
    return EffectUnguarded(f"the coordinator cannot be reached ({e}); not acting unguarded (act_when_unreachable=True to act anyway)")


def _journalled(
    api: Any, journal: _Journal, rollout_id: str, gym_attempt: int, seq: int, effect: str, args: Any, act: Callable[[], Any]
) -> Flow[Any]:
    """One guarded call as a sans-IO flow (``._core``), so the blocking and the async journal
    are the same code: ``act`` and ``reconcile`` are the user's callbacks (``Invoke``, awaited by
    the async client's driver). Only the journal's own requests are guarded: an error ``act``
    raises is the caller's, never a reason to act again."""
    digest = args_digest(effect, args)
    while True:
        try:
            ans = yield from api.begin_effect(rollout_id, gym_attempt, seq, effect, digest, uuid.uuid4().hex)
            if ans.answer == DONE:
                return ans.result
            if ans.answer != UNKNOWN:
                break
            if journal.reconcile is None:
                raise _unknown(ans.record, ans.effect_id)
            found = yield Invoke(journal.reconcile, (ans.record,))
            if found.happened:
                yield from api.complete_effect(ans.effect_id, found.result)
                return found.result
            yield from api.abandon_effect(ans.effect_id)  # it did not happen: begin again, and act
        except Unavailable as e:
            if not journal.act_when_unreachable:
                raise _unguarded(e) from e
            log.warning("effect %s of %s seq %d acts unguarded: %s", effect, rollout_id, seq, e)
            return (yield Invoke(act))
    result = yield Invoke(act)
    try:
        yield from api.complete_effect(ans.effect_id, result)
    except Unavailable as e:
        # It acted: its result is the caller's. The record stays begun; the next begin of the key
        # answers unknown and the reconcile hook finds the effect in the outside system.
        log.warning("effect %s of %s seq %d acted, but its completion was not recorded (%s): a later call gets unknown", effect, rollout_id, seq, e)
    return result


class _Journal:
    def __init__(self, client: Any, *, reconcile: Callable[[EffectRecord], Any] | None = None, act_when_unreachable: bool = False) -> None:
        self.client = client
        self.reconcile = reconcile
        self.act_when_unreachable = act_when_unreachable

    def _flow(self, rollout_id: str, gym_attempt: int, seq: int, effect: str, args: Any, act: Callable[[], Any]) -> Flow[Any]:
        return _journalled(self.client._api, self, rollout_id, gym_attempt, seq, effect, args, act)


class EffectJournal(_Journal):
    """A tool's guard for a blocking :class:`~ckpt_client.CoordinatorClient` of the run: one
    round trip before acting (begin), one after (complete). ``reconcile`` decides an ``unknown``
    effect; ``act_when_unreachable`` acts unguarded when the coordinator cannot be reached
    (default: raise :class:`EffectUnguarded`)."""

    reconcile: Reconcile | None

    def call(self, *, rollout_id: str, gym_attempt: int, seq: int, effect: str, args: Any, act: Callable[[], Any]) -> Any:
        return self.client._drive(self._flow(rollout_id, gym_attempt, seq, effect, args, act))


class AsyncEffectJournal(_Journal):
    """:class:`EffectJournal` for an :class:`~ckpt_client.AsyncCoordinatorClient` and coroutine
    tools (``act`` returns an awaitable; ``reconcile`` may be a coroutine function)."""

    async def call(self, *, rollout_id: str, gym_attempt: int, seq: int, effect: str, args: Any, act: Callable[[], Awaitable[Any]]) -> Any:
        return await self.client._drive(self._flow(rollout_id, gym_attempt, seq, effect, args, act))
