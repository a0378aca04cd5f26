"""Snapshot records, the ledger cut, train steps (recovery-ledger.md section 5).

Every phase is written before its side effects, so a restarted coordinator knows where each
snapshot stood. The ledger cut copies the run's live groups, each with its siblings' current
attempts in one array, into ``snapshot_cut_groups`` in one ``INSERT ... SELECT`` (read through the
views ``snapshot_groups`` and ``snapshot_attempts``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain.gym_manifest import MANIFEST_SCHEMA_VERSION
from ..domain.snapshot_state import UNFLUSHED_MOVES, AttemptStatus, GroupStatus, SnapshotOutcome, SnapshotPhase, SnapshotReason, snapshot_cause
from ..errors import Conflict, NotFound, RunStopped
from .db import JsonText, dump_json, one_statement, read_rows
from .leases import Fence, Fenced, fence_sql
from .models import SNAPSHOT_GROUP_COLUMNS, SNAPSHOT_SIBLING_FIELDS
from .outbox import pending_of_run
from .gate import CLOSE_GATE_SQL
from .gate import open_gate as _open_gate_of_run
from . import staging_keys as sk
from .runs import lock_run, stopped_by

P = SnapshotPhase
TERMINAL = tuple(o.value for o in SnapshotOutcome)

#: The channel a trainer handshake (barrier, capture, abort, train-step announce) notifies in the
#: transaction that records it; the owner of the snapshot LISTENs on it, on whichever replica.
NOTIFY_CHANNEL = "ckptc_snapshot"


# Marks the notification of a new snapshot (ids hold no space): only that one makes a replica
# that does not drive the snapshot look for work; a handshake concerns its owner alone.
CREATED_MARK = "new "
# Marks a notification of progress the owner wrote itself (a phase move, the pre-cut): it
# concerns only the trainers waiting on the snapshot (``GET ...?wait_s=``), not the owner.
PROGRESS_MARK = "moved "


def notify_payload(run_id: str, snapshot_id: str, *, created: bool = False, progress: bool = False) -> str:
    return f"{CREATED_MARK if created else PROGRESS_MARK if progress else ''}{run_id}/{snapshot_id}"


def _notice(run_id: str, snapshot_id: str, *, progress: bool = False) -> dict[str, str]:
    """The parameters of a ``pg_notify(:ch, :np)`` that rides on a statement."""
    return {"ch": NOTIFY_CHANNEL, "np": notify_payload(run_id, snapshot_id, progress=progress)}


def _notified_row(r: Any) -> SnapshotRow:
    """The row of a statement that answered ``SELECT u.*, pg_notify(...) AS notified``."""
    return SnapshotRow(**{k: v for k, v in r._mapping.items() if k != "notified"})


def parse_notify_payload(payload: str) -> tuple[str, str, str]:
    """``(run_id, snapshot_id, kind)`` of a notification, kind ``created``, ``progress`` or ``handshake``."""
    kind = "handshake"
    for mark, name in ((CREATED_MARK, "created"), (PROGRESS_MARK, "progress")):
        if payload.startswith(mark):
            kind, payload = name, payload.removeprefix(mark)
            break
    run_id, _, snapshot_id = payload.partition("/")
    return run_id, snapshot_id, kind


async def notify_created(conn: AsyncConnection, run_id: str, snapshot_id: str) -> None:
    """A snapshot created here for an owner on another replica: its listener starts it."""
    await _notify(conn, run_id, [snapshot_id], created=True)


async def _notify(conn: AsyncConnection, run_id: str, snapshot_ids: list[str], *, created: bool = False) -> None:
    if snapshot_ids:
        await conn.execute(
            text("SELECT pg_notify(:ch, p) FROM unnest(CAST(:ps AS text[])) AS p"),
            {"ch": NOTIFY_CHANNEL, "ps": [notify_payload(run_id, s, created=created) for s in snapshot_ids]},
        )


def awaiting(phase: str, outcome: str | None, *, cut_taken: bool, captured: bool) -> str | None:
    """The trainer handshake a snapshot waits for: the barrier, then the capture, both only in
    phase ``data_plane`` of an open snapshot."""
    if outcome is not None or phase != P.data_plane:
        return None
    if not cut_taken:
        return "barrier"
    return None if captured else "capture"


class SnapshotNotAwaiting(Conflict):
    code = "snapshot_not_awaiting"


_BASE_COLS = (
    "snapshot_id, anchor_step, stop, deadline_at, phase, outcome, reason, detail, owner, gym_checkpoint_id, snapshot_dir, phase_timings, "
    "data_plane_ref, counts, gym_parked_seconds, gym_restarted_episodes, resume_failure, "
    "abort_requested, cut_at, created_at, published_at, ended_at"
)
# A pending snapshot's Gym manifest is its entries, joined here (at its end, or for a reader that
# asks for it); NULL when it has none. Complete only from the move to data_plane on (which
# waits for every instance's entry): ``_COMPLETE_ENTRIES`` says so.
_COMPLETE_ENTRIES = f"(snapshots.phase = '{P.data_plane}' OR snapshots.cut_at IS NOT NULL)"
_ENTRIES_MANIFEST = (
    "(SELECT jsonb_build_object('checkpoint_id', snapshots.gym_checkpoint_id, 'instances', jsonb_object_agg(ge.instance_id, ge.entry), "
    f"'schema_version', {MANIFEST_SCHEMA_VERSION}) FROM snapshot_gym_entries ge "
    "WHERE ge.run_id = snapshots.run_id AND ge.snapshot_id = snapshots.snapshot_id HAVING count(*) > 0)"
)

# The Gym manifest and the cut's staging keys (megabytes for a big run) are read only when they
# are answered: the keys while the snapshot awaits its capture (``SnapshotRow.public``), the
# manifest on request; decoding them on every status read was most of its cost.
_KEYS_WHEN_AWAITING_CAPTURE = (
    f"CASE WHEN outcome IS NULL AND phase = '{P.data_plane}' AND cut_at IS NOT NULL AND data_plane_ref IS NULL "
    f"THEN {sk.KEYS} END AS cut_staging_keys"
)
_COLS = f"{_BASE_COLS}, CAST(NULL AS jsonb) AS gym_manifest, {_KEYS_WHEN_AWAITING_CAPTURE}"
_COLS_WITH_KEYS = f"{_BASE_COLS}, CAST(NULL AS jsonb) AS gym_manifest, {sk.KEYS} AS cut_staging_keys, cut_keys_added, cut_keys_removed"
_COLS_FULL = (
    f"{_BASE_COLS}, COALESCE(gym_manifest, CASE WHEN {_COMPLETE_ENTRIES} THEN {_ENTRIES_MANIFEST} END) AS gym_manifest, "
    f"{sk.KEYS} AS cut_staging_keys"
)
# Only what ``SnapshotRow`` does not need at all.
_COLS_NONE = f"{_BASE_COLS}, CAST(NULL AS jsonb) AS gym_manifest, CAST(NULL AS text[]) AS cut_staging_keys"


@dataclass
class SnapshotRow:
    snapshot_id: str
    anchor_step: int
    stop: bool
    deadline_at: datetime | None
    phase: str
    outcome: str | None
    reason: str | None
    detail: dict[str, Any] | None
    owner: str
    gym_checkpoint_id: str | None
    snapshot_dir: str | None
    phase_timings: dict[str, Any]
    gym_manifest: dict[str, Any] | None
    cut_staging_keys: list[str] | None
    data_plane_ref: dict[str, Any] | None
    counts: dict[str, Any]
    gym_parked_seconds: float | None
    gym_restarted_episodes: int | None
    resume_failure: dict[str, Any] | None
    abort_requested: str | None
    cut_at: datetime | None
    created_at: datetime
    published_at: datetime | None
    ended_at: datetime | None
    # What the barrier added to and removed from the pre-cut's keys (``take_cut``); None without a pre-cut.
    cut_keys_added: list[str] | None = None
    cut_keys_removed: list[str] | None = None

    @property
    def terminal(self) -> bool:
        return self.outcome is not None

    @property
    def awaiting(self) -> str | None:
        return awaiting(self.phase, self.outcome, cut_taken=self.cut_at is not None, captured=self.data_plane_ref is not None)

    @property
    def watch_token(self) -> str:
        """What a trainer waits on changing (``GET ...?wait_s=&watch_token=``): the phase, the
        outcome, the handshake awaited, and whether the pre-cut's keys can be fetched."""
        pre_cut = 1 if (self.counts or {}).get("cut_pre_cut_keys") is not None else 0
        return f"{self.phase}.{self.outcome or '-'}.{self.awaiting or '-'}.{pre_cut}"

    def public(self, *, with_manifest: bool = False) -> dict[str, Any]:
        cause, retryable = snapshot_cause(self.reason, self.detail)
        d: dict[str, Any] = {
            "snapshot_id": self.snapshot_id,
            "anchor_step": self.anchor_step,
            "stop": self.stop,
            "deadline_at": _iso(self.deadline_at),
            "phase": self.phase,
            "outcome": self.outcome,
            "reason": self.reason,
            "cause": cause,
            "retryable": retryable,
            "detail": self.detail,
            "awaiting": self.awaiting,
            "watch_token": self.watch_token,
            "gym_checkpoint_id": self.gym_checkpoint_id,
            "snapshot_dir": self.snapshot_dir,
            "phase_timings": self.phase_timings,
            "counts": self.counts,
            "gym_parked_seconds": self.gym_parked_seconds,
            "gym_restarted_episodes": self.gym_restarted_episodes,
            "resume_failure": self.resume_failure,
            "data_plane_ref": self.data_plane_ref,
            "cut_at": _iso(self.cut_at),
            "created_at": _iso(self.created_at),
            "published_at": _iso(self.published_at),
            "ended_at": _iso(self.ended_at),
        }
        if self.awaiting == "capture" or with_manifest:
            d["staging_keys"] = self.cut_staging_keys or []
        if with_manifest:
            d["gym_manifest"] = self.gym_manifest
        return d


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def _j(v: Any) -> str | None:
    return None if v is None else v if isinstance(v, JsonText) else dump_json(v)


