"""The snapshot row's phase moves, each fenced by the run's lease and checked against the phase
it leaves: creation, the gate's close (with the move to prepare), the moves of the pending
snapshot, a takeover after its owner died, publication and reopening a stopped run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ...domain.snapshot_state import (
    UNFLUSHED_MOVES,
    SnapshotPhase,
)
from ...domain.vocabulary import RestoreRecordState
from ...errors import Conflict, RunStopped
from ...ledger.db import one_statement
from ...ledger.leases import Fence, Fenced, fence_sql
from ...ledger.notify import _notice
from ...ledger.runs import CLOSE_GATE_SQL, get_run, lock_run, stopped_by
from ...ledger.runs import open_gate as _open_gate_of_run
from ...outbox.store import pending_of_run
from ...rollouts.stragglers import retire_stragglers
from .gym_entries import _ENTRY_INSERT, _ENTRY_UPSERT, GymEntry
from .rows import _COLS, P, SnapshotRow, _j, get
from .stragglers import find_stragglers
from .train_steps import newest_train_step


async def create_in(
    conn: AsyncConnection, run_id: str, snapshot_id: str, anchor_step: int, owner: str, snapshot_dir: str, *, stop: bool = False, deadline_s: float | None = None
) -> tuple[SnapshotRow, bool]:
    """Create the snapshot record (phase ``requested``) in the caller's transaction; (row,
    created). Idempotent by id. Refused ``run_stopped`` while a stopping snapshot holds the run."""
    run = await lock_run(conn, run_id, for_update=True)
    existing = (await conn.execute(text(f"SELECT {_COLS} FROM snapshots WHERE run_id = :r AND snapshot_id = :s"), {"r": run_id, "s": snapshot_id})).first()
    if existing is not None:
        row = SnapshotRow(**dict(existing._mapping))
        if row.anchor_step != anchor_step or row.stop != stop:
            raise Conflict(f"snapshot {snapshot_id!r} was requested at step {row.anchor_step}" + (" as a stopping snapshot" if row.stop else ""), code="snapshot_conflict")
        return row, False
    stopped = await stopped_by(conn, run_id, run.gate_snapshot_id)
    if stopped is not None:
        raise RunStopped(f"run {run_id!r} was stopped by snapshot {stopped!r}; restore it or reopen it first", snapshot_id=stopped)
    newest = await newest_train_step(conn, run_id)
    if newest is not None and anchor_step < newest:
        raise Conflict(
            f"anchor step {anchor_step} is older than the newest announced train step {newest}",
            code="snapshot_anchor_stale", newest_train_step=newest,
        )
    restoring = (await conn.execute(text(f"SELECT restore_id FROM restores WHERE run_id = :r AND state = '{RestoreRecordState.running}'"), {"r": run_id})).scalar()
    if restoring is not None:
        # A snapshot taken while the ledger is being rewound would cut a half-restored run.
        raise Conflict(f"restore {restoring!r} of this run is in progress", code="restore_in_progress", restore_id=restoring)
    other, has_gym = (
        await conn.execute(
            text(
                "SELECT (SELECT snapshot_id FROM snapshots WHERE run_id = :r AND outcome IS NULL), "
                "EXISTS (SELECT 1 FROM gym_instances WHERE run_id = :r)"
            ),
            {"r": run_id},
        )
    ).one()
    if other is not None:
        raise Conflict(f"snapshot {other!r} of this run is still in progress", code="snapshot_in_progress", snapshot_id=other)
    if not has_gym:
        # It would only fail once it ran: a snapshot saves the rollouts in flight in the run's Gym.
        raise Conflict(
            f"run {run_id!r} has no Gym instance registered: register its Gym instances first "
            "(POST /v1/runs/{run}/gym-instances, client.register_gym_instances), then snapshot",
            code="gym_not_registered",
        )
    try:
        async with conn.begin_nested():
            r = (
                await conn.execute(
                    text(
                        "INSERT INTO snapshots (run_id, snapshot_id, anchor_step, stop, deadline_at, phase, owner, snapshot_dir) "
                        "VALUES (:r, :s, :a, :stop, CASE WHEN CAST(:dl AS float8) IS NULL THEN NULL ELSE now() + make_interval(secs => :dl) END, "
                        f":ph, :o, :d) RETURNING {_COLS}"
                    ),
                    {"r": run_id, "s": snapshot_id, "a": anchor_step, "stop": stop, "dl": deadline_s, "ph": P.requested.value, "o": owner, "d": snapshot_dir},
                )
            ).one()
    except IntegrityError as e:  # the one-open-snapshot index, under a race
        raise Conflict("another snapshot of this run is in progress", code="snapshot_in_progress") from e
    return SnapshotRow(**dict(r._mapping)), True

# A phase write of the snapshot's owner: the row is still in the phase the owner last wrote, not
# ended, still the owner's, and the owner still holds the run's lease at its epoch.
_FENCED_MOVE = f"run_id = :r AND snapshot_id = :s AND phase = :expected AND outcome IS NULL AND owner = :fence_owner AND {fence_sql()}"

_JSON_FIELDS = frozenset({"gym_manifest", "counts", "phase_timings", "detail", "data_plane_ref", "resume_failure"})

_MOVE_FIELDS = _JSON_FIELDS | {"gym_checkpoint_id", "snapshot_dir"}

async def move_in(
    conn: AsyncConnection,
    run_id: str,
    snapshot_id: str,
    fence: Fence,
    expected: SnapshotPhase,
    to: SnapshotPhase,
    *,
    flush: bool = True,
    gym_entry: GymEntry | None = None,
    **fields: Any,
) -> None:
    """Move the snapshot ``expected -> to`` (with ``fields``) in one fenced statement, in the
    caller's transaction; :class:`Fenced` when it matched no row. ``flush=False`` makes the
    transaction's commit asynchronous (``UNFLUSHED_MOVES``). ``gym_entry``: one instance's Gym
    manifest entry, stored by the same statement (the last one, with the move to ``data_plane``)."""
    sets = ["phase = :to"]
    params: dict[str, Any] = {"r": run_id, "s": snapshot_id, "to": to.value, "expected": expected.value, **fence.params()}
    for k, v in fields.items():
        if k not in _MOVE_FIELDS:
            raise ValueError(f"a phase move does not write {k!r}")
        if k == "counts":  # other writers (the pre-cut) add their counts too
            sets.append("counts = COALESCE(counts, '{}'::jsonb) || CAST(:counts AS jsonb)")
            params[k] = _j(v)
        elif k in _JSON_FIELDS:
            sets.append(f"{k} = CAST(:{k} AS jsonb)")
            params[k] = _j(v)
        else:
            sets.append(f"{k} = :{k}")
            params[k] = v
    # The notification rides on the statement (no extra round trip): trainers waiting on the
    # snapshot, on any replica, read it again at once.
    params.update(_notice(run_id, snapshot_id, progress=True))
    lazy = "" if flush else ", set_config('synchronous_commit', 'off', true)"
    entry = ""
    if gym_entry is not None:
        params.update(gym_entry.params())
        entry = f", e AS ({_ENTRY_INSERT} FROM u {_ENTRY_UPSERT})"
    sql = f"WITH u AS (UPDATE snapshots SET {', '.join(sets)} WHERE {_FENCED_MOVE} RETURNING 1){entry} SELECT pg_notify(:ch, :np){lazy} FROM u"
    n = len((await conn.execute(text(sql), params)).all())
    if n != 1:
        raise Fenced(run_id, f"snapshot {snapshot_id}: {expected} -> {to}", fence)

async def move(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, expected: SnapshotPhase, to: SnapshotPhase, **fields: Any) -> None:
    # One statement (``move_in``), so it commits by itself: a refused move wrote nothing.
    async with one_statement(engine) as conn:
        await move_in(conn, run_id, snapshot_id, fence, expected, to, flush=to not in UNFLUSHED_MOVES, **fields)

async def take_over(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, expected: SnapshotPhase) -> None:
    """Make ``fence``'s owner (which holds the run's lease now) the snapshot's owner, so that its
    fenced writes may end it; :class:`Fenced` when the lease or the phase moved meanwhile."""
    async with engine.begin() as conn:
        n = (
            await conn.execute(
                text(
                    "UPDATE snapshots SET owner = :fence_owner WHERE run_id = :r AND snapshot_id = :s AND phase = :expected "
                    f"AND outcome IS NULL AND {fence_sql()}"
                ),
                {"r": run_id, "s": snapshot_id, "expected": expected.value, **fence.params()},
            )
        ).rowcount
    if n != 1:
        raise Fenced(run_id, f"snapshot {snapshot_id}: taking it over in phase {expected}", fence)

@dataclass(frozen=True)
class GateClosure:
    """What :func:`close_gate` did: the run's pending outbox pairs (instance, op), read after the
    close, whether the snapshot went on to ``prepare`` in the same transaction, and the
    stragglers it gave up (docs/ledger.md#stragglers)."""

    owed: set[tuple[str, str]]
    prepared: bool
    stragglers: tuple[str, ...] = ()

async def close_gate(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, *, prepare_as: str | None = None) -> GateClosure:
    """Phase ``gate``, persisted together with the gate itself, in one statement: the gate's
    update of the run row waits for in-flight dispatch transactions (they hold it FOR SHARE), so
    none lands after the close. The run's pending outbox pairs are read after the close: with
    none, the snapshot has nothing to deliver before its prepare, and with ``prepare_as`` (its
    Gym checkpoint id) it moves on to ``prepare`` in the same transaction, one flush fewer
    before Gym is prepared (not for a row without a ``snapshot_dir``: the caller moves it)."""
    async with engine.begin() as conn:
        return await close_gate_in(conn, run_id, snapshot_id, fence, prepare_as=prepare_as)

async def close_gate_in(conn: AsyncConnection, run_id: str, snapshot_id: str, fence: Fence, *, prepare_as: str | None = None) -> GateClosure:
    """:func:`close_gate` in the caller's transaction (the request that creates the snapshot on
    its owner's replica closes the gate in the same one)."""
    params = {"r": run_id, "s": snapshot_id, "to": P.gate.value, "expected": P.requested.value, **fence.params(),
              **_notice(run_id, snapshot_id, progress=True)}
    closed, moved, _ = (await conn.execute(text(_CLOSE_GATE_SQL), params)).one()
    if not closed:
        await lock_run(conn, run_id)  # not found, or closed: raised here
        raise Fenced(run_id, f"snapshot {snapshot_id}: the gate of a run that changed meanwhile", fence)
    if not moved:
        raise Fenced(run_id, f"snapshot {snapshot_id}: {P.requested} -> {P.gate}", fence)  # the gate's close rolls back
    # Episodes that blocked the last snapshots are given up now, with the gate closed: their
    # retires are owed before this snapshot's prepare, so it no longer waits for them.
    stragglers = await find_stragglers(conn, run_id)
    given_up = await retire_stragglers(conn, run_id, (await get_run(conn, run_id)).config, stragglers) if stragglers else []
    owed = await pending_of_run(conn, run_id)
    prepared = False
    if prepare_as is not None and not owed:
        # The close holds the snapshot row and the lease row: the fence cannot move in
        # between. Not taken for a snapshot that cannot reach Gym (past its deadline, no
        # instance registered: it ends from gate) nor for a row without a snapshot_dir (the
        # owner writes it with its own move). Its notification is the close's.
        prepared = (
            await conn.execute(
                text(
                    f"UPDATE snapshots SET phase = :to, gym_checkpoint_id = :cid WHERE {_FENCED_MOVE} AND snapshot_dir IS NOT NULL "
                    "AND (deadline_at IS NULL OR deadline_at > clock_timestamp()) AND EXISTS (SELECT 1 FROM gym_instances WHERE run_id = :r) "
                    "RETURNING 1"
                ),
                {**params, "to": P.prepare.value, "expected": P.gate.value, "cid": prepare_as},
            )
        ).first() is not None
    return GateClosure(owed, prepared, tuple(given_up))

_CLOSE_GATE_SQL = (
    f"WITH g AS ({CLOSE_GATE_SQL}), "
    f"u AS (UPDATE snapshots SET phase = :to WHERE {_FENCED_MOVE} AND EXISTS (SELECT 1 FROM g) RETURNING 1) "
    "SELECT EXISTS (SELECT 1 FROM g), EXISTS (SELECT 1 FROM u), (SELECT pg_notify(:ch, :np) FROM u)"
)

async def publish_phase(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, *, keep_gate: bool = False) -> None:
    """Phase ``publish``, with the gate reopened in the same transaction (before the publish);
    a stopping snapshot keeps it closed (``keep_gate``): the run is stopped. The gate's update
    comes first: the run row before the lease and the snapshot row (the fenced move locks
    them), the order a snapshot request (run, lease), a barrier or a capture (run, snapshot)
    lock them in; the other way round, one of them in between deadlocked with it. A refused
    move rolls the reopen back."""
    async with engine.begin() as conn:
        if not keep_gate:
            await _open_gate_of_run(conn, run_id, snapshot_id)
        await move_in(conn, run_id, snapshot_id, fence, P.resume, P.publish)

async def reopen(engine: AsyncEngine, run_id: str) -> SnapshotRow | None:
    """Lift a stop: the gate of the stopping snapshot that stopped the run reopens. Returns that
    snapshot, or None when the run was not stopped (a repeat is a no-op)."""
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id, for_update=True)
        sid = await stopped_by(conn, run_id, run.gate_snapshot_id)
        if sid is None:
            return None
        await _open_gate_of_run(conn, run_id, sid)
        return await get(conn, run_id, sid)
