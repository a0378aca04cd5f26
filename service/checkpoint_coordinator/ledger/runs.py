"""Runs: creation, lookup, token checks, closing, the epoch read-lock every write takes, and the
run's dispatch gate (closed by a snapshot, checked by every dispatch)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import weakref
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain.snapshot_state import SnapshotOutcome
from ..domain.vocabulary import RunState
from ..errors import Conflict, GateClosed, NotFound, RunClosed, RunStopped
from .db import dump_json, read_rows
from .models import Run

TOKEN_PREFIX = "ckptc_run_"


def new_run_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    # Run tokens are 256-bit random strings, so a fast hash is enough: nobody can brute-force them.
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_token(token), stored_hash)


@dataclass(frozen=True)
class RunRow:
    run_id: str
    config: dict[str, Any]
    checkpoint_root: str
    state: str
    epoch: int
    restored_from_rollout_snapshot: str | None
    consecutive_snapshot_losses: int
    consecutive_snapshot_failures: int
    gate_snapshot_id: str | None
    created_at: datetime
    closed_at: datetime | None


_RUN_COLS = (
    "run_id, config, checkpoint_root, state, epoch, restored_from_rollout_snapshot, "
    "consecutive_snapshot_losses, consecutive_snapshot_failures, gate_snapshot_id, created_at, closed_at"
)


def _row(r: Any) -> RunRow:
    return RunRow(**dict(r._mapping))


async def create_run(
    engine: AsyncEngine, run_id: str, checkpoint_root: str, config: dict[str, Any], *, max_open_runs: int | None = None
) -> tuple[RunRow, str]:
    """``max_open_runs``: refused ``run_quota`` when that many runs are open already."""
    token = new_run_token()
    try:
        async with engine.begin() as conn:
            if max_open_runs is not None:
                # One creation at a time while counting: two could otherwise both see room for one.
                await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('ckptc:create_run'))"))
                open_runs = (await conn.execute(text(f"SELECT count(*) FROM runs WHERE state = '{RunState.open}'"))).scalar() or 0
                if open_runs >= max_open_runs:
                    raise Conflict(
                        f"{open_runs} runs are open; the coordinator keeps at most {max_open_runs} (CKPTC_MAX_OPEN_RUNS): "
                        "close finished runs (POST /v1/runs/{run}/close) first",
                        code="run_quota", open_runs=open_runs, quota=max_open_runs,
                    )
            r = (
                await conn.execute(
                    text(
                        f"INSERT INTO runs (run_id, config, checkpoint_root, token_hash) "
                        f"VALUES (:run_id, CAST(:config AS jsonb), :root, :th) RETURNING {_RUN_COLS}"
                    ),
                    {"run_id": run_id, "config": dump_json(config), "root": checkpoint_root, "th": hash_token(token)},
                )
            ).one()
    except IntegrityError as e:
        raise Conflict(f"run {run_id!r} already exists; its token was returned when it was created", code="run_exists") from e
    return _row(r), token


async def rotate_token(engine: AsyncEngine, run_id: str) -> str:
    """A new run token (the old one stops working); for a trainer that lost the one it was given."""
    token = new_run_token()
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True, allow_closed=True)
        await conn.execute(text("UPDATE runs SET token_hash = :h WHERE run_id = :r"), {"r": run_id, "h": hash_token(token)})
    _token_cache(engine).forget(run_id)
    return token


async def get_run(conn: AsyncConnection, run_id: str) -> RunRow:
    r = (await conn.execute(text(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = :r"), {"r": run_id})).first()
    if r is None:
        raise NotFound(f"run {run_id!r} not found", code="run_not_found")
    return _row(r)


async def token_hash_of(engine: AsyncEngine, run_id: str) -> str | None:
    rows = await read_rows(engine, "SELECT token_hash FROM runs WHERE run_id = %(r)s", {"r": run_id})
    return rows[0][0] if rows else None


@dataclass
class _TokenHashCache:
    """Stored token hashes (never tokens) of runs whose token was accepted lately, so that a
    trainer's stream of batch calls does not read the run row once more per request for its
    authorisation. Only an acceptance is served from here: a token that does not match the cached
    hash is checked against the database again, so a refusal always reflects the stored hash, and
    an unknown run, a wrong token and a stale entry cost the same database read."""

    entries: dict[str, tuple[str, float]] = field(default_factory=dict)
    # When each run's token was last rotated through this process: a read that started before
    # that must not cache the hash it saw.
    rotated: dict[str, float] = field(default_factory=dict)

    MAX_ENTRIES = 10_000

    def forget(self, run_id: str) -> None:
        self.entries.pop(run_id, None)
        self.rotated[run_id] = time.monotonic()

    def remember(self, run_id: str, stored_hash: str, read_started: float, ttl_s: float) -> None:
        if self.rotated.get(run_id, float("-inf")) >= read_started:
            return
        now = time.monotonic()
        if len(self.entries) >= self.MAX_ENTRIES:
            self.entries = {k: v for k, v in self.entries.items() if v[1] > now}
            if len(self.entries) >= self.MAX_ENTRIES:
                self.entries.clear()
        self.entries[run_id] = (stored_hash, now + ttl_s)


_TOKEN_CACHES: weakref.WeakKeyDictionary[Any, _TokenHashCache] = weakref.WeakKeyDictionary()


def _token_cache(engine: AsyncEngine) -> _TokenHashCache:
    key = engine.sync_engine
    cache = _TOKEN_CACHES.get(key)
    if cache is None:
        cache = _TOKEN_CACHES[key] = _TokenHashCache()
    return cache


async def run_token_valid(engine: AsyncEngine, run_id: str, token: str, *, cache_s: float = 0.0) -> bool:
    """Whether ``token`` is the run's token, compared by hash in constant time. With ``cache_s``
    > 0 an accepted run's hash is kept that long: rotating the token through this process drops
    it at once; a rotation through another replica is seen here within ``cache_s``."""
    cache = _token_cache(engine)
    hit = cache.entries.get(run_id)
    if hit is not None and hit[1] > time.monotonic() and token_matches(token, hit[0]):
        return True
    started = time.monotonic()
    stored = await token_hash_of(engine, run_id)
    # Hash the token even when the run is unknown so both paths cost the same.
    ok = token_matches(token, stored or "0" * 64) and stored is not None
    if ok and cache_s > 0:
        cache.remember(run_id, stored, started, cache_s)  # type: ignore[arg-type]
    elif not ok:
        cache.entries.pop(run_id, None)
    return ok


async def list_runs(engine: AsyncEngine, *, limit: int, after: str | None, state: str | None) -> list[RunRow]:
    clauses, params = [], {"limit": limit}
    if after:
        clauses.append("run_id > :after")
        params["after"] = after
    if state:
        clauses.append("state = :state")
        params["state"] = state
    where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
    async with engine.connect() as conn:
        rows = (await conn.execute(text(f"SELECT {_RUN_COLS} FROM runs {where} ORDER BY run_id LIMIT :limit"), params)).all()
    return [_row(r) for r in rows]


async def close_run(engine: AsyncEngine, run_id: str) -> RunRow:
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id, for_update=True, allow_closed=True)
        if run.state == RunState.closed:
            return run
        r = (
            await conn.execute(
                text(
                    f"UPDATE runs SET state = '{RunState.closed}', closed_at = now(), gate_snapshot_id = NULL "
                    f"WHERE run_id = :r RETURNING {_RUN_COLS}"
                ),
                {"r": run_id},
            )
        ).one()
        return _row(r)


async def lock_run(
    conn: AsyncConnection,
    run_id: str,
    *,
    for_update: bool = False,
    allow_closed: bool = False,
    expect_epoch: int | None = None,
) -> RunRow:
    """Read-lock the run row for the rest of the transaction (fencing:
    docs/ledger.md#fencing-and-concurrency).

    ``FOR SHARE`` lets writers of the same run proceed together while anything that bumps the
    epoch (a restore) waits for them, and they for it.
    """
    mode = "FOR UPDATE" if for_update else "FOR SHARE"
    r = (await conn.execute(text(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = :r {mode}"), {"r": run_id})).first()
    if r is None:
        raise NotFound(f"run {run_id!r} not found", code="run_not_found")
    run = _row(r)
    if run.state != RunState.open and not allow_closed:
        raise RunClosed(f"run {run_id!r} is closed")
    if expect_epoch is not None and run.epoch != expect_epoch:
        from ..errors import FencedWrite

        raise FencedWrite(f"run {run_id!r} moved to epoch {run.epoch} (request was for {expect_epoch})", epoch=run.epoch)
    return run


async def stopped_by(conn: AsyncConnection, run_id: str, gate_snapshot_id: str | None) -> str | None:
    """The stopping snapshot that stopped the run (docs/ledger.md#stopping-snapshots): it published
    and still holds the dispatch gate, until a restore or a reopen."""
    if gate_snapshot_id is None:
        return None
    return (
        await conn.execute(
            text("SELECT snapshot_id FROM snapshots WHERE run_id = :r AND snapshot_id = :s AND stop AND outcome = :pub"),
            {"r": run_id, "s": gate_snapshot_id, "pub": SnapshotOutcome.published.value},
        )
    ).scalar()


# --------------------------------------------------------------------------- the dispatch gate

_R = Run.__table__


async def require_open(conn: AsyncConnection, run: RunRow, *, retry_after_s: float) -> None:
    """Refuse a dispatch while a snapshot holds the gate (read with the run's lock): for good once
    a stopping snapshot published (until a restore or a reopen), else until the snapshot ends."""
    if run.gate_snapshot_id is not None:
        stopped = await stopped_by(conn, run.run_id, run.gate_snapshot_id)
        if stopped is not None:
            raise RunStopped(f"run {run.run_id!r} was stopped by snapshot {stopped!r}; restore it or reopen it first", snapshot_id=stopped)
        raise GateClosed(
            f"dispatch gate closed by snapshot {run.gate_snapshot_id}; retry after it reopens",
            snapshot_id=run.gate_snapshot_id,
            retry_after_s=retry_after_s,
        )


# The gate's close (``:r`` the run, ``:s`` the snapshot): the update takes the run row's lock, so it
# waits for in-flight dispatch transactions (they hold it FOR SHARE); a row comes back only for an
# open run. A snapshot runs it as a CTE of the statement that moves it to phase ``gate``.
CLOSE_GATE_SQL = f"UPDATE runs SET gate_snapshot_id = :s WHERE run_id = :r AND state = '{RunState.open}' RETURNING 1"


async def close_gate(conn: AsyncConnection, run_id: str, snapshot_id: str) -> bool:
    """Close the gate by itself; False when the run is not open."""
    return (await conn.execute(text(CLOSE_GATE_SQL), {"r": run_id, "s": snapshot_id})).first() is not None


async def open_gate(conn: AsyncConnection, run_id: str, snapshot_id: str) -> None:
    """Reopen the gate if (and only if) this snapshot still holds it."""
    await conn.execute(update(_R).where(_R.c.run_id == run_id, _R.c.gate_snapshot_id == snapshot_id).values(gate_snapshot_id=None))