async def get(
    conn: AsyncConnection, run_id: str, snapshot_id: str, *, for_update: bool = False, with_manifest: bool = False, columns: str | None = None
) -> SnapshotRow:
    """The snapshot row; ``gym_manifest`` only ``with_manifest``, ``cut_staging_keys`` only when
    ``public()`` answers them (awaiting capture, or ``with_manifest``)."""
    cols = columns or (_COLS_FULL if with_manifest else _COLS)
    return SnapshotRow(**await _read_row(conn, run_id, snapshot_id, cols, " FOR UPDATE" if for_update else ""))


async def _read_row(conn: AsyncConnection, run_id: str, snapshot_id: str, select: str, lock: str = "", *, with_: str = "") -> dict[str, Any]:
    """The snapshot row's ``select`` list, by name; :class:`NotFound` when there is none.
    ``with_``: a WITH clause for the statement (it may use ``:r`` and ``:s``)."""
    r = (
        await conn.execute(text(f"{with_}SELECT {select} FROM snapshots WHERE run_id = :r AND snapshot_id = :s{lock}"), {"r": run_id, "s": snapshot_id})
    ).first()
    if r is None:
        raise NotFound(f"snapshot {snapshot_id!r} not found in run {run_id!r}", code="snapshot_not_found")
    return dict(r._mapping)


# The run's newest train step of its current lineage (a restore retires the discarded ones).
_NEWEST_STEP_SQL = "SELECT max(step) FROM train_steps WHERE run_id = :r AND retired_at IS NULL"


async def newest_train_step(conn: AsyncConnection, run_id: str) -> int | None:
    return (await conn.execute(text(_NEWEST_STEP_SQL), {"r": run_id})).scalar()


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
    restoring = (await conn.execute(text("SELECT restore_id FROM restores WHERE run_id = :r AND state = 'running'"), {"r": run_id})).scalar()
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
class GymEntry:
    """One instance's Gym manifest entry as ``snapshot_gym_entries`` keeps it while the snapshot
    is pending: its text (as the manifest holds it), and ``new_keys``, its staging keys that the
    pre-cut's key rows lack, sorted by code point (None when no pre-cut's keys were at hand: the
    barrier looks them up)."""

    instance_id: str
    entry: JsonText
    new_keys: list[str] | None

    def params(self) -> dict[str, Any]:
        return {"ei": self.instance_id, "ee": self.entry, "ek": self.new_keys}


_ENTRY_INSERT = (
    "INSERT INTO snapshot_gym_entries (run_id, snapshot_id, instance_id, entry, new_keys) "
    "SELECT :r, :s, :ei, CAST(:ee AS jsonb), CAST(:ek AS text[])"
)
_ENTRY_UPSERT = "ON CONFLICT (run_id, snapshot_id, instance_id) DO UPDATE SET entry = EXCLUDED.entry, new_keys = EXCLUDED.new_keys"


def new_keys(staging_keys: Iterable[str], pre_cut_keys: frozenset[str] | None) -> list[str] | None:
    """An entry's ``new_keys``: of its ``staging_keys``, those the pre-cut's key rows
    (``pre_cut_keys``, as :func:`pre_cut` answered them) lack, distinct and sorted by code point
    (PostgreSQL's byte order, what the barrier's ``added`` is sorted by)."""
    if pre_cut_keys is None:
        return None
    return sorted({k for k in staging_keys if k not in pre_cut_keys})


async def store_gym_entry(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, gym_entry: GymEntry) -> None:
    """Store one instance's Gym manifest entry while the snapshot is in phase ``commit`` or
    ``drain``, fenced like a phase move. :class:`Fenced` when the snapshot is no longer this
    owner's in those phases."""
    async with one_statement(engine) as conn:  # one statement: refused, it wrote nothing
        n = (
            await conn.execute(
                text(
                    # Flushed: a database crash must not lose an entry whose write was answered
                    # (nothing would write it again, and the snapshot would publish without it).
                    f"{_ENTRY_INSERT} WHERE EXISTS (SELECT 1 FROM snapshots WHERE run_id = :r AND snapshot_id = :s AND phase IN (:commit, :drain) "
                    f"AND outcome IS NULL AND owner = :fence_owner) AND {fence_sql()} {_ENTRY_UPSERT}"
                ),
                {"r": run_id, "s": snapshot_id, **gym_entry.params(), "commit": P.commit.value, "drain": P.drain.value, **fence.params()},
            )
        ).rowcount
    if n != 1:
        raise Fenced(run_id, f"snapshot {snapshot_id}: Gym entry of {gym_entry.instance_id}", fence)


async def lease_owner(conn: AsyncConnection, run_id: str) -> str | None:
    return (await conn.execute(text("SELECT owner FROM ownership_leases WHERE run_id = :r AND expires_at > now()"), {"r": run_id})).scalar()


@dataclass(frozen=True)
class GateClosed:
    """What :func:`close_gate` did: the run's pending outbox pairs (instance, op), read after the
    close, and whether the snapshot went on to ``prepare`` in the same transaction."""

    owed: set[tuple[str, str]]
    prepared: bool


async def close_gate(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, *, prepare_as: str | None = None) -> GateClosed:
    """Phase ``gate``, persisted together with the gate itself, in one statement: the gate's
    update of the run row waits for in-flight dispatch transactions (they hold it FOR SHARE), so
    none lands after the close. The run's pending outbox pairs are read after the close: with
    none, the snapshot has nothing to deliver before its prepare, and with ``prepare_as`` (its
    Gym checkpoint id) it moves on to ``prepare`` in the same transaction, one flush fewer
    before Gym is prepared (not for a row without a ``snapshot_dir``: the caller moves it)."""
    async with engine.begin() as conn:
        return await close_gate_in(conn, run_id, snapshot_id, fence, prepare_as=prepare_as)


