"""Restore records (what makes ``POST /restores`` idempotent) and the rows a restore answers,
stored in chunks with the rewind (docs/ledger.md#restore-records)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Text, cast, delete, func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.vocabulary import RestoreRecordState
from ...errors import Conflict
from ...ledger.db import driver_connection, dump_json, fetch
from ...ledger.models import (
    RESTORE_ROW_CHUNK_TEXT_COLUMNS,
    RESTORE_ROWS_PER_CHUNK,
    Restore,
    Snapshot,
)
from ...ledger.runs import lock_run

# -------------------------------------------------------------------------------------------
# Restore records (idempotency per restore id)


@dataclass(frozen=True)
class RestoreRecord:
    restore_id: str
    snapshot_id: str
    state: str
    with_gym_state: bool
    gym_restore_id: str | None
    result: dict[str, Any] | None
    created_at: datetime


_RS = Restore.__table__
_REST_COLS = tuple(_RS.c[f] for f in RestoreRecord.__dataclass_fields__)


def _this(run_id: str, restore_id: str) -> Any:
    return (_RS.c.run_id == run_id) & (_RS.c.restore_id == restore_id)


async def get_restore(conn: AsyncConnection, run_id: str, restore_id: str) -> RestoreRecord | None:
    r = (await conn.execute(select(*_REST_COLS).where(_this(run_id, restore_id)))).first()
    return RestoreRecord(**dict(r._mapping)) if r is not None else None


class RestoreBusy(Conflict):
    code, title = "restore_in_progress", "A restore of this run is in progress"


class SnapshotBusy(Conflict):
    code, title = "snapshot_in_progress", "A snapshot of this run is in progress"


async def claim_restore(
    engine: AsyncEngine,
    run_id: str,
    restore_id: str,
    snapshot_id: str,
    with_gym_state: bool,
    request: dict[str, Any],
    *,
    stale_after_s: float,
) -> RestoreRecord | None:
    """Record that restore ``restore_id`` starts; the existing record if the id is known.

    One restore runs per run at a time: a second one would find Gym instances mid-restore and
    could apply a competing plan. A record left ``running`` longer than ``stale_after_s`` (its
    coordinator died) no longer blocks, and is marked ``abandoned``. A snapshot in progress
    blocks too: its Gym phase and the restore would fight over the same instances.
    """
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True)
        existing = await get_restore(conn, run_id, restore_id)
        if existing is not None:
            return existing
        sn = Snapshot.__table__
        snap = (await conn.execute(select(sn.c.snapshot_id).where(sn.c.run_id == run_id, sn.c.outcome.is_(None)))).scalar()
        if snap is not None:
            raise SnapshotBusy(f"snapshot {snap} of this run is in progress; restore once it has ended", snapshot_id=snap)
        running = (_RS.c.run_id == run_id) & (_RS.c.state == RestoreRecordState.running)
        await conn.execute(
            update(_RS)
            .where(running, _RS.c.created_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, stale_after_s))
            .values(state="abandoned", ended_at=func.now())
        )
        busy = (await conn.execute(select(_RS.c.restore_id).where(running))).scalar()
        if busy is not None:
            raise RestoreBusy(f"restore {busy} of this run is still running", restore_id=busy)
        await conn.execute(
            insert(_RS).values(
                run_id=run_id, restore_id=restore_id, snapshot_id=snapshot_id, state=RestoreRecordState.running, with_gym_state=with_gym_state,
                result=_jsonb({"request": request}),
            )
        )
    return None


async def release_claim(engine: AsyncEngine, run_id: str, restore_id: str) -> None:
    """Forget a claim whose restore was refused before Gym was touched (the id may be retried)."""
    async with engine.begin() as conn:
        await conn.execute(delete(_RS).where(_this(run_id, restore_id), _RS.c.state == RestoreRecordState.running))


async def end_restore(
    engine: AsyncEngine,
    run_id: str,
    restore_id: str,
    state: str,
    result: dict[str, Any],
    gym_restore_id: str | None = None,
    *,
    only_running: bool = False,
) -> None:
    q = update(_RS).where(_this(run_id, restore_id))
    if only_running:
        q = q.where(_RS.c.state == RestoreRecordState.running)
    values: dict[str, Any] = {"state": state, "result": _jsonb(result), "ended_at": func.coalesce(_RS.c.ended_at, func.now())}
    if gym_restore_id is not None:
        values["gym_restore_id"] = gym_restore_id
    async with engine.begin() as conn:
        await conn.execute(q.values(**values))


async def update_restore_result(engine: AsyncEngine, run_id: str, restore_id: str, patch: dict[str, Any]) -> None:
    async with engine.begin() as conn:
        await conn.execute(update(_RS).where(_this(run_id, restore_id)).values(result=_RS.c.result.op("||")(_jsonb(patch))))


async def mark_applied(conn: AsyncConnection, run_id: str, restore_id: str, result: dict[str, Any]) -> None:
    """The restore's ledger change committed with this answer (in the rewind's transaction)."""
    await conn.execute(update(_RS).where(_this(run_id, restore_id)).values(state=RestoreRecordState.applied, result=_jsonb(result), ended_at=func.now()))


@dataclass
class AnswerRows:
    """The rows a restore answers (what the trainer sends next), as columns in answer order;
    stored in ``restore_row_chunks`` with the rewind and read back by page. The capture key is
    derived: ``rollout_id`` at ``gym_attempt`` 0, else ``<rollout_id>-a<gym_attempt>``."""

    group_ids: list[str] = field(default_factory=list)
    generation_indexes: list[int] = field(default_factory=list)
    dispositions: list[str] = field(default_factory=list)
    rollout_ids: list[str] = field(default_factory=list)
    gym_attempts: list[int] = field(default_factory=list)
    group_attempts: list[int] = field(default_factory=list)
    instance_ids: list[str | None] = field(default_factory=list)
    replaces_rollout_ids: list[str | None] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.group_ids)

    def append(
        self, group_id: str, index: int, disposition: str, rollout_id: str, gym_attempt: int, group_attempt: int,
        instance_id: str | None, replaces: str | None, reason: str,
    ) -> None:
        self.group_ids.append(group_id)
        self.generation_indexes.append(index)
        self.dispositions.append(disposition)
        self.rollout_ids.append(rollout_id)
        self.gym_attempts.append(gym_attempt)
        self.group_attempts.append(group_attempt)
        self.instance_ids.append(instance_id)
        self.replaces_rollout_ids.append(replaces)
        self.reasons.append(reason)

    def page(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Rows ``start``..``stop - 1`` as the JSON rows of the answer."""
        return [
            answer_row_json(*cols)
            for cols in zip(
                self.group_ids[start:stop], self.generation_indexes[start:stop], self.dispositions[start:stop],
                self.rollout_ids[start:stop], self.gym_attempts[start:stop], self.group_attempts[start:stop],
                self.instance_ids[start:stop], self.replaces_rollout_ids[start:stop], self.reasons[start:stop],
            )
        ]


