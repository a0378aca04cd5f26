"""The Gym instances a run registered and the participants discovery found on them.

The control token of an instance is sent to Gym on every control call, so it is stored as it
is; nothing in this module ever returns it except :func:`instance_specs`, which feeds the Gym
control client and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain.vocabulary import OutboxState
from ..errors import Conflict, NotFound
from .runs import lock_run


@dataclass(frozen=True)
class ParticipantRecord:
    server_name: str
    base_url: str
    kind: str
    participant_name: str
    mode: str | None
    stage: int


@dataclass(frozen=True)
class InstanceRecord:
    instance_id: str
    control_token: str
    servers: dict[str, str]
    participants: tuple[ParticipantRecord, ...]


@dataclass(frozen=True)
class StoredSpec:
    """What the Gym client needs to reach one registered instance (token included)."""

    instance_id: str
    control_token: str
    servers: dict[str, str]


class SnapshotInProgress(Conflict):
    code = "snapshot_in_progress"
    title = "A snapshot of this run is in progress"


async def open_snapshot_id(conn: AsyncConnection, run_id: str) -> str | None:
    """The run's non-terminal snapshot, if any (at most one, by constraint)."""
    return (
        await conn.execute(
            text("SELECT snapshot_id FROM snapshots WHERE run_id = :r AND outcome IS NULL"), {"r": run_id}
        )
    ).scalar()


async def store_instances(engine: AsyncEngine, run_id: str, records: list[InstanceRecord], *, replaced: Sequence[str] = ()) -> int:
    """Register (or re-register) instances with what discovery found, in one transaction.

    Re-registering an instance replaces its servers, token and participants: a restarted Gym
    process may listen on other ports. Refused while a snapshot is open, since the snapshot
    works on the topology it started with. ``replaced``: re-registered instances whose new
    process is fresh; the retires and forgets still owed to the process it replaces are moot
    (what they would stop died with it) and are superseded, not delivered to the new one, which
    would then hold marks and refuse a restore (docs/ledger.md#the-outbox). Returns how many.
    """
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True)
        open_id = await open_snapshot_id(conn, run_id)
        if open_id is not None:
            raise SnapshotInProgress(
                f"snapshot {open_id} is in progress; register Gym instances once it has ended (a new trainer "
                f"incarnation taking over aborts it first: POST .../snapshots/{open_id}/abort, client.abort_snapshot)",
                snapshot_id=open_id,
            )
        ids = [r.instance_id for r in records]
        moot = 0
        if replaced:
            moot = (
                await conn.execute(
                    text(
                        f"UPDATE outbox_items SET state = '{OutboxState.superseded}' WHERE run_id = :r "
                        f"AND instance_id = ANY(:ids) AND state = '{OutboxState.pending}'"
                    ),
                    {"r": run_id, "ids": list(replaced)},
                )
            ).rowcount
        await conn.execute(
            text(
                "INSERT INTO gym_instances (run_id, instance_id, servers, control_token, discovered_at) "
                "SELECT :r, i, s::jsonb, t, now() FROM unnest(CAST(:i AS text[]), CAST(:s AS text[]), CAST(:t AS text[])) AS x(i, s, t) "
                "ON CONFLICT (run_id, instance_id) DO UPDATE SET servers = EXCLUDED.servers, "
                "control_token = EXCLUDED.control_token, discovered_at = EXCLUDED.discovered_at"
            ),
            {
                "r": run_id,
                "i": ids,
                "s": [json.dumps(r.servers, sort_keys=True) for r in records],
                "t": [r.control_token for r in records],
            },
        )
        await conn.execute(
            text("DELETE FROM gym_participants WHERE run_id = :r AND instance_id = ANY(:ids)"), {"r": run_id, "ids": ids}
        )
        parts = [(r.instance_id, p) for r in records for p in r.participants]
        if parts:
            await conn.execute(
                text(
                    "INSERT INTO gym_participants (run_id, instance_id, server_name, base_url, kind, participant_name, mode, stage) "
                    "SELECT :r, i, n, u, k, pn, m, st FROM unnest(CAST(:i AS text[]), CAST(:n AS text[]), CAST(:u AS text[]), "
                    "CAST(:k AS text[]), CAST(:pn AS text[]), CAST(:m AS text[]), CAST(:st AS int[])) AS x(i, n, u, k, pn, m, st)"
                ),
                {
                    "r": run_id,
                    "i": [i for i, _ in parts],
                    "n": [p.server_name for _, p in parts],
                    "u": [p.base_url for _, p in parts],
                    "k": [p.kind for _, p in parts],
                    "pn": [p.participant_name for _, p in parts],
                    "m": [p.mode for _, p in parts],
                    "st": [p.stage for _, p in parts],
                },
            )
    return int(moot)