async def close_gate_in(conn: AsyncConnection, run_id: str, snapshot_id: str, fence: Fence, *, prepare_as: str | None = None) -> GateClosed:
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
    return GateClosed(owed, prepared)


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


async def deadline_left_s(conn: AsyncConnection, run_id: str, snapshot_id: str) -> float | None:
    """Seconds until the snapshot's deadline (negative once past), by the database's clock (its
    current time: ``now()`` would be the time the caller's transaction began)."""
    v = (
        await conn.execute(
            text("SELECT EXTRACT(EPOCH FROM deadline_at - clock_timestamp()) FROM snapshots WHERE run_id = :r AND snapshot_id = :s"), {"r": run_id, "s": snapshot_id}
        )
    ).scalar()
    return None if v is None else float(v)


_CANDIDATES_SQL = (
    "SELECT a.gym_instance_id, a.rollout_id, a.gym_attempt FROM attempts a JOIN prompt_groups g "
    "ON g.run_id = a.run_id AND g.group_id = a.group_id "
    f"WHERE a.run_id = %(r)s AND a.is_current AND g.restore_level = 'turn' AND g.status = '{GroupStatus.generating}' "
    "AND a.gym_instance_id IS NOT NULL "
    f"AND (a.status = '{AttemptStatus.dispatched}' OR (a.status = '{AttemptStatus.reserved}' AND (a.gym_owned OR a.gym_attempt > 0)))"
)


async def candidates(engine: AsyncEngine, run_id: str) -> dict[str, list[tuple[str, int]]]:
    """Per instance, the live turn-level attempts Gym may hold state for (section 5 step 5).
    Tens of thousands of rows while Gym may wait for them: plain driver tuples, no row objects."""
    out: dict[str, list[tuple[str, int]]] = {}
    for iid, rollout_id, attempt in await read_rows(engine, _CANDIDATES_SQL, {"r": run_id}):
        out.setdefault(iid, []).append((rollout_id, attempt))
    return out


