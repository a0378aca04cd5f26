"""The effect journal's SQL (docs/effects.md). ``begin`` is one statement in the common case
(first time: the key is free), fenced by the attempt's state in that statement: only the
rollout's current, unretired attempt at the Gym attempt it names may begin an effect, and the
run's row is share-locked so a restore (which locks it for update) cannot pass in between.
Everything else (a repeat, a completed or unfinished record, another digest) is decided in a
short transaction under the same locks. Records are found by the live key's unique index, or by
their id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic_core import to_json
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain.vocabulary import AttemptStatus as A
from ..domain.vocabulary import EffectAnswer, EffectState, OrphanReason, RunState
from ..domain.vocabulary import RetirementState as R
from ..errors import Conflict, NotFound
from ..ledger.db import fetch, one_statement

# The key's one live record (the partial unique index ``uq_effects_live_key``): neither orphaned
# nor abandoned (``ck_effects_live``), so whatever orphans or abandons a record clears ``live``.
LIVE = "live"

_COLS = (
    "effect_id, rollout_id, seq, effect, digest, state, result, gym_attempt, begun_at, completed_at, pending_restore, "
    "orphaned_at, orphan_reason, orphaned_by"
)

# The run (open, share-locked against a restore) and the rollout's current attempt at that Gym
# attempt, not ended, not retired.
_FENCE = (
    f"run AS (SELECT run_id FROM runs WHERE run_id = %(r)s AND state = '{RunState.open}' FOR SHARE), "
    "att AS (SELECT a.attempt_id FROM attempts a JOIN run ON true WHERE a.run_id = %(r)s AND a.rollout_id = %(ro)s "
    f"AND a.is_current AND a.retirement = '{R.none}' AND a.status IN ('{A.reserved}', '{A.dispatched}', '{A.returned}') "
    "AND a.gym_attempt = %(ga)s)"
)

# A record for the begin, made only when the fence holds (``att`` has the attempt).
_INSERT = (
    "INSERT INTO effects (run_id, rollout_id, seq, effect, digest, call_id, attempt_id, gym_attempt) "
    "SELECT %(r)s, %(ro)s, %(seq)s, %(e)s, %(d)s, %(c)s, att.attempt_id, %(ga)s FROM att"
)

_BEGIN = (
    f"WITH {_FENCE}, "
    f"ins AS ({_INSERT} "
    f"ON CONFLICT (run_id, rollout_id, seq) WHERE {LIVE} DO NOTHING RETURNING effect_id, begun_at) "
    "SELECT EXISTS (SELECT 1 FROM run), EXISTS (SELECT 1 FROM att), (SELECT effect_id FROM ins), (SELECT begun_at FROM ins)"
)


@dataclass(frozen=True)
class BeginCall:
    rollout_id: str
    gym_attempt: int
    seq: int
    effect: str
    digest: str
    call_id: str | None = None

    def params(self, run_id: str) -> dict[str, Any]:
        return {"r": run_id, "ro": self.rollout_id, "ga": self.gym_attempt, "seq": self.seq, "e": self.effect, "d": self.digest, "c": self.call_id}


_KEYS = tuple(k.strip() for k in _COLS.split(","))


def record_json(row: tuple[Any, ...]) -> dict[str, Any]:
    out = dict(zip(_KEYS, row, strict=True))
    for k in ("begun_at", "completed_at", "orphaned_at"):
        out[k] = out[k].isoformat() if out[k] is not None else None
    return out


def _refuse(run_id: str, call: BeginCall, run_open: bool) -> None:
    if not run_open:
        raise Conflict(f"run {run_id!r} is closed: no effect may begin", code="run_closed")
    raise Conflict(
        f"{call.rollout_id!r} at Gym attempt {call.gym_attempt} is not the current attempt of a rollout of run {run_id!r} "
        "(retired, replaced by a restore, ended, or never admitted): do not act; this episode's result will not be trained",
        code="stale_attempt", rollout_id=call.rollout_id, gym_attempt=call.gym_attempt,
    )


async def begin(engine: AsyncEngine, run_id: str, call: BeginCall) -> dict[str, Any]:
    """``proceed``, ``done`` (with the recorded result), ``unknown`` or ``diverged`` (with the
    record it orphaned); refused ``stale_attempt`` when the attempt is not current.

    The common case, a free key, is ``_BEGIN`` alone, committed by itself (no ``BEGIN`` and
    ``COMMIT`` round trips): its fence holds the run's share lock for the statement, insert
    included. A key with a live record is decided in a transaction that runs ``_BEGIN`` again, so
    the locks are held while ``_decide`` reads and writes."""
    async with one_statement(engine) as conn:
        ((run_open, attempt_ok, effect_id, begun_at),) = await fetch(conn, _BEGIN, call.params(run_id))
    if not (run_open and attempt_ok):
        _refuse(run_id, call, run_open)
    if effect_id is not None:
        return {"answer": EffectAnswer.proceed.value, "effect_id": effect_id, "begun_at": begun_at.isoformat()}
    async with engine.begin() as conn:
        ((run_open, attempt_ok, effect_id, begun_at),) = await fetch(conn, _BEGIN, call.params(run_id))
        if not (run_open and attempt_ok):
            _refuse(run_id, call, run_open)
        if effect_id is not None:  # the live record it met is gone (abandoned or orphaned since): the key is free
            return {"answer": EffectAnswer.proceed.value, "effect_id": effect_id, "begun_at": begun_at.isoformat()}
        return await _decide(conn, run_id, call)


async def _decide(conn: AsyncConnection, run_id: str, call: BeginCall) -> dict[str, Any]:
    """The key has a live record: the run and the attempt are locked by the statement before."""
    p = call.params(run_id)
    rows = await fetch(conn, f"SELECT {_COLS}, call_id FROM effects WHERE run_id = %(r)s AND rollout_id = %(ro)s AND seq = %(seq)s AND {LIVE} FOR UPDATE", p)
    if not rows:
        # Abandoned since this transaction's insert met it: the key is free.
        effect_id, begun_at = await _insert(conn, p)
        return {"answer": EffectAnswer.proceed.value, "effect_id": effect_id, "begun_at": begun_at.isoformat()}
    rec, call_id = record_json(rows[0][:-1]), rows[0][-1]
    if rec["digest"] == call.digest:
        if rec["pending_restore"] is not None:
            # The continuation made it again: it belongs to the timeline that goes on.
            await fetch(conn, "UPDATE effects SET pending_restore = NULL WHERE run_id = %(r)s AND effect_id = %(id)s RETURNING 1", {"r": run_id, "id": rec["effect_id"]})
            rec["pending_restore"] = None
        if rec["state"] == EffectState.completed:
            return {"answer": EffectAnswer.done.value, "effect_id": rec["effect_id"], "result": rec["result"], "record": rec}
        if call.call_id is not None and call_id == call.call_id:
            # The same begin again (its reply was lost): it may act.
            return {"answer": EffectAnswer.proceed.value, "effect_id": rec["effect_id"], "begun_at": rec["begun_at"]}
        return {"answer": EffectAnswer.unknown.value, "effect_id": rec["effect_id"], "record": rec}
    # Another effect at this place: the old one is an orphan, this one begins anew.
    # (A record pending after a restore names that restore: its timeline is the discarded one.)
    ((orphaned),) = await fetch(
        conn,
        f"UPDATE effects SET orphaned_at = now(), orphan_reason = '{OrphanReason.diverged}', orphaned_by = pending_restore, pending_restore = NULL, live = false "
        f"WHERE run_id = %(r)s AND effect_id = %(id)s RETURNING {_COLS}",
        {"r": run_id, "id": rec["effect_id"]},
    )
    rec = record_json(orphaned)
    effect_id, begun_at = await _insert(conn, p)
    from ..observability.metrics import record_effect_orphans

    record_effect_orphans(OrphanReason.diverged, 1)
    return {"answer": EffectAnswer.diverged.value, "effect_id": effect_id, "begun_at": begun_at.isoformat(), "orphaned": rec}


async def _insert(conn: AsyncConnection, p: dict[str, Any]) -> tuple[int, Any]:
    ((effect_id, begun_at),) = await fetch(
        conn,
        f"WITH {_FENCE} {_INSERT} RETURNING effect_id, begun_at",
        p,
    )
    return effect_id, begun_at


async def complete(engine: AsyncEngine, run_id: str, effect_id: int, result: Any) -> dict[str, Any]:
    """Record what the effect did. Always recorded, even once its timeline was discarded (the
    orphan then says what to compensate); a repeat with the same result is answered again."""
    doc = to_json(result).decode()
    # One statement, committed by itself; when it changed nothing, the record is read to say why.
    async with one_statement(engine) as conn:
        rows = await fetch(
            conn,
            f"UPDATE effects SET state = '{EffectState.completed}', result = %(res)s::jsonb, completed_at = now() "
            f"WHERE run_id = %(r)s AND effect_id = %(id)s AND state = '{EffectState.in_progress}' RETURNING {_COLS}",
            {"r": run_id, "id": effect_id, "res": doc},
        )
    if rows:
        return record_json(rows[0])
    async with engine.connect() as conn:
        rec = await _get(conn, run_id, effect_id)
    if rec["state"] == EffectState.completed and rec["result"] == result:
        return rec
    if rec["state"] == EffectState.completed:
        raise Conflict(f"effect {effect_id} was completed before with another result", code="effect_completed", effect_id=effect_id)
    raise Conflict(f"effect {effect_id} was abandoned: begin it again to act", code="effect_abandoned", effect_id=effect_id)


async def abandon(engine: AsyncEngine, run_id: str, effect_id: int) -> dict[str, Any]:
    """The reconcile hook found that the effect did not happen: its key is free again."""
    async with engine.begin() as conn:
        rows = await fetch(
            conn,
            f"UPDATE effects SET state = '{EffectState.abandoned}', pending_restore = NULL, live = false "
            f"WHERE run_id = %(r)s AND effect_id = %(id)s AND state IN ('{EffectState.in_progress}', '{EffectState.abandoned}') RETURNING {_COLS}",
            {"r": run_id, "id": effect_id},
        )
        if rows:
            return record_json(rows[0])
        await _get(conn, run_id, effect_id)
    raise Conflict(f"effect {effect_id} was completed: it happened, it cannot be abandoned", code="effect_completed", effect_id=effect_id)


async def _get(conn: AsyncConnection, run_id: str, effect_id: int) -> dict[str, Any]:
    rows = await fetch(conn, f"SELECT {_COLS} FROM effects WHERE run_id = %(r)s AND effect_id = %(id)s", {"r": run_id, "id": effect_id})
    if not rows:
        raise NotFound(f"effect {effect_id} not found in run {run_id!r}", code="effect_not_found", effect_id=effect_id)
    return record_json(rows[0])


async def list_effects(
    engine: AsyncEngine, run_id: str, *, orphaned: bool | None, rollout_id: str | None, after: int, limit: int
) -> dict[str, Any]:
    """A page of the run's journal in effect id order (``after``: the last id of the previous
    page); ``orphaned`` true: only the orphans (their own index)."""
    where = ["run_id = %(r)s", "effect_id > %(after)s"]
    if orphaned is True:
        where.append("orphaned_at IS NOT NULL")
    elif orphaned is False:
        where.append("orphaned_at IS NULL")
    if rollout_id is not None:
        where.append("rollout_id = %(ro)s")
    async with engine.connect() as conn:
        rows = await fetch(
            conn,
            f"SELECT {_COLS} FROM effects WHERE {' AND '.join(where)} ORDER BY effect_id LIMIT %(n)s",
            {"r": run_id, "after": after, "ro": rollout_id, "n": limit + 1},
        )
        ((orphans, known),) = await fetch(
            conn,
            "SELECT (SELECT count(*) FROM effects WHERE run_id = %(r)s AND orphaned_at IS NOT NULL), EXISTS (SELECT 1 FROM runs WHERE run_id = %(r)s)",
            {"r": run_id},
        )
    if not known:  # the admin token reaches any run id (accounting.store does the same)
        raise NotFound(f"run {run_id!r} not found", code="run_not_found")
    page = [record_json(r) for r in rows[:limit]]
    return {"effects": page, "orphans_total": int(orphans), "next_cursor": page[-1]["effect_id"] if len(rows) > limit else None}


async def orphan_unrepeated(conn: AsyncConnection, run_id: str, sealed_attempt_ids: list[int]) -> int:
    """A continuation sealed: the effects its episode made after the restored cut that it did not
    make again belong to the discarded timeline (orphans, ``not_repeated``). Called in the seal's
    transaction with the continued (Gym-owned) attempts it sealed."""
    if not sealed_attempt_ids:
        return 0
    ((n,),) = await fetch(
        conn,
        f"WITH o AS (UPDATE effects e SET orphaned_at = now(), orphan_reason = '{OrphanReason.not_repeated}', "
        "orphaned_by = e.pending_restore, pending_restore = NULL, live = false FROM attempts a WHERE a.attempt_id = ANY(%(ids)s::bigint[]) "
        f"AND a.run_id = %(r)s AND e.run_id = %(r)s AND e.rollout_id = a.rollout_id AND e.pending_restore IS NOT NULL AND e.live "
        "RETURNING 1) SELECT count(*) FROM o",
        {"r": run_id, "ids": [int(x) for x in sealed_attempt_ids]},
    )
    if n:
        from ..observability.metrics import record_effect_orphans

        record_effect_orphans(OrphanReason.not_repeated, int(n))
    return int(n)