async def delete_instance(engine: AsyncEngine, run_id: str, instance_id: str) -> None:
    async with engine.begin() as conn:
        await lock_run(conn, run_id, for_update=True)
        open_id = await open_snapshot_id(conn, run_id)
        if open_id is not None:
            raise SnapshotInProgress(
                f"snapshot {open_id} is in progress; change the Gym topology once it has ended", snapshot_id=open_id
            )
        gone = (
            await conn.execute(
                text("DELETE FROM gym_instances WHERE run_id = :r AND instance_id = :i RETURNING instance_id"),
                {"r": run_id, "i": instance_id},
            )
        ).scalar()
        if gone is None:
            raise NotFound(f"Gym instance {instance_id!r} is not registered for run {run_id!r}", code="gym_instance_not_found", instance_id=instance_id)


async def list_instances(conn: AsyncConnection, run_id: str) -> list[dict[str, Any]]:
    """Registered instances with their participants, tokens left out."""
    insts = (
        await conn.execute(
            text(
                "SELECT instance_id, servers, registered_at, discovered_at FROM gym_instances WHERE run_id = :r ORDER BY instance_id"
            ),
            {"r": run_id},
        )
    ).all()
    parts = await participants_by_instance(conn, run_id)
    out = []
    for i in insts:
        plist = parts.get(i.instance_id, [])
        names = {p.server_name for p in plist}
        out.append(
            {
                "instance_id": i.instance_id,
                "servers": dict(sorted(i.servers.items())),
                "participants": [participant_json(p) for p in plist],
                "non_participants": sorted(s for s in i.servers if s not in names),
                "registered_at": i.registered_at.isoformat(),
                "discovered_at": i.discovered_at.isoformat() if i.discovered_at else None,
            }
        )
    return out


def participant_json(p: ParticipantRecord) -> dict[str, Any]:
    return {
        "server_name": p.server_name,
        "base_url": p.base_url,
        "kind": p.kind,
        "participant_name": p.participant_name,
        "mode": p.mode,
        "stage": p.stage,
    }


async def participants_by_instance(conn: AsyncConnection, run_id: str) -> dict[str, list[ParticipantRecord]]:
    rows = (
        await conn.execute(
            text(
                "SELECT instance_id, server_name, base_url, kind, participant_name, mode, stage FROM gym_participants "
                "WHERE run_id = :r ORDER BY instance_id, stage, server_name"
            ),
            {"r": run_id},
        )
    ).all()
    out: dict[str, list[ParticipantRecord]] = {}
    for r in rows:
        out.setdefault(r.instance_id, []).append(
            ParticipantRecord(r.server_name, r.base_url, r.kind, r.participant_name, r.mode, r.stage)
        )
    return out


async def instance_specs(conn: AsyncConnection, run_id: str) -> list[StoredSpec]:
    """Registered instances with their control tokens, for the Gym control client only."""
    rows = (
        await conn.execute(
            text("SELECT instance_id, control_token, servers FROM gym_instances WHERE run_id = :r ORDER BY instance_id"),
            {"r": run_id},
        )
    ).all()
    return [StoredSpec(r.instance_id, r.control_token, dict(r.servers)) for r in rows]


async def issued_gym_ids(conn: AsyncConnection, run_id: str) -> frozenset[str]:
    """Gym checkpoint and restore ids this coordinator issued for the run, so the control
    client recognises its own orphans after a coordinator restart."""
    rows = (
        await conn.execute(
            text(
                "SELECT gym_checkpoint_id FROM snapshots WHERE run_id = :r AND gym_checkpoint_id IS NOT NULL "
                "UNION SELECT gym_restore_id FROM restores WHERE run_id = :r AND gym_restore_id IS NOT NULL"
            ),
            {"r": run_id},
        )
    ).scalars().all()
    return frozenset(rows)


async def registered_instance_ids(conn: AsyncConnection, run_id: str) -> list[str]:
    """The ids of the run's registered (live) Gym instances, sorted."""
    rows = await conn.execute(text("SELECT instance_id FROM gym_instances WHERE run_id = :r ORDER BY instance_id"), {"r": run_id})
    return list(rows.scalars())