async def still_pending(engine: AsyncEngine, run_id: str, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
    """Which of these (rollout_id, gym_attempt) are still on the wire: unique-index lookups only,
    so a drain pass costs time in the number pending, never in the number of live rollouts."""
    if not keys:
        return set()
    # One statement on the binary read path (no SQLAlchemy text() parameter handling).
    rows = await read_rows(
        engine,
        "SELECT a.rollout_id, a.gym_attempt FROM unnest(%(ro)s::text[]) AS t(ro) "
        "JOIN attempts a ON a.run_id = %(r)s AND a.rollout_id = t.ro "
        "WHERE a.is_current AND a.status = 'dispatched'",
        {"r": run_id, "ro": [k[0] for k in keys]},
    )
    wanted = set(keys)
    return {(r[0], r[1]) for r in rows} & wanted


@dataclass(frozen=True)
class SnapshotProgress:
    """The few columns the runner polls; the full row carries the manifest and staging keys
    (megabytes at 10 000 episodes), too heavy to read on every event and every fallback poll."""

    phase: str
    outcome: str | None
    abort_requested: str | None
    cut_taken: bool
    captured: bool

    @property
    def awaiting(self) -> str | None:
        return awaiting(self.phase, self.outcome, cut_taken=self.cut_taken, captured=self.captured)


async def poll(engine: AsyncEngine, run_id: str, snapshot_id: str) -> SnapshotProgress:
    async with engine.connect() as conn:
        r = (
            await conn.execute(
                text(
                    "SELECT phase, outcome, abort_requested, cut_at IS NOT NULL, data_plane_ref IS NOT NULL "
                    "FROM snapshots WHERE run_id = :r AND snapshot_id = :s"
                ),
                {"r": run_id, "s": snapshot_id},
            )
        ).first()
    if r is None:
        raise NotFound(f"snapshot {snapshot_id!r} not found in run {run_id!r}", code="snapshot_not_found")
    return SnapshotProgress(*r)


_BARRIER_READS = frozenset(
    {"cut_base_xid", "cut_xmin", "cut_system_id", "pre_cut_groups", "pre_cut_siblings", "newest_step", "recorded", "pre_cut_keys", "unfound_keys"}
)


async def take_cut(engine: AsyncEngine, run_id: str, snapshot_id: str, *, full_keys: bool = True) -> SnapshotRow:
    """The trainer holds its data-plane barrier: copy the live ledger into the snapshot, in one
    transaction, and record the staging keys that must exist. Idempotent.

    When the runner took a pre-cut (``pre_cut``, beside Gym's prepare and commit), only the
    groups written since are copied again: those ``snapshot_changed_groups`` recorded as they
    were written; their keys are counted into the pre-cut's key rows (waiting for them, which
    are written after the pre-cut; without them the whole run is copied), and what they and the
    Gym manifest's keys added and removed is recorded (``cut_keys_added``, ``cut_keys_removed``):
    the barrier's work and its delta answer grow with what changed, not with the run. Otherwise
    the whole run is copied (one row per group, its siblings in an array; its keys are read from
    those rows).
    ``counts`` says which way it went (``cut_recopied_groups``). The run is locked FOR UPDATE: no
    report lands between the reading of the changed groups and their copy. The row answered
    carries the whole key list (``cut_staging_keys``) unless ``full_keys`` is False (a trainer
    that asked for the delta; a repeat carries it anyway)."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True)
        # The row and all the barrier reads besides it, in one statement (after the run's lock:
        # its xmin sees every report that committed before the cut).
        # The groups recorded as changed are taken in the same statement (a barrier that does not
        # go on rolls their deletion back; a repeat's is harmless: the cut is taken).
        base = await _read_row(
            conn, run_id, snapshot_id,
            f"{_COLS_NONE}, cut_base_xid, {CURRENT_XMIN_SQL} AS cut_xmin, {SYSTEM_ID_SQL} AS cut_system_id, "
            "COALESCE(CAST(counts ->> 'cut_pre_cut_groups' AS bigint), 0) AS pre_cut_groups, "
            "CAST(counts ->> 'cut_pre_cut_siblings' AS bigint) AS pre_cut_siblings, "
            f"({_NEWEST_STEP_SQL}) AS newest_step, (SELECT COALESCE(array_agg(d.group_id), '{{}}') FROM d) AS recorded, "
            "CAST(counts ->> 'cut_pre_cut_keys' AS bigint) AS pre_cut_keys, (gym_manifest IS NOT NULL OR EXISTS (SELECT 1 FROM snapshot_gym_entries ge "
            "WHERE ge.run_id = :r AND ge.snapshot_id = :s AND ge.new_keys IS NULL)) AS unfound_keys",
            " FOR UPDATE OF snapshots",
            with_="WITH d AS (DELETE FROM snapshot_changed_groups WHERE run_id = :r RETURNING group_id) ",
        )
        snap = SnapshotRow(**{k: v for k, v in base.items() if k not in _BARRIER_READS})
        if snap.cut_at is not None and snap.outcome is None:
            return await get(conn, run_id, snapshot_id, columns=_COLS_WITH_KEYS)
        if snap.outcome is not None or snap.phase != P.data_plane:
            raise SnapshotNotAwaiting(
                f"snapshot {snapshot_id!r} is in phase {snap.phase}" + (f" ({snap.outcome}: {snap.reason})" if snap.outcome else "") + "; not awaiting the barrier",
                phase=snap.phase, outcome=snap.outcome, reason=snap.reason,
            )
        if snap.abort_requested is not None:
            raise SnapshotNotAwaiting(f"snapshot {snapshot_id!r} is being aborted ({snap.abort_requested})", phase=snap.phase, reason=snap.abort_requested)
        newest = base["newest_step"]
        if newest is not None and newest > snap.anchor_step and not snap.stop:
            # Train step wins: it was announced before this cut (not over a stopping snapshot:
            # the trainer is stopping). The announce itself asked the owner to abort.
            raise SnapshotNotAwaiting(f"train step {newest} committed after anchor {snap.anchor_step}; snapshot aborted", phase=snap.phase, reason="train_step_committed")
        p = {"r": run_id, "s": snapshot_id}
        notice = _notice(run_id, snapshot_id)  # rides on the cut's update
        extra: dict[str, Any] = {}
        changed: list[str] | None = None
        recorded = list(base["recorded"])
        if base["cut_base_xid"] is not None and base["pre_cut_groups"] > 0 and base["pre_cut_siblings"] is not None:
            changed = recorded
            if len(changed) * _DELTA_MAX_SHARE > base["pre_cut_groups"]:
                changed = None  # deleting and re-copying most groups costs more than one whole copy
        if changed is not None and (changed or base["unfound_keys"]) and not await sk.key_rows_in(conn, run_id, snapshot_id, base["pre_cut_keys"]):
            # Their keys are counted against the pre-cut's key rows, which never came in.
            changed = None
        if changed is not None:
            old_keys: list[str] = []
            new_keys: list[str] = []
            groups, siblings = base["pre_cut_groups"], base["pre_cut_siblings"]
            if changed:
                for keys, n in await conn.execute(
                    text(
                        "DELETE FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = :s AND group_id = ANY(CAST(:g AS text[])) "
                        "RETURNING staging_keys, cardinality(siblings)"
                    ),
                    {**p, "g": changed},
                ):
                    old_keys.extend(keys or ())
                    groups, siblings = groups - 1, siblings - (n or 0)
                if len(changed) > _DELTA_HASH_FROM:
                    await _cut_settings(conn)
                for keys, n in await conn.execute(text(_cut_insert(only_named_groups=True) + " RETURNING staging_keys, cardinality(siblings)"), {**p, "g": changed}):
                    new_keys.extend(keys or ())
                    groups, siblings = groups + 1, siblings + (n or 0)
            extra = {"cut_pre_cut_groups": base["pre_cut_groups"], "cut_recopied_groups": len(changed)}
            r = (
                await conn.execute(
                    text(_DELTA_CUT_SQL),
                    {**p, **notice, "old": old_keys, "new": new_keys, "extra": _j(extra), "cx": base["cut_xmin"], "cs": base["cut_system_id"], "g": groups, "n": siblings},
                )
            ).one()
        else:
            # No pre-cut, or one that most groups changed since: copy everything. A pre-cut's key
            # rows stay until the end: a whole-run cut's keys are read from its rows.
            await delete_cut_rows(conn, run_id, [snapshot_id])
            if base["pre_cut_groups"]:
                extra = {"cut_pre_cut_groups": base["pre_cut_groups"]}
            await _cut_settings(conn)
            # No key rows: its keys are read from its cut rows (``staging_keys.KEYS``).
            await conn.execute(text(_cut_insert(only_named_groups=False)), p)
            r = (await conn.execute(text(_FINISH_CUT_SQL), {**p, **notice, "extra": _j(extra), "cx": base["cut_xmin"], "cs": base["cut_system_id"]})).one()
        row = _notified_row(r)
        if full_keys:
            row.cut_staging_keys = list((await conn.execute(text(f"SELECT {sk.KEYS} FROM snapshots WHERE run_id = :r AND snapshot_id = :s"), p)).scalar())
        return row


async def cut_keys(engine: AsyncEngine, run_id: str, snapshot_id: str, *, pre_cut_keys: str | None = None) -> tuple[str, str]:
    """The keys the trainer may fetch ahead of the barrier, as a JSON array (text, sorted by code
    point): ``("pre_cut", keys)`` once a pre-cut was taken and until the barrier, ``("cut", keys)``
    after it, ``("none", "[]")`` before either. A trainer that holds the pre-cut's keys asks the
    barrier for its delta only. One statement, so the state and the keys are of the same moment;
    PostgreSQL writes the JSON, which spares this process parsing and encoding a few hundred
    thousand keys while Gym commits.

    ``pre_cut_keys``: the snapshot's pre-cut keys as :func:`pre_cut` answered them (its owner
    holds them, ``PreCut.keys_json``); answered in the pre-cut state instead of aggregating the
    cut rows' keys again (a snapshot takes one pre-cut, and nothing else writes its cut rows
    before the barrier). The trainer's fetch may still be running when Gym's commit ends, and
    the barrier waits for it."""
    async with engine.connect() as conn:
        st = (
            await conn.execute(
                text(
                    "SELECT x.cut, x.pre_cut, CASE WHEN x.cut THEN CAST(array_to_json(x.keys) AS text) WHEN x.pre_cut AND NOT :known THEN "
                    f"({sk.PRE_CUT_KEYS_JSON}) END AS keys FROM ("
                    "SELECT cut_at IS NOT NULL AS cut, counts ->> 'cut_pre_cut_keys' IS NOT NULL AND cut_base_xid IS NOT NULL AS pre_cut, "
                    f"{sk.KEYS} AS keys FROM snapshots WHERE run_id = :r AND snapshot_id = :s) x"
                ),
                {"r": run_id, "s": snapshot_id, "known": pre_cut_keys is not None},
            )
        ).first()
    if st is None:
        raise NotFound(f"snapshot {snapshot_id!r} not found in run {run_id!r}", code="snapshot_not_found")
    if st.cut:
        return "cut", st.keys or "[]"
    if not st.pre_cut:
        return "none", "[]"
    return "pre_cut", st.keys if pre_cut_keys is None else pre_cut_keys


_GROUP_COLS = ", ".join(SNAPSHOT_GROUP_COLUMNS)


def _sibling(row_attempts: str = "a") -> str:
    """One sibling of a cut row, from ``a`` (its attempt's columns) and ``row_attempts`` (the
    alias holding ``row_attempts_used``)."""
    return "CAST(ROW(" + ", ".join(f"{row_attempts if name == 'row_attempts_used' else 'a'}.{name}" for name, _ in SNAPSHOT_SIBLING_FIELDS) + ") AS snapshot_sibling)"


_LIVE = f"('{GroupStatus.generating}', '{GroupStatus.ready}')"

# The cut: one row per live group into ``snapshot_cut_groups``, its siblings (each with its
# current attempt) aggregated into one array, and the staging keys of its sealed and returned
# siblings into another (the barrier's answer is their union with the Gym manifest's keys).
# The siblings are aggregated per group before the group's own columns join them, so that the
# join and the aggregate carry one narrow row per sibling, not the group's columns with each
# (bench/README.md). The inner join with the live groups keeps the aggregate to them: a run's
# finalized groups stay in the ledger as history.
def _cut_insert(*, only_named_groups: bool) -> str:
    named_g = " AND g.group_id = ANY(CAST(:g AS text[]))" if only_named_groups else ""
    named_a = " AND a.group_id = ANY(CAST(:g AS text[]))" if only_named_groups else ""
    return (
        f"INSERT INTO snapshot_cut_groups (run_id, snapshot_id, {_GROUP_COLS}, siblings, staging_keys) "
        f"SELECT g.run_id, :s, {', '.join('g.' + c for c in SNAPSHOT_GROUP_COLUMNS)}, COALESCE(x.siblings, '{{}}'), x.keys "
        f"FROM prompt_groups g LEFT JOIN (SELECT a.group_id, array_agg({_sibling('s')}) AS siblings, "
        f"ckptc_text_cat(a.staging_keys) FILTER (WHERE a.status IN ('{AttemptStatus.sealed}', '{AttemptStatus.returned}')) AS keys "
        "FROM attempts a JOIN siblings s ON s.run_id = a.run_id AND s.group_id = a.group_id AND s.generation_index = a.generation_index "
        f"JOIN prompt_groups lg ON lg.run_id = a.run_id AND lg.group_id = a.group_id AND lg.status IN {_LIVE} "
        f"WHERE a.run_id = :r AND a.is_current{named_a} GROUP BY a.group_id) x ON x.group_id = g.group_id "
        f"WHERE g.run_id = :r AND g.status IN {_LIVE}{named_g}"
    )


# Hash joins and a hash aggregate for a whole-run copy, with room for them (the aggregate holds the
# whole cut). With statistics the planner otherwise sorts every joined row by group id (a
# linguistic sort) for a merge join and a group aggregate, or plans a nested loop of one index
# probe per sibling; both were slower (bench/README.md, snapshot_overhead). Transaction-local
# settings as a select list, so that they ride on a statement the caller sends anyway.
_CUT_SETTINGS = "set_config('enable_nestloop', 'off', true), set_config('enable_sort', 'off', true), set_config('work_mem', '128MB', true)"


async def _cut_settings(conn: AsyncConnection) -> None:
    """The whole-run copy's plan settings (``_CUT_SETTINGS``) for the rest of the transaction."""
    await conn.execute(text(f"SELECT {_CUT_SETTINGS}"))