def answer_row_json(
    group_id: str, index: int, disposition: str, rollout_id: str, gym_attempt: int, group_attempt: int,
    instance_id: str | None, replaces: str | None, reason: str | None = None,
) -> dict[str, Any]:
    return {
        "group_id": group_id,
        "generation_index": index,
        "disposition": disposition,
        "rollout_id": rollout_id,
        "capture_key": rollout_id if gym_attempt == 0 else f"{rollout_id}-a{gym_attempt}",
        "gym_attempt": gym_attempt,
        "group_attempt": group_attempt,
        "instance_id": instance_id,
        "replaces_rollout_id": replaces,
        "reason": reason or None,
    }


_CHUNK_COLUMNS = (
    "group_ids", "generation_indexes", "dispositions", "rollout_ids", "gym_attempts", "group_attempts", "instance_ids",
    "replaces_rollout_ids", "reasons",
)


# Sent as one string per column and chunk, split by the server: psycopg dumps a list element by
# element in Python, a join and ``string_to_array`` cost far less. The separator (unit
# separator, U+001F) cannot occur in these values (ids and instance names match NAME_PATTERN-like
# patterns, dispositions are fixed words) and '' stands for NULL (no value is empty); a value
# that breaks either is refused before anything is sent.
_SEP = "\x1f"


def _joined(col: str, values: Sequence[Any]) -> str:
    if col not in RESTORE_ROW_CHUNK_TEXT_COLUMNS:
        return _SEP.join(map(str, values))
    if "" in values:
        raise ValueError(f"restore answer column {col} holds an empty value")
    out = _SEP.join(values) if None not in values else _SEP.join([v or "" for v in values])
    if out.count(_SEP) != len(values) - 1:
        raise ValueError(f"restore answer column {col} holds a value with U+001F")
    return out


async def store_answer_rows(conn: AsyncConnection, run_id: str, restore_id: str, rows: AnswerRows) -> int:
    """Write ``rows`` as chunks of ``RESTORE_ROWS_PER_CHUNK`` (one pipelined batch of inserts);
    returns the number of rows."""
    n = len(rows)
    if not n:
        return 0
    per = RESTORE_ROWS_PER_CHUNK
    columns = {col: getattr(rows, col) for col in _CHUNK_COLUMNS}
    params = [
        {"r": run_id, "i": restore_id, "c": k, **{col: _joined(col, values[k * per:(k + 1) * per]) for col, values in columns.items()}}
        for k in range((n + per - 1) // per)
    ]
    split = [
        f"string_to_array(%({c})s, chr(31), '')" + ("" if c in RESTORE_ROW_CHUNK_TEXT_COLUMNS else "::int[]") for c in _CHUNK_COLUMNS
    ]
    sql = (
        f"INSERT INTO restore_row_chunks (run_id, restore_id, chunk, {', '.join(_CHUNK_COLUMNS)}) "
        f"VALUES (%(r)s, %(i)s, %(c)s, {', '.join(split)})"
    )
    cur = (await driver_connection(conn)).cursor()
    await cur.executemany(sql, params)
    return n


async def read_answer_rows(conn: AsyncConnection, run_id: str, restore_id: str, start: int, limit: int) -> list[dict[str, Any]]:
    """Rows ``start``..``start + limit - 1`` of a stored answer (fewer at its end)."""
    if limit <= 0:
        return []
    per = RESTORE_ROWS_PER_CHUNK
    first, last = start // per, (start + limit - 1) // per
    chunks = await fetch(
        conn,
        f"SELECT chunk, {', '.join(_CHUNK_COLUMNS)} FROM restore_row_chunks WHERE run_id = %(r)s AND restore_id = %(i)s "
        "AND chunk BETWEEN %(a)s AND %(b)s ORDER BY chunk",
        {"r": run_id, "i": restore_id, "a": first, "b": last},
    )
    out: list[dict[str, Any]] = []
    for chunk, *cols in chunks:
        # A chunk stored before rows carried a reason has none.
        cols = [c if c is not None else [None] * len(cols[0]) for c in cols]
        base = chunk * per
        lo, hi = max(start - base, 0), min(start + limit - base, len(cols[0]))
        out.extend(answer_row_json(*row) for row in zip(*(c[lo:hi] for c in cols)))
    return out


def _json(v: Any) -> str:
    return dump_json(v, default=str)


def _jsonb(v: Any) -> Any:
    # Bound as text in the ledger's one JSON form, cast by the server.
    return cast(literal(_json(v), Text), JSONB)
