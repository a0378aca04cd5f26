"""Reading snapshots to restore from and their ledger cut (docs/ledger.md#restore)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from ...domain.cut import Cut, CutAttempt, CutGroup, PromptRef
from ...ledger.db import fetch
from ...ledger.models import Snapshot

# -------------------------------------------------------------------------------------------
# Snapshots


@dataclass(frozen=True)
class RestorableSnapshot:
    snapshot_id: str
    anchor_step: int
    outcome: str | None
    phase: str
    gym_manifest: dict[str, Any] | None
    gym_checkpoint_id: str | None
    snapshot_dir: str | None
    data_plane_ref: dict[str, Any] | None
    published_at: datetime | None
    detail: dict[str, Any] | None


_SN = Snapshot.__table__
_SNAP_COLS = tuple(_SN.c[f] for f in RestorableSnapshot.__dataclass_fields__)


def _snap(r: Any) -> RestorableSnapshot:
    return RestorableSnapshot(**dict(r._mapping))


async def get_snapshot(conn: AsyncConnection, run_id: str, snapshot_id: str) -> RestorableSnapshot | None:
    r = (await conn.execute(select(*_SNAP_COLS).where(_SN.c.run_id == run_id, _SN.c.snapshot_id == snapshot_id))).first()
    return _snap(r) if r is not None else None


async def newest_published(conn: AsyncConnection, run_id: str, max_step: int | None) -> RestorableSnapshot | None:
    """The newest published snapshot whose anchor step is at most ``max_step`` (any if None)."""
    q = select(*_SNAP_COLS).where(_SN.c.run_id == run_id, _SN.c.outcome == "published")
    if max_step is not None:
        q = q.where(_SN.c.anchor_step <= max_step)
    q = q.order_by(_SN.c.anchor_step.desc(), _SN.c.published_at.desc().nulls_last(), _SN.c.snapshot_id.desc()).limit(1)
    r = (await conn.execute(q)).first()
    return _snap(r) if r is not None else None


# -------------------------------------------------------------------------------------------
# The cut


_GROUP_SQL_FULL = (
    "SELECT group_id, restore_level, expected_generations, group_attempt, status, task_digest, prompt_ref, "
    "agent_name, task_source, target_step, weight_version, data_attempts_used "
    "FROM snapshot_groups WHERE run_id = %(r)s AND snapshot_id = %(s)s ORDER BY group_id"
)
# Ordered as the full read: a refusal locates a broken group by its index in this list, and
# without an order that index follows wherever the rows happen to lie in the table.
_GROUP_SQL_PLAN = (
    "SELECT group_id, restore_level, expected_generations, group_attempt, status "
    "FROM snapshot_groups WHERE run_id = %(r)s AND snapshot_id = %(s)s ORDER BY group_id"
)
# A plan reads only the first eight fields of an attempt: fetch those (in the primary key's order,
# no sort) and pad the rest in Python, which is cheaper than having the driver build them.
_ATT_SQL_PLAN = (
    "SELECT group_id, generation_index, attempt_id, rollout_id, gym_instance_id, gym_attempt, group_attempt, status "
    "FROM snapshot_attempts WHERE run_id = %(r)s AND snapshot_id = %(s)s ORDER BY attempt_id"
)
_ATT_PAD = ((), 0, None, False)
_ATT_SQL_FULL = (
    "SELECT group_id, generation_index, attempt_id, rollout_id, gym_instance_id, gym_attempt, group_attempt, status, "
    "COALESCE(staging_keys, '{}'::text[]), row_attempts_used, reward, COALESCE(mask_sample, false) "
    "FROM snapshot_attempts WHERE run_id = %(r)s AND snapshot_id = %(s)s ORDER BY group_id, generation_index"
)
_NO_PROMPT = PromptRef("", "")


class PlanGroup(NamedTuple):
    """A cut group with only what the plan reads filled in (same attribute names as
    :class:`CutGroup`): a large cut has one per eight siblings or so."""

    group_id: str
    restore_level: str
    expected_generations: int
    group_attempt: int
    status: str
    task_digest: str = ""
    prompt_ref: PromptRef = _NO_PROMPT
    agent_name: str | None = None
    task_source: str | None = None
    target_step: int | None = None
    weight_version: str | None = None


@dataclass(frozen=True)
class GroupExtra:
    """Group fields the NeMo RL export needs beyond :class:`CutGroup`."""

    data_attempts_used: int
    weight_version: str | None


async def load_cut(
    conn: AsyncConnection, run_id: str, snapshot_id: str, *, detailed: bool = False
) -> tuple[Cut, dict[str, GroupExtra]]:
    """The cut of a snapshot. ``detailed``: every field (reused rows' staging keys, rewards,
    prompt locators; the export needs them); otherwise only what the plan reads. Read in text
    format (``binary=False``): up to a million rows, where binary costs memory and gains nothing."""
    params = {"r": run_id, "s": snapshot_id}
    extras: dict[str, GroupExtra] = {}
    if not detailed:
        groups: list[Any] = [PlanGroup(*g) for g in await fetch(conn, _GROUP_SQL_PLAN, params, binary=False)]
        pad = _ATT_PAD
        attempts: Sequence[Any] = [a + pad for a in await fetch(conn, _ATT_SQL_PLAN, params, binary=False)]
        return Cut(groups=groups, attempts=attempts), extras
    groups = []
    for gid, lvl, n, gatt, st, digest, pref, agent, source, tstep, wv, dau in await fetch(conn, _GROUP_SQL_FULL, params, binary=False):
        pref = pref or {}
        groups.append(
            CutGroup(
                group_id=gid,
                restore_level=lvl,
                expected_generations=n,
                group_attempt=gatt,
                status=st,
                task_digest=digest,
                prompt_ref=PromptRef(pref.get("sample_id"), pref.get("task_name")),
                agent_name=agent,
                task_source=source,
                target_step=tstep,
                weight_version=wv,
            )
        )
        extras[gid] = GroupExtra(dau, wv)
    attempts = [CutAttempt(*a[:8], tuple(a[8]), *a[9:]) for a in await fetch(conn, _ATT_SQL_FULL, params, binary=False)]
    return Cut(groups=groups, attempts=attempts), extras