# Above this many groups to copy again at the barrier, the whole-run plan settings are used.
_DELTA_HASH_FROM = 2000
# When more than 1/this of the pre-cut's groups changed, the barrier copies the whole run instead.
_DELTA_MAX_SHARE = 3
# A recorded xmin (a pre-cut's base, a cut's ``cut_xmin``) is trusted while the xid counter moved
# less than this since (32-bit xids compare correctly within 2**31 of each other).
_DELTA_MAX_XIDS = 1_000_000_000

# The 64-bit xmin of the statement's snapshot: every transaction with an older xid had ended when
# the snapshot was taken. Rows compare with it through ``age(xmin) <= age(CAST(:x32 AS xid))``
# (a newer or equal xid has the smaller age), ``:x32`` being the value modulo 2**32 as text.
CURRENT_XMIN_SQL = "CAST(CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS bigint)"
# The 64-bit xid the next transaction gets (the snapshot's xmax), which ``xid_base_usable`` measures against.
NEXT_XID_SQL = "CAST(CAST(pg_snapshot_xmax(pg_current_snapshot()) AS text) AS bigint)"
# The cluster those xids count in (text: an unsigned 64-bit number).
SYSTEM_ID_SQL = "(SELECT CAST(system_identifier AS text) FROM pg_control_system())"


async def cut_xid_basis(conn: AsyncConnection) -> tuple[int, str]:
    """``(cut_xmin, cut_system_id)`` for a cut about to be copied in this transaction: read
    *before* the copy, so every transaction older than that xmin had committed when the copy's
    statements took their snapshots. ``take_cut`` reads it once it holds the run lock; writers of
    a cut by other means (benchmarks, tests) call this, then ``set_cut_xid_basis``. An imported
    cut has none: it did not come from this ledger."""
    r = (await conn.execute(text(f"SELECT {CURRENT_XMIN_SQL}, {SYSTEM_ID_SQL}"))).one()
    return int(r[0]), str(r[1])


async def set_cut_xid_basis(conn: AsyncConnection, run_id: str, snapshot_id: str, basis: tuple[int, str]) -> None:
    await conn.execute(
        text("UPDATE snapshots SET cut_xmin = :x, cut_system_id = :c WHERE run_id = :r AND snapshot_id = :s"),
        {"r": run_id, "s": snapshot_id, "x": basis[0], "c": basis[1]},
    )


def xid_base_usable(base_xid: int | None, next_xid: int) -> bool:
    """Whether rows can still be compared with ``base_xid`` by ``age()``: recorded, a normal xid
    (not 0-2), and less than ``_DELTA_MAX_XIDS`` behind ``next_xid`` (the current snapshot's xmax)."""
    return base_xid is not None and base_xid % 2**32 >= 3 and 0 <= next_xid - base_xid < _DELTA_MAX_XIDS


# The barrier after a pre-cut, one statement: the keys of the groups copied again (``:new``)
# counted in, those of their pre-cut copies (``:old``) counted out (a key whose count reaches
# zero goes); what that and the Gym manifest's keys added to and removed from the pre-cut's keys,
# sorted by code point, is recorded with the cut. Only the changed keys are touched and the
# manifest's looked up (index lookups), never the whole cut. New key rows are plain inserts, not
# an upsert: the run's lock, and the wait for the pre-cut's own writer of them
# (``staging_keys.key_rows_in``), keep every other writer out.
_DELTA_CUT_SQL = (
    "WITH chg AS (SELECT x.k, sum(x.n) AS n FROM ("
    " SELECT k, 1 AS n FROM unnest(CAST(:new AS text[])) AS k"
    " UNION ALL SELECT k, -1 FROM unnest(CAST(:old AS text[])) AS k) x GROUP BY x.k HAVING sum(x.n) <> 0), "
    # Each changed key is probed in the key index (a scalar subquery, and ``= ANY`` of the keys
    # to update or delete): the pre-cut inserted the key rows moments ago and their statistics do
    # not show them, so a join let the planner walk every key row of the cut, once per part.
    "prev AS (SELECT chg.k COLLATE \"C\" AS k, chg.n, COALESCE((SELECT ck.refs FROM snapshot_cut_keys ck "
    " WHERE ck.run_id = :r AND ck.snapshot_id = :s AND ck.key = chg.k COLLATE \"C\"), 0) AS before FROM chg), "
    "up AS (INSERT INTO snapshot_cut_keys (run_id, snapshot_id, key, refs) SELECT :r, :s, k, n FROM prev WHERE before = 0 AND n > 0 ORDER BY k), "
    "upd AS (UPDATE snapshot_cut_keys ck SET refs = p.before + p.n FROM prev p WHERE ck.run_id = :r AND ck.snapshot_id = :s "
    " AND ck.key = ANY(ARRAY(SELECT k FROM prev WHERE before > 0 AND before + n > 0)) AND ck.key = p.k), "
    "gone AS (DELETE FROM snapshot_cut_keys ck WHERE ck.run_id = :r AND ck.snapshot_id = :s "
    " AND ck.key = ANY(ARRAY(SELECT k FROM prev WHERE before > 0 AND before + n <= 0))), "
    # Every statement part reads the key rows as they were before it: the pre-cut's.
    "added AS (SELECT COALESCE(array_agg(a.k ORDER BY a.k), '{}') AS ks FROM (SELECT k FROM prev WHERE before <= 0 AND before + n > 0 "
    f" UNION SELECT k FROM ({sk.MANIFEST_NEW_KEYS}) mn) a), "
    "removed AS (SELECT COALESCE(array_agg(d.k ORDER BY d.k), '{}') AS ks FROM prev d "
    f" WHERE d.before > 0 AND d.before + d.n <= 0 AND NOT EXISTS (SELECT 1 FROM ({sk.MANIFEST_KEYS}) man WHERE man.k COLLATE \"C\" = d.k)), "
    "tot AS (SELECT CAST(:g AS bigint) AS g, CAST(:n AS bigint) AS n), "
    "done AS (UPDATE snapshots SET cut_at = now(), cut_xmin = :cx, cut_system_id = :cs, "
    " cut_keys_added = (SELECT ks FROM added), cut_keys_removed = (SELECT ks FROM removed), "
    " counts = COALESCE(counts, '{}'::jsonb) || jsonb_build_object('cut_groups', (SELECT g FROM tot), "
    " 'cut_siblings', (SELECT n FROM tot)) || CAST(:extra AS jsonb) "
    f"WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS_NONE}, cut_keys_added, cut_keys_removed) "
    "SELECT done.*, pg_notify(:ch, :np) AS notified FROM done"
)
_TOT_COUNTED = (
    "(SELECT count(*) AS g, COALESCE(sum(cardinality(siblings)), 0) AS n FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = :s)"
)
# The snapshot row at a whole-run barrier: cut, and its counts.
_FINISH_CUT_SQL = (
    f"WITH tot AS {_TOT_COUNTED}, "
    "done AS (UPDATE snapshots SET cut_at = now(), cut_xmin = :cx, cut_system_id = :cs, cut_keys_added = NULL, cut_keys_removed = NULL, "
    " counts = COALESCE(counts, '{}'::jsonb) || jsonb_build_object('cut_groups', (SELECT g FROM tot), "
    " 'cut_siblings', (SELECT n FROM tot)) || CAST(:extra AS jsonb) "
    f"WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS_NONE}, cut_keys_added, cut_keys_removed) "
    "SELECT done.*, pg_notify(:ch, :np) AS notified FROM done"
)


