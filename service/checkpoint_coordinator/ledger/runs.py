"""Runs: creation, lookup, token checks, closing, and the epoch read-lock every write takes."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..errors import Conflict, NotFound, RunClosed
from .db import dump_json

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
    gate_snapshot_id: str | None
    created_at: datetime
    closed_at: datetime | None

    def public(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "state": self.state,
            "checkpoint_root": self.checkpoint_root,
            "recovery": self.config,
            "epoch": self.epoch,
            "restored_from_rollout_snapshot": self.restored_from_rollout_snapshot,
            "consecutive_snapshot_losses": self.consecutive_snapshot_losses,
            "dispatch_gate": {"open": self.gate_snapshot_id is None, "snapshot_id": self.gate_snapshot_id},
            "created_at": self.created_at.isoformat(),
            "closed_at": self.closed_at.isoformat() if self.closed_at else None,
        }


_RUN_COLS = (
    "run_id, config, checkpoint_root, state, epoch, restored_from_rollout_snapshot, "
    "consecutive_snapshot_losses, gate_snapshot_id, created_at, closed_at"
)


def _row(r: Any) -> RunRow:
    return RunRow(**dict(r._mapping))


async def create_run(engine: AsyncEngine, run_id: str, checkpoint_root: str, config: dict[str, Any]) -> tuple[RunRow, str]:
    token = new_run_token()
    try:
        async with engine.begin() as conn:
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
    return token


async def get_run(conn: AsyncConnection, run_id: str) -> RunRow:
    r = (await conn.execute(text(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = :r"), {"r": run_id})).first()
    if r is None:
        raise NotFound(f"run {run_id!r} not found", code="run_not_found")
    return _row(r)


async def token_hash_of(engine: AsyncEngine, run_id: str) -> str | None:
    async with engine.connect() as conn:
        return (await conn.execute(text("SELECT token_hash FROM runs WHERE run_id = :r"), {"r": run_id})).scalar()


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
        if run.state == "closed":
            return run
        r = (
            await conn.execute(
                text(
                    f"UPDATE runs SET state = 'closed', closed_at = now(), gate_snapshot_id = NULL "
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
    """Read-lock the run row for the rest of the transaction (section 2 fencing).

    ``FOR SHARE`` lets writers of the same run proceed together while anything that bumps the
    epoch (a restore) waits for them, and they for it.
    """
    mode = "FOR UPDATE" if for_update else "FOR SHARE"
    r = (await conn.execute(text(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = :r {mode}"), {"r": run_id})).first()
    if r is None:
        raise NotFound(f"run {run_id!r} not found", code="run_not_found")
    run = _row(r)
    if run.state != "open" and not allow_closed:
        raise RunClosed(f"run {run_id!r} is closed")
    if expect_epoch is not None and run.epoch != expect_epoch:
        from ..errors import Fenced

        raise Fenced(f"run {run_id!r} moved to epoch {run.epoch} (request was for {expect_epoch})", epoch=run.epoch)
    return run