@dataclass(frozen=True)
class PreCut:
    """What a pre-cut copied: its groups, and its keys, with which the owner finds each Gym
    entry's ``new_keys`` (:func:`new_keys`) without a lookup in the database; ``keys_json``, the
    same keys as :func:`cut_keys` answers them (a JSON array sorted by code point), which the
    owner hands to the trainer's fetch. ``key_rows``: the writing of its key rows, when the
    caller asked not to wait for it (how many were written)."""

    groups: int
    keys: frozenset[str]
    keys_json: str
    key_rows: asyncio.Future[int] | None = field(default=None, compare=False)


class _PreCutVoid(Exception):
    """No pre-cut for this snapshot (it moved on, or already has one): roll back what the
    pre-cut's transaction wrote, its copy and its emptying of the changed-groups record."""


async def pre_cut(
    engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence, *, tracked_from: int | None = None, defer_key_rows: bool = False
) -> PreCut | None:
    """Copy the run's live groups into the snapshot's cut ahead of the barrier (the runner starts
    this once the gate is closed, beside Gym's prepare and commit), so that the barrier copies only
    the groups written since. Records the copy's base (``cut_base_xid``) in the same transaction.
    Returns what it copied (:class:`PreCut`), or None when the snapshot is past the point where
    a pre-cut helps (ended, cut, already pre-cut): then nothing is written.

    No lock on the run or the snapshot row is held during the copy (the runner's phase updates
    must not wait for it); the closing conditional update decides, and a snapshot that ended
    meanwhile rolls the copy back (``end`` deletes the cut rows of every snapshot it does not
    publish, after waiting for this update's row lock). That update is fenced like a phase move:
    a copy by an owner that lost the run's lease rolls back.

    Its key rows (``snapshot_cut_keys``, against which the barrier counts the keys of the groups
    it copies again) are written by a transaction of their own once it committed, opened before
    it: about a third of the pre-cut's time, which would otherwise keep Gym parked when the
    pre-cut outlasts Gym's commit. A barrier that needs them (groups to copy again, or a Gym
    entry stored without its ``new_keys``) waits for that transaction, and copies the whole run
    when they never came; the cut's keys are read from its rows until they are in (``staging_keys.KEYS``).
    ``defer_key_rows``: return once the pre-cut committed, with their writing still going
    on (``PreCut.key_rows``, which the caller must await or cancel); otherwise they are in on return.

    ``tracked_from`` is ``tracking_horizon`` read once the snapshot's tracking phase was
    committed (the runner starts the pre-cut right then; by default it is read now)."""
    if not await _writers_see_the_tracking(engine, tracked_from):
        return None
    key_rows = await sk.KeyRowsWriter.open(engine, run_id, snapshot_id)
    try:
        taken = await _pre_cut(engine, run_id, snapshot_id, fence)
    except BaseException as e:
        await key_rows.discard()
        if isinstance(e, _PreCutVoid):
            return None
        raise
    writing = key_rows.start()
    if not defer_key_rows:
        await writing
        return taken
    return replace(taken, key_rows=writing)


async def _pre_cut(engine: AsyncEngine, run_id: str, snapshot_id: str, fence: Fence) -> PreCut:
    p = {"r": run_id, "s": snapshot_id}
    # Few round trips: this copy runs beside Gym's commit, and when it outlasts the commit the
    # move to data_plane (Gym parked) waits for it.
    async with engine.begin() as conn:
        # Not flushed at its commit (``synchronous_commit``): the flushed commits after it (the
        # move to data_plane, which waits for this copy, and the barrier) come later in the log
        # and flush it too. A crash that loses it leaves no ``cut_base_xid``: the barrier then
        # copies the whole run and answers the whole key list, also to a trainer that fetched
        # these keys and asked for the delta. The base is this statement's xmin, taken before
        # the copy's own statement snapshot: anything the copy saw that this base does not is
        # counted as changed at the barrier, never the other way round.
        # The recorded groups are emptied here, before the copy's statement: what was recorded
        # before the copy's snapshot is in the copy; what is written after it stays recorded (the
        # snapshot is in a tracking phase) and is copied again at the barrier. A writer still
        # open on a record holds this statement back until it commits, so that the copy sees
        # its write (in the copy's own statement, the copy's snapshot would be older than it).
        st = (
            await conn.execute(
                text(
                    "WITH d AS (DELETE FROM snapshot_changed_groups WHERE run_id = :r) "
                    f"SELECT outcome, phase, cut_at, cut_base_xid, {CURRENT_XMIN_SQL} AS base, set_config('synchronous_commit', 'off', true), "
                    f"{_CUT_SETTINGS} FROM snapshots WHERE run_id = :r AND snapshot_id = :s"
                ),
                p,
            )
        ).first()
        if st is None or st.outcome is not None or st.cut_at is not None or st.cut_base_xid is not None or st.phase == P.data_plane:
            raise _PreCutVoid()  # rolls the emptying of the record back
        # Its size comes back with the copy, so that the barrier's counts need no pass over it.
        copied = (
            await conn.execute(
                text(f"WITH ins AS ({_cut_insert(only_named_groups=False)} RETURNING cardinality(siblings) AS n) "
                     "SELECT count(*) AS groups, COALESCE(sum(ins.n), 0) AS siblings FROM ins"),
                p,
            )
        ).one()
        n, sibs = int(copied.groups), int(copied.siblings)
        # Its keys, for the owner (``PreCut``); their rows come after the commit.
        inserted = (await conn.execute(text(sk.PRE_CUT_KEYS_SQL), p)).one()
        keys = int(inserted.n)
        done = (
            await conn.execute(
                text(
                    "UPDATE snapshots SET cut_base_xid = :b, counts = COALESCE(counts, '{}'::jsonb) || jsonb_build_object('cut_pre_cut_groups', CAST(:n AS bigint), "
                    "'cut_pre_cut_siblings', CAST(:sib AS bigint), 'cut_pre_cut_keys', CAST(:keys AS bigint)) "
                    "WHERE run_id = :r AND snapshot_id = :s AND outcome IS NULL "
                    f"AND cut_at IS NULL AND cut_base_xid IS NULL AND phase <> :dp AND owner = :fence_owner AND {fence_sql()} "
                    # A waiting trainer fetches the pre-cut's keys.
                    "RETURNING pg_notify(:ch, :np)"
                ),
                {**p, "b": st.base, "n": n, "sib": sibs, "keys": keys, "dp": P.data_plane.value, **fence.params(), **_notice(run_id, snapshot_id, progress=True)},
            )
        ).all()
        if len(done) != 1:
            raise _PreCutVoid()
    return PreCut(n, frozenset(json.loads(inserted.keys)), inserted.keys)


# How long the pre-cut waits for the transactions that were writing when the snapshot entered a
# tracking phase; past it no pre-cut is taken (the barrier copies the whole run).
PRE_CUT_WAIT_S = 2.0


async def tracking_horizon(engine: AsyncEngine) -> int:
    """The next transaction id: read after a snapshot's tracking phase was committed, every
    transaction below it may have written without seeing that phase."""
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT {NEXT_XID_SQL}"))).scalar())


async def _writers_see_the_tracking(engine: AsyncEngine, horizon: int | None) -> bool:
    """Wait until every transaction below ``horizon`` has ended: a statement of one of them may
    have written without seeing the tracking phase (and recorded nothing). Every later statement
    records its groups."""
    async with engine.connect() as conn:
        if horizon is None:
            horizon = (await conn.execute(text(f"SELECT {NEXT_XID_SQL}"))).scalar()
        deadline = time.monotonic() + PRE_CUT_WAIT_S
        while (await conn.execute(text(f"SELECT {CURRENT_XMIN_SQL}"))).scalar() < horizon:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
    return True


async def insert_cut_rows(conn: AsyncConnection, run_id: str, snapshot_id: str, groups_sql: str, attempts_sql: str, params: dict[str, Any]) -> int:
    """Write a cut from two row sources, in the caller's transaction: ``groups_sql`` yields the
    columns of the ``snapshot_groups`` view after run_id and snapshot_id (``group_id``,
    ``prompt_ref``, ...), ``attempts_sql`` those of ``snapshot_attempts`` (``attempt_id``,
    ``group_id``, ``generation_index``, ...; any extra columns are ignored). Both are SQL with
    ``:name`` parameters from ``params``; ``:r`` and ``:s`` are the run and the snapshot. The
    cut tables are views: this is the way to write one outside the cut itself (the import
    writer, benchmarks, tests). Returns the number of groups written."""
    return (
        await conn.execute(
            text(
                f"INSERT INTO snapshot_cut_groups (run_id, snapshot_id, {_GROUP_COLS}, siblings) "
                f"SELECT :r, :s, {', '.join('g.' + c for c in SNAPSHOT_GROUP_COLUMNS)}, COALESCE(x.siblings, '{{}}') "
                f"FROM ({groups_sql}) AS g LEFT JOIN (SELECT a.group_id, array_agg({_sibling()}) AS siblings FROM ({attempts_sql}) AS a "
                "GROUP BY a.group_id) AS x ON x.group_id = g.group_id"
            ),
            {**params, "r": run_id, "s": snapshot_id},
        )
    ).rowcount


async def request_abort(engine: AsyncEngine, run_id: str, snapshot_id: str, reason: str, detail: str | None) -> SnapshotRow:
    """The trainer gives up on a snapshot (its capture failed, or it cancels): the runner resumes
    Gym and ends it. Refused once the capture was reported: the snapshot is then as good as published."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        snap = await get(conn, run_id, snapshot_id, for_update=True, columns=_COLS_NONE)
        if snap.outcome is not None:
            return snap
        if snap.data_plane_ref is not None:
            raise SnapshotNotAwaiting(f"snapshot {snapshot_id!r} already has its capture; it will publish", phase=snap.phase)
        d = dict(snap.detail or {})
        if detail:
            d["abort_detail"] = detail[:4096]
        r = (
            await conn.execute(
                text(f"UPDATE snapshots SET abort_requested = COALESCE(abort_requested, :a), detail = CAST(:d AS jsonb) WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS}"),
                {"r": run_id, "s": snapshot_id, "a": reason, "d": _j(d)},
            )
        ).one()
        await _notify(conn, run_id, [snapshot_id])
        return SnapshotRow(**dict(r._mapping))


# The capture of a snapshot that awaits it, in one statement (the run's row read-locked first, as
# every writer of the run does); it matches nothing in every other case, which the transaction
# of ``captured`` then answers.
_CAPTURED_SQL = (
    "WITH run AS (SELECT 1 FROM runs WHERE run_id = :r AND state = 'open' FOR SHARE), "
    "u AS (UPDATE snapshots SET data_plane_ref = CAST(:ref AS jsonb) WHERE run_id = :r AND snapshot_id = :s "
    f"AND data_plane_ref IS NULL AND outcome IS NULL AND cut_at IS NOT NULL AND EXISTS (SELECT 1 FROM run) RETURNING {_COLS}) "
    "SELECT u.*, pg_notify(:ch, :np) AS notified FROM u"
)


async def captured(engine: AsyncEngine, run_id: str, snapshot_id: str, reference: dict[str, Any]) -> SnapshotRow:
    """The trainer saved its data plane. The usual case is one round trip while Gym is parked;
    a repeat, a conflict or a snapshot not awaiting it is answered by the full check."""
    params = {"r": run_id, "s": snapshot_id, "ref": _j(reference), **_notice(run_id, snapshot_id)}
    async with one_statement(engine) as conn:
        r = (await conn.execute(text(_CAPTURED_SQL), params)).first()
    if r is not None:
        return _notified_row(r)
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        # Neither the staging keys nor the manifest: the answer, once captured, shows neither.
        snap = await get(conn, run_id, snapshot_id, for_update=True, columns=_COLS_NONE)
        if snap.data_plane_ref is not None:
            if snap.data_plane_ref != reference:
                raise Conflict("a different data-plane reference was already reported", code="capture_conflict")
            return snap
        if snap.outcome is not None or snap.cut_at is None:
            raise SnapshotNotAwaiting(
                f"snapshot {snapshot_id!r} is not awaiting a capture (phase {snap.phase}, outcome {snap.outcome})",
                phase=snap.phase, outcome=snap.outcome, reason=snap.reason,
            )
        r = (
            await conn.execute(
                text(f"UPDATE snapshots SET data_plane_ref = CAST(:ref AS jsonb) WHERE run_id = :r AND snapshot_id = :s RETURNING {_COLS}"),
                {"r": run_id, "s": snapshot_id, "ref": _j(reference)},
            )
        ).one()
        await _notify(conn, run_id, [snapshot_id])
        return SnapshotRow(**dict(r._mapping))


class Streaks(NamedTuple):
    """A run's snapshots in a row since its last published one: lost to a train step, failed."""

    losses: int
    failures: int


async def end(
    engine: AsyncEngine,
    run_id: str,
    snapshot_id: str,
    outcome: SnapshotOutcome | str,
    reason: SnapshotReason | str,
    *,
    fence: Fence,
    expected: SnapshotPhase,
    detail: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    gym_parked_seconds: float | None = None,
    gym_restarted_episodes: int | None = None,
    resume_failure: dict[str, Any] | None = None,
    keep_latest_k: int = 2,
    keep_gate: bool = False,
    keep_gym_manifest: bool | None = None,
) -> tuple[SnapshotRow, Streaks]:
    """End a snapshot (published, failed or aborted) in one transaction with its bookkeeping:
    reopen the gate if still held, count consecutive losses and failures, apply retention on
    publish. Fenced like every phase move (from ``expected``). Returns (row, the run's streaks
    after this).
    ``keep_gym_manifest``: join its Gym entries into ``gym_manifest`` (the snapshot reached
    ``data_plane``, so every instance's entry is in); by default only when it publishes."""
    outcome, reason = SnapshotOutcome(outcome), SnapshotReason(reason)
    if keep_gym_manifest is None:
        keep_gym_manifest = outcome is SnapshotOutcome.published
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True, allow_closed=True)
        phase = SnapshotPhase(outcome.value)
        r = (
            await conn.execute(
                text(
                    "UPDATE snapshots SET phase = :ph, outcome = :o, reason = :rs, "
                    # What was recorded before (the trainer's abort detail) stays beside the end's.
                    "detail = CASE WHEN CAST(:d AS jsonb) IS NULL THEN detail ELSE COALESCE(detail, '{}'::jsonb) || CAST(:d AS jsonb) END, "
                    "phase_timings = COALESCE(CAST(:t AS jsonb), phase_timings), gym_parked_seconds = COALESCE(:gp, gym_parked_seconds), "
                    "gym_restarted_episodes = COALESCE(:gr, gym_restarted_episodes), resume_failure = COALESCE(CAST(:rf AS jsonb), resume_failure), "
                    "ended_at = now(), published_at = CASE WHEN :published THEN now() ELSE NULL END, "
                    # The cut's keys, rows while it was pending (after Gym was resumed: off the park).
                    f"cut_staging_keys = CASE WHEN :published THEN {sk.KEYS} ELSE cut_staging_keys END, "
                    # Its Gym manifest, entries while it was pending (joined after Gym was resumed),
                    # kept when complete (``keep_gym_manifest``).
                    f"gym_manifest = CASE WHEN :keep_manifest THEN COALESCE(gym_manifest, {_ENTRIES_MANIFEST}) ELSE gym_manifest END "
                    f"WHERE {_FENCED_MOVE} RETURNING {_COLS}"
                ),
                {
                    "r": run_id, "s": snapshot_id, "ph": phase.value, "o": outcome.value, "rs": reason.value, "d": _j(detail), "t": _j(timings),
                    "gp": gym_parked_seconds, "gr": gym_restarted_episodes, "rf": _j(resume_failure),
                    "published": outcome is SnapshotOutcome.published, "expected": expected.value, "keep_manifest": keep_gym_manifest,
                    **fence.params(),
                },
            )
        ).first()
        if r is None:
            raise Fenced(run_id, f"snapshot {snapshot_id}: {expected} -> {outcome}/{reason}", fence)
        await _notify(conn, run_id, [snapshot_id])  # its waiting trainers, and an owner elsewhere
        if not (keep_gate and outcome is SnapshotOutcome.published):
            await _open_gate_of_run(conn, run_id, snapshot_id)
        if outcome is SnapshotOutcome.published:
            losses_sql = failures_sql = "0"
        else:
            losses_sql = "consecutive_snapshot_losses + 1" if reason is SnapshotReason.train_step_committed else "consecutive_snapshot_losses"
            failures_sql = "consecutive_snapshot_failures + 1" if outcome is SnapshotOutcome.failed else "consecutive_snapshot_failures"
        streaks = (
            await conn.execute(
                text(
                    f"UPDATE runs SET consecutive_snapshot_losses = {losses_sql}, consecutive_snapshot_failures = {failures_sql} "
                    "WHERE run_id = :r RETURNING consecutive_snapshot_losses, consecutive_snapshot_failures"
                ),
                {"r": run_id},
            )
        ).one()
        # The pre-cut's key rows may still be being written: their writer ends first, or rows it
        # wrote after this delete would stay behind (bounded: it normally ends within a second).
        await sk.key_rows_in(conn, run_id, snapshot_id, None, wait_s=sk.END_KEY_ROWS_WAIT_S)
        if outcome is SnapshotOutcome.published:
            gone = (
                await conn.execute(
                    text(
                        "DELETE FROM snapshots WHERE run_id = :r AND outcome = :pub AND snapshot_id NOT IN ("
                        " SELECT snapshot_id FROM snapshots WHERE run_id = :r AND outcome = :pub ORDER BY published_at DESC, snapshot_id DESC LIMIT :k) "
                        "RETURNING snapshot_id"
                    ),
                    {"r": run_id, "k": keep_latest_k, "pub": SnapshotOutcome.published.value},
                )
            ).scalars().all()
            # The cut tables have no foreign key to snapshots (it slowed the cut): their rows go here.
            await delete_cut_rows(conn, run_id, list(gone))
        else:
            # Only a published snapshot is ever restored from or exported: the cut (or pre-cut) of a
            # failed or aborted one (a data-plane failure after the barrier, a lost resume, a train
            # step during commit) would otherwise stay forever, a copy of every live row per loss.
            # The snapshot row stays, for history.
            await delete_cut_rows(conn, run_id, [snapshot_id])
        await conn.execute(text("DELETE FROM snapshot_changed_groups WHERE run_id = :r"), {"r": run_id})
        await conn.execute(text("DELETE FROM snapshot_gym_entries WHERE run_id = :r AND snapshot_id = :s"), {"r": run_id, "s": snapshot_id})
        # The one place key rows go. They are read only for the run's one pending snapshot, this
        # one: those a writer committed after an earlier end stopped waiting for it go too.
        await conn.execute(text("DELETE FROM snapshot_cut_keys WHERE run_id = :r"), {"r": run_id})
        return SnapshotRow(**dict(r._mapping)), Streaks(int(streaks[0]), int(streaks[1]))


async def delete_cut_rows(conn: AsyncConnection, run_id: str, snapshot_ids: list[str]) -> None:
    """Delete the cut of these snapshots, in the caller's transaction (the one deleting the rows).
    Their key rows go at the snapshot's end (:func:`end`, for the whole run)."""
    if snapshot_ids:
        await conn.execute(text("DELETE FROM snapshot_cut_groups WHERE run_id = :r AND snapshot_id = ANY(:ids)"), {"r": run_id, "ids": snapshot_ids})


async def announce_train_step(engine: AsyncEngine, run_id: str, step: int, checkpoint_ref: str | None) -> tuple[dict[str, Any], list[str]]:
    """Create-or-return the train step; abort every snapshot of the run that is older and not cut
    yet (train step wins). Returns the step and the snapshot ids asked to abort."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        r = (
            await conn.execute(
                text(
                    "INSERT INTO train_steps (run_id, step, checkpoint_ref) VALUES (:r, :s, :c) "
                    "ON CONFLICT (run_id, step) WHERE retired_at IS NULL DO NOTHING RETURNING step, checkpoint_ref, announced_at"
                ),
                {"r": run_id, "s": step, "c": checkpoint_ref},
            )
        ).first()
        created = r is not None
        if r is None:
            r = (
                await conn.execute(
                    text("SELECT step, checkpoint_ref, announced_at FROM train_steps WHERE run_id = :r AND step = :s AND retired_at IS NULL"),
                    {"r": run_id, "s": step},
                )
            ).one()
            if r.checkpoint_ref != checkpoint_ref and checkpoint_ref is not None:
                raise Conflict(f"train step {step} was announced with another checkpoint reference", code="train_step_conflict")
        aborted = (
            await conn.execute(
                text(
                    "UPDATE snapshots SET abort_requested = :why WHERE run_id = :r AND outcome IS NULL AND cut_at IS NULL "
                    "AND anchor_step < :s AND abort_requested IS NULL AND NOT stop RETURNING snapshot_id"
                ),
                {"r": run_id, "s": step, "why": SnapshotReason.train_step_committed.value},
            )
        ).scalars().all()
        await _notify(conn, run_id, list(aborted))
        return {"step": r.step, "checkpoint_ref": r.checkpoint_ref, "announced_at": r.announced_at.isoformat(), "created": created}, list(aborted)


async def list_train_steps(engine: AsyncEngine, run_id: str, *, include_retired: bool) -> list[dict[str, Any]]:
    """The run's train-step announces, oldest first; retired ones (a restore discarded their
    lineage) name the restore that retired them."""
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        rows = (
            await conn.execute(
                text(
                    "SELECT step, checkpoint_ref, announced_at, retired_at, retired_by_restore FROM train_steps WHERE run_id = :r "
                    + ("" if include_retired else "AND retired_at IS NULL ")
                    + "ORDER BY announce_id"
                ),
                {"r": run_id},
            )
        ).all()
    return [
        {
            "step": r.step,
            "checkpoint_ref": r.checkpoint_ref,
            "announced_at": r.announced_at.isoformat(),
            "retired_at": r.retired_at.isoformat() if r.retired_at else None,
            "retired_by_restore": r.retired_by_restore,
        }
        for r in rows
    ]


async def list_snapshots(engine: AsyncEngine, run_id: str, *, limit: int, before: str | None) -> list[SnapshotRow]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        if before is not None:
            await get(conn, run_id, before, columns=_COLS_NONE)  # an unknown cursor is a 404, not an empty page
        rows = (
            await conn.execute(
                text(
                    f"SELECT {_COLS} FROM snapshots WHERE run_id = :r "
                    # The key of the order: snapshots created in the same instant are not skipped.
                    + ("AND (created_at, snapshot_id) < (SELECT created_at, snapshot_id FROM snapshots WHERE run_id = :r AND snapshot_id = :b) " if before else "")
                    + "ORDER BY created_at DESC, snapshot_id DESC LIMIT :l"
                ),
                {"r": run_id, "b": before, "l": limit},
            )
        ).all()
    return [SnapshotRow(**dict(r._mapping)) for r in rows]


async def unfinished(engine: AsyncEngine) -> list[tuple[str, str, str, str | None, str, str | None]]:
    """(run_id, snapshot_id, owner, gym_checkpoint_id, phase, abort_requested) of every
    non-terminal snapshot."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT run_id, snapshot_id, owner, gym_checkpoint_id, phase, abort_requested FROM snapshots WHERE outcome IS NULL")
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]
